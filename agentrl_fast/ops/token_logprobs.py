"""Fused log-probs and entropy of the sampled tokens (DESIGN.md, "Token-level PPO loss", last
paragraph).

``token_logprobs(logits[T, V], labels[T])`` and ``linear_token_logprobs(hidden[T, H],
weight[V, H], labels[T])`` return, for the tempered distribution ``p = softmax(logits /
temperature)`` of each row,

    logp[t]    = log p[labels[t]]      (float32, always <= 0)
    entropy[t] = -sum_j p_j log p_j    (float32, >= 0; with ``return_entropy=True``)

Labels are already aligned with the rows (the caller shifts them, within each sequence). Rows
whose label is ``ignore_index`` give 0 for both and no gradient.

Backends (``backend=``):

- ``"triton"``: the kernels of ``kernels/token_logprobs.py`` (one pass over the vocabulary with
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

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LABEL_DTYPES = (torch.int64, torch.int32)
BACKENDS = ("auto", "triton", "torch")
# The torch backend works on row chunks of at most this many logits (bounded fp32 temporaries).
TORCH_CHUNK_ELEMENTS = 1 << 22
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


# ---------------------------------------------------------------------------------------------
# The Triton launchers (preallocated outputs, so tests can poison them)


def token_logprobs_forward_triton(logits: torch.Tensor, labels: torch.Tensor,
                                  inv_temperature: float, ignore_index: int,
                                  compute_entropy: bool, logp: torch.Tensor,
                                  entropy: torch.Tensor, lse: torch.Tensor,
                                  block_v: int | None = None) -> None:
    """Fill ``logp[T]``, ``lse[T]`` and (with ``compute_entropy``) ``entropy[T]`` (float32,
    contiguous) from ``logits[T, V]`` (column stride 1) and ``labels[T]`` (int64).
    ``block_v`` overrides the launcher's block (tests only)."""
    from agentrl_fast.kernels.token_logprobs import block_config, token_logprobs_forward_kernel

    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    chosen_block, num_warps = block_config(vocab)
    token_logprobs_forward_kernel[(num_rows,)](
        logits, labels, logp, entropy if compute_entropy else lse, lse, logits.stride(0), vocab,
        inv_temperature, ignore_index, COMPUTE_ENTROPY=compute_entropy,
        BLOCK_V=block_v or chosen_block, num_warps=num_warps, num_stages=1)


def token_logprobs_backward_triton(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                                   entropy: torch.Tensor, grad_logp: torch.Tensor,
                                   grad_entropy: torch.Tensor | None, inv_temperature: float,
                                   ignore_index: int, grad_logits: torch.Tensor,
                                   block_v: int | None = None) -> None:
    """Fill ``grad_logits[T, V]`` (dtype of ``logits``, column stride 1; may be ``logits``
    itself) with d(logp, entropy)/d logits for upstream gradients ``grad_logp[T]`` and
    ``grad_entropy[T]`` (float32, or None)."""
    from agentrl_fast.kernels.token_logprobs import block_config, token_logprobs_backward_kernel

    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    chosen_block, num_warps = block_config(vocab)
    has_entropy = grad_entropy is not None
    token_logprobs_backward_kernel[(num_rows,)](
        logits, grad_logits, labels, lse, entropy if has_entropy else lse, grad_logp,
        grad_entropy if has_entropy else grad_logp, logits.stride(0), grad_logits.stride(0),
        vocab, inv_temperature, ignore_index, HAS_GRAD_ENTROPY=has_entropy,
        BLOCK_V=block_v or chosen_block, num_warps=num_warps, num_stages=1)


# ---------------------------------------------------------------------------------------------
# The torch backend (the CPU path): the same math in float32, row-chunked


def _row_chunks(num_rows: int, vocab: int):
    step = max(1, TORCH_CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, num_rows, step):
        yield start, min(num_rows, start + step)


