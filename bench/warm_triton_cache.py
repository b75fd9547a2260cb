"""Warm Triton's kernel cache for the GPU suite: every configuration the benchmarks (and the GPU
tests' common cases) launch, compiled in parallel processes while other stages run.

    python bench/warm_triton_cache.py [--device cuda|cpu] [--workers N] [--list]

Triton compiles a kernel configuration at its first launch (seconds of CPU each) and caches it
on disk (``~/.triton/cache``), keyed by the source, the options and the arguments'
specialisation (dtypes, pointers and integers divisible by 16, integers equal to 1). Each job
here launches a kernel forward and backward on a small input shaped like the real launch
(the benchmark's heads and head dim, the same dtypes), so the later launch finds it compiled.
``--device cpu`` runs the same jobs on CPU tensors (the CI dry run: the plumbing, no Triton).
"""

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (op, dtype name, options): the benchmarks' launches, then the attention GPU tests' grid
# (tests/test_varlen_attention.py's TRITON_GPU_GRID, by index: the same shapes, so the same
# specialisations).
JOBS = (
    [("bench_varlen_attention", "bfloat16", {})]
    + [("bench_token_logprobs", dtype, {"linear": linear})
       for dtype in ("bfloat16", "float32") for linear in (False, True)]
    + [("bench_ppo_loss", dtype, {}) for dtype in ("bfloat16", "float32")]
    + [("test_varlen_attention", "-", {"case": index}) for index in range(14)]
    + [("bench_prefix_sharing", "bfloat16", {"head_dim": d}) for d in (128, 64)]
    + [("test_varlen_attention_prefix", "-", {"case": index}) for index in range(4)]
    + [("test_varlen_attention_prefix_split", "-", {"deterministic": deterministic})
       for deterministic in (False, True)]
)


def _attention_bench(device, dtype, options):
    import bench_varlen_attention as b

    sizes = b.SIZES["cuda" if device.type == "cuda" else "tiny"]
    inst = b.make_instance("warm", [96, 160], sizes, device, dtype, True, 0)
    b.prepare_ours(inst, "auto").forward_backward()


def _token_logprobs_bench(device, dtype, options):
    import bench_token_logprobs as b

    vocab, hidden = (151936, 4096) if device.type == "cuda" else (1024, 64)
    b.step(b.linear_ours if options["linear"] else b.ours,
           b.make_inputs(64, vocab, hidden, device, dtype, 0, options["linear"]))


def _ppo_loss_bench(device, dtype, options):
    import bench_ppo_loss as b

    b.step(b.ours, b.make_inputs(4096, device, dtype, 0))


def _attention_test_case(device, dtype, options):
    sys.path.insert(0, str(ROOT / "tests"))
    import test_varlen_attention as t

    from agentrl_fast.ops.varlen_attention import varlen_attention

    if options["case"] >= len(t.TRITON_GPU_GRID):
        return
    lengths, dtype, causal, (hq, hk), head_dim = t.TRITON_GPU_GRID[options["case"]]
    q, k, v, cu, max_seqlen = t.make_inputs(lengths, hq, hk, head_dim, dtype, seed=0,
                                            device=device)
    backend = "triton" if device.type == "cuda" else "auto"
    varlen_attention(q, k, v, cu, max_seqlen, causal=causal, backend=backend).sum().backward()


def _prefix_launch(q, k, v, cu, prefix_of, max_seqlen, device, deterministic=False):
    from agentrl_fast.ops.varlen_attention import varlen_attention

    backend = "triton" if device.type == "cuda" else "auto"
    varlen_attention(q, k, v, cu, max_seqlen, prefix_of=prefix_of, backend=backend,
                     deterministic=deterministic).float().sum().backward()


def _prefix_bench(device, dtype, options):
    # the long-prompt layout of bench/bench_prefix_sharing.py (prompt, suffixes of one length)
    import bench_prefix_sharing as b

    sizes = b.SIZES["cuda" if device.type == "cuda" else "tiny"]
    head_dim = options["head_dim"] if device.type == "cuda" else sizes.long_head_dims[0]
    inputs = b.op_inputs(b.long_prompt_layouts(*sizes.long_prompt), sizes.long_heads, head_dim,
                         dtype, device, 0)
    _prefix_launch(*inputs.shared, inputs.shared_cu, inputs.prefix_of, inputs.shared_max, device)


def _prefix_test_case(device, dtype, options):
    sys.path.insert(0, str(ROOT / "tests"))
    import test_varlen_attention_prefix as t

    layout_name, dtype, gqa = t.GPU_CASES[options["case"]]
    q, k, v, cu, prefix_of, max_seqlen, _ = t.make_case(t.LAYOUTS[layout_name], *gqa, dtype,
                                                        seed=50, device=device)
    _prefix_launch(q, k, v, cu, prefix_of, max_seqlen, device)


def _prefix_split_case(device, dtype, options):
    # test_cuda_triton_prefix_kernels_split_a_prefix_across_programs at D 64
    sys.path.insert(0, str(ROOT / "tests"))
    import test_varlen_attention_prefix as t

    q, k, v, cu, prefix_of, max_seqlen, _ = t.make_case(t.SPLIT_LAYOUT, 4, 2, t.torch.bfloat16,
                                                        seed=52, device=device, head_dim=64)
    _prefix_launch(q, k, v, cu, prefix_of, max_seqlen, device, options["deterministic"])


RUNNERS = {"bench_varlen_attention": _attention_bench,
           "bench_token_logprobs": _token_logprobs_bench, "bench_ppo_loss": _ppo_loss_bench,
           "test_varlen_attention": _attention_test_case, "bench_prefix_sharing": _prefix_bench,
           "test_varlen_attention_prefix": _prefix_test_case,
           "test_varlen_attention_prefix_split": _prefix_split_case}


def run_job(job: tuple, device_name: str) -> str:
    import torch

    op, dtype_name, options = job
    device = torch.device(device_name)
    start = time.perf_counter()
    try:
        RUNNERS[op](device, getattr(torch, dtype_name, None), options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        verdict = "ok"
    except Exception as error:  # noqa: BLE001  (a job that fails only loses its warm cache)
        verdict = f"FAILED {type(error).__name__}: {str(error)[:300]}"
    return f"{op} {dtype_name} {options}: {verdict} in {time.perf_counter() - start:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes (default: a third of the cores, at most 6)")
    parser.add_argument("--list", action="store_true", help="print the jobs and exit")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{op} {dtype} {options}" for op, dtype, options in JOBS))
        return 0
    import os

    workers = args.workers or max(1, min(6, (os.cpu_count() or 1) // 3))
    # spawn: CUDA cannot be used in forked children; each worker imports torch once.
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = [pool.apply_async(run_job, (job, args.device)) for job in JOBS]
        lines = [r.get() for r in results]
    print("\n".join(lines), flush=True)
    return 1 if any("FAILED" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
