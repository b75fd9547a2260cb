"""Benchmark: attention over packed variable-length sequences (docs/design.md, "Attention over packed
trajectories"), forward and forward+backward.

Providers, all in this process, all checked before they are timed:

* ``agentrl_fast (auto: NAME)``: ours, ``varlen_attention(..., backend="auto", validate=False)``
  (NAME is the backend auto picks); every other available backend gets a row of its own,
  ``agentrl_fast backend=NAME`` (the float32 "reference" backend only on instances it can hold).
* ``flex_attention``: ``torch.nn.attention.flex_attention`` on the packed ``[1, H, T, D]`` layout
  with a document-causal mask; its BlockMask is built straight from the document ids (the block
  sparsity of a document-causal mask is known in closed form, and ``create_block_mask`` would
  materialize ``T x T`` booleans). Compiled (``torch.compile``, dynamic shapes: one compile for
  every T) on CUDA; on the CPU it runs eager (unfused, scores materialized) unless
  ``--flex-compile`` is given (a compile costs ~10 s there), forward only (torch's flex_attention
  has no CPU backward: a printed note says so).
* ``sdpa-padded``: the sequences padded to ``[B, max_len]`` (right padding) and
  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``. With right padding the
  causal mask is the padding+causal mask for every real token (its window holds real tokens
  only), which lets SDPA use its flash kernel; pad rows are computed and thrown away, as padded
  trainers do. Non-causal runs pass a key padding mask. Only the attention is timed (inputs are
  padded beforehand). Skipped with a printed note when the padded tensors or the padded work
  exceed ``--max-padded-gib`` / ``--max-padded-tflop``. On CUDA the math backend is excluded.

Every provider is first checked on a small instance (odd lengths, length 1) against the float64
``varlen_attention_reference`` (outputs and gradients), then, on each timed instance, against
ours. Inputs are random normal.

Mixes (``--mix``): "uniform" (lengths uniform in a range), "long-tail" (log-uniform 64..32768),
"bimodal" (half the tokens in sequences of ~128..320, half in 8192..16384). CUDA: 65536 and
262144 tokens, 32 query / 8 KV heads, head dim 128, bfloat16. ``--tiny``: 2048 tokens, 4 / 2
heads, head dim 64, float32 (bf16 matrix products are slow on the CPU), one CPU thread (the dry
run checks the plumbing; one thread stays fast on a shared CI box). ``--device cpu``: 8192
tokens, 8 / 2 heads, head dim 64, float32. ``--sizes main-job``: the default training run's
micro-batches (16384 tokens in sequences of at most 200, 4 / 2 heads of 16).

FLOPs are counted as flash-attention counts them: forward ``4 * sum(L^2) * Hq * D``, halved
when causal; backward 2.5x the forward, so forward+backward is 3.5x. TFLOP/s are also stated
as a fraction of the matrix rate measured in the same run (a ``8192^3`` matmul in the benchmark's
dtype on CUDA). ``ratio`` = provider time / ours (> 1: ours is faster).

Timing: CPU, ``bench.common.benchmark``. CUDA: CUDA events around each call, median of at least
3 calls after the checked (warm-up) call, more while under ~100 ms in all; like
``triton.testing.do_bench`` without its 5 estimation calls, which would cost seconds on the
slowest instances (at the CUDA sizes every input is >= 512 MiB, far above the L2 cache, so no
flush is needed).
``--time-budget`` (45 s on CUDA) skips, with a note, what would start after it is spent; rows
are appended after every instance, so a run cut off still leaves its finished instances.

Usage (from the repository root)::

    python bench/bench_varlen_attention.py [--device cpu|cuda] [--mix NAME] [--tiny] [--out DIR]
"""

import argparse
import dataclasses
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from agentrl_fast.ops.reference import varlen_attention_reference  # noqa: E402
from agentrl_fast.ops.varlen_attention import (available_backends, resolve_backend,  # noqa: E402
                                               varlen_attention)