def token_logprobs_forward_torch(logits, labels, inv_temperature, ignore_index, compute_entropy,
                                 logp, entropy, lse) -> None:
    """``token_logprobs_forward_triton``'s contract in plain torch."""
    num_rows, vocab = logits.shape
    for r0, r1 in _row_chunks(num_rows, vocab):
        x = logits[r0:r1].float() * inv_temperature
        row_max = x.amax(-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        shifted = x - row_max
        e = shifted.exp()
        total = e.sum(-1)
        log_total = total.log()
        row_lse = row_max.squeeze(-1) + log_total
        ignored = labels[r0:r1] == ignore_index
        label = labels[r0:r1].clamp(0, vocab - 1)
        x_label = x.gather(-1, label.unsqueeze(-1)).squeeze(-1)
        logp[r0:r1] = (x_label - row_lse).clamp(max=0.0).masked_fill(ignored, 0.0)
        lse[r0:r1] = row_lse
        if compute_entropy:
            t = torch.where(e > 0, e * shifted, torch.zeros_like(e)).sum(-1)
            entropy[r0:r1] = (log_total - t / total).clamp(min=0.0).masked_fill(ignored, 0.0)


def token_logprobs_backward_torch(logits, labels, lse, entropy, grad_logp, grad_entropy,
                                  inv_temperature, ignore_index, grad_logits) -> None:
    """``token_logprobs_backward_triton``'s contract in plain torch."""
    num_rows, vocab = logits.shape
    for r0, r1 in _row_chunks(num_rows, vocab):
        x = logits[r0:r1].float() * inv_temperature
        log_p = x - lse[r0:r1].unsqueeze(-1)
        p = log_p.exp()
        ignored = labels[r0:r1] == ignore_index
        keep = (~ignored).float()
        g = (grad_logp[r0:r1] * keep * inv_temperature).unsqueeze(-1)
        grad = -g * p
        label = labels[r0:r1].clamp(0, vocab - 1).unsqueeze(-1)
        grad.scatter_add_(-1, label, g)
        if grad_entropy is not None:
            ge = (grad_entropy[r0:r1] * keep * inv_temperature).unsqueeze(-1)
            h = entropy[r0:r1].unsqueeze(-1)
            grad -= ge * torch.where(p > 0, p * (log_p + h), torch.zeros_like(p))
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad_logits[r0:r1] = grad


ROW_FORWARD = {"triton": token_logprobs_forward_triton, "torch": token_logprobs_forward_torch}
ROW_BACKWARD = {"triton": token_logprobs_backward_triton, "torch": token_logprobs_backward_torch}


# ---------------------------------------------------------------------------------------------
# Registered ops: token_logprobs


def _new_outputs(num_rows: int, compute_entropy: bool, like: torch.Tensor):
    logp = like.new_empty(num_rows, dtype=torch.float32)
    entropy = like.new_empty(num_rows if compute_entropy else 0, dtype=torch.float32)
    lse = like.new_empty(num_rows, dtype=torch.float32)
    return logp, entropy, lse


@torch.library.custom_op("agentrl_fast::validate_token_labels", mutates_args=())
def validate_token_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """Every label is in ``[0, vocab_size)`` or equals ``ignore_index`` (one host sync on the
    GPU); returns a copy of ``labels`` that callers pass on, so the check is not dead code."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if labels.numel():
        probe = torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1).item()
        if probe >= 0:
            raise ValueError(
                f"labels must be in [0, V = {vocab_size}) or equal ignore_index = {ignore_index}, "
                f"got labels[{probe}] = {int(labels[probe])}; mask such tokens with ignore_index")
    return labels.clone()


@validate_token_labels.register_fake
def _validate_token_labels_fake(labels, vocab_size, ignore_index):
    return torch.empty_like(labels)


def _forward_impl(logits, labels, temperature, ignore_index, compute_entropy, backend):
    logp, entropy, lse = _new_outputs(logits.shape[0], compute_entropy, logits)
    ROW_FORWARD[backend](logits, labels, 1.0 / temperature, ignore_index, compute_entropy, logp,
                         entropy, lse)
    return logp, entropy, lse


@torch.library.custom_op("agentrl_fast::token_logprobs_forward", mutates_args=())
def _forward(logits: torch.Tensor, labels: torch.Tensor, temperature: float, ignore_index: int,
             compute_entropy: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(logits, labels, temperature, ignore_index, compute_entropy, backend)


@_forward.register_fake
def _forward_fake(logits, labels, temperature, ignore_index, compute_entropy, backend):
    return _new_outputs(logits.shape[0], compute_entropy, logits)


@torch.library.custom_op("agentrl_fast::token_logprobs_backward", mutates_args=())
def _backward_op(grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, logits: torch.Tensor,
                 labels: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 temperature: float, ignore_index: int, backend: str) -> torch.Tensor:
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    ROW_BACKWARD[backend](logits, labels, lse, entropy, grad_logp, grad_entropy,
                          1.0 / temperature, ignore_index, grad_logits)
    return grad_logits


@_backward_op.register_fake
def _backward_fake(grad_logp, grad_entropy, logits, labels, lse, entropy, temperature,
                   ignore_index, backend):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("agentrl_fast::token_logprobs_backward_inplace", mutates_args=("logits",))
def _backward_inplace_op(grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None,
                         logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                         entropy: torch.Tensor, temperature: float, ignore_index: int,
                         backend: str) -> None:
    """d logits written over ``logits`` itself (``inplace_backward=True``)."""
    ROW_BACKWARD[backend](logits, labels, lse, entropy, grad_logp, grad_entropy,
                          1.0 / temperature, ignore_index, logits)


@_backward_inplace_op.register_fake
def _backward_inplace_fake(grad_logp, grad_entropy, logits, labels, lse, entropy, temperature,
                           ignore_index, backend):
    return None


def _entropy_grad(compute_entropy: bool, grad_entropy):
    """The entropy's upstream gradient as a contiguous float32 tensor, or None when unused."""
    if not compute_entropy or grad_entropy is None:
        return None
    return grad_entropy.float().contiguous()


def _setup_context(ctx, inputs, output):
    logits, labels, temperature, ignore_index, compute_entropy, backend = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, labels, lse, entropy)
    ctx.params = (temperature, ignore_index, compute_entropy, backend)
    ctx.mark_non_differentiable(lse)


