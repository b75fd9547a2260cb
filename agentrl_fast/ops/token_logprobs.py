"""Fused log-probs and entropy of the sampled tokens (docs/design.md, "Token-level PPO loss", last
paragraph).

``token_logprobs(logits[T, V], labels[T])`` and ``linear_token_logprobs(hidden[T, H],
weight[V, H], labels[T])`` return, for the tempered distribution ``p = softmax(logits /
temperature)`` of each row,

    logp[t]    = log p[labels[t]]      (float32, always <= 0)
    entropy[t] = -sum_j p_j log p_j    (float32, >= 0; with ``return_entropy=True``)

Labels are already aligned with the rows (the caller shifts them, within each sequence). Rows
whose label is ``ignore_index`` give 0 for both and no gradient.

Backends (``backend=``):

- ``"triton"``: the kernels of ``agentrl_fast/kernels/token_logprobs.py`` (one pass over the vocabulary with
  an online log-sum-exp forward, one pass backward); CUDA, or CPU tensors when
  ``TRITON_INTERPRET=1`` (how the tests run them).
- ``"torch"``: plain torch in float32, row-chunked (the CPU path).
- ``"auto"`` (default): ``"triton"`` on CUDA (and on the CPU under ``TRITON_INTERPRET=1``),
  ``"torch"`` otherwise.

Both backends compute in float32, so float64 logits (or hidden/weight) are refused on every
backend with a ``TypeError`` naming the argument, never silently rounded to float32.

Both run inside the registered ops ``agentrl_fast::token_logprobs_forward`` / ``_backward``
(and ``linear_token_logprobs_forward`` / ``_backward``), declared with
``torch.library.custom_op`` plus a fake, so ``torch.compile`` keeps one graph.

This module holds the backend choice, the argument checks and the public functions; the row
computations are in ``_token_logprobs_triton`` (launchers) and ``_token_logprobs_torch``, the
registered ops in ``_token_logprobs_ops``.

``linear_token_logprobs`` computes ``logits = hidden @ weight.T`` ``chunk_size`` tokens at a
time (in the dtype of ``hidden``, as the model's LM head would), runs the row kernels on the
chunk, and keeps only ``logp``/``entropy``/``lse``: the full ``[T, V]`` logits never exist. The
backward recomputes each chunk's logits, writes the chunk's d logits over them in place, and
accumulates ``grad_hidden`` and ``grad_weight`` (in the weight's dtype, with an ``addmm`` per
chunk, as Liger-Kernel does).
"""

from __future__ import annotations

import math
import os

import torch

from agentrl_fast.ops._checks import require_real, require_tensor
from agentrl_fast.ops._token_logprobs_ops import (ROW_BACKWARD, ROW_FORWARD,
                                                  linear_token_logprobs_op,
                                                  token_logprobs_inplace_backward_op,
                                                  token_logprobs_op, validate_token_labels)

