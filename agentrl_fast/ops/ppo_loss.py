"""Token-level PPO loss, its per-token loss weights and the value loss (DESIGN.md,
"Token-level PPO loss").

- ``loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant) -> w[T]``: the
  aggregation of every ``loss_agg_mode`` as one weight per token, computed once for the global
  batch and sliced with the tokens into micro-batches (any split then accumulates to exactly the
  full-batch gradient).
- ``ppo_loss(...) -> (loss, metrics)`` and ``value_loss(...) -> (loss, metrics)``:
  ``loss = sum_t w_t * l_t`` over action tokens.

Backends: plain torch (autograd) for CPU tensors; the Triton kernels of ``kernels/ppo_loss.py``
for CUDA tensors and for CPU tensors when ``TRITON_INTERPRET=1`` (the interpreter tests),
declared as ``torch.library.custom_op`` s with fakes so ``torch.compile`` traces them. The
kernels compute in float32, so float64 ``logprobs`` / ``values`` always take the torch path
(which computes in float64): ``auto`` routes them there and ``triton`` refuses them. No op
syncs with the host: metrics are 0-d tensors (except for ``validate=True``, which checks
``cu_seqlens`` values with one sync when cu_seqlens is used).
"""

from __future__ import annotations

import math
import os

import torch

from agentrl_fast.ops._checks import (check_cu_seqlens_metadata, require_real, require_tensor,
                                      validate_cu_seqlens)

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm", "rollout-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Metric names, in the order of the Triton kernel's metrics columns (kernels/ppo_loss.py).
PPO_METRICS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "action_tokens", "pg_clipfrac_upper",
               "pg_clipfrac_lower", "pg_clipfrac_dual", "approx_kl", "ratio_mean", "ratio_max",
               "kl_mean", "entropy_mean")
VALUE_METRICS = ("loss", "action_tokens", "vf_clipfrac", "vf_mse")
_NUM_COLUMNS = 16
_RATIO_LOG_CLAMP = 20.0
_KL_CLAMP = 10.0


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_mode(loss_agg_mode) -> str:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}; "
                         f"got {loss_agg_mode!r}")
    return loss_agg_mode