def _make_backward(inplace: bool):
    def backward(ctx, grad_logp, grad_entropy, grad_lse):
        logits, labels, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, compute_entropy, backend = ctx.params
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_logp = grad_logp.float().contiguous()
        grad_entropy = _entropy_grad(compute_entropy, grad_entropy)
        if inplace:
            _backward_inplace_op(grad_logp, grad_entropy, logits, labels, lse, entropy,
                                 temperature, ignore_index, backend)
            grad_logits = logits
        else:
            grad_logits = _backward_op(grad_logp, grad_entropy, logits, labels, lse, entropy,
                                       temperature, ignore_index, backend)
        return grad_logits, None, None, None, None, None
    return backward


_forward.register_autograd(_make_backward(False), setup_context=_setup_context)


# The in-place variant is a second forward op (same kernels) whose backward writes over logits.
@torch.library.custom_op("agentrl_fast::token_logprobs_forward_inplace_backward", mutates_args=())
def _forward_inplace_backward(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                              ignore_index: int, compute_entropy: bool,
                              backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(logits, labels, temperature, ignore_index, compute_entropy, backend)


@_forward_inplace_backward.register_fake
def _forward_inplace_backward_fake(logits, labels, temperature, ignore_index, compute_entropy,
                                   backend):
    return _new_outputs(logits.shape[0], compute_entropy, logits)


_forward_inplace_backward.register_autograd(_make_backward(True), setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Registered ops: linear_token_logprobs


def default_chunk_size(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk: at most LINEAR_CHUNK_ELEMENTS logits, a multiple of 256 when it can."""
    chunk = max(1, LINEAR_CHUNK_ELEMENTS // max(vocab, 1))
    if chunk >= 256:
        chunk -= chunk % 256
    return max(1, min(num_tokens, chunk))


def _chunks(num_tokens: int, chunk_size: int):
    for start in range(0, num_tokens, chunk_size):
        yield start, min(num_tokens, start + chunk_size)


@torch.library.custom_op("agentrl_fast::linear_token_logprobs_forward", mutates_args=())
def _linear_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    temperature: float, ignore_index: int, compute_entropy: bool,
                    chunk_size: int, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp, entropy, lse = _new_outputs(hidden.shape[0], compute_entropy, hidden)
    for c0, c1 in _chunks(hidden.shape[0], chunk_size):
        logits = hidden[c0:c1] @ weight.T
        ROW_FORWARD[backend](logits, labels[c0:c1], 1.0 / temperature, ignore_index,
                             compute_entropy, logp[c0:c1],
                             entropy[c0:c1] if compute_entropy else entropy, lse[c0:c1])
    return logp, entropy, lse


@_linear_forward.register_fake
def _linear_forward_fake(hidden, weight, labels, temperature, ignore_index, compute_entropy,
                         chunk_size, backend):
    return _new_outputs(hidden.shape[0], compute_entropy, hidden)


@torch.library.custom_op("agentrl_fast::linear_token_logprobs_backward", mutates_args=())
def _linear_backward_op(grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None,
                        hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        lse: torch.Tensor, entropy: torch.Tensor, temperature: float,
                        ignore_index: int, chunk_size: int, need_hidden: bool,
                        need_weight: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    grad_hidden = (torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden
                   else hidden.new_empty(0))
    grad_weight = (torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_weight
                   else weight.new_empty(0))
    for c0, c1 in _chunks(hidden.shape[0], chunk_size):
        logits = hidden[c0:c1] @ weight.T
        ROW_BACKWARD[backend](logits, labels[c0:c1], lse[c0:c1],
                              entropy[c0:c1] if grad_entropy is not None else entropy,
                              grad_logp[c0:c1],
                              None if grad_entropy is None else grad_entropy[c0:c1],
                              1.0 / temperature, ignore_index, logits)  # d logits over logits
        if need_hidden:
            torch.matmul(logits, weight, out=grad_hidden[c0:c1])
        if need_weight:
            grad_weight.addmm_(logits.T, hidden[c0:c1])
    return grad_hidden, grad_weight


@_linear_backward_op.register_fake
def _linear_backward_fake(grad_logp, grad_entropy, hidden, weight, labels, lse, entropy,
                          temperature, ignore_index, chunk_size, need_hidden, need_weight,
                          backend):
    grad_hidden = (torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden
                   else hidden.new_empty(0))
    grad_weight = (torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight
                   else weight.new_empty(0))
    return grad_hidden, grad_weight


def _linear_setup_context(ctx, inputs, output):
    hidden, weight, labels, temperature, ignore_index, compute_entropy, chunk_size, backend = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, labels, lse, entropy)
    ctx.params = (temperature, ignore_index, compute_entropy, chunk_size, backend)
    ctx.mark_non_differentiable(lse)


def _linear_backward(ctx, grad_logp, grad_entropy, grad_lse):
    hidden, weight, labels, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, compute_entropy, chunk_size, backend = ctx.params
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    grad_hidden, grad_weight = _linear_backward_op(
        grad_logp.float().contiguous(), _entropy_grad(compute_entropy, grad_entropy), hidden,
        weight, labels, lse, entropy, temperature, ignore_index, chunk_size, need_hidden,
        need_weight, backend)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None,
            None, None, None, None, None, None)


_linear_forward.register_autograd(_linear_backward, setup_context=_linear_setup_context)


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
    op = _forward_inplace_backward if inplace_backward else _forward
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
        raise ValueError(f"weight must be 2-D [V, H] (the LM head), got shape {tuple(weight.shape)}")
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
    logp, entropy, _ = _linear_forward(flat, weight, labels, temperature, ignore_index,
                                       return_entropy, max(1, chunk_size), name)
    return _finish(logp, entropy, rows_shape, return_entropy)
