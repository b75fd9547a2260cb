"""Attention over packed variable-length trajectories (DESIGN.md, "Attention over packed
trajectories").

``varlen_attention(q[T, Hq, D], k[T, Hk, D], v[T, Hk, D], cu_seqlens, max_seqlen)``: each of the B
sequences laid end to end attends only to itself. Several backends compute it:

- ``"reference"``: per-sequence scaled-dot-product attention in float32 (any device); its
  forward and backward run inside the registered op ``agentrl_fast::varlen_attention_forward`` /
  ``_backward``.
- ``"native"``: our C++ kernel (``csrc/varlen_attention.cpp``; the CPU default): per sequence
  and KV head, vectorised over keys, no padding; the same registered ops.
- ``"cpu_flash"``: torch's fused CPU flash-attention kernel on padded batches of sequences of
  similar length (the same registered ops).
- ``"torch"``: torch's own varlen attention (``torch.nn.attention.varlen``, CUDA).
- ``"flash_attn"``: flash-attn's ``flash_attn_varlen_func`` when installed (CUDA).
- ``"triton"``: our Triton kernel, registered by ``agentrl_fast.ops.varlen_attention_triton``.

Backends of kind ``"op"`` (reference, native, cpu_flash, triton) provide ``forward``/``backward`` functions that write
into preallocated outputs and run inside our registered ops; backends of kind ``"autograd"``
(torch, flash_attn) are differentiable functions called directly (they are registered ops of
their own libraries, so ``torch.compile`` traces them too).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from agentrl_fast.ops._checks import (check_cu_seqlens_metadata, require_real, require_tensor,
                                      validate_cu_seqlens)

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Backend:
    """One way to compute varlen attention.

    ``unavailable(device) -> str | None`` says why the backend cannot run on a device (None: it
    can). Kind ``"op"``: ``forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic,
    out, lse)`` fills ``out[T, Hq, D]`` and ``lse[Hq, T]`` (float32); ``backward(dout, q, k, v,
    out, lse, cu_seqlens, max_seqlen, causal, scale, deterministic, dq, dk, dv)`` fills the
    gradients. Kind ``"autograd"``: ``run(q, k, v, cu_seqlens, max_seqlen, causal, scale,
    deterministic, need_lse) -> (out, lse or None)``, differentiable by itself.
    """

    name: str
    kind: str
    unavailable: Callable[[torch.device], str | None]
    forward: Callable | None = None
    backward: Callable | None = None
    run: Callable | None = None
    # unsupported(q, k) -> str | None: why these inputs (dtype, head_dim, ...) are out of the
    # backend's reach; "auto" skips such backends, an explicit choice raises with the reason.
    unsupported: Callable[[torch.Tensor, torch.Tensor], str | None] = lambda q, k: None


BACKENDS: dict[str, Backend] = {}
# "auto" takes the first available, per device type.
AUTO_ORDER = {"cuda": ("triton", "flash_attn", "torch", "reference"),
              "cpu": ("native", "cpu_flash", "reference")}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; the Triton backend registers itself this way."""
    if backend.kind not in ("op", "autograd"):
        raise ValueError(f"backend kind must be 'op' or 'autograd', got {backend.kind!r}")
    BACKENDS[backend.name] = backend


def available_backends(device: torch.device | str) -> list[str]:
    """Names of the backends that can run on ``device``."""
    device = torch.device(device)
    return [name for name, b in BACKENDS.items() if b.unavailable(device) is None]


