"""Which Triton attention backward launches give the right gradients on this GPU.

    python bench/attention_backward_probe.py --out OUT.jsonl [--set full|quick|suite|dry]
        [--workers N]

Each job is one backward launch in its own process (an illegal memory access ends its CUDA
context) against the float64 reference: max |got - ref| / max |ref| of out, dq, dk, dv; right
when each is within ``--tolerance`` (bf16: 0.05). A job names

- the variant: the atomic dq as ``K^T dS^T`` (the default), as ``dS K``
  (``AGENTRL_FAST_PROBE_DQ_ROWS=1``), or the deterministic two-kernel backward;
- the mode: plain (causal or not) or prefix-shared (causal);
- the head dim (64, 128, 256; bf16) and the dk/dv launch (BLOCK, STEP, warps, stages);
- the ptxas that assembles triton's PTX (``TRITON_PTXAS_PATH``): triton's own for sm_90
  (``bundled``; 12.8 in triton 3.6), the CUDA toolkit's (``cuda``), or triton's
  ``ptxas-blackwell`` (``blackwell``; a newer CUDA's); the other two with Triton caches of
  their own.

Sets: ``full`` (every variant and mode at each head dim's launches, bundled ptxas), ``quick``
(each head dim's default launch), ``suite`` (the GPU suite's, 26 jobs where all three ptxas
exist: ``suite_jobs``), ``dry`` (two small interpreter jobs: the plumbing, on
the CPU with ``TRITON_INTERPRET=1``). The probe lifts the backend's refusal of the backward
above ``GPU_CHECKED_BACKWARD_HEAD_DIM``: that is what it measures.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# dk/dv launches (BLOCK, STEP, num_warps, num_stages) per head dim, the default first; a STEP of
# 16 or 32 stores dS^T with a narrow swizzle (D 128's and 256's defaults until session 27).
CONFIGS = {
    64: [(64, 64, 4, 1), (64, 32, 4, 1), (64, 64, 8, 2), (128, 64, 8, 2), (64, 16, 4, 1)],
    128: [(64, 64, 8, 2), (128, 32, 8, 1), (64, 64, 8, 1), (64, 64, 4, 1), (128, 64, 8, 2),
          (64, 32, 8, 1)],
    256: [(64, 64, 8, 2), (64, 32, 8, 1), (64, 64, 8, 1)],
}
LENGTHS = [1, 7, 113, 203, 0, 300, 64]  # the plain mode's sequences
PREFIX = (300, [50, 113, 7, 1], 200)  # prefix, its suffixes, then one plain sequence
DRY_LENGTHS = [1, 7, 0, 40]
DRY_PREFIX = (40, [9, 1], 20)
PTXAS = ("bundled", "cuda", "blackwell")


def job(variant, mode, head_dim, config, causal=True, ptxas="bundled") -> dict:
    return dict(variant=variant, mode=mode, causal=causal, head_dim=head_dim,
                config=list(config), ptxas=ptxas)


def full_jobs(head_dims=(64, 128, 256), first_only=False) -> list[dict]:
    out = []
    for head_dim in head_dims:
        configs = CONFIGS[head_dim][:1] if first_only else CONFIGS[head_dim]
        for index, config in enumerate(configs):
            for variant in ("atomic_t", "atomic_rows", "deterministic"):
                if variant == "deterministic" and index > 1:
                    continue
                for mode in ("plain", "prefix"):
                    for causal in ((True, False) if mode == "plain" else (True,)):
                        out.append(job(variant, mode, head_dim, config, causal))
    return out


def suite_jobs() -> list[dict]:
    """Most telling first: the D 128 and 256 defaults (both variants, both modes), then the old
    narrow-swizzle defaults and the defaults under each ptxas, then D 128's default unpipelined
    and with 4 warps, D 64's default and its narrow STEP 16 (which crashed) and 32, under
    triton's own."""
    out = []
    for head_dim in (128, 256):
        default = CONFIGS[head_dim][0]
        out += [job("atomic_t", "plain", head_dim, default),
                job("deterministic", "plain", head_dim, default),
                job("atomic_t", "prefix", head_dim, default),
                job("deterministic", "prefix", head_dim, default),
                job("atomic_t", "plain", head_dim, default, causal=False)]
    for head_dim in (128, 256):
        default, narrow = CONFIGS[head_dim][:2]
        out += [job("atomic_t", "plain", head_dim, narrow, ptxas=ptxas) for ptxas in PTXAS]
        out += [job("atomic_t", "plain", head_dim, default, ptxas=ptxas) for ptxas in PTXAS[1:]]
    out += [job("atomic_t", "plain", 128, CONFIGS[128][2]),  # the default unpipelined
            job("atomic_t", "plain", 128, CONFIGS[128][3]),  # 4 warps
            job("atomic_t", "plain", 64, CONFIGS[64][0]),
            job("atomic_t", "prefix", 64, CONFIGS[64][0]),
            job("atomic_t", "plain", 64, CONFIGS[64][4]),  # STEP 16: crashed on the H200
            job("atomic_t", "plain", 64, CONFIGS[64][1])]
    return out


