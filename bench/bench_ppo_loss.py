"""Benchmark: the token-level PPO loss, forward + backward (docs/design.md, "Token-level PPO loss").

Providers, all in this process, each checked against ours (loss and both gradients) before it
is timed:

* ``agentrl_fast``: ``agentrl_fast.ops.ppo_loss`` (the Triton kernels on CUDA, the torch path on
  the CPU).
* ``eager``: the eager torch code verl's ``compute_policy_loss`` (dual clip) + ``kl_penalty``
  (``low_var_kl``) + entropy bonus + ``agg_loss(token-mean)`` run, written here over the packed
  ``[T]`` tensors (TRL's loss is the same chain of elementwise ops and a masked mean).
* ``torch.compile``: ``torch.compile(eager, dynamic=True)``.

Every provider computes the same loss: clip 0.2/0.28 (clip-higher), dual clip 3, k3 KL to a
reference (coef 0.001), entropy bonus (coef 0.001), token-mean; gradients into ``logprobs`` and
``entropy``. Sizes: T = 16k and 64k tokens (``--tiny``: 2k); per-token inputs in ``--dtype``
(default bfloat16 on CUDA, float32 on the CPU; advantages float32). Rows give time, tokens/s,
the bandwidth of the bytes our op must move (against the copy bandwidth measured in the same
run) and peak memory (``peak_gib``, CUDA).

Usage (from the repository root)::

    python bench/bench_ppo_loss.py [--device cpu|cuda] [--dtype bfloat16] [--tiny] [--out DIR]
"""

import argparse
import time

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from agentrl_fast.ops.ppo_loss import ppo_loss  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CLIP_LOW, CLIP_HIGH, DUAL_CLIP, KL_COEF, ENTROPY_COEF = 0.2, 0.28, 3.0, 0.001, 0.001


Row = common.Row


def make_inputs(num_tokens: int, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """Random packed inputs: ~60% action tokens in runs, log-probs <= 0, old/ref/entropy
    perturbed so the clips and the dual clip are active on some tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    run = torch.randint(0, 2, (num_tokens // 32 + 1,), generator=gen, device=device)
    mask = (run.repeat_interleave(32)[:num_tokens] > 0) | (
        torch.rand(num_tokens, generator=gen, device=device) < 0.2)
    logp = -torch.rand(num_tokens, generator=gen, device=device) * 2
    old = logp + 0.3 * torch.randn(num_tokens, generator=gen, device=device)
    return {
        "logprobs": logp.to(dtype), "old_logprobs": old.to(dtype),
        "advantages": torch.randn(num_tokens, generator=gen, device=device),
        "action_mask": mask,
        "ref_logprobs": (logp + 0.2 * torch.randn(num_tokens, generator=gen, device=device)).to(dtype),
        "entropy": (torch.rand(num_tokens, generator=gen, device=device) * 3).to(dtype),
    }


def eager_loss(logprobs, old_logprobs, advantages, action_mask, ref_logprobs, entropy):
    """verl's eager chain (compute_policy_loss with dual clip, kl_penalty low_var_kl, entropy,
    agg_loss token-mean = masked_mean), on packed [T] tensors, computed in float32."""
    logprobs, old_logprobs = logprobs.float(), old_logprobs.float()
    ref_logprobs, entropy = ref_logprobs.float(), entropy.float()
    mask = action_mask.float()
    denom = mask.sum().clamp_min(1)

    def masked_mean(x):
        return (x * mask).sum() / denom

    negative_approx_kl = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * DUAL_CLIP
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = masked_mean(pg_losses)
    kl = torch.clamp(ref_logprobs - logprobs, -20, 20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
    entropy_loss = masked_mean(entropy)
    loss = pg_loss + KL_COEF * masked_mean(kld) - ENTROPY_COEF * entropy_loss
    with torch.no_grad():  # verl's metrics
        metrics = (masked_mean(torch.gt(pg_losses2, pg_losses1).float()), masked_mean(-negative_approx_kl))
    return loss, metrics


def ours(logprobs, old_logprobs, advantages, action_mask, ref_logprobs, entropy):
    return ppo_loss(logprobs, old_logprobs, advantages, action_mask, clip_low=CLIP_LOW,
                    clip_high=CLIP_HIGH, dual_clip=DUAL_CLIP, ref_logprobs=ref_logprobs,
                    kl_coef=KL_COEF, kl_estimator="k3", entropy=entropy, entropy_coef=ENTROPY_COEF)


def step(fn, inputs):
    """Forward + backward: ``(loss, dlogprobs, dentropy)``."""
    logp = inputs["logprobs"].detach().requires_grad_()
    entropy = inputs["entropy"].detach().requires_grad_()
    loss, _ = fn(logp, inputs["old_logprobs"], inputs["advantages"], inputs["action_mask"],
                 inputs["ref_logprobs"], entropy)
    dlogp, dentropy = torch.autograd.grad(loss, (logp, entropy))
    return loss, dlogp, dentropy


def check(label: str, got, want, dtype: torch.dtype) -> float:
    """Max |got - want| over (loss, dlogp, dentropy), relative to max |want| per tensor."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.detach().double(), w.detach().double()
        scale = max(float(w.abs().max()), 1e-30) if w.numel() else 1.0
        error = float((g - w).abs().max()) / scale if w.numel() else 0.0
        if not error <= tol:
            raise AssertionError(f"{label}: relative error {error:.3g} > {tol}")
        worst = max(worst, error)
    return worst


