"""Argument checks of the loss ops (``loss_weights``, ``ppo_loss``, ``value_loss``): types,
shapes, devices and scalar ranges, no host sync (the values of ``cu_seqlens`` are checked by
``validate_cu_seqlens``, behind ``validate=True``)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from agentrl_fast.ops._checks import check_cu_seqlens_metadata, require_real, require_tensor

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm", "rollout-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class PPOOptions(NamedTuple):
    """The checked scalar options of ``ppo_loss`` (Python floats; ``dual_clip`` and
    ``tis_cap`` None when off)."""

    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    tis_cap: float | None


def check_mode(loss_agg_mode) -> str:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}; "
                         f"got {loss_agg_mode!r}")
    return loss_agg_mode


def check_count(name: str, value):
    """A global count: None, a positive Python number, or a 0-d tensor (e.g. all-reduced)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a number or a 0-d tensor, got shape "
                             f"{tuple(value.shape)}")
        return value
    count = require_real(name, value)
    if not (count > 0 and math.isfinite(count)):
        raise ValueError(f"{name} must be > 0 (the number of tokens/sequences in the global "
                         f"batch), got {value}")
    return count


def check_mask(action_mask, num_tokens: int, device) -> None:
    require_tensor("action_mask", action_mask)
    if action_mask.dtype != torch.bool:
        raise TypeError(f"action_mask must be bool, got {action_mask.dtype}; pass "
                        "action_mask.bool()")
    if action_mask.dim() != 1 or action_mask.shape[0] != num_tokens:
        raise ValueError(f"action_mask must be [T] with T = {num_tokens}, got shape "
                         f"{tuple(action_mask.shape)}")
    if action_mask.device != device:
        raise ValueError(f"action_mask must be on {device}, got {action_mask.device}")


def check_per_token(name: str, tensor, num_tokens: int, device, *, optional: bool = False,
                    reference: str = "logprobs") -> None:
    if tensor is None and optional:
        return
    require_tensor(name, tensor)
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {tensor.dtype}")
    if tensor.dim() != 1 or tensor.shape[0] != num_tokens:
        raise ValueError(f"{name} must be [T] with T = {reference}.shape[0] = {num_tokens}, got "
                         f"shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device} like {reference}, got {tensor.device}")


def check_structure(mode: str, action_mask, cu_seqlens, rollout_ids, norm_constant, device):
    """Checks what ``mode`` needs; returns norm_constant as a float (or None)."""
    needs_sequences = mode not in ("token-mean", "token-sum")
    if cu_seqlens is not None:
        check_cu_seqlens_metadata(cu_seqlens, device)
    elif needs_sequences:
        raise ValueError(f"loss_agg_mode {mode!r} needs cu_seqlens ([B+1] int32) to find the "
                         "sequences; pass cu_seqlens or use 'token-mean'")
    if mode == "rollout-mean":
        if rollout_ids is None:
            raise ValueError("loss_agg_mode 'rollout-mean' needs rollout_ids ([B] integer, the "
                             "rollout each sequence (sub-trace) belongs to); pass rollout_ids")
    if rollout_ids is not None:
        _check_rollout_ids(rollout_ids, cu_seqlens, device)
    if mode == "seq-mean-token-sum-norm":
        if norm_constant is None:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs norm_constant (Dr. "
                             "GRPO's constant length, e.g. the max response length); pass "
                             "norm_constant=...")
    if norm_constant is not None:
        norm_constant = require_real("norm_constant", norm_constant)
        if not (norm_constant > 0 and math.isfinite(norm_constant)):
            raise ValueError(f"norm_constant must be > 0 and finite, got {norm_constant}")
    return norm_constant


def _check_rollout_ids(rollout_ids, cu_seqlens, device) -> None:
    require_tensor("rollout_ids", rollout_ids)
    dtype = rollout_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"rollout_ids must be an integer tensor, got {rollout_ids.dtype}; pass "
                        "rollout_ids.long()")
    num_sequences = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if rollout_ids.dim() != 1 or (num_sequences is not None
                                  and rollout_ids.shape[0] != num_sequences):
        raise ValueError(f"rollout_ids must be [B] with B = cu_seqlens.shape[0] - 1 = "
                         f"{num_sequences}, got shape {tuple(rollout_ids.shape)}")
    if rollout_ids.device != device:
        raise ValueError(f"rollout_ids must be on {device}, got {rollout_ids.device}")