def jobs(which: str) -> list[dict]:
    if which == "dry":
        return [job("atomic_t", "plain", 64, CONFIGS[64][0]) | {"dry": True},
                job("deterministic", "prefix", 64, CONFIGS[64][0]) | {"dry": True}]
    if which == "suite":
        return suite_jobs()
    return full_jobs(first_only=which == "quick")


def ptxas_paths() -> dict[str, str | None]:
    """Each ptxas choice's binary (None: triton's own, no override), where it exists."""
    import triton  # noqa: F401 - knobs below need the package
    from triton import knobs

    paths = {"bundled": None}
    cuda = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if os.path.exists(cuda):
        paths["cuda"] = cuda
    try:
        blackwell = knobs.nvidia.ptxas_blackwell.path
    except Exception:  # noqa: BLE001 - an older triton has no such knob
        blackwell = None
    if blackwell and os.path.exists(blackwell):
        paths["blackwell"] = blackwell
    return paths


def ptxas_version(path: str | None) -> str:
    if path is None:
        from triton import knobs

        path = knobs.nvidia.ptxas.path
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    except OSError as error:
        return f"? ({error})"
    lines = text.strip().splitlines() or ["?"]
    return next((line for line in lines if "release" in line), lines[-1])


def prefix_case(torch, device, dry: bool):
    """Shared rows [P][S1..Sn][plain], prefix_of, and rows [T_plain]: each plain-packing
    token's shared row (P repeated before each suffix)."""
    prompt, suffixes, plain = DRY_PREFIX if dry else PREFIX
    lengths = [prompt] + suffixes + [plain]
    prefix_of = [-1] + [0] * len(suffixes) + [-1]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows, plain_lengths = [], []
    for index, length in enumerate(suffixes, start=1):
        rows += list(range(prompt)) + list(range(starts[index], starts[index] + length))
        plain_lengths.append(prompt + length)
    rows += list(range(starts[-1], starts[-1] + plain))
    plain_lengths.append(plain)
    return lengths, prefix_of, torch.tensor(rows, device=device), plain_lengths


def run_one(job: dict) -> dict:
    import torch

    from agentrl_fast.kernels import varlen_attention as kernels
    from agentrl_fast.kernels.tuned import forced
    from agentrl_fast.ops import varlen_attention_triton
    from agentrl_fast.ops.reference import varlen_attention_reference
    from agentrl_fast.ops.varlen_attention import varlen_attention

    # What a GPU refuses above the checked head dim is what this probe measures.
    varlen_attention_triton.GPU_CHECKED_BACKWARD_HEAD_DIM = kernels.PADDED_HEAD_DIMS[-1]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, head_dim, hq, hk = torch.bfloat16, job["head_dim"], 4, 2
    gen = torch.Generator().manual_seed(0)

    def cu_of(lengths):
        return torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))],
                            dtype=torch.int32, device=device)

    if job["mode"] == "plain":
        lengths = DRY_LENGTHS if job.get("dry") else LENGTHS
        prefix_of, rows, plain_lengths = None, None, lengths
    else:
        lengths, prefix_of, rows, plain_lengths = prefix_case(torch, device, job.get("dry"))
    num_rows = sum(lengths)
    q, k, v, dout = (torch.randn(num_rows, h, head_dim, generator=gen).to(device, dtype)
                     for h in (hq, hk, hk, hq))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    block, step, warps, stages = job["config"]
    config = dict(BLOCK=block, STEP=step, num_warps=warps, num_stages=stages)
    with forced("varlen_attention_backward", f"bf16_d{head_dim}", config):
        out = varlen_attention(*leaves, cu_of(lengths), max(lengths), causal=job["causal"],
                               prefix_of=(None if prefix_of is None else
                                          torch.tensor(prefix_of, dtype=torch.int32,
                                                       device=device)),
                               backend="triton", deterministic=job["variant"] == "deterministic")
        grads = torch.autograd.grad(out, leaves, dout)
    if device == "cuda":
        torch.cuda.synchronize()
    # The reference runs on the CPU (varlen_attention_reference computes there).
    device = "cpu"
    q, k, v, dout = (x.cpu() for x in (q, k, v, dout))
    out, grads = out.detach().cpu(), [g.cpu() for g in grads]
    rows = None if rows is None else rows.cpu()
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    if rows is None:
        ref_out = varlen_attention_reference(*ref_leaves, cu_of(lengths),
                                             causal=job["causal"])[0]
    else:  # the unshared packing; each shared row's output read from its first plain copy
        plain_out = varlen_attention_reference(*(x[rows] for x in ref_leaves),
                                               cu_of(plain_lengths), causal=True)[0]
        first = torch.full((num_rows,), len(rows), dtype=torch.long, device=device)
        first.scatter_reduce_(0, rows, torch.arange(len(rows), device=device), "amin")
        ref_out = plain_out[first]
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    result = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        scale = float(want.detach().abs().max())
        result[name] = float((got.double() - want).abs().max()) / max(scale, 1e-30)
    return result


