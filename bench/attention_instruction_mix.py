"""The instruction mix of the attention kernels' hinted sm_90 compiles (no GPU): per
configuration, matrix instructions in the SASS (``HGMMA`` = wgmma, ``HMMA`` = mma.sync), fp32
atomics (``RED``/``ATOM``), exp2 (``MUFU.EX2``), local memory (``LDL``/``STL``), shared-memory
traffic (``LDS``/``STS``/``LDSM``), barriers, and registers/spills from ptxas; the PTX's wgmma
shapes and ``wgmma.wait_group`` depths. Static counts (after unrolling), not timings.

    python bench/attention_instruction_mix.py [NAME ...]   # default: the backward and forward
                                                           # at bf16/fp16, D 64 and 128

Run it under the triton to measure (the GPU machine's: ``~/.cache/agentrl_fast/side-envs/
triton36/bin/python``); it imports only triton and ``agentrl_fast/kernels/`` through ``tests/triton_aot.py``.
"""

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import triton_aot  # noqa: E402

SASS_OPS = {"HGMMA": r"\bHGMMA\b", "HMMA": r"\bHMMA\b", "RED/ATOM": r"\b(?:RED|ATOM)G?\b",
            "MUFU.EX2": r"\bMUFU\.EX2\b", "LDL/STL": r"\b(?:LDL|STL)\b",
            "LDS/LDSM": r"\b(?:LDS|LDSM)\b", "STS": r"\bSTS\b", "BAR": r"\bBAR\b",
            "LDGSTS": r"\bLDGSTS\b", "LDG": r"\bLDG\b"}
DEFAULT = [f"varlen_attention_{kind}_{dtype}_d{head_dim}" for dtype in ("bf16", "fp16")
           for head_dim in (64, 128)
           for kind in ("forward", "backward", "backward_dkdv", "backward_dq")]


def sass(cubin: bytes) -> str:
    tool = triton_aot.ptxas_path().parent / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def mix(spec: dict) -> dict:
    compiled, log = triton_aot._compile(triton_aot.hinted_source(spec), spec)
    ptx, code = compiled.asm["ptx"], sass(compiled.asm["cubin"])
    lines = [line for line in code.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    report = (triton_aot.parse_ptxas_log(log) if "Used " in log
              else triton_aot.ptxas_report(ptx))
    row = {"name": spec["name"], "warps": spec["num_warps"], "stages": spec["num_stages"],
           **report}
    row["wgmma_shapes"] = dict(collections.Counter(
        re.findall(r"wgmma\.mma_async\S*\.(m\d+n\d+k\d+)", ptx)))
    row["wait_group"] = dict(collections.Counter(
        re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)))
    row.update({op: sum(bool(re.search(rx, line)) for line in lines)
                for op, rx in SASS_OPS.items()})
    row["sass_lines"] = len(lines)
    return row


def main() -> None:
    names = sys.argv[1:] or DEFAULT
    specs = {s["name"]: s for m in triton_aot.load_kernel_modules()
             for s in getattr(m, "aot_specs", lambda: [])()}
    missing = [n for n in names if n not in specs]
    if missing:
        raise SystemExit(f"no such configuration: {missing}")
    import triton
    print(f"triton {triton.__version__}, sm_90, launch hints as tests/triton_aot.py\n")
    columns = ["registers", "spill_bytes", *SASS_OPS, "sass_lines"]
    print("| configuration | warps | stages | " + " | ".join(columns)
          + " | wgmma shapes (PTX) | wait_group depths |")
    print("|" + "---|" * (len(columns) + 5))
    for name in names:
        row = mix(specs[name])
        shapes = " ".join(f"{s}x{n}" for s, n in row["wgmma_shapes"].items()) or "-"
        waits = " ".join(f"{d}:{n}" for d, n in sorted(row["wait_group"].items())) or "-"
        print(f"| {name} | {row['warps']} | {row['stages']} | "
              + " | ".join(str(row.get(c)) for c in columns) + f" | {shapes} | {waits} |",
              flush=True)


if __name__ == "__main__":
    main()