def check_aggregation(name0, x0, action_mask, cu_seqlens, rollout_ids, token_weights,
                      loss_agg_mode, global_tokens, global_sequences, norm_constant):
    """The checks ``ppo_loss`` and ``value_loss`` share, against their differentiable input
    ``x0[T]`` (named ``name0``); returns ``(mode, norm_constant, global_tokens,
    global_sequences)`` checked."""
    require_tensor(name0, x0)
    if x0.dim() != 1:
        raise ValueError(f"{name0} must be 1-D [T], got shape {tuple(x0.shape)}")
    num_tokens, device = x0.shape[0], x0.device
    mode = check_mode(loss_agg_mode)
    check_mask(action_mask, num_tokens, device)
    check_per_token("token_weights", token_weights, num_tokens, device, optional=True,
                    reference=name0)
    if token_weights is None:
        norm_constant = check_structure(mode, action_mask, cu_seqlens, rollout_ids, norm_constant,
                                        device)
    elif cu_seqlens is not None:
        check_cu_seqlens_metadata(cu_seqlens, device)
    return (mode, norm_constant, check_count("global_tokens", global_tokens),
            check_count("global_sequences", global_sequences))


def check_ppo_tensors(logprobs, old_logprobs, advantages, ref_logprobs, entropy,
                      rollout_logprobs) -> None:
    """Every per-token input of ``ppo_loss``: ``[T]`` float on the device of ``logprobs``."""
    num_tokens, device = logprobs.shape[0], logprobs.device
    check_per_token("logprobs", logprobs, num_tokens, device)
    check_per_token("old_logprobs", old_logprobs, num_tokens, device)
    check_per_token("advantages", advantages, num_tokens, device)
    check_per_token("ref_logprobs", ref_logprobs, num_tokens, device, optional=True)
    check_per_token("entropy", entropy, num_tokens, device, optional=True)
    check_per_token("rollout_logprobs", rollout_logprobs, num_tokens, device, optional=True)


def check_ppo_options(clip_low, clip_high, dual_clip, kl_coef, kl_estimator, entropy_coef,
                      tis_cap, *, has_ref: bool, has_rollout: bool) -> PPOOptions:
    """The scalar options of ``ppo_loss``; ``has_ref``/``has_rollout``: whether
    ``ref_logprobs`` / ``rollout_logprobs`` were given (KL and the truncated IS weight need
    them)."""
    clip_low, clip_high = require_real("clip_low", clip_low), require_real("clip_high", clip_high)
    if not 0 <= clip_low < 1:
        raise ValueError("clip_low must be in [0, 1) (the ratio is clipped at 1 - clip_low), got "
                         f"{clip_low}")
    if not (clip_high >= 0 and math.isfinite(clip_high)):
        raise ValueError(f"clip_high must be >= 0 and finite, got {clip_high}")
    if dual_clip is not None:
        dual_clip = require_real("dual_clip", dual_clip)
        if not (dual_clip > 1 and math.isfinite(dual_clip)):
            raise ValueError("dual_clip must be None or a finite c > 1 (e.g. 3.0), got "
                             f"{dual_clip}")
    kl_coef = require_real("kl_coef", kl_coef)
    entropy_coef = require_real("entropy_coef", entropy_coef)
    for name, value in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got "
                         f"{kl_estimator!r}")
    if kl_coef != 0 and not has_ref:
        raise ValueError(f"kl_coef = {kl_coef} needs ref_logprobs ([T], the reference policy's "
                         "log-probs); pass ref_logprobs or kl_coef=0")
    if has_rollout:
        if tis_cap is None:
            raise ValueError("rollout_logprobs needs tis_cap (the truncation of the importance "
                             "weight exp(old - rollout), e.g. 2.0); pass tis_cap=...")
        tis_cap = require_real("tis_cap", tis_cap)
        if not tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    elif tis_cap is not None:
        tis_cap = require_real("tis_cap", tis_cap)
    return PPOOptions(clip_low, clip_high, dual_clip, kl_coef, kl_estimator, entropy_coef, tis_cap)


def check_value_clip(clip) -> float | None:
    if clip is not None:
        clip = require_real("clip", clip)
        if not (clip > 0 and math.isfinite(clip)):
            raise ValueError(f"clip must be None or a finite value > 0 (e.g. 0.2), got {clip}")
    return clip