MIXES = ("uniform", "long-tail", "bimodal")
MODES = ("fwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5}  # backward = 2.5x forward
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FLEX_BLOCK = 128
# Small check instance: length 1, odd lengths, a length crossing several 128-blocks.
CHECK_LENGTHS = [1, 7, 64, 129, 300, 523]


@dataclass(frozen=True)
class Sizes:
    totals: tuple[int, ...]
    heads_q: int
    heads_k: int
    head_dim: int
    uniform: tuple[int, int]
    long_tail: tuple[int, int]
    short: tuple[int, int]
    long: tuple[int, int]


SIZES = {
    "cuda": Sizes((65536, 262144), 32, 8, 128, (512, 4096), (64, 32768), (128, 320), (8192, 16384)),
    "cpu": Sizes((8192,), 8, 2, 64, (128, 1024), (64, 4096), (128, 320), (1024, 2048)),
    "tiny": Sizes((2048,), 4, 2, 64, (32, 256), (16, 1024), (24, 64), (256, 512)),
    # The default `agentrl-fast train` run's micro-batches: sub-traces of at most 200 tokens,
    # the tiny policy's 4 / 2 heads of 16.
    "main-job": Sizes((16384,), 4, 2, 16, (40, 200), (8, 200), (24, 64), (150, 200)),
}


# ---------------------------------------------------------------------------------------------
# Inputs


def _fill(draw: Callable[[], int], total: int) -> list[int]:
    """Lengths from ``draw()`` until they reach ``total``; the last one takes the rest."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(draw(), total - sum(lengths)))
    return lengths


def mix_lengths(name: str, total: int, sizes: Sizes, seed: int) -> list[int]:
    """Sequence lengths of a mix, summing to ``total``."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low: int, high: int) -> Callable[[], int]:
        return lambda: int(torch.randint(low, high + 1, (), generator=gen))

    if name == "uniform":
        return _fill(uniform(*sizes.uniform), total)
    if name == "long-tail":
        low, high = (math.log(x) for x in sizes.long_tail)

        def log_uniform() -> int:
            return round(math.exp(float(torch.empty(()).uniform_(low, high, generator=gen))))
        return _fill(log_uniform, total)
    if name == "bimodal":
        lengths = _fill(uniform(*sizes.long), total // 2) + _fill(uniform(*sizes.short),
                                                                 total - total // 2)
        order = torch.randperm(len(lengths), generator=gen).tolist()
        return [lengths[i] for i in order]
    raise ValueError(f"unknown mix {name!r}; choose from {MIXES}")


def make_instance(name: str, lengths: list[int], sizes: Sizes, device: torch.device,
                  dtype: torch.dtype, causal: bool, seed: int) -> dict:
    """Packed random-normal ``q[T, Hq, D]``, ``k, v[T, Hk, D]`` (leaves requiring grad), ``dout``,
    ``cu_seqlens`` (int32), document ids ``doc[T]`` and the facts the rows need."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total, hq, hk, d = sum(lengths), sizes.heads_q, sizes.heads_k, sizes.head_dim

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    counts = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    return {
        "name": name, "lengths": lengths, "num_tokens": total, "max_len": max(lengths),
        "causal": causal, "heads_q": hq, "heads_k": hk, "head_dim": d,
        "q": randn(total, hq, d).requires_grad_(), "k": randn(total, hk, d).requires_grad_(),
        "v": randn(total, hk, d).requires_grad_(), "dout": randn(total, hq, d),
        "cu_seqlens": cu.to(device),
        "doc": torch.repeat_interleave(torch.arange(len(lengths)), counts).to(device),
        "shape": f"{name} B={len(lengths)} T={total} Hq={hq} Hk={hk} D={d}"
                 + ("" if causal else " non-causal"),
    }


def attention_flops(lengths: list[int], heads_q: int, head_dim: int, causal: bool,
                    mode: str) -> float:
    """FLOPs as flash-attention counts them: forward 4 * sum(L^2) * Hq * D (/2 when causal),
    backward 2.5x forward."""
    forward = 4 * sum(n * n for n in lengths) * heads_q * head_dim / (2 if causal else 1)
    return forward * FLOP_FACTOR[mode]


# ---------------------------------------------------------------------------------------------
# Providers: prepare(instance) -> Prepared. forward() runs without grad; forward_backward()
# returns (out, dq, dk, dv); to_packed maps an output or gradient to the packed [T, H, D] layout.


@dataclass
class Prepared:
    forward: Callable[[], torch.Tensor]
    forward_backward: Callable[[], tuple[torch.Tensor, ...]]
    to_packed: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Provider:
    name: str
    prepare: Callable[[dict], Prepared]
    ours: bool = False  # our code: an exception or a failed check is a failure of the run
    limit: Callable[[dict, str], str | None] | None = None  # (instance, mode) -> reason to skip
    unsupported: set[str] = dataclasses.field(default_factory=set)  # modes it cannot run


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _prepared(run: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
              dout: torch.Tensor, to_packed: Callable = _identity) -> Prepared:
    """forward(): ``run(q, k, v)`` on detached inputs without grad; forward_backward(): on the
    leaves, then the gradients for ``dout`` (autograd.grad: nothing accumulates)."""
    detached = tuple(x.detach() for x in inputs)

    def forward():
        with torch.no_grad():
            return run(*detached)

    def forward_backward():
        out = run(*inputs)
        return (out.detach(),) + torch.autograd.grad(out, inputs, dout)
    return Prepared(forward, forward_backward, to_packed)


def prepare_ours(inst: dict, backend: str) -> Prepared:
    def run(q, k, v):
        return varlen_attention(q, k, v, inst["cu_seqlens"], inst["max_len"], causal=inst["causal"],
                                backend=backend, validate=False)
    return _prepared(run, (inst["q"], inst["k"], inst["v"]), inst["dout"])


def document_block_mask(doc: torch.Tensor, causal: bool, block_mask_cls, mask_mod) -> object:
    """flex_attention BlockMask of the document (causal) mask of ``doc[T]`` (non-decreasing ids),
    built from per-block document ranges: block pair (i, j) is non-empty when the document ranges
    of q-block i and kv-block j overlap (and j <= i when causal), full when both blocks lie in one
    document (and j < i when causal). Partial blocks apply ``mask_mod``."""
    total = doc.numel()
    blocks = -(-total // FLEX_BLOCK)
    positions = torch.arange(blocks * FLEX_BLOCK, device=doc.device).clamp_(max=total - 1)
    per_block = doc[positions].view(blocks, FLEX_BLOCK)
    low, high = per_block[:, 0], per_block[:, -1]
    # Rows: q-block i; columns: kv-block j.
    nonempty = (high[None, :] >= low[:, None]) & (low[None, :] <= high[:, None])
    single = low == high
    if total % FLEX_BLOCK:
        single[-1] = False                           # the ragged last block is never full
    full = single[:, None] & single[None, :] & (low[None, :] == low[:, None])
    index = torch.arange(blocks, device=doc.device)
    if causal:
        nonempty &= index[None, :] <= index[:, None]
        full &= index[None, :] < index[:, None]
    partial = nonempty & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
        return counts[None, None], indices.to(torch.int32)[None, None]

    kv_num, kv_indices = ordered(partial)
    full_num, full_indices = ordered(full)
    return block_mask_cls.from_kv_blocks(kv_num, kv_indices, full_num, full_indices,
                                         BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                         seq_lengths=(total, total))


def make_flex_provider(device: torch.device, args: argparse.Namespace) -> Provider | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError as error:
        print(f"note: flex_attention skipped: {error}")
        return None
    compiled = device.type == "cuda" or args.flex_compile
    if compiled:
        flex = torch.compile(flex_attention, dynamic=True)
    else:
        flex = flex_attention
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        print("note: flex_attention runs eager on the CPU (unfused, scores materialized); "
              "--flex-compile compiles it")

    def prepare(inst: dict) -> Prepared:
        doc, causal = inst["doc"], inst["causal"]

        def mask_mod(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        block_mask = document_block_mask(doc, causal, BlockMask, mask_mod)
        gqa = inst["heads_q"] != inst["heads_k"]

        def run(q, k, v):
            out = flex(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None],
                       v.permute(1, 0, 2)[None], block_mask=block_mask, enable_gqa=gqa)
            return out[0].permute(1, 0, 2)               # [T, Hq, D]
        return _prepared(run, (inst["q"], inst["k"], inst["v"]), inst["dout"])

    def limit(inst: dict, mode: str) -> str | None:
        if compiled:
            return None
        scores = inst["heads_q"] * inst["num_tokens"] ** 2 * 4
        if scores > args.max_eager_flex_gib * 2**30:
            return (f"eager flex_attention would materialize {scores / 2**30:.1f} GiB of scores "
                    f"(> --max-eager-flex-gib {args.max_eager_flex_gib})")
        return None

    name = "flex_attention (doc mask, compiled)" if compiled else "flex_attention (doc mask, eager)"
    return Provider(name, prepare, limit=limit)


def make_padded_provider(device: torch.device, args: argparse.Namespace) -> Provider:
    def prepare(inst: dict) -> Prepared:
        lengths = torch.tensor(inst["lengths"], device=device)
        valid = torch.arange(inst["max_len"], device=device)[None, :] < lengths[:, None]  # [B, L]

        def pad(x: torch.Tensor) -> torch.Tensor:             # [T, H, D] -> [B, L, H, D]
            out = x.new_zeros(valid.shape + x.shape[1:])
            out[valid] = x.detach()
            return out

        leaves = tuple(pad(inst[n]).requires_grad_() for n in ("q", "k", "v"))
        dout = pad(inst["dout"])
        causal = inst["causal"]
        mask = None if causal else valid[:, None, None, :]
        gqa = inst["heads_q"] != inst["heads_k"]
        kernels = None
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend
            kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                       SDPBackend.EFFICIENT_ATTENTION]  # never the math backend: it materializes

        def run(q, k, v):                                     # -> [B, L, Hq, D]
            inputs = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            if kernels is None:
                out = F.scaled_dot_product_attention(*inputs, attn_mask=mask, is_causal=causal,
                                                     enable_gqa=gqa)
            else:
                from torch.nn.attention import sdpa_kernel
                with sdpa_kernel(kernels):
                    out = F.scaled_dot_product_attention(*inputs, attn_mask=mask,
                                                         is_causal=causal, enable_gqa=gqa)
            return out.transpose(1, 2)

        def to_packed(x: torch.Tensor) -> torch.Tensor:       # [B, L, H, D] -> [T, H, D]
            return x[valid]
        return _prepared(run, leaves, dout, to_packed)

    def limit(inst: dict, mode: str) -> str | None:
        batch, longest = len(inst["lengths"]), inst["max_len"]
        hq, hk, d = inst["heads_q"], inst["heads_k"], inst["head_dim"]
        size = inst["q"].element_size()
        # q, out, dq, dout with Hq heads; k, v, dk, dv with Hk heads
        gib = batch * longest * (4 * hq + 4 * hk) * d * size / 2**30
        tflop = attention_flops([longest] * batch, hq, d, inst["causal"], mode) / 1e12
        if gib > args.max_padded_gib:
            return f"padded tensors {gib:.1f} GiB > --max-padded-gib {args.max_padded_gib}"
        if tflop > args.max_padded_tflop:
            return (f"padded work {tflop:.1f} TFLOP ({batch} x {longest} tokens) > "
                    f"--max-padded-tflop {args.max_padded_tflop}")
        return None

    return Provider("sdpa-padded", prepare, limit=limit)


def reference_limit(args: argparse.Namespace) -> Callable[[dict, str], str | None]:
    """The float32 "reference" backend holds one sequence's [Hq, L, L] scores (several copies
    in backward) and computes full matrices: only small instances."""
    def limit(inst: dict, mode: str) -> str | None:
        scores = inst["heads_q"] * inst["max_len"] ** 2 * 4
        tflop = attention_flops(inst["lengths"], inst["heads_q"], inst["head_dim"], inst["causal"],
                                mode) / 1e12
        if scores > args.max_reference_gib * 2**30:
            return (f"per-sequence scores {scores / 2**30:.1f} GiB > --max-reference-gib "
                    f"{args.max_reference_gib}")
        if tflop > args.max_reference_tflop:
            return f"{tflop:.1f} TFLOP > --max-reference-tflop {args.max_reference_tflop}"
        return None
    return limit


def make_providers(device: torch.device,
                   args: argparse.Namespace) -> tuple[Provider, list[Provider]]:
    """Ours (backend auto), then every other available backend, flex_attention, sdpa-padded."""
    auto = resolve_backend("auto", device)
    ours = Provider(f"agentrl_fast (auto: {auto})", lambda inst: prepare_ours(inst, "auto"),
                    ours=True)
    others = []
    for name in available_backends(device):
        if name == auto:
            print(f"note: backend={name} is what auto picks; its figures are the "
                  f"'agentrl_fast (auto: {name})' rows")
            continue
        others.append(Provider(f"agentrl_fast backend={name}",
                               lambda inst, name=name: prepare_ours(inst, name), ours=True,
                               limit=reference_limit(args) if name == "reference" else None))
    flex = make_flex_provider(device, args)
    if flex is not None:
        others.append(flex)
    others.append(make_padded_provider(device, args))
    skip = set(args.skip or ())
    kept = [p for p in others if not any(p.name.startswith(s) for s in skip)]
    for p in others:
        if p not in kept:
            print(f"note: {p.name} skipped (--skip)")
    return ours, kept


# ---------------------------------------------------------------------------------------------
# Checks and timing

# Allowed max |error| relative to max |expected|, per input dtype: outputs, gradients.
TOLERANCE = {torch.float32: (1e-4, 2e-4), torch.float16: (1e-2, 2.5e-2),
             torch.bfloat16: (2e-2, 5e-2)}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in want's dtype (at least float32) and device."""
    dtype = torch.float64 if want.dtype == torch.float64 else torch.float32
    want = want.detach().to(dtype)
    got = got.detach().to(device=want.device, dtype=dtype)
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    scale = float(want.abs().max())
    if not scale > 0:
        raise AssertionError("the expected values are all zero; refusing to check against them")
    return float((got - want).abs().max()) / scale


def compare(label: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...],
            dtype: torch.dtype, slack: float = 1.0) -> list[float]:
    """Errors of (out[, dq, dk, dv]); raises AssertionError above TOLERANCE * slack (or NaN)."""
    errors = []
    for index, (g, w) in enumerate(zip(got, want)):
        error = relative_error(g, w)
        tol = TOLERANCE[dtype][min(index, 1)] * slack
        if not error <= tol:
            what = ("out", "dq", "dk", "dv")[index]
            raise AssertionError(f"{label}: {what} max relative error {error:.3g} > {tol:.1e}")
        errors.append(error)
    return errors


