"""The generic prefix-shared (tree) mode of ``varlen_attention``: two passes merged by their
log-sum-exp (docs/design.md, "Prefix-shared mode").

``prefix_of[b] = p >= 0``: segment b is a suffix of segment p, its tokens attend to all of p's
tokens and causally to b's own. A backend without a native prefix mode (``Backend.prefix_forward``
is None) runs it as

- the self pass: its plain causal attention over the segments -> ``out_s``, ``lse_s``;
- the cross pass: each prefix's suffix tokens (all its suffixes together, non-causal) against
  the prefix's keys -> ``out_c``, ``lse_c`` (``cpu_flash``: torch's CPU flash kernel; the
  ``torch`` and ``flash_attn`` backends: their raw varlen kernels with separate query and key
  bounds; any other backend: ``reference_cross_*``, float32);
- the merge, on the suffix tokens: ``lse = logaddexp(lse_s, lse_c)``,
  ``out = exp(lse_s - lse) out_s + exp(lse_c - lse) out_c``;
- the backward: each pass's backward called with the MERGED out and lse. Then each pass's
  probabilities ``exp(S - lse)`` are the full attention's over its keys, and its
  ``rowsum(dout * out)`` is the full one, so each pass gives exactly its keys' share of the
  gradients: dq is the sum of both, a prefix's dk/dv its self part plus its cross part (added
  in that fixed order: deterministic when both passes are).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrl_fast.ops._attention_backends import Backend
from agentrl_fast.ops._tensor_memo import PairMemo

# ---------------------------------------------------------------------------------------------
# The layout of the cross pass.


@dataclass(frozen=True)
class PrefixLayout:
    """The cross pass of one batch: G groups, one per prefix that has suffix tokens.

    Group g's queries are ``q[query_index[cu_q[g]:cu_q[g+1]]]`` (its suffixes' tokens in packed
    order), its keys ``k[key_index[cu_k[g]:cu_k[g+1]]]`` (the prefix's tokens).
    """

    query_index: torch.Tensor  # [Tc] int64, on q's device
    key_index: torch.Tensor  # [Tk] int64
    cu_q: torch.Tensor  # [G+1] int32
    cu_k: torch.Tensor  # [G+1] int32
    groups: tuple[tuple[int, int, int, int], ...]  # per group (q_start, q_end, k_start, k_end)
    max_q: int
    max_k: int


def _segment_bounds(cu: list[int], num_tokens: int) -> list[tuple[int, int]]:
    """(start, end) per segment, clamped so unvalidated cu_seqlens never index out of range."""
    bounds, previous_end = [], 0
    for start, end in itertools.pairwise(cu):
        start = min(max(start, previous_end), num_tokens)
        end = min(max(end, start), num_tokens)
        bounds.append((start, end))
        previous_end = end
    return bounds


def _ranges(bounds: list[tuple[int, int]]) -> torch.Tensor:
    """The tokens of ``bounds`` laid end to end, ``[sum of lengths]`` int64 (CPU)."""
    if not bounds:
        return torch.zeros(0, dtype=torch.int64)
    starts = torch.tensor([a for a, _ in bounds], dtype=torch.int64)
    lengths = torch.tensor([b - a for a, b in bounds], dtype=torch.int64)
    offsets = lengths.cumsum(0) - lengths
    return (torch.arange(int(lengths.sum()), dtype=torch.int64)
            + torch.repeat_interleave(starts - offsets, lengths))


def prefix_layout(cu_seqlens: torch.Tensor, prefix_of: torch.Tensor,
                  num_tokens: int) -> PrefixLayout:
    """The cross pass's groups (one host sync on the GPU). Unvalidated input is made safe:
    bounds are clamped, and an entry that is not an earlier segment whose own entry is -1 is
    read as -1."""
    num_segments = prefix_of.numel()
    host = torch.cat([cu_seqlens.reshape(-1), prefix_of.reshape(-1)]).tolist()
    bounds = _segment_bounds(host[:num_segments + 1], num_tokens)
    parents = host[num_segments + 1:]
    suffixes: dict[int, list[tuple[int, int]]] = {}
    for b, p in enumerate(parents):
        if 0 <= p < b and parents[p] == -1 and bounds[p][1] > bounds[p][0] \
                and bounds[b][1] > bounds[b][0]:
            suffixes.setdefault(p, []).append(bounds[b])
    query_bounds, key_bounds, groups, q_end, k_end = [], [], [], 0, 0
    for p in sorted(suffixes):
        query_bounds += suffixes[p]
        key_bounds.append(bounds[p])
        q_start, k_start = q_end, k_end
        q_end += sum(b - a for a, b in suffixes[p])
        k_end += bounds[p][1] - bounds[p][0]
        groups.append((q_start, q_end, k_start, k_end))
    device = cu_seqlens.device
    cu_q = [0] + [g[1] for g in groups]
    cu_k = [0] + [g[3] for g in groups]
    return PrefixLayout(
        query_index=_ranges(query_bounds).to(device), key_index=_ranges(key_bounds).to(device),
        cu_q=torch.tensor(cu_q, dtype=torch.int32).to(device),
        cu_k=torch.tensor(cu_k, dtype=torch.int32).to(device), groups=tuple(groups),
        max_q=max((g[1] - g[0] for g in groups), default=0),
        max_k=max((g[3] - g[2] for g in groups), default=0))


# The layouts of (prefix_of, cu_seqlens) pairs: one host sync per pair of tensors, shared by the
# layers of a forward and their backward (the Triton backend's tables are kept the same way).
_LAYOUTS = PairMemo()


def cached_prefix_layout(cu_seqlens: torch.Tensor, prefix_of: torch.Tensor,
                         num_tokens: int) -> PrefixLayout:
    """:func:`prefix_layout`, built once per (``cu_seqlens``, ``prefix_of``) tensors."""
    return _LAYOUTS.get_or_build(prefix_of, cu_seqlens, num_tokens,
                                 lambda: prefix_layout(cu_seqlens, prefix_of, num_tokens))


# ---------------------------------------------------------------------------------------------
# Cross-attention primitives: (q_c[Tc, Hq, D], k_c[Tk, Hk, D], v_c, layout, scale,
# deterministic) -> (out_c[Tc, Hq, D], lse_c[Hq, Tc] float32) and (dout_c, q_c, k_c, v_c, out_c,
# lse_c, layout, scale, deterministic) -> (dq_c, dk_c, dv_c), non-causal within each group; the
# backward reads the merged out and lse of the suffix tokens. Any float dtype out.

def _group_tensors(q_c, k_c, v_c, group, heads_per_kv):
    """One group's ``q [Hq, Lq, D]``, ``k, v [Hq, Lk, D]`` in float32."""
    q_start, q_end, k_start, k_end = group
    qs = q_c[q_start:q_end].float().transpose(0, 1)
    ks = k_c[k_start:k_end].float().transpose(0, 1).repeat_interleave(heads_per_kv, dim=0)
    vs = v_c[k_start:k_end].float().transpose(0, 1).repeat_interleave(heads_per_kv, dim=0)
    return qs, ks, vs


def reference_cross_forward(q_c, k_c, v_c, layout, scale, deterministic):
    """The cross pass in float32, per group (any device)."""
    heads_per_kv = q_c.shape[1] // k_c.shape[1]
    out = torch.zeros(q_c.shape[0], q_c.shape[1], v_c.shape[2], device=q_c.device)
    lse = torch.full((q_c.shape[1], q_c.shape[0]), -math.inf, device=q_c.device)
    for group in layout.groups:
        qs, ks, vs = _group_tensors(q_c, k_c, v_c, group, heads_per_kv)
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale                # [Hq, Lq, Lk]
        group_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - group_lse.unsqueeze(-1))
        out[group[0]:group[1]] = torch.matmul(probs, vs).transpose(0, 1)
        lse[:, group[0]:group[1]] = group_lse
    return out, lse


