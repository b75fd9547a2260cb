"""Which Triton attention backward launches give the right gradients on this GPU.

    python bench/attention_backward_probe.py --out OUT.jsonl [--workers N] [--quick]

Every variant of the backward (the atomic dq as ``K^T dS^T``, the default; the atomic dq as
``dS K`` (``AGENTRL_FAST_PROBE_DQ_ROWS=1``); the deterministic two-kernel backward; the same three
in the prefix-shared mode) at D 64 and 128 in bf16, causal and not (the prefix mode is causal
only), over a grid of dk/dv launch configurations, each job in its own process (an illegal
memory access ends its CUDA context), against the float64 reference: max |got - ref| / max |ref|
of out, dq, dk, dv. On the CPU (``TRITON_INTERPRET=1``) it checks its own plumbing.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    64: [(64, 64, 4, 1), (64, 32, 4, 1), (64, 64, 8, 1), (128, 64, 8, 1), (64, 64, 4, 2)],
    128: [(128, 32, 8, 1), (64, 64, 4, 1), (64, 32, 4, 1), (128, 64, 8, 1), (64, 32, 8, 1)],
}
LENGTHS = [1, 7, 113, 203, 0, 300, 64]  # the plain mode's sequences
PREFIX = (300, [50, 113, 7, 1], 200)  # prefix, its suffixes, then one plain sequence


def jobs(quick: bool) -> list[dict]:
    out = []
    for head_dim, configs in CONFIGS.items():
        for index, config in enumerate(configs[:1] if quick else configs):
            for variant in ("atomic_t", "atomic_rows", "deterministic"):
                if variant == "deterministic" and index > 1:
                    continue
                for mode in ("plain", "prefix"):
                    for causal in ((True, False) if mode == "plain" else (True,)):
                        out.append(dict(variant=variant, mode=mode, causal=causal,
                                        head_dim=head_dim, config=config))
    return out


def prefix_case(torch, head_dim, device, dtype):
    """Shared rows [P][S1..Sn][plain], prefix_of, and rows [T_plain]: each plain-packing
    token's shared row (P repeated before each suffix)."""
    prompt, suffixes, plain = PREFIX
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

    from agentrl_fast.kernels.tuned import forced
    from agentrl_fast.ops.reference import varlen_attention_reference
    from agentrl_fast.ops.varlen_attention import varlen_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, head_dim, hq, hk = torch.bfloat16, job["head_dim"], 4, 2
    gen = torch.Generator().manual_seed(0)

    def cu_of(lengths):
        return torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))],
                            dtype=torch.int32, device=device)

    if job["mode"] == "plain":
        lengths, prefix_of, rows, plain_lengths = LENGTHS, None, None, LENGTHS
    else:
        lengths, prefix_of, rows, plain_lengths = prefix_case(torch, head_dim, device, dtype)
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


def launch(job: dict, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if job["variant"] == "atomic_rows":
        env["AGENTRL_FAST_PROBE_DQ_ROWS"] = "1"
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
    return "ok" if max(job["errors"].values()) <= tolerance else "WRONG"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--quick", action="store_true", help="one configuration per head dim")
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest max-relative error taken as right (bf16)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    todo = jobs(args.quick)
    print(f"{len(todo)} jobs, {args.workers} at a time", flush=True)
    failed = 0
    with ThreadPoolExecutor(args.workers) as pool:
        for job in pool.map(lambda j: launch(j, args.timeout), todo):
            mark = verdict(job, args.tolerance)
            failed += mark != "ok"
            detail = job.get("failure") or " ".join(f"{k} {v:.1e}" for k, v in job["errors"].items())
            print(f"{mark:5} {job['mode']:6} {job['variant']:13} D{job['head_dim']:<3} "
                  f"causal={job['causal']!s:5} {job['config']}: {detail} ({job['seconds']} s)",
                  flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({**job, "verdict": mark}) + "\n")
    print(f"{len(todo) - failed} ok, {failed} crashed or wrong")
    return 0


if __name__ == "__main__":
    sys.exit(main())
