"""The compile report of every Triton kernel configuration for sm_90, compiled with the launch
hints a GPU launch gets: registers, spills, shared memory, cp.async/TMA and wgmma counts, local
memory traffic in loops, per triton version, as a markdown table for ``bench/results/``.

    python bench/triton_compile_report.py bench/results/triton_compile.md [PYTHON ...]

runs ``tests/triton_aot.py`` under this Python and each PYTHON given (e.g. the side environment
with triton 3.6, ``~/.cache/agentrl_fast/side-envs/triton36/bin/python``) and writes the table.
No GPU needed: the compiles are ahead of time (``GPUTarget("cuda", 90, 32)``; registers and
spills from the ptxas run of triton's compile).
"""

import datetime
import json
import re
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("configuration", "triton", "warps", "stages", "regs", "spill B", "smem B", "cp.async",
           "TMA", "wgmma", "wgmma shapes", "local ld/st in loops", "compile s", "result")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_aot(python: str) -> tuple[dict, dict]:
    """``(summary, rows by name)`` of ``tests/triton_aot.py`` under ``python``; the summary
    gains ``cpu_seconds``, the CPU time of the run (its worker processes included)."""
    before = _children_cpu_seconds()
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
        raise SystemExit(f"{python} tests/triton_aot.py printed no summary:\n"
                         f"{result.stderr[-3000:]}")
    summary["cpu_seconds"] = round(_children_cpu_seconds() - before)
    return summary, rows


def natural_key(name: str) -> list:
    """Sort key with numbers compared as numbers (d32 before d128)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def hint_lines(rows: dict) -> list[str]:
    """One line per kernel: the integer arguments its compiles take as divisible by 16 or 1."""
    lines, seen = [], set()
    for row in sorted(rows.values(), key=lambda row: row["kernel"]):
        hints = row.get("hints")
        if hints is None or row["kernel"] in seen:
            continue
        seen.add(row["kernel"])
        parts = [f"{label}: {', '.join(f'`{n}`' for n in hints[key])}" for key, label in
                 (("divisible_by_16", "divisible by 16"), ("equal_to_1", "equal to 1"))
                 if hints[key]]
        lines.append(f"- `{row['kernel']}`: {'; '.join(parts) or 'pointers only'}")
    return lines


def row_cells(row: dict | None) -> list[str]:
    """The measured cells of one configuration under one triton."""
    if row is None:
        return ["-"] * 9 + ["not compiled"]
    if "compile_seconds" not in row:
        return ["-"] * 9 + [f"FAILED: {row['reason']}"]
    spills = str(row["spill_bytes"]) + (" (allowed)" if row["spill_bytes"] and row["allow_spills"]
                                        else "")
    return [str(row["registers"]), spills, str(row["shared_bytes"]),
            str(row["cp_async"]), str(row["tma"]), str(row["wgmma_count"]),
            " ".join(row["wgmma_shapes"]) or "-", str(row["local_in_loops"]),
            f"{row['compile_seconds']:.1f}", "ok" if row["ok"] else f"FAILED: {row['reason']}"]


def report(runs: list, commit: str, command: str) -> str:
    versions = [summary["triton"] for summary, _ in runs]
    lines = [
        "# Triton kernels compiled for sm_90 (compile report)", "",
        f"Date: {datetime.date.today()} · commit: {commit} · triton {' and '.join(versions)} · "
        "no GPU: ahead-of-time compiles by `tests/triton_aot.py` (`GPUTarget(\"cuda\", 90, 32)`; "
        "registers and spills from the ptxas `-v` report of triton's compile). Regenerate with:",
        "", f"    {command}", "",
        "Every configuration a launcher can pick (`aot_specs()` in `agentrl_fast/kernels/*.py`), compiled with "
        "the launch hints of a typical launch on the GPU: every pointer and the integer arguments "
        "below divisible by 16 (`tt.divisibility`), those equal to 1 as constants (as triton's "
        "launcher specialises them).", "",
        *hint_lines({name: row for _, rows in runs for name, row in rows.items()}), "",
        "Columns: registers per thread, spill stores (bytes), shared memory (bytes), static "
        "instruction counts in the PTX: `cp.async` copies (`.ca`/`.cg`), TMA copies "
        "(`cp.async.bulk.tensor`), `wgmma.mma_async` and its shapes, `ld.local`/`st.local` "
        "inside a loop body (between a label and a branch back to it). A configuration fails on "
        "a compile error, shared memory over the sm_90 limit (232448 bytes per block), spills "
        "where its spec does not allow them (spills a spec allows read `(allowed)`) or a wgmma "
        "result stored to shared memory with a swizzle under 128 bytes (`narrow_mma_stores`); "
        "`tests/test_triton_kernels.py` checks it.", "",
    ]
    for summary, _ in runs:
        lines.append(f"- triton {summary['triton']}: {summary['configurations']} configurations, "
                     f"{summary['cpu_seconds']} CPU seconds, failed: "
                     f"{', '.join(summary['failed']) or 'none'}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    names = sorted({name for _, rows in runs for name in rows}, key=natural_key)
    for name in names:
        first = next(rows[name] for _, rows in runs if name in rows)
        for summary, rows in runs:
            cells = [name, summary["triton"], str(first["num_warps"]), str(first["num_stages"])]
            lines.append("| " + " | ".join(cells + row_cells(rows.get(name))) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    output, pythons = Path(sys.argv[1]), [sys.executable] + sys.argv[2:]
    runs = [run_aot(python) for python in pythons]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    home = str(Path.home())
    command = " ".join(["python bench/triton_compile_report.py", sys.argv[1],
                        *(p.replace(home, "~") for p in sys.argv[2:])])
    from common import write_record  # torch: only where the record is written
    write_record(output, report(runs, commit, command), command)
    print(f"wrote {output} ({sum(len(rows) for _, rows in runs)} compiles)")


if __name__ == "__main__":
    main()
