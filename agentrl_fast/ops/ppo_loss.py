"""Token-level PPO loss, its per-token loss weights and the value loss (docs/design.md,
"Token-level PPO loss").

- ``loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant) -> w[T]``: the
  aggregation of every ``loss_agg_mode`` as one weight per token, computed once for the global
  batch and sliced with the tokens into micro-batches (any split then accumulates to exactly the
  full-batch gradient).
- ``ppo_loss(...) -> (loss, metrics)`` and ``value_loss(...) -> (loss, metrics)``:
  ``loss = sum_t w_t * l_t`` over action tokens.

This module holds the public functions and the backend choice; the argument checks are in
``_loss_checks``, the weights in ``_loss_aggregation``. Backends: plain torch (autograd,
``_ppo_loss_torch``) for CPU tensors; the Triton kernels of ``agentrl_fast/kernels/ppo_loss.py``
(``_ppo_loss_triton``) for CUDA tensors and for CPU tensors when ``TRITON_INTERPRET=1`` (the
interpreter tests), declared as ``torch.library.custom_op`` s with fakes so ``torch.compile``
traces them. The kernels compute in float32, so float64 ``logprobs`` / ``values`` always take
the torch path (which computes in float64): ``auto`` routes them there and ``triton`` refuses
them. No op syncs with the host: metrics are 0-d tensors (except for ``validate=True``, which
checks ``cu_seqlens`` values with one sync when cu_seqlens is used).
"""

from __future__ import annotations

import os

import torch

from agentrl_fast.ops._checks import require_tensor, validate_cu_seqlens
from agentrl_fast.ops._loss_aggregation import aggregation, compute_loss_weights, torch_scale
from agentrl_fast.ops._loss_checks import (KL_ESTIMATORS, LOSS_AGG_MODES, check_aggregation,
                                           check_count, check_mask, check_mode, check_per_token,
                                           check_ppo_options, check_ppo_tensors, check_structure,
                                           check_value_clip)
from agentrl_fast.ops._ppo_loss_torch import ppo_loss_torch, value_loss_torch
from agentrl_fast.ops._ppo_loss_triton import (PPO_METRICS, VALUE_METRICS, launch_ppo_loss_forward,
                                               launch_scale_gradient, launch_value_loss_forward,
                                               ppo_loss_triton, value_loss_triton)

__all__ = ["BACKENDS", "KL_ESTIMATORS", "LOSS_AGG_MODES", "PPO_METRICS", "VALUE_METRICS",
           "launch_ppo_loss_forward", "launch_scale_gradient", "launch_value_loss_forward",
           "loss_weights", "ppo_loss", "value_loss"]

BACKENDS = ("auto", "torch", "triton")


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
        raise ValueError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got "
                         f"{device}; use backend='torch' or 'auto'")
    if backend == "triton" and dtype == torch.float64:
        raise ValueError(f"{name} is float64, but backend 'triton' computes in float32; use "
                         "backend='auto' or 'torch' (float64 runs in float64 there) or pass "
                         f"{name}.float()")
    return backend


def _aggregation_for_backend(backend, name, device, input_dtype, mode, action_mask, cu_seqlens,
                             rollout_ids, token_weights, global_tokens, global_sequences,
                             norm_constant, validate):
    """The backend choice and the loss aggregation shared by ``ppo_loss`` and ``value_loss``:
    ``(triton, weights, token_mean, count_override, scale)``; ``scale`` only for the torch path."""
    triton = _resolve_backend(backend, device, input_dtype, name) == "triton"
    compute_dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    weights, token_mean, count_override = aggregation(
        mode, action_mask, cu_seqlens, rollout_ids, token_weights, global_tokens, global_sequences,
        norm_constant, validate, triton, compute_dtype)
    scale = None if triton else torch_scale(token_mean, count_override, action_mask, compute_dtype)
    return triton, weights, token_mean, count_override, scale


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
    mode = check_mode(mode)
    require_tensor("action_mask", action_mask)
    if action_mask.dim() != 1:
        raise ValueError(f"action_mask must be 1-D [T], got shape {tuple(action_mask.shape)}")
    check_mask(action_mask, action_mask.shape[0], action_mask.device)
    norm_constant = check_structure(mode, action_mask, cu_seqlens, rollout_ids, norm_constant,
                                    action_mask.device)
    global_tokens = check_count("global_tokens", global_tokens)
    global_sequences = check_count("global_sequences", global_sequences)
    if validate and cu_seqlens is not None and mode not in ("token-mean", "token-sum"):
        cu_seqlens = validate_cu_seqlens(cu_seqlens, action_mask.shape[0], -1)
    return compute_loss_weights(mode, action_mask, cu_seqlens, rollout_ids, norm_constant,
                                global_tokens, global_sequences)


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
    mode, norm_constant, global_tokens, global_sequences = check_aggregation(
        "logprobs", logprobs, action_mask, cu_seqlens, rollout_ids, token_weights, loss_agg_mode,
        global_tokens, global_sequences, norm_constant)
    check_ppo_tensors(logprobs, old_logprobs, advantages, ref_logprobs, entropy, rollout_logprobs)
    options = check_ppo_options(clip_low, clip_high, dual_clip, kl_coef, kl_estimator,
                                entropy_coef, tis_cap, has_ref=ref_logprobs is not None,
                                has_rollout=rollout_logprobs is not None)
    triton, weights, token_mean, count_override, scale = _aggregation_for_backend(
        backend, "logprobs", logprobs.device, logprobs.dtype, mode, action_mask, cu_seqlens,
        rollout_ids, token_weights, global_tokens, global_sequences, norm_constant, validate)
    if triton:
        return ppo_loss_triton(logprobs, old_logprobs, advantages, action_mask, weights,
                               token_mean, count_override, options, ref_logprobs, entropy,
                               rollout_logprobs)
    return ppo_loss_torch(logprobs, old_logprobs, advantages, action_mask, weights, scale, options,
                          ref_logprobs, entropy, rollout_logprobs)


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
    mode, norm_constant, global_tokens, global_sequences = check_aggregation(
        "values", values, action_mask, cu_seqlens, rollout_ids, token_weights, loss_agg_mode,
        global_tokens, global_sequences, norm_constant)
    num_tokens, device = values.shape[0], values.device
    check_per_token("values", values, num_tokens, device, reference="values")
    check_per_token("old_values", old_values, num_tokens, device, reference="values")
    check_per_token("returns", returns, num_tokens, device, reference="values")
    clip = check_value_clip(clip)
    triton, weights, token_mean, count_override, scale = _aggregation_for_backend(
        backend, "values", device, values.dtype, mode, action_mask, cu_seqlens, rollout_ids,
        token_weights, global_tokens, global_sequences, norm_constant, validate)
    if triton:
        return value_loss_triton(values, old_values, returns, action_mask, weights, clip,
                                 token_mean, count_override)
    return value_loss_torch(values, old_values, returns, action_mask, weights, scale, clip)
