"""The registered ops of ``token_logprobs`` and ``linear_token_logprobs``
(``torch.library.custom_op`` with fakes and autograd, so ``torch.compile`` keeps one graph).
Each runs the row forward/backward of the backend it is given (``ROW_FORWARD`` /
``ROW_BACKWARD``); arguments are checked by the caller (``token_logprobs.py``)."""

from __future__ import annotations

import torch

from agentrl_fast.ops._token_logprobs_torch import (token_logprobs_backward_torch,
                                                    token_logprobs_forward_torch)
from agentrl_fast.ops._token_logprobs_triton import (token_logprobs_backward_triton,
                                                     token_logprobs_forward_triton)

ROW_FORWARD = {"triton": token_logprobs_forward_triton, "torch": token_logprobs_forward_torch}
ROW_BACKWARD = {"triton": token_logprobs_backward_triton, "torch": token_logprobs_backward_torch}


# ---------------------------------------------------------------------------------------------
# token_logprobs


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
def token_logprobs_op(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                      ignore_index: int, compute_entropy: bool,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(logits, labels, temperature, ignore_index, compute_entropy, backend)


@token_logprobs_op.register_fake
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


token_logprobs_op.register_autograd(_make_backward(False), setup_context=_setup_context)


# The in-place variant is a second forward op (same kernels) whose backward writes over logits.
@torch.library.custom_op("agentrl_fast::token_logprobs_forward_inplace_backward", mutates_args=())
def token_logprobs_inplace_backward_op(logits: torch.Tensor, labels: torch.Tensor,
                                       temperature: float, ignore_index: int,
                                       compute_entropy: bool, backend: str
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(logits, labels, temperature, ignore_index, compute_entropy, backend)


@token_logprobs_inplace_backward_op.register_fake
def _forward_inplace_backward_fake(logits, labels, temperature, ignore_index, compute_entropy,
                                   backend):
    return _new_outputs(logits.shape[0], compute_entropy, logits)


token_logprobs_inplace_backward_op.register_autograd(_make_backward(True),
                                                     setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# linear_token_logprobs


def _chunks(num_tokens: int, chunk_size: int):
    for start in range(0, num_tokens, chunk_size):
        yield start, min(num_tokens, start + chunk_size)


@torch.library.custom_op("agentrl_fast::linear_token_logprobs_forward", mutates_args=())
def linear_token_logprobs_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             temperature: float, ignore_index: int, compute_entropy: bool,
                             chunk_size: int, backend: str
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp, entropy, lse = _new_outputs(hidden.shape[0], compute_entropy, hidden)
    for c0, c1 in _chunks(hidden.shape[0], chunk_size):
        logits = hidden[c0:c1] @ weight.T
        ROW_FORWARD[backend](logits, labels[c0:c1], 1.0 / temperature, ignore_index,
                             compute_entropy, logp[c0:c1],
                             entropy[c0:c1] if compute_entropy else entropy, lse[c0:c1])
    return logp, entropy, lse


@linear_token_logprobs_op.register_fake
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


linear_token_logprobs_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)
