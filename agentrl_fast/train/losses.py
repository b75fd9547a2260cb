"""Policy losses, chosen by ``train.policy_loss`` from the registry :data:`POLICY_LOSSES`
(``"ppo"`` built in; GRPO trains with it too, on its own advantages). A policy loss is a function

    loss(logprobs: [t], entropy: [t], micro: MicroBatch, ctx: StepContext) -> (loss, metrics)

over one micro-batch: ``logprobs`` and ``entropy`` of the current policy (with gradients),
``micro`` the step's per-token tensors for these tokens (``old_logprobs``, ``advantages``,
``ref_logprobs`` or None, ``weights``: the mini-batch's loss weights, which make the sum over
micro-batches and ranks the mini-batch's loss; ``action_mask``; ``packed.rollout_logprobs``),
``ctx`` the run's config and this step's ``kl_coef``. It returns the micro-batch's share of
the loss (a scalar) and a dict of metrics: the update averages ``approx_kl``,
``entropy_mean`` and ``pg_clipfrac_upper`` + ``pg_clipfrac_lower`` over action tokens and
takes the maximum of ``ratio_max``, where present. Register your own with
``@register_policy_loss("name")``."""

from __future__ import annotations

import torch

from agentrl_fast.ops import ppo_loss
from agentrl_fast.train.context import StepContext
from agentrl_fast.train.registry import Registry
from agentrl_fast.train.step_batch import MicroBatch

POLICY_LOSSES = Registry("train.policy_loss")
register_policy_loss = POLICY_LOSSES.register


@register_policy_loss("ppo")
def ppo_policy_loss(logprobs: torch.Tensor, entropy: torch.Tensor, micro: MicroBatch,
                    ctx: StepContext) -> tuple[torch.Tensor, dict]:
    """Token-level clipped PPO (``ppo_loss``): asymmetric clip, optional dual clip, the KL to
    the reference in the loss (``kl_mode="loss"``), an entropy bonus and the truncated
    importance weight of asynchronous training (``tis_cap``)."""
    config = ctx.config
    use_ref = micro.ref_logprobs is not None and config.kl_mode == "loss"
    return ppo_loss(
        logprobs, micro.old_logprobs, micro.advantages, micro.action_mask,
        token_weights=micro.weights, clip_low=config.clip_low, clip_high=config.clip_high,
        dual_clip=config.dual_clip, ref_logprobs=micro.ref_logprobs if use_ref else None,
        kl_coef=ctx.kl_coef if use_ref else 0.0, kl_estimator=config.kl_estimator,
        entropy=entropy, entropy_coef=config.entropy_coef,
        rollout_logprobs=micro.packed.rollout_logprobs if config.tis_cap else None,
        tis_cap=config.tis_cap)
