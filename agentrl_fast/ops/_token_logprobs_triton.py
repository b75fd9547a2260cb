"""The Triton path of ``token_logprobs``: launchers of the row kernels of
``agentrl_fast/kernels/token_logprobs.py``, writing into preallocated outputs (so the tests can poison them).
triton is imported on the first launch, not with this module; arguments are checked by the
caller."""

from __future__ import annotations

import torch


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
