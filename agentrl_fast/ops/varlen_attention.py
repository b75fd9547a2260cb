"""Attention over packed variable-length trajectories (docs/design.md, "Attention over packed
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
- ``"triton"``: our Triton kernel (``agentrl_fast.ops.varlen_attention_triton``).

Backends of kind ``"op"`` (reference, native, cpu_flash, triton) provide ``forward``/``backward``
functions that write into preallocated outputs and run inside our registered ops; backends of
kind ``"autograd"`` (torch, flash_attn) are differentiable functions called directly (they are
registered ops of their own libraries, so ``torch.compile`` traces them too).

Prefix-shared (tree) mode (``prefix_of``): a suffix segment attends to all of its prefix
segment's tokens and causally to its own; it runs in the registered ops
``agentrl_fast::varlen_attention_prefix_forward`` / ``_backward`` for every backend, through the
backend's ``prefix_forward``/``prefix_backward`` when it has them, else through the generic
LSE-merge path (``_varlen_attention_prefix``).

This module holds the dispatch (``resolve_backend``), the registered ops and the public
function, and registers the built-in backends; the registry (``Backend``, ``BACKENDS``,
``register_backend``) is ``_attention_backends``, the backends are ``_varlen_attention_cpu``
(reference, native, cpu_flash), ``_varlen_attention_flash`` (torch, flash_attn) and
``varlen_attention_triton``.
"""

from __future__ import annotations

import math
import os

import torch

from agentrl_fast.ops._attention_backends import (BACKENDS, MAX_HEAD_DIM, Backend,
                                                  register_backend)
from agentrl_fast.ops._checks import (check_cu_seqlens_metadata, check_prefix_of_metadata,
                                      require_real, require_tensor, validate_cu_seqlens,
                                      validate_prefix_of)
from agentrl_fast.ops._varlen_attention_cpu import CPU_FLASH, CPU_FLASH_PADDING, NATIVE, REFERENCE
from agentrl_fast.ops._varlen_attention_cpu import NATIVE_VECTORISED as _NATIVE_VECTORISED
from agentrl_fast.ops._varlen_attention_flash import FLASH_ATTN, TORCH
from agentrl_fast.ops._varlen_attention_prefix import prefix_kernels