def reference_cross_backward(dout_c, q_c, k_c, v_c, out_c, lse_c, layout, scale, deterministic):
    """The cross pass's gradients in float32, per group (one group per prefix, so each key row
    is written once)."""
    num_heads_k = k_c.shape[1]
    heads_per_kv = q_c.shape[1] // num_heads_k
    dq, dk, dv = (torch.zeros(x.shape, device=x.device) for x in (q_c, k_c, v_c))
    for group in layout.groups:
        q_start, q_end, k_start, k_end = group
        qs, ks, vs = _group_tensors(q_c, k_c, v_c, group, heads_per_kv)
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
        probs = torch.exp(scores - lse_c[:, q_start:q_end].unsqueeze(-1))   # [Hq, Lq, Lk]
        do = dout_c[q_start:q_end].float().transpose(0, 1)                  # [Hq, Lq, D]
        o = out_c[q_start:q_end].float().transpose(0, 1)
        row_dot = (do * o).sum(-1, keepdim=True)
        dscores = probs * (torch.matmul(do, vs.transpose(1, 2)) - row_dot) * scale
        dq[q_start:q_end] = torch.matmul(dscores, ks).transpose(0, 1)
        length = k_end - k_start
        # GQA: a KV head's gradient sums over the query heads of its group.
        dk[k_start:k_end] = (torch.matmul(dscores.transpose(1, 2), qs)
                             .view(num_heads_k, heads_per_kv, length, -1).sum(1).transpose(0, 1))
        dv[k_start:k_end] = (torch.matmul(probs.transpose(1, 2), do)
                             .view(num_heads_k, heads_per_kv, length, -1).sum(1).transpose(0, 1))
    return dq, dk, dv