def launch(job: dict, timeout: float, paths: dict, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("AGENTRL_FAST_PROBE_DQ_ROWS", "TRITON_PTXAS_PATH"):  # each job sets its own
        env.pop(name, None)
    if job["variant"] == "atomic_rows":
        env["AGENTRL_FAST_PROBE_DQ_ROWS"] = "1"
    if paths.get(job["ptxas"]):  # another assembler: a Triton cache of its own
        env["TRITON_PTXAS_PATH"] = paths[job["ptxas"]]
        env["TRITON_CACHE_DIR"] = str(cache / job["ptxas"])
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            job["errors"] = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            job["failure"] = f"exit {proc.returncode}: {tail[:200]}"
    except subprocess.TimeoutExpired:
        job["failure"] = f"timed out after {timeout:.0f} s"
    job["seconds"] = round(time.perf_counter() - start, 1)
    return job


def verdict(job: dict, tolerance: float) -> str:
    if "failure" in job:
        return "CRASH"
    # (all, not max: max() passes a NaN that is not first)
    return "ok" if all(e <= tolerance for e in job["errors"].values()) else "WRONG"


def describe(job: dict) -> str:
    config = tuple(job["config"])
    narrow = " narrow" if config[1] < 64 else ""  # bf16 dS^T rows under 128 bytes
    return (f"{job['mode']:6} {job['variant']:13} D{job['head_dim']:<3} "
            f"causal={job['causal']!s:5} {config}{narrow} ptxas={job['ptxas']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=False,
                        help="append each job's row (JSON lines) to this file")
    parser.add_argument("--set", choices=("full", "quick", "suite", "dry"), default="full",
                        help="which jobs (the module docstring)")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="jobs at a time")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds a job may take (its compiles included)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest max-relative error taken as right (bf16)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    # A timeout's SIGTERM: leave through the with-blocks (the temporary caches are removed; the
    # rows written so far stay).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.pop("TRITON_PTXAS_PATH", None)  # "bundled" is triton's own
    paths = ptxas_paths()
    for name in PTXAS:
        where = paths.get(name, "missing") if name != "bundled" else "triton's own"
        print(f"ptxas {name}: {where or ''} "
              f"{ptxas_version(paths[name]) if name in paths else ''}", flush=True)
    todo = [j for j in jobs(args.set) if j["ptxas"] in paths]
    print(f"{len(todo)} jobs, {args.workers} at a time", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="probe_cache_") as cache, \
            ThreadPoolExecutor(args.workers) as pool:
        running = [pool.submit(launch, j, args.timeout, paths, Path(cache)) for j in todo]
        for finished in as_completed(running):  # each row as its job ends
            done = finished.result()
            mark = verdict(done, args.tolerance)
            failed += mark != "ok"
            detail = done.get("failure") or " ".join(f"{k} {v:.1e}"
                                                      for k, v in done["errors"].items())
            print(f"{mark:5} {describe(done)}: {detail} ({done['seconds']} s)", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({**done, "verdict": mark}) + "\n")
    print(f"{len(todo) - failed} ok, {failed} crashed or wrong")
    return 0


if __name__ == "__main__":
    sys.exit(main())