def _check_count(name: str, value):
    """A global count: None, a positive Python number, or a 0-d tensor (e.g. all-reduced)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a number or a 0-d tensor, got shape {tuple(value.shape)}")
        return value
    count = require_real(name, value)
    if not (count > 0 and math.isfinite(count)):
        raise ValueError(f"{name} must be > 0 (the number of tokens/sequences in the global "
                         f"batch), got {value}")
    return count


def _check_mask(action_mask, num_tokens: int, device) -> None:
    require_tensor("action_mask", action_mask)
    if action_mask.dtype != torch.bool:
        raise TypeError(f"action_mask must be bool, got {action_mask.dtype}; pass action_mask.bool()")
    if action_mask.dim() != 1 or action_mask.shape[0] != num_tokens:
        raise ValueError(f"action_mask must be [T] with T = {num_tokens}, got shape "
                         f"{tuple(action_mask.shape)}")
    if action_mask.device != device:
        raise ValueError(f"action_mask must be on {device}, got {action_mask.device}")


def _check_per_token(name: str, tensor, num_tokens: int, device, *, optional: bool = False,
                     reference: str = "logprobs") -> None:
    if tensor is None and optional:
        return
    require_tensor(name, tensor)
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {tensor.dtype}")
    if tensor.dim() != 1 or tensor.shape[0] != num_tokens:
        raise ValueError(f"{name} must be [T] with T = {reference}.shape[0] = {num_tokens}, got shape "
                         f"{tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device} like {reference}, got {tensor.device}")


def _check_structure(mode: str, action_mask, cu_seqlens, rollout_ids, norm_constant, device):
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
        require_tensor("rollout_ids", rollout_ids)
        if rollout_ids.dtype.is_floating_point or rollout_ids.dtype.is_complex or rollout_ids.dtype == torch.bool:
            raise TypeError(f"rollout_ids must be an integer tensor, got {rollout_ids.dtype}; pass "
                            "rollout_ids.long()")
        num_sequences = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if rollout_ids.dim() != 1 or (num_sequences is not None and rollout_ids.shape[0] != num_sequences):
            raise ValueError(f"rollout_ids must be [B] with B = cu_seqlens.shape[0] - 1 = "
                             f"{num_sequences}, got shape {tuple(rollout_ids.shape)}")
        if rollout_ids.device != device:
            raise ValueError(f"rollout_ids must be on {device}, got {rollout_ids.device}")
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


# ---------------------------------------------------------------------------------------------
# Loss weights


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


def _loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant, global_tokens,
                  global_sequences, dtype=torch.float32) -> torch.Tensor:
    """The weights (checked arguments); plain torch, no host sync."""
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
    sequence = torch.searchsorted(cu_seqlens[1:], positions, right=True).clamp_(max=num_sequences - 1)
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


def loss_weights(
    mode: str,
    action_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    rollout_ids: torch.Tensor | None = None,
    norm_constant: float | None = None,
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_sequences: float | torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Per-token loss weights of an aggregation mode: ``loss = sum_t w_t * l_t``.

    Args:
        mode: one of ``LOSS_AGG_MODES``. On action tokens ``w`` is ``1/N_tokens`` (token-mean),
            ``1`` (token-sum), ``1/N_seq`` (seq-mean-token-sum), ``1/(n_seq * N_seq)``
            (seq-mean-token-mean), ``1/(norm_constant * N_seq)`` (seq-mean-token-sum-norm),
            ``1/(n_rollout * N_rollouts)`` (rollout-mean); ``n_seq``/``n_rollout`` count the
            action tokens of the token's sequence/rollout, ``N_seq``/``N_rollouts`` the sequences
            /rollouts with at least one action token (fully masked ones do not count).
        action_mask: ``[T]`` bool.
        cu_seqlens: ``[B+1]`` int32; required by every mode but token-mean and token-sum.
        rollout_ids: ``[B]`` integer, the rollout of each sequence (sub-trace); rollout-mean only.
        norm_constant: > 0, seq-mean-token-sum-norm only.
        global_tokens: overrides ``N_tokens`` (token-mean): a number or a 0-d tensor.
        global_sequences: overrides ``N_seq`` (seq-mean-*) and, for rollout-mean, ``N_rollouts``
            (it counts rollouts there). With these a micro-batch computes its own weights
            exactly when no sequence (rollout, for rollout-mean) is split between micro-batches;
            otherwise compute the weights on the whole batch and slice them.
        validate: check ``cu_seqlens`` values (one host sync on the GPU).

    Returns:
        ``w[T]`` float32, exactly 0 on non-action tokens.
    """
    mode = _check_mode(mode)
    require_tensor("action_mask", action_mask)
    if action_mask.dim() != 1:
        raise ValueError(f"action_mask must be 1-D [T], got shape {tuple(action_mask.shape)}")
    _check_mask(action_mask, action_mask.shape[0], action_mask.device)
    norm_constant = _check_structure(mode, action_mask, cu_seqlens, rollout_ids, norm_constant,
                                     action_mask.device)
    global_tokens = _check_count("global_tokens", global_tokens)
    global_sequences = _check_count("global_sequences", global_sequences)
    if validate and cu_seqlens is not None and mode not in ("token-mean", "token-sum"):
        cu_seqlens = validate_cu_seqlens(cu_seqlens, action_mask.shape[0], -1)
    return _loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant, global_tokens,
                         global_sequences)


# ---------------------------------------------------------------------------------------------
# The torch path (CPU)


def _kl(logp, ref, estimator: str):
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    log_ratio = torch.clamp(ref - logp, -_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -_KL_CLAMP, _KL_CLAMP)