def check_small(ours: Provider, providers: list[Provider], sizes: Sizes, device: torch.device,
                dtype: torch.dtype, args: argparse.Namespace,
                failures: list[str]) -> list[Provider]:
    """Every provider on a small instance against the float64 reference (outputs and gradients).
    Returns the providers that passed; a failing baseline is dropped with a note."""
    inst = make_instance("check", CHECK_LENGTHS, sizes, device, dtype, args.causal, args.seed + 1)
    leaves = [inst[n].detach().to("cpu", torch.float64).requires_grad_() for n in ("q", "k", "v")]
    out64, _ = varlen_attention_reference(*leaves, inst["cu_seqlens"], causal=args.causal)
    want = (out64,) + torch.autograd.grad(out64, leaves, inst["dout"].to("cpu", torch.float64))
    kept = []
    for provider in [ours] + providers:
        label = f"check {inst['shape']}: {provider.name}"
        start = time.perf_counter()
        errors = []
        try:
            prepared = provider.prepare(inst)
            errors += compare(label + " fwd", (prepared.to_packed(prepared.forward()),),
                              want[:1], dtype)
            try:
                grads = tuple(prepared.to_packed(x) for x in prepared.forward_backward())
            except Exception as error:  # noqa: BLE001  (a baseline without a backward here)
                if provider.ours:
                    raise
                provider.unsupported.add("fwd+bwd")
                print(f"note: {provider.name} fwd+bwd skipped: {_first_line(error)}")
            else:
                errors += compare(label + " fwd+bwd", grads, want, dtype)[1:]
        except AssertionError as error:
            failures.append(str(error))
            print(f"FAILED {error}", flush=True)
            continue
        except Exception as error:  # noqa: BLE001  (a baseline that cannot run here is skipped)
            if provider.ours:
                raise
            print(f"note: {provider.name} skipped: it failed on the check instance: "
                  f"{_first_line(error)}")
            continue
        if provider is not ours:
            kept.append(provider)
        print(f"{label}: out{'/dq/dk/dv' if len(errors) > 1 else ''} max rel error vs float64 "
              + "/".join(f"{e:.1e}" for e in errors)
              + f" ({time.perf_counter() - start:.1f} s)", flush=True)
    return kept


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, args: argparse.Namespace) -> float:
    """Median milliseconds of ``fn()`` (already run once: the check). See the module docstring."""
    if device.type != "cuda":
        # The checked call was the first warm-up.
        options = {"warmup": 0, "repeats": 3, "max_seconds": 0.5} if args.tiny else \
            {"warmup": 1, "max_seconds": args.max_seconds}
        return common.benchmark(fn, device, **options)
    times = []
    while len(times) < 3 or (sum(times) < args.target_ms and len(times) < 50):
        times.append(common.cuda_event_ms(fn))
    return statistics.median(times)


