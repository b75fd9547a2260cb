"""The compile report of every Triton kernel configuration for sm_90: registers, spills, shared
memory and wgmma use, per triton version, as a markdown table for ``bench/results/``.

    python bench/triton_compile_report.py bench/results/triton_compile.md [PYTHON ...]

runs ``tests/triton_aot.py`` under this Python and each PYTHON given (e.g. a side environment
with triton 3.6) and writes the table. No GPU needed: the compiles are ahead of time
(``GPUTarget("cuda", 90, 32)``; registers and spills from the ptxas run of triton's compile).
"""

import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_aot(python: str) -> tuple[dict, dict]:
    result = subprocess.run([python, str(ROOT / "tests" / "triton_aot.py")], capture_output=True,
                            text=True, cwd=ROOT)
    rows, summary = {}, None
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("summary"):
                summary = record
            else:
                rows[record["name"]] = record
    if summary is None:
        raise SystemExit(f"{python} tests/triton_aot.py printed no summary:\n{result.stderr[-3000:]}")
    return summary, rows


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    output, pythons = Path(sys.argv[1]), [sys.executable] + sys.argv[2:]
    runs = [run_aot(python) for python in pythons]
    versions = [summary["triton"] for summary, _ in runs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# Triton kernels compiled for sm_90 (compile report)", "",
        f"Date: {datetime.date.today()} · commit: {commit} · no GPU: ahead-of-time compiles "
        "(`GPUTarget(\"cuda\", 90, 32)`, ptxas `-arch=sm_90a -v` from triton's NVIDIA backend) · "
        f"`python bench/triton_compile_report.py` under triton {' and '.join(versions)}.", "",
        "Every configuration a launcher can pick (`aot_specs()` in `kernels/*.py`): registers per "
        "thread, spill stores (bytes), shared memory (bytes), whether the PTX uses `wgmma`. "
        "Configurations marked `allow_spills` (backward kernels) may spill; all others must not "
        "(`tests/test_triton_kernels.py`). Ahead-of-time compiles get no divisibility hints for "
        "pointers and strides (JIT launches on the GPU do), so GPU compiles may use fewer "
        "registers.", "",
    ]
    for summary, _ in runs:
        lines.append(f"- triton {summary['triton']}: {summary['configurations']} configurations, "
                     f"failed: {', '.join(summary['failed']) or 'none'}")
    lines += ["", "| configuration | warps | stages | " + " | ".join(
        f"regs {v} | spill B {v} | smem B {v} | wgmma {v}" for v in versions) + " |",
        "|" + "---|" * (3 + 4 * len(versions))]
    names = list(runs[0][1]) + [n for _, rows in runs[1:] for n in rows if n not in runs[0][1]]
    for name in names:
        first = next(rows[name] for _, rows in runs if name in rows)
        cells = [name, str(first["num_warps"]), str(first["num_stages"])]
        for _, rows in runs:
            row = rows.get(name)
            if row is None:
                cells += ["-"] * 4
            elif not row.get("ptxas_ok"):
                cells += ["FAILED"] * 4
            else:
                cells += [str(row["registers"]), str(row["spill_bytes"]), str(row["shared_bytes"]),
                          "yes" if row["wgmma"] else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    output.write_text("\n".join(lines) + "\n")
    print(f"wrote {output} ({len(names)} configurations)")


if __name__ == "__main__":
    main()