def resolve_backend(backend: str, device: torch.device, q: torch.Tensor | None = None,
                    k: torch.Tensor | None = None) -> str:
    """The backend ``varlen_attention`` would use for ``backend`` on ``device`` (and, when
    given, for inputs like ``q`` and ``k``)."""

    def why_not(name: str) -> str | None:
        chosen = BACKENDS[name]
        reason = chosen.unavailable(device)
        if reason is None and q is not None:
            reason = chosen.unsupported(q, k)
        return reason

    if backend == "auto":
        order = AUTO_ORDER.get(device.type, ("reference",))
        if device.type == "cpu" and not _NATIVE_VECTORISED:  # native's baseline build:
            order = ("cpu_flash", "native", "reference")  # slower than cpu_flash, not reference
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            order = ("triton",) + tuple(order)  # how the tests run Triton kernels on the CPU
        for name in order:
            if name in BACKENDS and why_not(name) is None:
                return name
        raise ValueError(f"no varlen_attention backend is available on {device}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    reason = BACKENDS[backend].unavailable(device)
    if reason is not None:
        raise ValueError(f"backend {backend!r} is not available on {device}: {reason}")
    reason = why_not(backend)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot take these inputs: {reason}")
    return backend


def _flash_kernel_unsupported(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """What flash-attention kernels (torch's varlen, flash-attn) do not take."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"its flash kernels take float16/bfloat16 only, got {q.dtype}"
    if q.shape[2] % 8 != 0:
        return f"its flash kernels need head_dim % 8 == 0, got {q.shape[2]}"
    if q.shape[0] == 0:
        return "its flash kernels need at least one token"
    return None


# ---------------------------------------------------------------------------------------------
# The "reference" backend: per-sequence attention in float32.

def _sequence_bounds(cu_seqlens: torch.Tensor, num_tokens: int) -> list[tuple[int, int]]:
    """(start, end) per sequence, clamped so unvalidated cu_seqlens never index out of range."""
    bounds, previous_end = [], 0
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        start = min(max(start, previous_end), num_tokens)
        end = min(max(end, start), num_tokens)
        bounds.append((start, end))
        previous_end = end
    return bounds


def _sequence_scores(q, k, start, end, groups, causal, scale):
    """Scores ``[Hq, L, L]`` (float32) of one sequence, and its q, k as ``[H, L, D]``."""
    qs = q[start:end].float().transpose(0, 1)
    ks = k[start:end].float().transpose(0, 1).repeat_interleave(groups, dim=0)
    scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
    if causal:
        length = end - start
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(future, -math.inf)
    return scores, qs, ks


def _reference_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, out, lse):
    num_tokens = q.shape[0]
    groups = q.shape[1] // k.shape[1]
    out.zero_()  # tokens outside every sequence (only with unvalidated cu_seqlens)
    lse.fill_(-math.inf)
    for start, end in _sequence_bounds(cu_seqlens, num_tokens):
        if start == end:
            continue
        scores, _, _ = _sequence_scores(q, k, start, end, groups, causal, scale)
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        sequence_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - sequence_lse.unsqueeze(-1))
        out[start:end] = torch.matmul(probs, vs).transpose(0, 1).to(out.dtype)
        lse[:, start:end] = sequence_lse


def _reference_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale,
                        deterministic, dq, dk, dv):
    num_tokens, num_heads_q, _ = q.shape
    num_heads_k = k.shape[1]
    groups = num_heads_q // num_heads_k
    for grad in (dq, dk, dv):
        grad.zero_()
    for start, end in _sequence_bounds(cu_seqlens, num_tokens):
        if start == end:
            continue
        length = end - start
        scores, qs, ks = _sequence_scores(q, k, start, end, groups, causal, scale)
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        probs = torch.exp(scores - lse[:, start:end].unsqueeze(-1))           # [Hq, L, L]
        do = dout[start:end].float().transpose(0, 1)                          # [Hq, L, D]
        o = out[start:end].float().transpose(0, 1)
        dv_heads = torch.matmul(probs.transpose(1, 2), do)                    # [Hq, L, D]
        dprobs = torch.matmul(do, vs.transpose(1, 2))                         # [Hq, L, L]
        row_dot = (do * o).sum(-1, keepdim=True)                              # [Hq, L, 1]
        dscores = probs * (dprobs - row_dot) * scale
        dq_heads = torch.matmul(dscores, ks)
        dk_heads = torch.matmul(dscores.transpose(1, 2), qs)
        dq[start:end] = dq_heads.transpose(0, 1).to(dq.dtype)
        # GQA: a KV head's gradient sums over the query heads of its group.
        dk[start:end] = dk_heads.view(num_heads_k, groups, length, -1).sum(1).transpose(0, 1).to(dk.dtype)
        dv[start:end] = dv_heads.view(num_heads_k, groups, length, -1).sum(1).transpose(0, 1).to(dv.dtype)


register_backend(Backend("reference", "op", lambda device: None, forward=_reference_forward,
                         backward=_reference_backward))


# ---------------------------------------------------------------------------------------------
# The "native" backend: our C++ kernel (csrc/varlen_attention.cpp), CPU only.

def _native_status() -> tuple[str | None, bool]:
    """(why the native kernel cannot run on the CPU, or None; whether it runs its AVX2 + FMA
    build). Its baseline build (x86-64 without AVX2 + FMA, other CPUs,
    AGENTRL_FAST_CPU_BASELINE=1) is slower than cpu_flash, so "auto" then prefers that. Read
    once at import: ``torch.compile`` traces ``resolve_backend`` and cannot call into the
    extension."""
    try:
        from agentrl_fast import _native
    except ImportError:
        return "the native extension agentrl_fast._C is not built", False
    if not _native.has_kernel("varlen_attention_cpu_out", "CPU"):
        return ("the installed agentrl_fast._C has no varlen_attention_cpu_out kernel (rebuild: "
                "pip install --no-build-isolation -e .)"), False
    return None, bool(_native._C.varlen_attention_cpu_uses_avx2())


_NATIVE_UNAVAILABLE, _NATIVE_VECTORISED = _native_status()


def _native_unavailable(device: torch.device) -> str | None:
    return "it runs on the CPU only" if device.type != "cpu" else _NATIVE_UNAVAILABLE


def _native_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, out, lse):
    torch.ops.agentrl_fast.varlen_attention_cpu_out(q.contiguous(), k.contiguous(), v.contiguous(),
                                                    cu_seqlens, causal, scale, out, lse)


def _native_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale,
                     deterministic, dq, dk, dv):
    # Deterministic always: one thread writes a sequence's dk, dv (no atomics).
    torch.ops.agentrl_fast.varlen_attention_cpu_backward_out(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
        lse.contiguous(), cu_seqlens, causal, scale, dq, dk, dv)


register_backend(Backend("native", "op", _native_unavailable, forward=_native_forward,
                         backward=_native_backward))


# ---------------------------------------------------------------------------------------------
# The "cpu_flash" backend: torch's fused CPU flash-attention kernel (the one behind
# scaled_dot_product_attention on the CPU) over padded batches of sequences of similar length.

# A bucket's padded tokens are at most this many times its real tokens (sequences are bucketed
# longest first; a new bucket starts where the next one would break the bound).
CPU_FLASH_PADDING = 1.5


def _cpu_flash_ops():
    aten = torch.ops.aten
    if not (hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu")
            and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward")):
        return None
    return (aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward)


def _cpu_flash_unavailable(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "it runs on the CPU only"
    if _cpu_flash_ops() is None:
        return f"torch {torch.__version__} has no CPU flash-attention kernel"
    return None


def _cpu_flash_buckets(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device):
    """Per bucket ``(index[G, L], valid[G, L])``: the packed token of each padded position
    (``num_tokens``, a zero row, where padded) and which positions are real. Empty sequences
    are in no bucket."""
    bounds = [(a, b) for a, b in _sequence_bounds(cu_seqlens, num_tokens) if b > a]
    bounds.sort(key=lambda ab: ab[0] - ab[1])  # longest first (stable: packed order on ties)
    buckets, current, real = [], [], 0
    for start, end in bounds:
        length = end - start
        if current and (len(current) + 1) * (current[0][1] - current[0][0]) \
                > CPU_FLASH_PADDING * (real + length):
            buckets.append(current)
            current, real = [], 0
        current.append((start, end))
        real += length
    if current:
        buckets.append(current)
    out = []
    for bucket in buckets:
        width = bucket[0][1] - bucket[0][0]
        starts = torch.tensor([a for a, _ in bucket], device=device)
        lengths = torch.tensor([b - a for a, b in bucket], device=device)
        position = torch.arange(width, device=device)
        valid = position[None, :] < lengths[:, None]
        out.append((torch.where(valid, starts[:, None] + position[None, :], num_tokens), valid))
    return out


def _padded(x: torch.Tensor, index: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x[T, H, ...]`` gathered to ``[G, H, L, ...]`` by ``index[G, L]`` (T: ``fill``)."""
    extended = torch.cat([x, x.new_full((1, *x.shape[1:]), fill)])
    return extended[index].transpose(1, 2)


def _key_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[G, 1, 1, L]`` mask hiding padded keys (non-causal attention)."""
    return torch.zeros(valid.shape[0], 1, 1, valid.shape[1], dtype=dtype,
                       device=valid.device).masked_fill_(~valid[:, None, None, :], -math.inf)


def _cpu_flash_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, out, lse):
    if scale == 0.0:  # torch's kernel returns NaN for a zero scale (uniform attention)
        return _reference_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic,
                                  out, lse)
    forward, _ = _cpu_flash_ops()
    out.zero_()  # tokens outside every sequence (only with unvalidated cu_seqlens)
    lse.fill_(-math.inf)
    for index, valid in _cpu_flash_buckets(cu_seqlens, q.shape[0], q.device):
        mask = None if causal else _key_mask(valid, q.dtype)
        # Causal with right padding is exact: a real query never sees a later (padded) key.
        bucket_out, bucket_lse = forward(_padded(q, index), _padded(k, index), _padded(v, index),
                                         0.0, causal, attn_mask=mask, scale=scale)
        tokens = index[valid]
        out[tokens] = bucket_out.transpose(1, 2)[valid].to(out.dtype)
        lse[:, tokens] = bucket_lse.transpose(1, 2)[valid].transpose(0, 1).float()


def _cpu_flash_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale,
                        deterministic, dq, dk, dv):
    if scale == 0.0:
        return _reference_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale,
                                   deterministic, dq, dk, dv)
    _, backward = _cpu_flash_ops()
    for grad in (dq, dk, dv):
        grad.zero_()
    lse_tokens = lse.transpose(0, 1)  # [T, Hq]
    for index, valid in _cpu_flash_buckets(cu_seqlens, q.shape[0], q.device):
        mask = None if causal else _key_mask(valid, q.dtype)
        # Padded query rows are zero with a zero upstream gradient: they add nothing (their
        # probabilities exp(0 - 0) are finite), so any finite LSE fills them.
        grads = backward(_padded(dout, index), _padded(q, index), _padded(k, index),
                         _padded(v, index), _padded(out, index),
                         _padded(lse_tokens, index).contiguous(), 0.0, causal, attn_mask=mask,
                         scale=scale)
        tokens = index[valid]
        for grad, bucket_grad in zip((dq, dk, dv), grads):
            grad[tokens] = bucket_grad.transpose(1, 2)[valid].to(grad.dtype)


register_backend(Backend("cpu_flash", "op", _cpu_flash_unavailable, forward=_cpu_flash_forward,
                         backward=_cpu_flash_backward))


# ---------------------------------------------------------------------------------------------
# The "torch" backend: torch.nn.attention.varlen (flash kernels, CUDA only).

@functools.lru_cache(maxsize=None)
def _torch_varlen_parameters() -> frozenset[str] | None:
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    fn = getattr(varlen, "varlen_attn", None)
    return None if fn is None else frozenset(inspect.signature(fn).parameters)


def _torch_unavailable(device: torch.device) -> str | None:
    if _torch_varlen_parameters() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if device.type != "cuda":
        return "torch's varlen attention runs on CUDA only"
    return None


def _torch_run(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, need_lse):
    from torch.nn.attention import varlen

    params = _torch_varlen_parameters()
    kwargs = {"scale": scale}
    # The causal flag moved: torch 2.10/2.11 take is_causal, later ones a window (-1, 0).
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        raise ValueError("this torch's varlen_attn supports no causal mask; use another backend")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older torch: expand the KV heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    if deterministic and "num_splits" in params:
        kwargs["num_splits"] = 1
    if need_lse and hasattr(varlen, "AuxRequest"):
        out, lse = varlen.varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      return_aux=varlen.AuxRequest(lse=True), **kwargs)
        return out, lse.detach().float()  # the LSE is not differentiable (its grad is dropped)
    if need_lse:
        raise ValueError("this torch's varlen_attn cannot return the LSE; use another backend")
    return varlen.varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs), None


register_backend(Backend("torch", "autograd", _torch_unavailable, run=_torch_run,
                         unsupported=_flash_kernel_unsupported))


# ---------------------------------------------------------------------------------------------
# The "flash_attn" backend (optional dependency).

def _flash_attn_unavailable(device: torch.device) -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    if device.type != "cuda":
        return "flash-attn runs on CUDA only"
    return None


def _flash_attn_run(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, need_lse):
    from flash_attn import flash_attn_varlen_func

    result = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                    softmax_scale=scale, causal=causal, deterministic=deterministic,
                                    return_attn_probs=need_lse)
    if need_lse:
        out, lse = result[0], result[1]
        return out, lse.detach().float()  # the LSE is not differentiable (its grad is dropped)
    return result, None


register_backend(Backend("flash_attn", "autograd", _flash_attn_unavailable, run=_flash_attn_run,
                         unsupported=_flash_kernel_unsupported))


# ---------------------------------------------------------------------------------------------
# The registered ops behind backends of kind "op".

@torch.library.custom_op("agentrl_fast::varlen_attention_forward", mutates_args=())
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_seqlen: int, causal: bool, softmax_scale: float, deterministic: bool,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    BACKENDS[backend].forward(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale,
                              deterministic, out, lse)
    return out, lse


@_attention_forward.register_fake
def _attention_forward_fake(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, deterministic,
                            backend):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("agentrl_fast::varlen_attention_backward", mutates_args=())
def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int, causal: bool, softmax_scale: float, deterministic: bool,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    BACKENDS[backend].backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal,
                               softmax_scale, deterministic, dq, dk, dv)
    return dq, dk, dv


@_attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal,
                             softmax_scale, deterministic, backend):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.params = (max_seqlen, causal, softmax_scale, deterministic, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    max_seqlen, causal, softmax_scale, deterministic, backend = ctx.params
    dq, dk, dv = _attention_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen,
                                     causal, softmax_scale, deterministic, backend)
    return dq, dk, dv, None, None, None, None, None, None


_attention_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The public function.

def _check_arguments(q, k, v, cu_seqlens, max_seqlen) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, tensor)
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, heads, head_dim], got shape {tuple(tensor.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q, got {tensor.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have T = q.shape[0] = {q.shape[0]} tokens, got {k.shape[0]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k must have head_dim = q.shape[2] = {q.shape[2]}, got {k.shape[2]}")
    num_heads_q, num_heads_k, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if num_heads_k == 0 or num_heads_q % num_heads_k != 0:
        raise ValueError(f"q's heads ({num_heads_q}) must be a multiple of k's heads ({num_heads_k}) "
                         "(GQA/MQA)")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    check_cu_seqlens_metadata(cu_seqlens, q.device)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be a Python int, got {type(max_seqlen).__name__}")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention within each sequence of a packed batch.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hk, D]`` with ``Hq % Hk == 0`` (GQA/MQA); one dtype of
            float16, bfloat16, float32; ``D <= 256``.
        cu_seqlens: ``[B+1]`` int32, ``0 = cu[0] <= ... <= cu[B] = T`` (empty sequences allowed).
        max_seqlen: a Python int, at least the longest sequence.
        causal: each token attends to itself and earlier tokens of its sequence.
        softmax_scale: default ``D ** -0.5``.
        return_lse: also return the log-sum-exp ``[Hq, T]`` (float32, not differentiable).
        deterministic: ask the backend for a deterministic backward.
        backend: ``"auto"`` (the fastest available on the device) or a name of ``BACKENDS``.
        validate: check ``cu_seqlens`` values and ``max_seqlen`` (one host sync on the GPU).

    Returns:
        ``out[T, Hq, D]`` in the input dtype (and the LSE when asked); differentiable in q, k, v.
    """
    _check_arguments(q, k, v, cu_seqlens, max_seqlen)
    scale = q.shape[2] ** -0.5 if softmax_scale is None else require_real("softmax_scale", softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    name = resolve_backend(backend, q.device, q, k)
    chosen = BACKENDS[name]
    if validate:
        cu_seqlens = validate_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)
    elif chosen.kind == "autograd":
        # Other libraries' kernels do not clamp cu_seqlens: make unvalidated input in range and
        # non-decreasing on the device (no sync), so it can give wrong numbers but never a crash.
        cu_seqlens = torch.cummax(cu_seqlens.clamp(0, q.shape[0]), dim=0).values.to(torch.int32)
    if chosen.kind == "op":
        out, lse = _attention_forward(q, k, v, cu_seqlens, max_seqlen, bool(causal), scale,
                                      bool(deterministic), name)
    else:
        out, lse = chosen.run(q, k, v, cu_seqlens, max_seqlen, bool(causal), scale,
                              bool(deterministic), bool(return_lse))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# The "triton" backend registers itself; a missing or broken triton leaves a backend whose
# ``unavailable`` says why, instead of an import error.

try:
    from agentrl_fast.ops import varlen_attention_triton as _triton_backend  # noqa: E402,F401
except Exception as _error:  # noqa: BLE001
    _TRITON_IMPORT_ERROR = f"{type(_error).__name__}: {_error}"
    register_backend(Backend("triton", "op",
                             lambda device: f"the triton backend failed to import ({_TRITON_IMPORT_ERROR})"))