__all__ = ["AUTO_ORDER", "BACKENDS", "CPU_FLASH_PADDING", "MAX_HEAD_DIM", "SUPPORTED_DTYPES",
           "Backend", "available_backends", "register_backend", "resolve_backend",
           "varlen_attention"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# "auto" takes the first available, per device type.
AUTO_ORDER = {"cuda": ("triton", "flash_attn", "torch", "reference"),
              "cpu": ("native", "cpu_flash", "reference")}
# ... but on the CPU torch's flash kernel (key blocks kept in cache, queries split over threads)
# overtakes native's rows where a query sees this many keys on average, weighted by the work
# (``mean_keys``): from head dim 32, sooner from 128 (bench/results/cpu_attention_auto.md).
CPU_FLASH_MIN_HEAD_DIM = 32
CPU_FLASH_FROM_KEYS = 640
CPU_FLASH_WIDE_HEAD_DIM, CPU_FLASH_WIDE_FROM_KEYS = 128, 448


def _triton_backend() -> Backend:
    """Our Triton backend; when triton is missing or broken, a backend whose ``unavailable``
    says why, instead of an import error."""
    try:
        from agentrl_fast.ops.varlen_attention_triton import BACKEND
    except Exception as error:  # noqa: BLE001
        reason = f"the triton backend failed to import ({type(error).__name__}: {error})"
        return Backend("triton", "op", lambda device: reason)
    return BACKEND


for _backend in (REFERENCE, NATIVE, CPU_FLASH, TORCH, FLASH_ATTN, _triton_backend()):
    register_backend(_backend)


# ---------------------------------------------------------------------------------------------
# Dispatch

def available_backends(device: torch.device | str) -> list[str]:
    """Names of the backends that can run on ``device``."""
    device = torch.device(device)
    return [name for name, b in BACKENDS.items() if b.unavailable(device) is None]


def _long_for_native(q: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                     prefix_of: torch.Tensor | None, causal: bool) -> bool:
    """Whether this CPU batch's queries see so many keys that cpu_flash runs it faster than
    native (never while torch.compile traces: the layout's values are not known then)."""
    if (q is None or cu_seqlens is None or q.shape[-1] < CPU_FLASH_MIN_HEAD_DIM
            or cu_seqlens.device.type != "cpu" or torch.compiler.is_compiling()):
        return False
    wide = q.shape[-1] >= CPU_FLASH_WIDE_HEAD_DIM
    threshold = CPU_FLASH_WIDE_FROM_KEYS if wide else CPU_FLASH_FROM_KEYS
    return mean_keys(cu_seqlens, q.shape[0], prefix_of, causal) >= threshold


def mean_keys(cu_seqlens: torch.Tensor, num_tokens: int, prefix_of: torch.Tensor | None = None,
              causal: bool = True) -> float:
    """The keys a query sees, averaged over the (query, key) pairs (``sum k^2 / sum k`` over
    query rows that see ``k`` keys): ``2L/3`` for one causal sequence of ``L``, ``L``
    non-causal; a suffix's rows see its prefix too. Host-side (a CPU ``cu_seqlens``), read
    sanitized: garbage gives some number, never an error."""
    bounds = torch.cummax(cu_seqlens.detach().to("cpu", torch.float64).reshape(-1)
                          .clamp(0, num_tokens), dim=0).values
    lengths = bounds[1:] - bounds[:-1]
    if not causal:
        return float((lengths ** 3).sum() / (lengths ** 2).sum().clamp(min=1))
    before = torch.zeros_like(lengths)  # keys ahead of a sequence's own: its prefix's
    if prefix_of is not None and lengths.numel():
        parent = prefix_of.detach().to("cpu", torch.int64).reshape(-1)[:lengths.numel()]
        valid = (parent >= 0) & (parent < lengths.numel())
        before[:parent.numel()] = torch.where(valid, lengths[parent.clamp(0, lengths.numel() - 1)],
                                              0.0)
    # rows i = 1..L see before + i keys
    first = lengths * before + lengths * (lengths + 1) / 2
    second = (lengths * before ** 2 + before * lengths * (lengths + 1)
              + lengths * (lengths + 1) * (2 * lengths + 1) / 6)
    return float(second.sum() / first.sum().clamp(min=1))


def resolve_backend(backend: str, device: torch.device, q: torch.Tensor | None = None,
                    k: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                    prefix_of: torch.Tensor | None = None, causal: bool = True) -> str:
    """The backend ``varlen_attention`` would use for ``backend`` on ``device`` (and, when
    given, for inputs like ``q`` and ``k``; on the CPU ``auto`` also reads the batch's layout,
    ``cu_seqlens`` and ``prefix_of``, for its sequences' lengths: ``mean_keys``)."""

    def why_not(name: str) -> str | None:
        chosen = BACKENDS[name]
        reason = chosen.unavailable(device)
        if reason is None and q is not None:
            reason = chosen.unsupported(q, k)
        return reason

    if backend == "auto":
        order = AUTO_ORDER.get(device.type, ("reference",))
        if device.type == "cpu" and (not _NATIVE_VECTORISED  # native's baseline build, or
                                     or _long_for_native(q, cu_seqlens, prefix_of, causal)):
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
# The registered ops of the prefix-shared mode (every backend; causal implied).

@torch.library.custom_op("agentrl_fast::varlen_attention_prefix_forward", mutates_args=())
def _prefix_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens: torch.Tensor, prefix_of: torch.Tensor, max_seqlen: int,
                              softmax_scale: float, deterministic: bool,
                              backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    forward, _ = prefix_kernels(BACKENDS[backend])
    forward(q, k, v, cu_seqlens, prefix_of, max_seqlen, softmax_scale, deterministic, out, lse)
    return out, lse


@_prefix_attention_forward.register_fake
def _prefix_attention_forward_fake(q, k, v, cu_seqlens, prefix_of, max_seqlen, softmax_scale,
                                   deterministic, backend):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("agentrl_fast::varlen_attention_prefix_backward", mutates_args=())
def _prefix_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                               cu_seqlens: torch.Tensor, prefix_of: torch.Tensor,
                               max_seqlen: int, softmax_scale: float, deterministic: bool,
                               backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    _, backward = prefix_kernels(BACKENDS[backend])
    backward(dout, q, k, v, out, lse, cu_seqlens, prefix_of, max_seqlen, softmax_scale,
             deterministic, dq, dk, dv)
    return dq, dk, dv


@_prefix_attention_backward.register_fake
def _prefix_attention_backward_fake(dout, q, k, v, out, lse, cu_seqlens, prefix_of, max_seqlen,
                                    softmax_scale, deterministic, backend):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _prefix_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, prefix_of, max_seqlen, softmax_scale, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, prefix_of)
    ctx.params = (max_seqlen, softmax_scale, deterministic, backend)
    ctx.mark_non_differentiable(lse)


