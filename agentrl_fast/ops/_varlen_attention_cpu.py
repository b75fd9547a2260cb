"""The CPU backends of ``varlen_attention`` (``REFERENCE``, ``NATIVE``, ``CPU_FLASH``), all of
kind ``"op"``: they fill preallocated outputs inside the registered ops of ``varlen_attention``.

- ``"reference"``: per-sequence scaled-dot-product attention in float32 (any device).
- ``"native"``: our C++ kernel (``csrc/varlen_attention.cpp``; the CPU default): per sequence
  and KV head, vectorised over keys, no padding; with its own prefix-shared mode (a suffix's
  queries read its prefix's keys, then its own; a prefix's dk, dv summed over all its suffixes'
  queries by one thread per KV head, deterministic).
- ``"cpu_flash"``: torch's fused CPU flash-attention kernel on padded batches of sequences of
  similar length.
"""

from __future__ import annotations

import math

import torch

from agentrl_fast.ops._attention_backends import Backend


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
        dk_kv = dk_heads.view(num_heads_k, groups, length, -1).sum(1)
        dv_kv = dv_heads.view(num_heads_k, groups, length, -1).sum(1)
        dk[start:end] = dk_kv.transpose(0, 1).to(dk.dtype)
        dv[start:end] = dv_kv.transpose(0, 1).to(dv.dtype)


REFERENCE = Backend("reference", "op", lambda device: None, forward=_reference_forward,
                    backward=_reference_backward)


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


_NATIVE_UNAVAILABLE, NATIVE_VECTORISED = _native_status()


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


def _native_prefix_forward(q, k, v, cu_seqlens, prefix_of, max_seqlen, scale, deterministic,
                           out, lse):
    torch.ops.agentrl_fast.varlen_attention_cpu_prefix_out(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, prefix_of, scale, out, lse)


def _native_prefix_backward(dout, q, k, v, out, lse, cu_seqlens, prefix_of, max_seqlen, scale,
                            deterministic, dq, dk, dv):
    # Deterministic always: one thread sums a prefix's dk, dv over its suffixes, in order.
    torch.ops.agentrl_fast.varlen_attention_cpu_prefix_backward_out(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
        lse.contiguous(), cu_seqlens, prefix_of, scale, dq, dk, dv)


def _native_has_prefix_mode() -> bool:
    """Whether the installed extension has the prefix-shared kernels (an older build without
    them leaves the prefix mode to the generic LSE-merge path)."""
    if _NATIVE_UNAVAILABLE is not None:
        return False
    from agentrl_fast import _native
    return _native.has_kernel("varlen_attention_cpu_prefix_out", "CPU")


_NATIVE_PREFIX = _native_has_prefix_mode()
NATIVE = Backend("native", "op", _native_unavailable, forward=_native_forward,
                 backward=_native_backward,
                 prefix_forward=_native_prefix_forward if _NATIVE_PREFIX else None,
                 prefix_backward=_native_prefix_backward if _NATIVE_PREFIX else None)


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


CPU_FLASH = Backend("cpu_flash", "op", _cpu_flash_unavailable, forward=_cpu_flash_forward,
                    backward=_cpu_flash_backward)