def _cross_buckets(layout: PrefixLayout, num_q: int, num_k: int, device: torch.device):
    """Padded batches of groups for torch's CPU flash kernel: per bucket ``(q_index[G, Lq],
    q_valid, k_index[G, Lk], k_valid)`` (``num_q``/``num_k``, a zero row, where padded); a
    bucket's padded area stays within CPU_FLASH_PADDING of its real area (or is one group)."""
    from agentrl_fast.ops._varlen_attention_cpu import CPU_FLASH_PADDING

    groups = sorted(layout.groups, key=lambda g: g[0] - g[1])  # most queries first
    buckets, current, real, width_k = [], [], 0, 0
    for group in groups:
        length_q, length_k = group[1] - group[0], group[3] - group[2]
        wider_k = max(width_k, length_k)
        if current and (len(current) + 1) * (current[0][1] - current[0][0]) * wider_k \
                > CPU_FLASH_PADDING * (real + length_q * length_k):
            buckets.append(current)
            current, real, wider_k = [], 0, length_k
        current.append(group)
        real += length_q * length_k
        width_k = wider_k
    if current:
        buckets.append(current)

    def padded_index(ranges, fill):
        starts = torch.tensor([a for a, _ in ranges], device=device)
        lengths = torch.tensor([b - a for a, b in ranges], device=device)
        position = torch.arange(int(lengths.max()), device=device)
        valid = position[None, :] < lengths[:, None]
        return torch.where(valid, starts[:, None] + position[None, :], fill), valid

    return [(*padded_index([g[:2] for g in bucket], num_q),
             *padded_index([g[2:] for g in bucket], num_k)) for bucket in buckets]


def cpu_flash_cross_forward(q_c, k_c, v_c, layout, scale, deterministic):
    """The cross pass through torch's fused CPU flash kernel on padded batches of groups (keys
    of other lengths hidden by an additive mask)."""
    from agentrl_fast.ops._varlen_attention_cpu import _cpu_flash_ops, _key_mask, _padded

    if scale == 0.0:  # torch's kernel returns NaN for a zero scale
        return reference_cross_forward(q_c, k_c, v_c, layout, scale, deterministic)
    forward, _ = _cpu_flash_ops()
    out = torch.zeros_like(q_c)
    lse = torch.full((q_c.shape[1], q_c.shape[0]), -math.inf, device=q_c.device)
    for q_index, q_valid, k_index, k_valid in _cross_buckets(layout, q_c.shape[0], k_c.shape[0],
                                                             q_c.device):
        bucket_out, bucket_lse = forward(_padded(q_c, q_index), _padded(k_c, k_index),
                                         _padded(v_c, k_index), 0.0, False,
                                         attn_mask=_key_mask(k_valid, q_c.dtype), scale=scale)
        tokens = q_index[q_valid]
        out[tokens] = bucket_out.transpose(1, 2)[q_valid].to(out.dtype)
        lse[:, tokens] = bucket_lse.transpose(1, 2)[q_valid].transpose(0, 1).float()
    return out, lse