__all__ = ["BACKENDS", "ROW_BACKWARD", "ROW_FORWARD", "default_chunk_size", "linear_token_logprobs",
           "resolve_backend", "token_logprobs", "validate_token_labels"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LABEL_DTYPES = (torch.int64, torch.int32)
BACKENDS = ("auto", "triton", "torch")
# Default token chunk of linear_token_logprobs: at most this many logits per chunk, and
# a multiple of 256 tokens where the vocabulary allows (cuBLAS-friendly shapes).
LINEAR_CHUNK_ELEMENTS = 1 << 28
MAX_VOCAB = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Backend choice


def _triton_unavailable(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "the Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1)"


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend ``token_logprobs`` uses for ``backend`` on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if _triton_unavailable(device) is None else "torch"
    if backend == "triton":
        reason = _triton_unavailable(device)
        if reason is not None:
            raise ValueError(f"backend 'triton' is not available on {device}: {reason}; "
                             "pass backend='torch' or 'auto'")
    return backend


def default_chunk_size(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk: at most LINEAR_CHUNK_ELEMENTS logits, a multiple of 256 when it can."""
    chunk = max(1, LINEAR_CHUNK_ELEMENTS // max(vocab, 1))
    if chunk >= 256:
        chunk -= chunk % 256
    return max(1, min(num_tokens, chunk))


# ---------------------------------------------------------------------------------------------
# Argument checks and the public functions


def _require_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_common(labels, rows_shape, device, temperature, ignore_index, return_entropy,
                  rows_name: str) -> float:
    require_tensor("labels", labels)
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}; pass labels.long()")
    if tuple(labels.shape) != tuple(rows_shape):
        raise ValueError(f"labels must have shape {rows_name} = {tuple(rows_shape)}, got "
                         f"{tuple(labels.shape)} (labels are aligned with the rows: shift them "
                         "before the call)")
    if labels.device != device:
        raise ValueError(f"labels must be on {device} like the logits, got {labels.device}")
    temperature = require_real("temperature", temperature)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be a Python int, got {type(ignore_index).__name__}")
    if not -2**31 <= ignore_index < 2**31:
        raise ValueError(f"ignore_index must fit in int32, got {ignore_index}")
    _require_bool("return_entropy", return_entropy)
    return temperature


def _check_float(name: str, tensor: torch.Tensor) -> None:
    require_tensor(name, tensor)
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {tensor.dtype}; "
                        f"pass {name}.float()")


def _prepare_labels(labels: torch.Tensor, vocab: int, ignore_index: int, validate: bool):
    labels = labels.reshape(-1).to(torch.int64).contiguous()
    if validate:
        labels = validate_token_labels(labels, vocab, ignore_index)
    return labels


def _finish(logp, entropy, rows_shape, return_entropy):
    logp = logp.view(rows_shape)
    return (logp, entropy.view(rows_shape)) if return_entropy else logp


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each row's label (and the row's entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[T, V]`` (or ``[..., V]``: the leading dimensions are flattened), bfloat16,
            float16 or float32; rows may be strided, columns must be contiguous (otherwise a
            copy is made).
        labels: ``[T]`` (the leading shape of ``logits``), int64 or int32, already aligned with
            the rows; ``ignore_index`` marks rows to skip.
        temperature: > 0; the distribution is ``softmax(logits / temperature)``.
        return_entropy: also return ``entropy[T]`` (differentiable).
        ignore_index: rows with this label give ``logp = entropy = 0`` and no gradient.
        inplace_backward: the backward writes d logits over the ``logits`` buffer and returns
            it as the gradient (saves a ``[T, V]`` allocation). Caveat: after the backward the
            logits tensor holds gradients, not logits; anything else that saved it for its
            own backward fails loudly (autograd's version check) or, if it read it later
            without autograd, sees the gradient.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).
        validate: check that every label is in ``[0, V)`` or equals ``ignore_index`` (one host
            sync on the GPU). Without it, out-of-range labels are clamped (wrong numbers,
            never a bad memory access).

    Returns:
        ``logp`` float32 of the leading shape, always ``<= 0`` (with ``return_entropy``, the
        pair ``(logp, entropy)``, entropy ``>= 0``); differentiable with respect to ``logits``.
    """
    _check_float("logits", logits)
    if logits.dim() < 2:
        raise ValueError(f"logits must be [T, V] (or [..., V]), got shape {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    if not 0 < vocab <= MAX_VOCAB:
        raise ValueError(f"logits must have a vocabulary (last) dimension of 1..{MAX_VOCAB}, "
                         f"got {vocab}")
    rows_shape = logits.shape[:-1]
    temperature = _check_common(labels, rows_shape, logits.device, temperature, ignore_index,
                                return_entropy, "logits.shape[:-1]")
    _require_bool("inplace_backward", inplace_backward)
    _require_bool("validate", validate)
    name = resolve_backend(backend, logits.device)
    flat = logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    labels = _prepare_labels(labels, vocab, ignore_index, validate)
    op = token_logprobs_inplace_backward_op if inplace_backward else token_logprobs_op
    logp, entropy, _ = op(flat, labels, temperature, ignore_index, return_entropy, name)
    return _finish(logp, entropy, rows_shape, return_entropy)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs(hidden @ weight.T, labels, ...)`` without the ``[T, V]`` logits.

    Args:
        hidden: ``[T, H]`` (or ``[..., H]``), bfloat16, float16 or float32.
        weight: the LM head ``[V, H]``, same dtype and device as ``hidden``.
        labels: ``[T]`` (the leading shape of ``hidden``), int64 or int32, aligned with the rows.
        chunk_size: tokens per chunk (default: as many as keep a chunk's logits at 2^28
            elements, a multiple of 256). Peak extra memory is one chunk's logits.
        temperature, return_entropy, ignore_index, backend, validate: as in ``token_logprobs``.

    Returns:
        ``logp`` float32 (and ``entropy``), differentiable with respect to ``hidden`` and
        ``weight``. ``grad_weight`` is accumulated over chunks in the weight's dtype.
    """
    _check_float("hidden", hidden)
    _check_float("weight", weight)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [T, H] (or [..., H]), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError("weight must be 2-D [V, H] (the LM head), got shape "
                         f"{tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({hidden.dtype}), got "
                        f"{weight.dtype}; pass weight.to(hidden.dtype)")
    if weight.device != hidden.device:
        raise ValueError(f"weight must be on {hidden.device} like hidden, got {weight.device}")
    vocab, hidden_size = weight.shape
    if hidden.shape[-1] != hidden_size:
        raise ValueError(f"hidden's last dimension must equal weight.shape[1] = {hidden_size}, "
                         f"got {hidden.shape[-1]}")
    if not 0 < vocab <= MAX_VOCAB:
        raise ValueError(f"weight must have 1..{MAX_VOCAB} rows (the vocabulary), got {vocab}")
    rows_shape = hidden.shape[:-1]
    temperature = _check_common(labels, rows_shape, hidden.device, temperature, ignore_index,
                                return_entropy, "hidden.shape[:-1]")
    _require_bool("validate", validate)
    num_tokens = math.prod(rows_shape)
    if chunk_size is None:
        chunk_size = default_chunk_size(num_tokens, vocab)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a Python int or None, got {type(chunk_size).__name__}")
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    name = resolve_backend(backend, hidden.device)
    flat = hidden.reshape(-1, hidden_size)
    labels = _prepare_labels(labels, vocab, ignore_index, validate)
    logp, entropy, _ = linear_token_logprobs_op(flat, weight, labels, temperature, ignore_index,
                                                return_entropy, max(1, chunk_size), name)
    return _finish(logp, entropy, rows_shape, return_entropy)
