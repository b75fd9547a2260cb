"""Compile-only study of the attention backward's dk/dv kernel (atomic dq, even head dim) over
block shapes, warps and pipeline stages, under the hinted sm_90 compile of
``tests/triton_aot.py``: registers / spill bytes per configuration, for the kernels of this tree
and, with ``--before REV``, for those of commit REV side by side (no GPU; no timings).

    ~/.cache/agentrl_fast/side-envs/triton36/bin/python bench/dkdv_pipelining_study.py \\
        --before fedec3a --out bench/results/dkdv_pipelining.md

Run it under the triton to study (the GPU machine's is the triton 3.6 side environment); it
imports only triton and ``agentrl_fast/kernels/`` (``--kernels DIR``: another copy of that folder). The
per-configuration counts come from ``bench/attention_instruction_mix.py``'s ``mix``.
"""

import argparse
import datetime
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import triton_aot  # noqa: E402

GRID = {"head_dim": (64, 128), "BLOCK": (64, 128), "STEP": (16, 32, 64), "num_warps": (4, 8)}


def spec(shipped: dict, head_dim: int, block: int, step: int, warps: int, stages: int) -> dict:
    """The shipped spec of the dk/dv launch (atomic dq, even head dim) at ``head_dim``, moved to
    this configuration (``tests/triton_aot.py``'s ``_variant``, as the sweep's extras are)."""
    name = f"d{head_dim} {block}x{step} w{warps} s{stages}"
    config = {"BLOCK": block, "STEP": step, "num_warps": warps, "num_stages": stages}
    base = shipped[head_dim]
    return triton_aot._variant(base, config, name) or dict(base, name=name)


_SPECS: list[dict] = []


def _row(index: int) -> dict:
    from attention_instruction_mix import mix
    try:
        return mix(_SPECS[index])
    except Exception as error:  # noqa: BLE001 - a configuration that fails is a row
        return {"name": _SPECS[index]["name"], "error": f"{type(error).__name__}: {error}"[:200]}


def study(dtype: str, stages: list[int]) -> list[dict]:
    """Rows of every grid configuration (compiled in two processes)."""
    module = {m.__name__.rsplit(".", 1)[-1]: m
              for m in triton_aot.load_kernel_modules()}["varlen_attention"]
    by_name = {s["name"]: s for s in module.aot_specs()}
    shipped = {d: by_name[f"varlen_attention_backward_{dtype}_d{d}"] for d in GRID["head_dim"]}
    _SPECS[:] = [spec(shipped, *point, stage)
                 for point in itertools.product(*GRID.values()) for stage in stages]
    with multiprocessing.get_context("fork").Pool(max(1, min(2, os.cpu_count() or 1))) as pool:
        return pool.map(_row, range(len(_SPECS)))


def cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "error"
    return f"{row['registers']}/{row['spill_bytes']}"


def before_rows(rev: str, args) -> dict:
    """The same study on the kernels of commit ``rev`` (a child process, its own modules)."""
    # The kernels moved from kernels/ to agentrl_fast/kernels/ (issue 42); older commits have
    # the first.
    folder = next(name for name in ("agentrl_fast/kernels", "kernels")
                  if subprocess.run(["git", "cat-file", "-e", f"{rev}:{name}"], cwd=ROOT,
                                    capture_output=True).returncode == 0)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev, folder], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        out = subprocess.run([sys.executable, __file__, "--kernels", f"{tmp}/{folder}", "--json",
                              "--dtype", args.dtype, "--stages", *map(str, args.stages)],
                             check=True, capture_output=True, text=True).stdout
    return {row["name"]: row for row in map(json.loads, out.splitlines())}


def table(after: dict, before: dict, stages: list[int]) -> list[str]:
    arrow = " -> " if before else ""
    lines = ["| D | keys x queries | warps | " + " | ".join(f"{s} stage{'s' * (s > 1)}"
                                                       for s in stages) + " |",
             "|" + " --- |" * (3 + len(stages))]
    for head_dim, block, step, warps in itertools.product(*GRID.values()):
        names = [f"d{head_dim} {block}x{step} w{warps} s{s}" for s in stages]
        cells = [(cell(before.get(n)) + arrow if before else "") + cell(after.get(n))
                 for n in names]
        lines.append(f"| {head_dim} | {block} x {step} | {warps} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--kernels", help="another agentrl_fast/kernels/ folder to compile")
    parser.add_argument("--before", help="also compile agentrl_fast/kernels/ of this commit (left of ->)")
    parser.add_argument("--json", action="store_true", help="print rows as JSON lines only")
    parser.add_argument("--out", help="write the table (and the command) here")
    args = parser.parse_args()
    if args.kernels:
        triton_aot.KERNELS = Path(args.kernels)
    rows = study(args.dtype, args.stages)
    if args.json:
        print("\n".join(json.dumps(row) for row in rows))
        return
    before = before_rows(args.before, args) if args.before else {}
    import triton
    lines = table({row["name"]: row for row in rows}, before, args.stages)
    print("\n".join(lines))
    if args.out:
        command = "python bench/dkdv_pipelining_study.py " + " ".join(sys.argv[1:])
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
        head = ["# dk/dv backward: registers / spill bytes by shape and pipeline stages", "",
                f"Command (under the triton studied): `{command}`", "",
                f"Date {datetime.date.today()}, commit {commit}, triton {triton.__version__}, "
                f"{args.dtype}, sm_90 hinted compiles (`tests/triton_aot.py`), atomic dq, even "
                f"head dim; no GPU, no timings."
                + (f" Left of `->`: the kernels of commit {args.before}." if before else ""),
                ""]
        from common import write_record  # torch: only where the record is written
        write_record(args.out, "\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
