"""The torch path of ``token_logprobs`` (the CPU path): the row launchers' contract
(``_token_logprobs_triton``) in plain torch, float32, row-chunked so temporaries stay bounded."""

from __future__ import annotations

import torch

# Row chunks of at most this many logits (bounded float32 temporaries).
TORCH_CHUNK_ELEMENTS = 1 << 22


def _row_chunks(num_rows: int, vocab: int):
    step = max(1, TORCH_CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, num_rows, step):
        yield start, min(num_rows, start + step)


def token_logprobs_forward_torch(logits, labels, inv_temperature, ignore_index, compute_entropy,
                                 logp, entropy, lse) -> None:
    """``token_logprobs_forward_triton``'s contract in plain torch."""
    num_rows, vocab = logits.shape
    if not compute_entropy:
        _forward_without_entropy(logits, labels, inv_temperature, ignore_index, logp, lse)
        return
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
    if (grad_entropy is None and grad_logits.dtype == torch.float32
            and logits.dtype == torch.float32):
        _backward_without_entropy(logits, labels, lse, grad_logp, inv_temperature, ignore_index,
                                  grad_logits)
        return
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


def _forward_without_entropy(logits, labels, inv_temperature, ignore_index, logp, lse) -> None:
    """The forward without entropy: one fused ``logsumexp`` pass per chunk instead of five
    (a real vocabulary's 151k columns make these passes the CPU step's largest cost)."""
    num_rows, vocab = logits.shape
    for r0, r1 in _row_chunks(num_rows, vocab):
        x = logits[r0:r1].float()
        if inv_temperature != 1.0:
            x = x * inv_temperature
        row_lse = torch.logsumexp(x, -1)
        ignored = labels[r0:r1] == ignore_index
        label = labels[r0:r1].clamp(0, vocab - 1)
        x_label = x.gather(-1, label.unsqueeze(-1)).squeeze(-1)
        logp[r0:r1] = (x_label - row_lse).clamp(max=0.0).masked_fill(ignored, 0.0)
        lse[r0:r1] = row_lse


def _backward_without_entropy(logits, labels, lse, grad_logp, inv_temperature, ignore_index,
                              grad_logits) -> None:
    """The float32 backward without entropy, in place in ``grad_logits`` (which may be
    ``logits`` itself): ``-g * softmax`` with ``g`` added at the label, in three passes."""
    num_rows, vocab = logits.shape
    for r0, r1 in _row_chunks(num_rows, vocab):
        out = grad_logits[r0:r1]
        if out.data_ptr() != logits[r0:r1].data_ptr():
            out.copy_(logits[r0:r1])
        ignored = labels[r0:r1] == ignore_index
        g = (grad_logp[r0:r1] * inv_temperature).masked_fill(ignored, 0.0).unsqueeze(-1)
        # exp(x / T - lse) * -g, in place: softmax rows of an all -inf row are 0 (lse = -inf).
        out.mul_(inv_temperature).sub_(lse[r0:r1].unsqueeze(-1)).exp_()
        out.nan_to_num_(nan=0.0).mul_(-g)
        out.scatter_add_(-1, labels[r0:r1].clamp(0, vocab - 1).unsqueeze(-1), g)
        out.masked_fill_(ignored.unsqueeze(-1), 0.0)