def _prefix_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens, prefix_of = ctx.saved_tensors
    max_seqlen, softmax_scale, deterministic, backend = ctx.params
    dq, dk, dv = _prefix_attention_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens,
                                            prefix_of, max_seqlen, softmax_scale, deterministic,
                                            backend)
    return dq, dk, dv, None, None, None, None, None, None


_prefix_attention_forward.register_autograd(_prefix_backward,
                                            setup_context=_prefix_setup_context)


# ---------------------------------------------------------------------------------------------
# The public function.

def _check_arguments(q, k, v, cu_seqlens, max_seqlen) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, tensor)
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, heads, head_dim], got shape "
                             f"{tuple(tensor.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q, got {tensor.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have T = q.shape[0] = {q.shape[0]} tokens, got {k.shape[0]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k must have head_dim = q.shape[2] = {q.shape[2]}, got {k.shape[2]}")
    num_heads_q, num_heads_k, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if num_heads_k == 0 or num_heads_q % num_heads_k != 0:
        raise ValueError(f"q's heads ({num_heads_q}) must be a multiple of k's heads "
                         f"({num_heads_k}) (GQA/MQA)")
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
    prefix_of: torch.Tensor | None = None,
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
        max_seqlen: a Python int, at least the longest sequence (segment).
        prefix_of: None, or ``[B]`` int32 on q's device (prefix-shared mode, causal only):
            ``-1`` for a segment that stands alone, ``p`` for a suffix of segment ``p``
            (``p < b``, ``prefix_of[p] == -1``): its tokens attend to all of p's tokens, then
            causally to their own, as if p's tokens were laid right before them. Several
            suffixes may share a prefix; out, LSE and gradients equal the plain op on the
            packing where each suffix has its own copy of its prefix (a prefix's dk, dv summed
            over the copies).
        causal: each token attends to itself and earlier tokens of its sequence.
        softmax_scale: default ``D ** -0.5``.
        return_lse: also return the log-sum-exp ``[Hq, T]`` (float32, not differentiable).
        deterministic: ask the backend for a deterministic backward.
        backend: ``"auto"`` (the fastest available on the device) or a name of ``BACKENDS``.
        validate: check ``cu_seqlens`` values and ``max_seqlen`` (one host sync on the GPU),
            and ``prefix_of``'s values (one more). Unvalidated garbage never crashes (an entry
            that is not a valid prefix reads as -1 on the generic path); results are then
            unspecified.

    Returns:
        ``out[T, Hq, D]`` in the input dtype (and the LSE when asked); differentiable in q, k, v.
    """
    _check_arguments(q, k, v, cu_seqlens, max_seqlen)
    if prefix_of is not None:
        if not causal:
            raise ValueError("prefix_of needs causal=True (a suffix attends causally to its own "
                             "tokens), got causal=False with prefix_of")
        check_prefix_of_metadata(prefix_of, cu_seqlens.numel() - 1, q.device)
    scale = (q.shape[2] ** -0.5 if softmax_scale is None
             else require_real("softmax_scale", softmax_scale))
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    name = resolve_backend(backend, q.device, q, k, cu_seqlens, prefix_of, causal)
    chosen = BACKENDS[name]
    if validate:
        cu_seqlens = validate_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)
        if prefix_of is not None:
            prefix_of = validate_prefix_of(prefix_of)
    elif chosen.kind == "autograd":
        # Other libraries' kernels do not clamp cu_seqlens: make unvalidated input in range and
        # non-decreasing on the device (no sync), so it can give wrong numbers but never a crash.
        cu_seqlens = torch.cummax(cu_seqlens.clamp(0, q.shape[0]), dim=0).values.to(torch.int32)
    if prefix_of is not None:
        if chosen.kind == "autograd" and chosen.prefix_forward is None:
            raise ValueError(f"backend {name!r} has no prefix-shared mode (prefix_of); use "
                             "another backend")
        out, lse = _prefix_attention_forward(q, k, v, cu_seqlens, prefix_of, max_seqlen, scale,
                                             bool(deterministic), name)
    elif chosen.kind == "op":
        out, lse = _attention_forward(q, k, v, cu_seqlens, max_seqlen, bool(causal), scale,
                                      bool(deterministic), name)
    else:
        out, lse = chosen.run(q, k, v, cu_seqlens, max_seqlen, bool(causal), scale,
                              bool(deterministic), bool(return_lse))
    return (out, lse) if return_lse else out