def _ppo_loss_torch(logprobs, old_logprobs, advantages, action_mask, weights, scale, p):
    """``(loss, metrics)`` with torch autograd: ``weights`` [T] (0 off actions) or None (ones,
    then times ``scale``, a 0-d tensor)."""
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    act = action_mask

    def clean(x):  # exactly 0 gradient (and no NaN) on non-action tokens
        return None if x is None else torch.where(act, x.to(dtype), 0)

    logp, old, adv = clean(logprobs), clean(old_logprobs).detach(), clean(advantages).detach()
    w = act.to(dtype) if weights is None else clean(weights).detach()
    ratio = torch.exp(torch.clamp(logp - old, -_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP))
    low, high = 1 - p["clip_low"], 1 + p["clip_high"]
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
    clip_dual = torch.zeros_like(act)
    if p["dual_clip"] is not None:
        pg3 = -adv * p["dual_clip"]
        clip_dual = act & (adv < 0) & (pg3 < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    if p["rollout_logprobs"] is not None:
        rollout = clean(p["rollout_logprobs"]).detach()
        tis = torch.clamp(torch.exp(torch.clamp(old - rollout, max=_RATIO_LOG_CLAMP)), max=p["tis_cap"])
        pg = pg * tis
    zero = logp.new_zeros(())
    term = pg
    kl = entropy = None
    if p["ref_logprobs"] is not None:
        kl = torch.where(act, _kl(logp, clean(p["ref_logprobs"]).detach(), p["kl_estimator"]), 0)
        term = term + p["kl_coef"] * kl
    if p["entropy"] is not None:
        entropy = clean(p["entropy"])
        term = term - p["entropy_coef"] * entropy
    loss = torch.sum(w * term) * scale
    with torch.no_grad():
        count = act.sum().to(dtype)
        n = count.clamp_min(1)
        ratio_d, pg_d = ratio.detach(), pg.detach()
        metrics = {
            "loss": loss.detach(),
            "pg_loss": torch.sum(w * pg_d) * scale,
            "kl_loss": zero if kl is None else torch.sum(w * kl.detach()) * scale,
            "entropy_loss": zero if entropy is None else torch.sum(w * entropy.detach()) * scale,
            "action_tokens": count,
            "pg_clipfrac_upper": (act & (adv > 0) & (ratio_d > high)).sum() / n,
            "pg_clipfrac_lower": (act & (adv < 0) & (ratio_d < low)).sum() / n,
            "pg_clipfrac_dual": clip_dual.sum() / n,
            "approx_kl": torch.sum(old - logp.detach()) / n,
            "ratio_mean": torch.sum(torch.where(act, ratio_d, 0)) / n,
            "ratio_max": torch.where(act, ratio_d, 0).max() if ratio_d.numel() else zero,
            "kl_mean": zero if kl is None else kl.detach().sum() / n,
            "entropy_mean": zero if entropy is None else entropy.detach().sum() / n,
        }
    return loss, {k: v.to(dtype) for k, v in metrics.items()}


def _value_loss_torch(values, old_values, returns, action_mask, weights, scale, clip):
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    act = action_mask

    def clean(x):
        return torch.where(act, x.to(dtype), 0)

    v, ret = clean(values), clean(returns).detach()
    w = act.to(dtype) if weights is None else clean(weights).detach()
    loss1 = (v - ret) ** 2
    per_token = loss1
    clipped = torch.zeros_like(act)
    if clip is not None:
        old = clean(old_values).detach()
        loss2 = (torch.clamp(v, old - clip, old + clip) - ret) ** 2
        clipped = act & (loss2 > loss1)
        per_token = torch.maximum(loss1, loss2)
    loss = torch.sum(w * 0.5 * per_token) * scale
    with torch.no_grad():
        count = act.sum().to(dtype)
        n = count.clamp_min(1)
        metrics = {"loss": loss.detach(), "action_tokens": count, "vf_clipfrac": clipped.sum() / n,
                   "vf_mse": loss1.detach().sum() / n}
    return loss, {k: v_.to(dtype) for k, v_ in metrics.items()}


# ---------------------------------------------------------------------------------------------
# The Triton path: registered ops around the launchers of kernels/ppo_loss.py


def _kernels():
    from agentrl_fast.kernels import ppo_loss as kernels  # noqa: PLC0415 (triton imported lazily)

    return kernels


def _blocks(num_tokens: int, block: int) -> int:
    return max(1, -(-num_tokens // block))


def launch_ppo_loss_forward(logprobs, old_logprobs, advantages, action_mask, weights, ref_logprobs,
                            entropy, rollout_logprobs, clip_low, clip_high, dual_clip, kl_coef,
                            kl_estimator, entropy_coef, tis_cap, token_mean, count_override,
                            *, dlogp, dentropy, partials, metrics) -> None:
    """Runs the forward and finalize kernels into preallocated outputs: ``dlogp[T]`` /
    ``dentropy[T]`` float32 (or None: not needed), ``partials[blocks, 16]`` float32,
    ``metrics[16]`` float32 (``PPO_METRICS`` order; column 15 the scale). ``kl_estimator``:
    0 none, 1..3 = k1..k3; ``dual_clip <= 0``: none."""
    k = _kernels()
    num_tokens = logprobs.shape[0]
    grid = (_blocks(num_tokens, k.BLOCK),)
    dummy = logprobs
    k.ppo_loss_forward_kernel[grid](
        logprobs, old_logprobs, advantages, action_mask.view(torch.uint8),
        dummy if weights is None else weights, dummy if ref_logprobs is None else ref_logprobs,
        dummy if entropy is None else entropy, dummy if rollout_logprobs is None else rollout_logprobs,
        partials if dlogp is None else dlogp, partials if dentropy is None else dentropy, partials,
        num_tokens, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tis_cap,
        HAS_WEIGHTS=weights is not None, HAS_DUAL=dual_clip > 0, KL=kl_estimator,
        HAS_ENTROPY=entropy is not None, HAS_ROLLOUT=rollout_logprobs is not None,
        NEED_GRAD_LOGP=dlogp is not None, NEED_GRAD_ENTROPY=dentropy is not None,
        BLOCK=k.BLOCK, NUM_COLUMNS=k.NUM_COLUMNS, num_warps=k.NUM_WARPS, num_stages=1)
    k.loss_finalize_kernel[(1,)](
        partials, metrics, grid[0], count_override, TOKEN_MEAN=token_mean, USED=k.PPO_USED,
        COUNT_COLUMN=k.PPO_COUNT, MAX_COLUMN=k.PPO_RATIO_MAX, SCALED=k.PPO_SCALED,
        MEANS=k.PPO_MEANS, NUM_COLUMNS=k.NUM_COLUMNS, BLOCK_ROWS=k.FINALIZE_BLOCK,
        num_warps=k.NUM_WARPS, num_stages=1)


def launch_value_loss_forward(values, old_values, returns, action_mask, weights, clip, token_mean,
                              count_override, *, dvalues, partials, metrics) -> None:
    """Value-loss forward + finalize into preallocated outputs (``VALUE_METRICS`` order;
    ``clip <= 0``: no clipping; ``dvalues`` None: not needed)."""
    k = _kernels()
    num_tokens = values.shape[0]
    grid = (_blocks(num_tokens, k.BLOCK),)
    k.value_loss_forward_kernel[grid](
        values, old_values, returns, action_mask.view(torch.uint8),
        values if weights is None else weights, partials if dvalues is None else dvalues, partials,
        num_tokens, clip, HAS_WEIGHTS=weights is not None, HAS_CLIP=clip > 0,
        NEED_GRAD=dvalues is not None, BLOCK=k.BLOCK, NUM_COLUMNS=k.NUM_COLUMNS,
        num_warps=k.NUM_WARPS, num_stages=1)
    k.loss_finalize_kernel[(1,)](
        partials, metrics, grid[0], count_override, TOKEN_MEAN=token_mean, USED=k.VALUE_USED,
        COUNT_COLUMN=k.VALUE_COUNT, MAX_COLUMN=-1, SCALED=k.VALUE_SCALED, MEANS=k.VALUE_MEANS,
        NUM_COLUMNS=k.NUM_COLUMNS, BLOCK_ROWS=k.FINALIZE_BLOCK, num_warps=k.NUM_WARPS,
        num_stages=1)


def launch_scale_gradient(d, grad_out, metrics, *, out) -> None:
    """``out[t] = d[t] * grad_out * metrics[15]`` (``out`` preallocated, any float dtype)."""
    k = _kernels()
    num_tokens = d.shape[0]
    k.scale_gradient_kernel[(_blocks(num_tokens, k.BLOCK),)](
        d, grad_out, metrics, out, num_tokens, SCALE_COLUMN=k.SCALE_COLUMN, BLOCK=k.BLOCK,
        num_warps=k.NUM_WARPS, num_stages=1)


def _num_partials(num_tokens: int) -> int:
    return _blocks(num_tokens, 1024)  # == kernels.BLOCK (kept here so fakes need no triton)


@torch.library.custom_op("agentrl_fast::ppo_loss_forward", mutates_args=())
def _ppo_loss_forward(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      action_mask: torch.Tensor, weights: torch.Tensor | None,
                      ref_logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
                      rollout_logprobs: torch.Tensor | None, clip_low: float, clip_high: float,
                      dual_clip: float, kl_coef: float, kl_estimator: int, entropy_coef: float,
                      tis_cap: float, token_mean: bool, count_override: float,
                      need_grad_logprobs: bool, need_grad_entropy: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(metrics[16], dlogp[T or 0], dentropy[T or 0])`` (float32)."""
    num_tokens = logprobs.shape[0]
    f32 = dict(dtype=torch.float32, device=logprobs.device)
    dlogp = torch.empty(num_tokens if need_grad_logprobs else 0, **f32)
    dentropy = torch.empty(num_tokens if need_grad_entropy else 0, **f32)
    partials = torch.empty(_num_partials(num_tokens), _NUM_COLUMNS, **f32)
    metrics = torch.empty(_NUM_COLUMNS, **f32)
    launch_ppo_loss_forward(logprobs, old_logprobs, advantages, action_mask, weights, ref_logprobs,
                            entropy, rollout_logprobs, clip_low, clip_high, dual_clip, kl_coef,
                            kl_estimator, entropy_coef, tis_cap, token_mean, count_override,
                            dlogp=dlogp if need_grad_logprobs else None,
                            dentropy=dentropy if need_grad_entropy else None,
                            partials=partials, metrics=metrics)
    return metrics, dlogp, dentropy


@_ppo_loss_forward.register_fake
def _ppo_loss_forward_fake(logprobs, old_logprobs, advantages, action_mask, weights, ref_logprobs,
                           entropy, rollout_logprobs, clip_low, clip_high, dual_clip, kl_coef,
                           kl_estimator, entropy_coef, tis_cap, token_mean, count_override,
                           need_grad_logprobs, need_grad_entropy):
    num_tokens = logprobs.shape[0]
    return (logprobs.new_empty(_NUM_COLUMNS, dtype=torch.float32),
            logprobs.new_empty(num_tokens if need_grad_logprobs else 0, dtype=torch.float32),
            logprobs.new_empty(num_tokens if need_grad_entropy else 0, dtype=torch.float32))


@torch.library.custom_op("agentrl_fast::loss_scale_gradient", mutates_args=())
def _scale_gradient(d: torch.Tensor, grad_metrics: torch.Tensor, metrics: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """``d * grad_metrics[0] * metrics[15]`` in ``dtype`` (the backward of the weighted sum)."""
    out = torch.empty(d.shape, dtype=dtype, device=d.device)
    launch_scale_gradient(d, grad_metrics, metrics, out=out)
    return out


@_scale_gradient.register_fake
def _scale_gradient_fake(d, grad_metrics, metrics, dtype):
    return torch.empty(d.shape, dtype=dtype, device=d.device)


def _ppo_setup_context(ctx, inputs, output):
    metrics, dlogp, dentropy = output
    ctx.save_for_backward(metrics, dlogp, dentropy)
    ctx.dtypes = (inputs[0].dtype, None if inputs[6] is None else inputs[6].dtype)
    ctx.mark_non_differentiable(dlogp, dentropy)


def _ppo_backward(ctx, grad_metrics, _grad_dlogp, _grad_dentropy):
    metrics, dlogp, dentropy = ctx.saved_tensors
    grad_metrics = grad_metrics.contiguous()
    grads = [None] * 19
    if ctx.needs_input_grad[0]:
        grads[0] = _scale_gradient(dlogp, grad_metrics, metrics, ctx.dtypes[0])
    if ctx.needs_input_grad[6]:
        grads[6] = _scale_gradient(dentropy, grad_metrics, metrics, ctx.dtypes[1])
    return tuple(grads)


_ppo_loss_forward.register_autograd(_ppo_backward, setup_context=_ppo_setup_context)


@torch.library.custom_op("agentrl_fast::value_loss_forward", mutates_args=())
def _value_loss_forward(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        action_mask: torch.Tensor, weights: torch.Tensor | None, clip: float,
                        token_mean: bool, count_override: float, need_grad: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(metrics[16], dvalues[T or 0])`` (float32)."""
    num_tokens = values.shape[0]
    f32 = dict(dtype=torch.float32, device=values.device)
    dvalues = torch.empty(num_tokens if need_grad else 0, **f32)
    partials = torch.empty(_num_partials(num_tokens), _NUM_COLUMNS, **f32)
    metrics = torch.empty(_NUM_COLUMNS, **f32)
    launch_value_loss_forward(values, old_values, returns, action_mask, weights, clip, token_mean,
                              count_override, dvalues=dvalues if need_grad else None,
                              partials=partials, metrics=metrics)
    return metrics, dvalues


@_value_loss_forward.register_fake
def _value_loss_forward_fake(values, old_values, returns, action_mask, weights, clip, token_mean,
                             count_override, need_grad):
    return (values.new_empty(_NUM_COLUMNS, dtype=torch.float32),
            values.new_empty(values.shape[0] if need_grad else 0, dtype=torch.float32))


def _value_setup_context(ctx, inputs, output):
    metrics, dvalues = output
    ctx.save_for_backward(metrics, dvalues)
    ctx.dtype = inputs[0].dtype
    ctx.mark_non_differentiable(dvalues)


def _value_backward(ctx, grad_metrics, _grad_dvalues):
    metrics, dvalues = ctx.saved_tensors
    grads = [None] * 9
    if ctx.needs_input_grad[0]:
        grads[0] = _scale_gradient(dvalues, grad_metrics.contiguous(), metrics, ctx.dtype)
    return tuple(grads)


_value_loss_forward.register_autograd(_value_backward, setup_context=_value_setup_context)


# ---------------------------------------------------------------------------------------------
# Dispatch and the public functions


def _resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, name: str) -> str:
    """``torch`` or ``triton``; ``name``/``dtype``: the differentiable input, whose dtype is
    the compute dtype (the Triton kernels compute in float32: float64 goes to the torch path)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        if dtype == torch.float64:
            return "torch"
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return "triton"
        return "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {device}; "
                         "use backend='torch' or 'auto'")
    if backend == "triton" and dtype == torch.float64:
        raise ValueError(f"{name} is float64, but backend 'triton' computes in float32; use "
                         "backend='auto' or 'torch' (float64 runs in float64 there) or pass "
                         f"{name}.float()")
    return backend


def _aggregation(mode, action_mask, cu_seqlens, rollout_ids, token_weights, global_tokens,
                 global_sequences, norm_constant, validate, triton, dtype=torch.float32):
    """``(weights or None, token_mean, count_override)``: token_weights as given; token-mean
    and token-sum without weights (the kernel scales by 1/N itself, or the torch path by
    ``scale``); weights from the mode otherwise."""
    if token_weights is not None:
        return token_weights, False, 0.0
    if mode == "token-sum":
        return None, False, 0.0
    if mode == "token-mean" and not isinstance(global_tokens, torch.Tensor):
        return None, True, 0.0 if global_tokens is None else float(global_tokens)
    if validate and cu_seqlens is not None and mode not in ("token-mean", "token-sum"):
        cu_seqlens = validate_cu_seqlens(cu_seqlens, action_mask.shape[0], -1)
    dtype = torch.float32 if triton else dtype
    return (_loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant, global_tokens,
                          global_sequences, dtype), False, 0.0)


def _torch_scale(token_mean, count_override, action_mask, dtype):
    if not token_mean:
        return torch.ones((), dtype=dtype, device=action_mask.device)
    count = action_mask.sum().to(dtype) if count_override <= 0 else torch.tensor(
        count_override, dtype=dtype, device=action_mask.device)
    return 1 / count.clamp_min(1)


def _check_common(name0, x0, action_mask, cu_seqlens, rollout_ids, token_weights, loss_agg_mode,
                  global_tokens, global_sequences, norm_constant):
    require_tensor(name0, x0)
    if x0.dim() != 1:
        raise ValueError(f"{name0} must be 1-D [T], got shape {tuple(x0.shape)}")
    num_tokens, device = x0.shape[0], x0.device
    mode = _check_mode(loss_agg_mode)
    _check_mask(action_mask, num_tokens, device)
    _check_per_token("token_weights", token_weights, num_tokens, device, optional=True,
                     reference=name0)
    if token_weights is None:
        norm_constant = _check_structure(mode, action_mask, cu_seqlens, rollout_ids, norm_constant,
                                         device)
    elif cu_seqlens is not None:
        check_cu_seqlens_metadata(cu_seqlens, device)
    return (mode, norm_constant, _check_count("global_tokens", global_tokens),
            _check_count("global_sequences", global_sequences))


def _aggregation_for_backend(backend, name, device, input_dtype, mode, action_mask, cu_seqlens,
                             rollout_ids, token_weights, global_tokens, global_sequences,
                             norm_constant, validate):
    """The backend choice and the loss aggregation shared by ``ppo_loss`` and ``value_loss``:
    ``(triton, weights, token_mean, count_override, scale)``; ``scale`` only for the torch path."""
    triton = _resolve_backend(backend, device, input_dtype, name) == "triton"
    compute_dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    weights, token_mean, count_override = _aggregation(
        mode, action_mask, cu_seqlens, rollout_ids, token_weights, global_tokens, global_sequences,
        norm_constant, validate, triton, compute_dtype)
    scale = None if triton else _torch_scale(token_mean, count_override, action_mask, compute_dtype)
    return triton, weights, token_mean, count_override, scale


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    rollout_ids: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_sequences: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped PPO policy loss over a packed batch.

    Per action token: ``ratio = exp(clamp(logp - old, -20, 20))``,
    ``pg = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))``, with ``dual_clip``
    ``c > 1`` and ``A < 0``: ``pg = min(pg, -A * c)``; with ``rollout_logprobs``:
    ``pg *= min(exp(old - rollout), tis_cap)`` (truncated importance weight, a constant);
    ``l = pg + kl_coef * KL(logp, ref) - entropy_coef * entropy``;
    ``loss = sum_t w_t * l_t`` over action tokens.

    Args:
        logprobs: ``[T]`` float, differentiable (the gradient flows only into it and into
            ``entropy``); old_logprobs, advantages, ref_logprobs, rollout_logprobs: ``[T]``
            constants. entropy: ``[T]`` (may require grad).
        action_mask: ``[T]`` bool; non-action tokens get exactly zero gradient and their values
            are never read into the loss (NaN there is harmless).
        token_weights: ``[T]`` float weights (``loss_weights`` of the global batch, sliced);
            when None the weights of ``loss_agg_mode`` for this batch (see ``loss_weights``;
            ``cu_seqlens``, ``rollout_ids``, ``norm_constant``, ``global_tokens``,
            ``global_sequences`` as there).
        clip_low, clip_high: >= 0 (asymmetric clip: DAPO's clip-higher).
        dual_clip: None or ``c > 1``.
        kl_estimator: ``k1`` (``logp - ref``), ``k2`` (``(logp - ref)^2 / 2``), ``k3``
            (``exp(ref - logp) - (ref - logp) - 1``, log ratio clamped to +-20 and the result to
            +-10, as verl does). KL and entropy use the same weights as the policy term.
        tis_cap: > 0, required with ``rollout_logprobs``.
        backend: ``auto`` (Triton on CUDA or with TRITON_INTERPRET=1, else torch; float64
            ``logprobs`` always torch), ``torch``, ``triton`` (its kernels compute in float32:
            float64 ``logprobs`` raise ``ValueError``; other float64 inputs are rounded to
            float32, as the torch path does for float32 ``logprobs``).
        validate: check ``cu_seqlens`` values when the weights are computed from it (one sync).

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-d float32 tensor (float64, computed in float64, for
        float64 ``logprobs``); ``metrics`` 0-d tensors (no host sync): ``pg_loss``, ``kl_loss``,
        ``entropy_loss`` (the weighted parts of the loss), ``action_tokens``, and over the
        batch's action tokens the means ``pg_clipfrac_upper`` (A > 0, ratio > 1 + clip_high),
        ``pg_clipfrac_lower`` (A < 0, ratio < 1 - clip_low), ``pg_clipfrac_dual`` (dual clip
        active), ``approx_kl`` (``old - logp``), ``ratio_mean``, ``kl_mean``, ``entropy_mean``,
        and ``ratio_max``.
    """
    mode, norm_constant, global_tokens, global_sequences = _check_common(
        "logprobs", logprobs, action_mask, cu_seqlens, rollout_ids, token_weights, loss_agg_mode,
        global_tokens, global_sequences, norm_constant)
    num_tokens, device = logprobs.shape[0], logprobs.device
    _check_per_token("logprobs", logprobs, num_tokens, device)
    _check_per_token("old_logprobs", old_logprobs, num_tokens, device)
    _check_per_token("advantages", advantages, num_tokens, device)
    _check_per_token("ref_logprobs", ref_logprobs, num_tokens, device, optional=True)
    _check_per_token("entropy", entropy, num_tokens, device, optional=True)
    _check_per_token("rollout_logprobs", rollout_logprobs, num_tokens, device, optional=True)
    clip_low, clip_high = require_real("clip_low", clip_low), require_real("clip_high", clip_high)
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1) (the ratio is clipped at 1 - clip_low), got {clip_low}")
    if not (clip_high >= 0 and math.isfinite(clip_high)):
        raise ValueError(f"clip_high must be >= 0 and finite, got {clip_high}")
    if dual_clip is not None:
        dual_clip = require_real("dual_clip", dual_clip)
        if not (dual_clip > 1 and math.isfinite(dual_clip)):
            raise ValueError(f"dual_clip must be None or a finite c > 1 (e.g. 3.0), got {dual_clip}")
    kl_coef, entropy_coef = require_real("kl_coef", kl_coef), require_real("entropy_coef", entropy_coef)
    for name, value in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {kl_estimator!r}")
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef = {kl_coef} needs ref_logprobs ([T], the reference policy's "
                         "log-probs); pass ref_logprobs or kl_coef=0")
    if rollout_logprobs is not None:
        if tis_cap is None:
            raise ValueError("rollout_logprobs needs tis_cap (the truncation of the importance "
                             "weight exp(old - rollout), e.g. 2.0); pass tis_cap=...")
        tis_cap = require_real("tis_cap", tis_cap)
        if not tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    elif tis_cap is not None:
        tis_cap = require_real("tis_cap", tis_cap)
    triton, weights, token_mean, count_override, scale = _aggregation_for_backend(
        backend, "logprobs", device, logprobs.dtype, mode, action_mask, cu_seqlens, rollout_ids,
        token_weights, global_tokens, global_sequences, norm_constant, validate)
    if not triton:
        params = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                      ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator,
                      entropy=entropy, entropy_coef=entropy_coef, rollout_logprobs=rollout_logprobs,
                      tis_cap=tis_cap)
        return _ppo_loss_torch(logprobs, old_logprobs, advantages, action_mask, weights, scale, params)

    def prepared(x, dtypes=TRITON_DTYPES):
        if x is None:
            return None
        return (x if x.dtype in dtypes else x.float()).contiguous()

    grad_enabled = torch.is_grad_enabled()
    metrics, _, _ = _ppo_loss_forward(
        prepared(logprobs), prepared(old_logprobs), prepared(advantages, (torch.float32,)),
        action_mask.contiguous(), prepared(weights, (torch.float32,)),
        prepared(ref_logprobs),
        None if entropy is None else prepared(entropy), prepared(rollout_logprobs),
        clip_low, clip_high, 0.0 if dual_clip is None else dual_clip, kl_coef,
        0 if ref_logprobs is None else 1 + KL_ESTIMATORS.index(kl_estimator), entropy_coef,
        1.0 if tis_cap is None else tis_cap, token_mean, count_override,
        grad_enabled and logprobs.requires_grad,
        grad_enabled and entropy is not None and entropy.requires_grad)
    loss = metrics[0]
    values = metrics.detach()
    return loss, {name_: values[i] for i, name_ in enumerate(PPO_METRICS) if name_ != "loss"}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    rollout_ids: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_sequences: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``sum_t w_t * 0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old +
    clip) - R)^2)`` over action tokens (``clip`` None: no clipping); weights as in ``ppo_loss``.

    Args:
        values: ``[T]`` float, differentiable; old_values, returns: ``[T]`` constants.
        clip: None or > 0.
        backend: as in ``ppo_loss``, with ``values`` in the role of ``logprobs`` (float64
            ``values`` run on the torch path in float64; ``triton`` refuses them).

    Returns:
        ``(loss, metrics)``: ``vf_clipfrac`` (fraction of action tokens whose clipped term is
        the larger), ``vf_mse`` (mean ``(v - R)^2``), ``action_tokens``; 0-d tensors.
    """
    mode, norm_constant, global_tokens, global_sequences = _check_common(
        "values", values, action_mask, cu_seqlens, rollout_ids, token_weights, loss_agg_mode,
        global_tokens, global_sequences, norm_constant)
    num_tokens, device = values.shape[0], values.device
    _check_per_token("values", values, num_tokens, device, reference="values")
    _check_per_token("old_values", old_values, num_tokens, device, reference="values")
    _check_per_token("returns", returns, num_tokens, device, reference="values")
    if clip is not None:
        clip = require_real("clip", clip)
        if not (clip > 0 and math.isfinite(clip)):
            raise ValueError(f"clip must be None or a finite value > 0 (e.g. 0.2), got {clip}")
    triton, weights, token_mean, count_override, scale = _aggregation_for_backend(
        backend, "values", device, values.dtype, mode, action_mask, cu_seqlens, rollout_ids,
        token_weights, global_tokens, global_sequences, norm_constant, validate)
    if not triton:
        return _value_loss_torch(values, old_values, returns, action_mask, weights, scale, clip)

    def prepared(x, dtypes=TRITON_DTYPES):
        return (x if x.dtype in dtypes else x.float()).contiguous()

    metrics, _ = _value_loss_forward(
        prepared(values), prepared(old_values), prepared(returns, (torch.float32,)),
        action_mask.contiguous(), None if weights is None else prepared(weights, (torch.float32,)),
        0.0 if clip is None else clip, token_mean, count_override,
        torch.is_grad_enabled() and values.requires_grad)
    detached = metrics.detach()
    return metrics[0], {n: detached[i] for i, n in enumerate(VALUE_METRICS) if n != "loss"}