def cpu_flash_cross_backward(dout_c, q_c, k_c, v_c, out_c, lse_c, layout, scale, deterministic):
    from agentrl_fast.ops._varlen_attention_cpu import _cpu_flash_ops, _key_mask, _padded

    if scale == 0.0:
        return reference_cross_backward(dout_c, q_c, k_c, v_c, out_c, lse_c, layout, scale,
                                        deterministic)
    _, backward = _cpu_flash_ops()
    dq, dk, dv = (torch.zeros_like(x) for x in (q_c, k_c, v_c))
    lse_tokens = lse_c.transpose(0, 1)  # [Tc, Hq]
    for q_index, q_valid, k_index, k_valid in _cross_buckets(layout, q_c.shape[0], k_c.shape[0],
                                                             q_c.device):
        # Padded query rows (zero q, out and dout, LSE 0) add nothing to dk, dv.
        grads = backward(_padded(dout_c, q_index), _padded(q_c, q_index), _padded(k_c, k_index),
                         _padded(v_c, k_index), _padded(out_c, q_index),
                         _padded(lse_tokens, q_index).contiguous(), 0.0, False,
                         attn_mask=_key_mask(k_valid, q_c.dtype), scale=scale)
        grad_q, grad_k, grad_v = (g.transpose(1, 2) for g in grads)
        dq[q_index[q_valid]] = grad_q[q_valid].to(dq.dtype)
        keys = k_index[k_valid]
        dk[keys] = grad_k[k_valid].to(dk.dtype)
        dv[keys] = grad_v[k_valid].to(dv.dtype)
    return dq, dk, dv


# Backends of kind "op" whose cross pass is not the float32 reference.
CROSS_PASSES: dict[str, tuple[Callable, Callable]] = {
    "cpu_flash": (cpu_flash_cross_forward, cpu_flash_cross_backward),
}


# ---------------------------------------------------------------------------------------------
# The generic path.

@dataclass(frozen=True)
class Passes:
    """What the generic path runs on one backend: the plain ``forward``/``backward`` of a kind
    "op" backend (fill preallocated outputs; called with causal=True) and the cross pass."""

    forward: Callable
    backward: Callable
    cross_forward: Callable = reference_cross_forward
    cross_backward: Callable = reference_cross_backward


def varlen_passes(raw_forward: Callable, raw_backward: Callable) -> Passes:
    """``Passes`` over a raw varlen kernel with separate query and key bounds:
    ``raw_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic) -> (out,
    lse)`` and ``raw_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
    deterministic) -> (dq, dk, dv)`` (the torch and flash_attn backends)."""

    def forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, out, lse):
        got_out, got_lse = raw_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                       causal, scale, deterministic)
        out.copy_(got_out)
        lse.copy_(got_lse)

    def backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, deterministic,
                 dq, dk, dv):
        grads = raw_backward(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen,
                             max_seqlen, causal, scale, deterministic)
        for grad, got in zip((dq, dk, dv), grads):
            grad.copy_(got)

    def cross_forward(q_c, k_c, v_c, layout, scale, deterministic):
        return raw_forward(q_c, k_c, v_c, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k,
                           False, scale, deterministic)

    def cross_backward(dout_c, q_c, k_c, v_c, out_c, lse_c, layout, scale, deterministic):
        return raw_backward(dout_c, q_c, k_c, v_c, out_c, lse_c, layout.cu_q, layout.cu_k,
                            layout.max_q, layout.max_k, False, scale, deterministic)

    return Passes(forward, backward, cross_forward, cross_backward)


