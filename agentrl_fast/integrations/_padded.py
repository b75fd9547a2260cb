"""verl's padded ``[B, L]`` layout mapped onto our packed ops, with verl's numbers as the target.

verl passes every per-token tensor as ``[B, L]`` rows (one response per row, right-padded) with a
``response_mask`` that is 0 on padding and, in multi-turn rollouts, on tool-response tokens
inside the row (holes). The rows laid end to end are our packed layout with
``cu_seqlens = [0, L, 2L, ..., B*L]`` and ``action_mask = response_mask``: no copy, no loop over
rows. These functions import nothing from verl (they are testable without it); what verl does
and we reproduce is said at each one.
"""

from __future__ import annotations

import torch

from agentrl_fast.ops import gae_padded, loss_weights, ppo_loss

VERL_LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                       "seq-mean-token-sum-norm")
"""Every ``loss_agg_mode`` of verl 0.9.1's ``core_algos.agg_loss``."""


def _bool_mask(name: str, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != like.shape or like.dim() != 2:
        raise ValueError(f"{name} must be [B, L] like the per-token tensors "
                         f"{tuple(like.shape)}, got {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def carry_back(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: at every position, the advantage of the first action token at or after it in
    its row (0 after a row's last one). verl's loop leaves exactly these carried-over values on
    non-action tokens; its returns and whitening see them."""
    length = mask.shape[1]
    # int32 positions: the reverse running minimum is the costly pass, and half the bytes.
    positions = torch.arange(length, dtype=torch.int32, device=mask.device)
    next_action = torch.where(mask, positions, length).flip(-1).cummin(-1).values.flip(-1)
    padded = torch.nn.functional.pad(advantages, (0, 1))  # column L: 0, for "no action after"
    return padded.gather(-1, next_action.long())


def whiten_like_verl(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """verl's ``masked_whiten``: mean and unbiased variance over the action tokens, applied to
    every position (non-action ones included). With fewer than two action tokens, where verl
    raises, the variance is taken as 0 (our ``whiten``'s rule). Like verl's, it syncs with the
    host (the count of action tokens)."""
    selected = values[mask]
    if selected.numel() > 1:
        variance, mean = torch.var_mean(selected)
    else:
        mean = selected.sum()
        variance = torch.zeros_like(mean)
    return (values - mean) * torch.rsqrt(variance + eps)


def gae_like_verl(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``compute_gae_advantage_return`` on our GAE kernel: ``(advantages, returns)``,
    each ``[B, L]`` in the dtype verl's would have.

    verl steps only over action tokens (values and TD errors on other tokens are skipped and its
    rewards there ignored: we zero them, our op would reject them), carries the next action
    token's advantage over non-action tokens, returns ``A + V`` everywhere and whitens the
    advantages over the action tokens. The recurrence runs in ``gae_padded`` (the packed kernel
    on the rows laid end to end); the rest is elementwise.
    """
    mask = _bool_mask("response_mask", response_mask, token_level_rewards)
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"values must be [B, L] like token_level_rewards "
                         f"{tuple(token_level_rewards.shape)}, got {tuple(values.shape)}")
    out_dtype = torch.result_type(token_level_rewards, values)
    rewards = torch.where(mask, token_level_rewards, 0)
    advantages, _ = gae_padded(rewards, values, mask, gamma=float(gamma), lam=float(lam))
    advantages = carry_back(advantages, mask)
    returns = advantages + values.to(advantages.dtype)
    advantages = whiten_like_verl(advantages, mask)
    return advantages.to(out_dtype), returns.to(out_dtype)


def _count(name: str, value):
    """A global count from verl's ``global_batch_info`` as a number or 0-d tensor (or None)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"global_batch_info[{name!r}] must hold one number, got shape "
                             f"{tuple(value.shape)}")
        return value.reshape(())
    return value


def verl_token_weights(
    mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """``w[B*L]`` with ``sum_t w_t * l_t`` equal to verl's ``agg_loss(l, mask, mode, ...)``.

    ``mask``: ``[B, L]`` bool. The keywords are verl's ``config.global_batch_info``: global
    token / sequence counts replace the micro-batch's own, and every mode is multiplied by
    ``dp_size`` (verl's FSDP averages gradients over ranks). seq-mean-token-sum-norm divides by
    ``loss_scale_factor``, or by ``L`` (the padded horizon) when it is None, as verl does.
    """
    if loss_agg_mode not in VERL_LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of verl's {', '.join(VERL_LOSS_AGG_MODES)}, "
                         f"got {loss_agg_mode!r}")
    rows, length = mask.shape
    batch_num_tokens = _count("batch_num_tokens", batch_num_tokens)
    global_batch_size = _count("global_batch_size", global_batch_size)
    if dp_size > 1 and loss_agg_mode == "token-mean" and batch_num_tokens is None:
        raise ValueError("global_batch_info['batch_num_tokens'] is required when dp_size > 1")
    if dp_size > 1 and loss_agg_mode.startswith("seq-") and global_batch_size is None:
        raise ValueError("global_batch_info['global_batch_size'] is required when dp_size > 1")
    cu_seqlens = torch.arange(0, rows * length + 1, max(length, 1), dtype=torch.int32,
                              device=mask.device)[: rows + 1]
    norm = None
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = float(loss_scale_factor if loss_scale_factor is not None else max(length, 1))
    weights = loss_weights(loss_agg_mode, mask.reshape(-1), cu_seqlens, norm_constant=norm,
                           global_tokens=batch_num_tokens, global_sequences=global_batch_size,
                           validate=False)
    return weights * dp_size if dp_size != 1 else weights


def _option(config, name: str, default=None):
    """``config.name`` for verl's ActorConfig (a dataclass) and a DictConfig alike."""
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get"):
        value = config.get(name, None)
    return default if value is None else value


def clip_options(config) -> dict:
    """Our ``ppo_loss`` keywords from verl's actor config: ``clip_ratio_low``/``_high`` default
    to ``clip_ratio``; ``clip_ratio_c`` (default 3.0, as verl's) is the dual clip, always on."""
    if config is None:
        raise ValueError("config is required: verl's actor config (clip_ratio, clip_ratio_low, "
                         "clip_ratio_high, clip_ratio_c, global_batch_info)")
    clip = _option(config, "clip_ratio", 0.2)
    dual_clip = float(_option(config, "clip_ratio_c", 3.0))
    if not dual_clip > 1.0:
        raise ValueError(f"config.clip_ratio_c must be > 1 (dual-clip PPO), got {dual_clip}")
    return {"clip_low": float(_option(config, "clip_ratio_low", clip)),
            "clip_high": float(_option(config, "clip_ratio_high", clip)), "dual_clip": dual_clip}


def policy_loss_like_verl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``"vanilla"`` policy loss (``compute_policy_loss_vanilla``) on our ``ppo_loss``.

    All tensors ``[B, L]``; ``log_prob`` differentiable. The aggregation, ``dp_size`` and
    verl's rollout importance weights (``rollout_is_weights``, per token, constants) are folded
    into ``token_weights``. Returns ``(loss, metrics)`` with verl's metric keys
    (``actor/pg_clipfrac`` = both clip sides, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` =
    the dual clip), as Python floats like verl's.
    """
    mask = _bool_mask("response_mask", response_mask, log_prob)
    options = clip_options(config)
    batch_info = dict(_option(config, "global_batch_info", {}) or {})
    weights = verl_token_weights(mask, loss_agg_mode, **batch_info)
    if rollout_is_weights is not None:
        weights = weights * rollout_is_weights.detach().reshape(-1).to(weights.dtype)
    loss, metrics = ppo_loss(log_prob.reshape(-1), old_log_prob.reshape(-1),
                             advantages.reshape(-1), mask.reshape(-1), token_weights=weights,
                             **options)
    clipfrac = metrics["pg_clipfrac_upper"] + metrics["pg_clipfrac_lower"]
    return loss, {"actor/pg_clipfrac": clipfrac.item(),
                  "actor/ppo_kl": metrics["approx_kl"].item(),
                  "actor/pg_clipfrac_lower": metrics["pg_clipfrac_dual"].item()}
