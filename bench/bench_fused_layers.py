"""Benchmark: fused RMSNorm and SwiGLU (agentrl_fast.ops.fused_layers), forward + backward.

Providers, in this process, each checked against ours before it is timed:

* ``agentrl_fast``: ``rms_norm`` / ``swiglu`` (our C++ kernels on the CPU).
* ``hf``: what HF's ``Qwen3RMSNorm`` and ``Qwen3MLP`` run: the norm's chain of torch ops
  (float32 upcast, ``pow``, ``mean``, ``rsqrt``, two products) and ``silu(gate) * up``.
* ``torch-rms_norm``: ``torch.nn.functional.rms_norm`` (RMSNorm only).

Shapes: the rows of a training micro-batch of the default policy (hidden 64, SwiGLU width 128,
q/k norms over heads of 16) at 16384 tokens, and a wider model's (hidden 1024, width 3072) at
4096 tokens. ``gbps`` counts the bytes the op must move (forward: read x, write y; backward:
read x and dy, write dx; SwiGLU: two reads and a write, then three reads and two writes).

Usage (from the repository root)::

    python bench/bench_fused_layers.py [--device cpu] [--threads N] [--tiny] [--out DIR]
"""

import argparse
import sys

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from agentrl_fast.ops.fused_layers import rms_norm, swiglu  # noqa: E402

SHAPES = {"rms_norm": [(16384, 64), (65536, 16), (4096, 1024)],
          "swiglu": [(16384, 128), (4096, 3072)]}
TINY = {"rms_norm": [(512, 64)], "swiglu": [(512, 128)]}


def hf_rms_norm(x, weight, eps=1e-6):
    normed = x.to(torch.float32)
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def forward_backward(fn, inputs, grad):
    def run():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
    return run


def rows_for(op: str, shape, device, dtype) -> list:
    gen = torch.Generator().manual_seed(0)
    if op == "rms_norm":
        x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype).requires_grad_()
        inputs, nbytes = (x, w), x.numel() * x.element_size() * 5
        providers = {"agentrl_fast": lambda a, b: rms_norm(a, b, 1e-6), "hf": hf_rms_norm,
                     "torch-rms_norm": lambda a, b: torch.nn.functional.rms_norm(a, (a.shape[-1],), b, 1e-6)}
    else:
        gate = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
        up = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
        inputs, nbytes = (gate, up), gate.numel() * gate.element_size() * 8
        providers = {"agentrl_fast": swiglu,
                     "hf": lambda a, b: torch.nn.functional.silu(a) * b}
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    want = providers["agentrl_fast"](*inputs).detach().double()
    times = {}
    for name, fn in providers.items():
        got = fn(*inputs).detach().double()
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"{op} {name} disagrees with agentrl_fast by "
                             f"{(got - want).abs().max().item():.3g}")
        times[name] = common.benchmark(forward_backward(fn, inputs, grad), device)
    ours = times["agentrl_fast"]
    return [common.Row(op=op, provider=name, shape="x".join(map(str, shape)),
                       dtype=str(dtype).removeprefix("torch."), device=common.device_name(device),
                       time_ms=ms, tokens_per_s=shape[0] / (ms * 1e-3),
                       gbps=nbytes / (ms * 1e-3) / 1e9, ratio=ms / ours)
            for name, ms in times.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = [row for op, shapes in (TINY if args.tiny else SHAPES).items()
            for shape in shapes for row in rows_for(op, shape, device, dtype)]
    common.print_table(rows)
    print(f"copy bandwidth ({common.device_name(device)}): "
          f"{common.copy_bandwidth_gbps(device):.1f} GB/s; threads {torch.get_num_threads()}")
    if not args.tiny:
        print(f"rows appended to {common.write_rows(rows, 'fused_layers', args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