def make_row(provider: str, inst: dict, mode: str, device: torch.device, ms: float,
             ours_ms: float) -> common.Row:
    flops = attention_flops(inst["lengths"], inst["heads_q"], inst["head_dim"], inst["causal"],
                            mode)
    return common.Row(
        op="varlen_attention", provider=provider, shape=f"{inst['shape']} {mode}",
        dtype=str(inst["q"].dtype).removeprefix("torch."), device=common.device_name(device),
        time_ms=ms, tokens_per_s=inst["num_tokens"] / (ms * 1e-3),
        tflops=flops / (ms * 1e-3) / 1e12, ratio=ms / ours_ms,
    )


class Budget:
    def __init__(self, seconds: float | None):
        self.deadline = None if not seconds else time.perf_counter() + seconds

    def spent(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


def bench_instance(inst: dict, ours: Provider, providers: list[Provider], device: torch.device,
                   args: argparse.Namespace, budget: Budget,
                   failures: list[str]) -> list[common.Row]:
    """Rows of one instance: ours first in each mode (ratio 1.0), then every provider, each
    checked against ours on this instance before it is timed."""
    dtype = inst["q"].dtype
    rows, ours_ms, ours_out = [], {}, {}
    for provider in [ours] + providers:
        if budget.spent():
            print(f"  note: time budget spent; skipped {provider.name}", flush=True)
            continue
        reasons = {mode: provider.limit(inst, mode) if provider.limit else None for mode in MODES}
        modes = [m for m in MODES if reasons[m] is None and m not in provider.unsupported]
        for mode in MODES:
            if reasons[mode]:
                print(f"  note: {provider.name} {mode} skipped: {reasons[mode]}", flush=True)
        if not modes:
            continue
        try:
            prepared = provider.prepare(inst)
        except Exception as error:  # noqa: BLE001
            if provider.ours:
                raise
            print(f"  note: {provider.name} skipped: {_first_line(error)}", flush=True)
            continue
        for mode in modes:
            if provider is not ours and mode not in ours_ms:
                continue
            if budget.spent():
                print(f"  note: time budget spent; skipped {provider.name} {mode}", flush=True)
                continue
            fn = prepared.forward if mode == "fwd" else prepared.forward_backward
            label = f"{inst['shape']} {mode}: {provider.name}"
            try:
                result = fn()
                _sync(device)
                got = (prepared.to_packed(result),) if mode == "fwd" else \
                    tuple(prepared.to_packed(x) for x in result)
                del result
                if provider is ours:
                    for g in got:
                        if not bool(torch.isfinite(g).all()) or not float(g.abs().max()) > 0:
                            raise AssertionError(f"{label}: non-finite or all-zero result")
                    ours_out[mode] = got
                    error_text = "reference for the others"
                else:
                    errors = compare(label, got, ours_out[mode], dtype, slack=2.0)
                    error_text = "max rel error vs ours " + "/".join(f"{e:.1e}" for e in errors)
                del got
                ms = measure(fn, device, args)
            except AssertionError as error:
                failures.append(str(error))
                print(f"  FAILED {error}", flush=True)
                continue
            except Exception as error:  # noqa: BLE001
                if provider.ours:
                    raise
                print(f"  note: {provider.name} {mode} skipped: {_first_line(error)}", flush=True)
                continue
            if provider is ours:
                ours_ms[mode] = ms
            row = make_row(provider.name, inst, mode, device, ms, ours_ms[mode])
            rows.append(row)
            print(f"  {provider.name} {mode}: {ms:.3f} ms, {row.tflops:.3g} TFLOP/s, "
                  f"ratio {row.ratio:.2f} ({error_text})", flush=True)
        del prepared
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def matrix_rate(device: torch.device, dtype: torch.dtype,
                args: argparse.Namespace) -> tuple[int, float]:
    """(n, TFLOP/s) of an n^3 matmul in ``dtype``: the ceiling stated with every figure."""
    n = 8192 if device.type == "cuda" and not args.tiny else (1024 if args.tiny else 2048)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    a = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    options = {"warmup": 1, "repeats": 3, "max_seconds": 1.0} if device.type == "cpu" else {}
    ms = common.benchmark(lambda: torch.mm(a, b, out=c), device, **options)
    return n, 2 * n**3 / (ms * 1e-3) / 1e12


def run(args: argparse.Namespace) -> tuple[list[common.Row], list[str]]:
    """Checks, times and reports every provider on the selected mixes and totals; appends rows to
    varlen_attention.jsonl after every instance. Returns (rows, failures)."""
    device = torch.device(args.device)
    threads = args.threads if args.threads is not None else (1 if args.tiny else None)
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    sizes = SIZES[args.sizes or ("tiny" if args.tiny else device.type)]
    if args.totals:
        sizes = dataclasses.replace(sizes, totals=tuple(args.totals))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" and not args.tiny
                                  else "float32")]
    budget = Budget(args.time_budget if args.time_budget is not None
                    else (45.0 if device.type == "cuda" else None))
    failures: list[str] = []
    ours, providers = make_providers(device, args)
    providers = check_small(ours, providers, sizes, device, dtype, args, failures)
    names = MIXES if args.mix == "all" else (args.mix,)
    rows, path = [], None
    for total in sizes.totals:
        for index, name in enumerate(names):
            if budget.spent():
                print(f"note: time budget spent; skipped {name} T={total}", flush=True)
                continue
            start = time.perf_counter()
            lengths = mix_lengths(name, total, sizes, args.seed + index)
            inst = make_instance(name, lengths, sizes, device, dtype, args.causal, args.seed)
            tflop = attention_flops(lengths, sizes.heads_q, sizes.head_dim, args.causal,
                                    "fwd") / 1e12
            print(f"bench {inst['shape']} (max len {inst['max_len']}, causal {args.causal}, "
                  f"{tflop:.3g} TFLOP forward)", flush=True)
            new = bench_instance(inst, ours, providers, device, args, budget, failures)
            if new:
                path = common.write_rows(new, "varlen_attention", args.out)
            rows += new
            del inst
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)
    if rows:
        common.print_table(rows)
    n, rate = matrix_rate(device, dtype, args)
    print(f"matrix rate ({str(dtype).removeprefix('torch.')} {n}^3 matmul, "
          f"{common.device_name(device)}): {rate:.2f} TFLOP/s")
    for row in rows:
        print(f"  {row.provider:<40} {row.shape:<54} {row.tflops:8.3f} TFLOP/s = "
              f"{row.tflops / rate:6.1%} of the matrix rate")
    if path:
        print(f"rows appended to {path}")
    for failure in failures:
        print(f"FAILED {failure}")
    return rows, failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mix", choices=MIXES + ("all",), default="all")
    parser.add_argument("--totals", type=int, nargs="+", default=None,
                        help="token totals (default 65536 262144 on CUDA, 8192 on the CPU, "
                             "2048 with --tiny)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="default bfloat16 on CUDA, float32 on the CPU and with --tiny")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CI dry run)")
    parser.add_argument("--sizes", choices=("main-job",), default=None,
                        help="main-job: the default training run's shapes (16384 tokens in "
                             "sequences of <= 200, 4 / 2 heads of 16)")
    parser.add_argument("--out", default=None,
                        help="folder for varlen_attention.jsonl (default bench/results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="+", default=None,
                        help="providers to leave out (name prefixes, e.g. flex_attention)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default torch's; 1 with --tiny: the dry run checks "
                             "the plumbing, and one thread stays fast on a shared CI box)")
    parser.add_argument("--flex-compile", action="store_true",
                        help="compile flex_attention on the CPU too (always compiled on CUDA)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which nothing new starts (default 45 on CUDA, none "
                             "on the CPU; 0: none)")
    parser.add_argument("--target-ms", type=float, default=100.0,
                        help="CUDA: keep timing a provider (up to 50 calls) until this many ms")
    parser.add_argument("--max-seconds", type=float, default=10.0,
                        help="stop repeating a provider after about this many seconds")
    parser.add_argument("--max-padded-gib", type=float, default=None,
                        help="skip sdpa-padded when its padded tensors (inputs, output, "
                             "gradients) exceed this (default 32 on CUDA, 4 on the CPU)")
    parser.add_argument("--max-padded-tflop", type=float, default=None,
                        help="skip sdpa-padded above this padded work (default 100 on CUDA, "
                             "0.05 on the CPU)")
    parser.add_argument("--max-reference-gib", type=float, default=2.0,
                        help="skip backend=reference when one sequence's float32 scores exceed it")
    parser.add_argument("--max-reference-tflop", type=float, default=12.0,
                        help="skip backend=reference (not ours) above this counted work")
    parser.add_argument("--max-eager-flex-gib", type=float, default=1.0,
                        help="skip eager (CPU) flex_attention above this many GiB of scores")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.max_padded_tflop is None:
        args.max_padded_tflop = 100.0 if cuda else 0.05
    if args.max_padded_gib is None:
        args.max_padded_gib = 32.0 if cuda else 4.0
    return args


def main() -> None:
    start = time.perf_counter()
    _, failures = run(parse_args())
    print(f"total {time.perf_counter() - start:.1f} s")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