def merge(out_s: torch.Tensor, lse_s: torch.Tensor, out_c: torch.Tensor,
          lse_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out[N, Hq, D] float32, lse[Hq, N])`` of two passes over disjoint keys of the same
    queries, from each pass's ``out[N, Hq, D]`` and ``lse[Hq, N]``."""
    lse = torch.logaddexp(lse_s, lse_c)
    shift = lse.masked_fill(lse == -math.inf, 0.0)  # no key in either pass: weights 0, not NaN
    weight_s = torch.exp(lse_s - shift).transpose(0, 1).unsqueeze(-1)
    weight_c = torch.exp(lse_c - shift).transpose(0, 1).unsqueeze(-1)
    return weight_s * out_s.float() + weight_c * out_c.float(), lse


def generic_prefix_forward(passes: Passes, q, k, v, cu_seqlens, prefix_of, max_seqlen, scale,
                           deterministic, out, lse):
    """``Backend.prefix_forward`` through the self pass, the cross pass and their merge."""
    passes.forward(q, k, v, cu_seqlens, max_seqlen, True, scale, deterministic, out, lse)
    layout = cached_prefix_layout(cu_seqlens, prefix_of, q.shape[0])
    if not layout.groups:
        return
    rows, keys = layout.query_index, layout.key_index
    out_c, lse_c = passes.cross_forward(q[rows], k[keys], v[keys], layout, scale, deterministic)
    merged_out, merged_lse = merge(out[rows], lse[:, rows], out_c, lse_c)
    out[rows] = merged_out.to(out.dtype)
    lse[:, rows] = merged_lse


def generic_prefix_backward(passes: Passes, dout, q, k, v, out, lse, cu_seqlens, prefix_of,
                            max_seqlen, scale, deterministic, dq, dk, dv):
    """``Backend.prefix_backward``: each pass's backward with the merged out and lse, summed
    (self part first, then the cross part, in float32)."""
    passes.backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, True, scale, deterministic,
                    dq, dk, dv)
    layout = cached_prefix_layout(cu_seqlens, prefix_of, q.shape[0])
    if not layout.groups:
        return
    rows, keys = layout.query_index, layout.key_index
    dq_c, dk_c, dv_c = passes.cross_backward(dout[rows], q[rows], k[keys], v[keys], out[rows],
                                             lse[:, rows], layout, scale, deterministic)
    dq[rows] = (dq[rows].float() + dq_c.float()).to(dq.dtype)
    dk[keys] = (dk[keys].float() + dk_c.float()).to(dk.dtype)
    dv[keys] = (dv[keys].float() + dv_c.float()).to(dv.dtype)


def generic_passes(backend: Backend) -> Passes:
    """The generic path's passes on a backend of kind "op": its plain kernels and its cross
    pass (``CROSS_PASSES``, else the float32 reference)."""
    if backend.kind != "op":
        raise ValueError(f"backend {backend.name!r} (kind {backend.kind!r}) has no prefix mode "
                         "(prefix_of); use another backend")
    cross = CROSS_PASSES.get(backend.name, (reference_cross_forward, reference_cross_backward))
    return Passes(backend.forward, backend.backward, *cross)


def generic_kernels(backend: Backend) -> tuple[Callable, Callable]:
    """``(prefix_forward, prefix_backward)`` of the generic path on ``backend``, whatever its
    native prefix mode."""
    passes = generic_passes(backend)
    return (functools.partial(generic_prefix_forward, passes),
            functools.partial(generic_prefix_backward, passes))


def prefix_kernels(backend: Backend) -> tuple[Callable, Callable]:
    """``(prefix_forward, prefix_backward)`` of ``backend``: its own when it has them, else
    the generic path."""
    if backend.prefix_forward is not None and backend.prefix_backward is not None:
        return backend.prefix_forward, backend.prefix_backward
    return generic_kernels(backend)