def bytes_moved(num_tokens: int, dtype: torch.dtype) -> int:
    """What our fused op must move: read logp, old, ref, entropy (dtype), advantages (fp32),
    mask (1 byte); write and re-read dlogp, dentropy (fp32); write both gradients (dtype)."""
    size = torch.empty((), dtype=dtype).element_size()
    return num_tokens * (4 * size + 4 + 1 + 2 * 4 * 2 + 2 * size)


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    sizes = [2048] if args.tiny else [16384, 65536]
    timing = {"warmup": 1, "repeats": 3, "max_seconds": 1.0} if args.tiny else {"max_seconds": args.max_seconds}
    providers = {"agentrl_fast": ours, "eager (verl/TRL)": eager_loss}
    if not args.no_compile:
        providers["torch.compile(eager)"] = torch.compile(eager_loss, dynamic=True)
    if args.only_compiled:  # the GPU suite's last stage: compiled baselines after the others
        providers = {k: v for k, v in providers.items() if k == "agentrl_fast" or "compile" in k}
    rows, path = [], None
    for num_tokens in sizes:
        inputs = make_inputs(num_tokens, device, dtype, args.seed)
        shape = f"T={num_tokens} actions={int(inputs['action_mask'].sum())}"
        reference = step(ours, inputs)
        ours_ms, new = None, []
        for name, fn in providers.items():
            start = time.perf_counter()
            error = check(f"{shape}: {name}", step(fn, inputs), reference, dtype)
            warm_s = time.perf_counter() - start
            for _ in range(3):  # settle compiled graphs (torch.compile may specialize again)
                step(fn, inputs)
            peak = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                step(fn, inputs)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            ms = common.benchmark(lambda: step(fn, inputs), device, **timing)
            ours_ms = ours_ms or ms
            seconds = ms * 1e-3
            new.append(Row(op="ppo_loss", provider=name, shape=shape,
                           dtype=str(dtype).removeprefix("torch."),
                           device=common.device_name(device), time_ms=ms,
                           tokens_per_s=num_tokens / seconds,
                           gbps=bytes_moved(num_tokens, dtype) / seconds / 1e9, ratio=ms / ours_ms,
                           peak_gib=None if peak is None else peak / 1024))
            mem = f", peak {peak:.2f} MiB" if peak is not None else ""
            print(f"  {shape} {name}: {ms:.3f} ms (checked: rel error {error:.1e}; first call "
                  f"{warm_s:.1f} s{mem})", flush=True)
        path = common.write_rows(new, "ppo_loss", args.out)  # as it goes: kept if cut off
        rows += new
        if device.type == "cuda":
            torch.cuda.empty_cache()
    common.print_table(rows)
    bandwidth = common.copy_bandwidth_gbps(device, nbytes=1 << (24 if args.tiny else 28))
    print(f"copy bandwidth ({common.device_name(device)}): {bandwidth:.1f} GB/s")
    for row in rows:
        print(f"  {row.provider} {row.shape}: {row.gbps:.2f} GB/s of the bytes our op moves = "
              f"{row.gbps / bandwidth:.1%} of copy bandwidth; peak memory "
              f"{'-' if row.peak_gib is None else f'{row.peak_gib * 1024:.2f} MiB'}")
    print(f"rows appended to {path}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="per-token inputs (default bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CI dry run)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    parser.add_argument("--only-compiled", action="store_true",
                        help="ours and torch.compile only (the GPU suite's compiled stage)")
    parser.add_argument("--out", default=None, help="folder for ppo_loss.jsonl (default bench/results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=5.0,
                        help="stop repeating a provider after about this many seconds")
    return parser.parse_args(argv)


def main() -> None:
    start = time.perf_counter()
    run(parse_args())
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
