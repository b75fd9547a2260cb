"""Loss aggregation as one weight per token (docs/design.md, "Token-level PPO loss"):
``loss = sum_t w_t * l_t`` over action tokens, for every ``loss_agg_mode``. Plain torch, no
host sync; the arguments are checked by the caller (``_loss_checks``)."""

from __future__ import annotations

import torch

from agentrl_fast.ops._checks import validate_cu_seqlens


def _group_index(rollout_ids: torch.Tensor) -> torch.Tensor:
    """[B] int64 in [0, B): equal ids get equal indices (sort-based; no host sync)."""
    ordered, order = torch.sort(rollout_ids.to(torch.int64), stable=True)
    starts = torch.ones_like(ordered, dtype=torch.int64)
    if ordered.numel() > 1:
        starts[1:] = (ordered[1:] != ordered[:-1]).to(torch.int64)
    group_sorted = torch.cumsum(starts, 0) - 1
    group = torch.empty_like(group_sorted)
    group[order] = group_sorted
    return group


def _as_count(value, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=like.dtype)
    return like.new_tensor(float(value))


def compute_loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant, global_tokens,
                         global_sequences, dtype=torch.float32) -> torch.Tensor:
    """``w[T]`` in ``dtype`` for checked arguments (see ``loss_weights``)."""
    m = action_mask.to(dtype)
    if mode == "token-sum":
        return m
    if mode == "token-mean":
        count = m.sum() if global_tokens is None else _as_count(global_tokens, m)
        return m / count.clamp_min(1)
    num_tokens = action_mask.shape[0]
    num_sequences = cu_seqlens.shape[0] - 1
    if num_sequences == 0:
        return m  # no sequences: no tokens (checked by validate) -> empty
    positions = torch.arange(num_tokens, device=m.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    sequence = sequence.clamp_(max=num_sequences - 1)
    tokens_per_sequence = m.new_zeros(num_sequences).index_add_(0, sequence, m)
    if mode == "rollout-mean":
        group = _group_index(rollout_ids)
        tokens_per_group = m.new_zeros(num_sequences).index_add_(0, group, tokens_per_sequence)
        units = (tokens_per_group > 0).sum().to(dtype)
        per_unit_tokens = tokens_per_group[group]
    else:
        units = (tokens_per_sequence > 0).sum().to(dtype)
        per_unit_tokens = tokens_per_sequence
    if global_sequences is not None:
        units = _as_count(global_sequences, m)
    units = units.clamp_min(1)
    if mode == "seq-mean-token-sum":
        per_sequence = (1 / units).expand(num_sequences)
    elif mode == "seq-mean-token-sum-norm":
        per_sequence = (1 / (units * norm_constant)).expand(num_sequences)
    else:  # seq-mean-token-mean, rollout-mean
        per_sequence = 1 / (per_unit_tokens.clamp_min(1) * units)
    return m * per_sequence[sequence]


def aggregation(mode, action_mask, cu_seqlens, rollout_ids, token_weights, global_tokens,
                global_sequences, norm_constant, validate, triton, dtype=torch.float32):
    """``(weights or None, token_mean, count_override)``: token_weights as given; token-mean
    and token-sum without weights (the kernel scales by 1/N itself, or the torch path by
    ``torch_scale``); weights from the mode otherwise (float32 for the Triton path)."""
    if token_weights is not None:
        return token_weights, False, 0.0
    if mode == "token-sum":
        return None, False, 0.0
    if mode == "token-mean" and not isinstance(global_tokens, torch.Tensor):
        return None, True, 0.0 if global_tokens is None else float(global_tokens)
    if validate and cu_seqlens is not None and mode not in ("token-mean", "token-sum"):
        cu_seqlens = validate_cu_seqlens(cu_seqlens, action_mask.shape[0], -1)
    dtype = torch.float32 if triton else dtype
    return (compute_loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant,
                                 global_tokens, global_sequences, dtype), False, 0.0)


def torch_scale(token_mean, count_override, action_mask, dtype) -> torch.Tensor:
    """The torch path's 0-d factor on the weighted sum: ``1/N`` for token-mean without
    weights (``N`` the action tokens, or ``count_override`` when > 0), else 1."""
    if not token_mean:
        return torch.ones((), dtype=dtype, device=action_mask.device)
    count = action_mask.sum().to(dtype) if count_override <= 0 else torch.tensor(
        count_override, dtype=dtype, device=action_mask.device)
    return 1 / count.clamp_min(1)
