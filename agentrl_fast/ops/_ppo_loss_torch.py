"""The torch path of ``ppo_loss`` and ``value_loss``: the same math as the Triton kernels with
torch autograd, in float32 (float64 for float64 ``logprobs`` / ``values``). Arguments are
checked by the caller."""

from __future__ import annotations

import torch

from agentrl_fast.ops._loss_checks import PPOOptions

_RATIO_LOG_CLAMP = 20.0
_KL_CLAMP = 10.0


def _kl(logp, ref, estimator: str):
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    log_ratio = torch.clamp(ref - logp, -_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -_KL_CLAMP, _KL_CLAMP)


def ppo_loss_torch(logprobs, old_logprobs, advantages, action_mask, weights, scale,
                   options: PPOOptions, ref_logprobs, entropy, rollout_logprobs):
    """``(loss, metrics)`` with torch autograd: ``weights`` [T] (0 off actions) or None (ones,
    then times ``scale``, a 0-d tensor)."""
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    act = action_mask

    def clean(x):  # exactly 0 gradient (and no NaN) on non-action tokens
        return None if x is None else torch.where(act, x.to(dtype), 0)

    logp, old, adv = clean(logprobs), clean(old_logprobs).detach(), clean(advantages).detach()
    w = act.to(dtype) if weights is None else clean(weights).detach()
    ratio = torch.exp(torch.clamp(logp - old, -_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP))
    low, high = 1 - options.clip_low, 1 + options.clip_high
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
    clip_dual = torch.zeros_like(act)
    if options.dual_clip is not None:
        pg3 = -adv * options.dual_clip
        clip_dual = act & (adv < 0) & (pg3 < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    if rollout_logprobs is not None:
        rollout = clean(rollout_logprobs).detach()
        tis = torch.clamp(torch.exp(torch.clamp(old - rollout, max=_RATIO_LOG_CLAMP)),
                          max=options.tis_cap)
        pg = pg * tis
    zero = logp.new_zeros(())
    term = pg
    kl = None
    if ref_logprobs is not None:
        kl = torch.where(act, _kl(logp, clean(ref_logprobs).detach(), options.kl_estimator), 0)
        term = term + options.kl_coef * kl
    if entropy is not None:
        entropy = clean(entropy)
        term = term - options.entropy_coef * entropy
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


def value_loss_torch(values, old_values, returns, action_mask, weights, scale, clip):
    """``(loss, metrics)`` with torch autograd; ``weights`` and ``scale`` as in
    ``ppo_loss_torch``, ``clip`` None or > 0."""
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
