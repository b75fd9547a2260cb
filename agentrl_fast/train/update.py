"""The updates of a step: K epochs over seeded mini-batches of whole rollouts; per mini-batch
the policy's optimizer step over its micro-batches (``ppo_loss``, and with a shared head
``value_loss``, in one backward) and the separate critic's (``value_loss``), with the loss
weights of the mini-batch; then the adaptive KL coefficient."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from agentrl_fast.models.critic import critic_values, policy_logprobs
from agentrl_fast.ops import loss_weights, ppo_loss, value_loss
from agentrl_fast.seeds import derive_seed
from agentrl_fast.train.distributed import World, empty_batch, gradient_sync
from agentrl_fast.train.models import Models
from agentrl_fast.train.overlap import CriticOverlap
from agentrl_fast.train.packing import pack_sub_traces


@dataclass
class UpdateContext:
    """What every micro-batch of an update needs: the config (a TrainConfig), the models'
    device, the sampling temperature, this step's KL coefficient, the world (None: one
    process) and ``plan(sub_traces, indices)``: this rank's micro-batches (None: an empty one)."""

    config: object
    device: torch.device
    temperature: float
    kl_coef: float
    world: World | None
    plan: Callable


def mini_batches(num_rollouts: int, count: int, seed: int, step: int, epoch: int
                 ) -> list[list[int]]:
    """``count`` mini-batches of rollout positions ``0..num_rollouts-1`` in a seeded order."""
    order = torch.randperm(num_rollouts, generator=torch.Generator().manual_seed(
        derive_seed(seed, "minibatch", step, epoch))).tolist()
    size = math.ceil(num_rollouts / count)
    return [order[i:i + size] for i in range(0, num_rollouts, size)]


def update_epochs(models: Models, policy_optimizer, critic_optimizer, ctx: UpdateContext,
                  sub_traces, rollout_index, old, ref, values, advantages, returns, *,
                  step: int, overlap: CriticOverlap) -> dict[str, float]:
    """The step's updates: ``epochs`` (policy) and ``critic_epochs`` (critic) passes over
    mini-batches of whole rollouts, the critic's beside the policy's. The policy is not
    trained before ``critic_warmup_steps`` (a shared head still is). Returns the metrics
    averaged over the updates, ``ratio_max`` the maximum."""
    config = ctx.config
    by_rollout: dict[int, list[int]] = {}
    for i, s in enumerate(sub_traces):
        by_rollout.setdefault(rollout_index[s.rollout_id], []).append(i)
    rollouts = sorted(by_rollout)
    train_policy = step >= config.critic_warmup_steps
    critic_epochs = config.critic_epochs if config.critic_epochs is not None else config.epochs
    policy_totals: Counter = Counter()
    critic_totals: Counter = Counter()
    policy_updates, critic_updates, ratio_max = 0, 0, None
    for epoch in range(max(config.epochs, critic_epochs if models.critic is not None else 0)):
        for group in mini_batches(len(rollouts), config.mini_batches, config.seed, step, epoch):
            indices = sorted(i for r in group for i in by_rollout[rollouts[r]])
            if not any(sub_traces[i].num_action_tokens for i in indices):
                continue
            run_policy = epoch < config.epochs
            run_critic = models.critic is not None and epoch < critic_epochs
            with overlap.beside(run_policy and run_critic) as beside:
                critic_job = beside(critic_update, models.critic, critic_optimizer, ctx,
                                    sub_traces, indices, rollout_index, values,
                                    returns) if run_critic else None
                policy_metrics = None
                if run_policy and models.value_head is not None:  # one backward for both
                    policy_metrics = policy_update(models, policy_optimizer, ctx, sub_traces,
                                                   indices, rollout_index, old, ref, advantages,
                                                   values, returns, train_policy)
                elif run_policy and train_policy:
                    policy_metrics = policy_update(models, policy_optimizer, ctx, sub_traces,
                                                   indices, rollout_index, old, ref, advantages)
                critic_metrics = critic_job() if critic_job is not None else None
            policy_updates += run_policy
            if policy_metrics is not None:
                ratio = policy_metrics.pop("ratio_max")
                ratio_max = ratio if ratio_max is None else max(ratio_max, ratio)
                policy_totals.update(policy_metrics)
            if critic_metrics is not None:
                critic_totals.update(critic_metrics)
                critic_updates += 1
    out = {key: value / max(policy_updates, 1) for key, value in policy_totals.items()}
    out.update({key: value / max(critic_updates, 1) for key, value in critic_totals.items()})
    if ratio_max is not None:
        out["ratio_max"] = ratio_max
    return out


def on_device(sub_traces, group, rollout_index, device: torch.device):
    """A micro-batch on the models' device, and ``pick``: per-sub-trace tensors of the
    global batch (on the CPU) -> ``[T]`` on that device."""
    batch = pack_sub_traces(sub_traces, group, rollout_index).to(device)
    return batch, lambda per_sequence: batch.gather(per_sequence).to(device)


def _total_norm(norm) -> float:
    """``clip_grad_norm_``'s result as a float (a DTensor under FSDP2)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def batch_weights(config, sub_traces, indices, rollout_index) -> dict[int, torch.Tensor]:
    """``loss_weights`` of the mini-batch, split per sub-trace."""
    whole = pack_sub_traces(sub_traces, indices, rollout_index)
    weights = loss_weights(config.loss_aggregation, whole.action_mask, whole.cu_seqlens,
                           whole.rollout_index, config.loss_norm_constant)
    return dict(zip(indices, whole.split(weights)))


def policy_update(models: Models, optimizer, ctx: UpdateContext, sub_traces, indices,
                  rollout_index, old, ref, advantages, values=None, returns=None,
                  train_policy=True) -> Counter:
    """One optimizer step of the policy (and, when shared, of the value head: the loss is
    ``pg + value_coef * value loss``, the pg term dropped during critic warmup)."""
    config = ctx.config
    models.policy.train()
    weights = batch_weights(config, sub_traces, indices, rollout_index)
    optimizer.zero_grad(set_to_none=True)
    totals: Counter = Counter()
    plan = ctx.plan(sub_traces, indices)
    for position, group in enumerate(plan):
        with gradient_sync(models.policy, ctx.world, last=position == len(plan) - 1):
            if group is None:  # an empty micro-batch: collectives only, zero gradient
                policy_logprobs(models.policy, *empty_batch(ctx.device),
                                temperature=ctx.temperature).sum().mul(0.0).backward()
                continue
            policy_micro_batch(models, ctx, sub_traces, group, rollout_index, old, ref,
                               advantages, weights, values, returns, train_policy, totals)
    if ctx.world is not None:
        totals = ctx.world.summed(totals, maxima=("_ratio_max",))
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    norm = _total_norm(torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm))
    optimizer.step()
    tokens = max(totals.pop("_action_tokens"), 1)
    out = Counter({"policy_loss": totals["policy_loss"], "policy_grad_norm": norm,
                   "ratio_max": totals["_ratio_max"]})
    for key in ("clipfrac", "approx_kl", "entropy"):
        if f"_{key}" in totals:
            out[key] = totals[f"_{key}"] / tokens
    if models.value_head is not None:
        out["value_loss"] = totals["value_loss"]
        out["value_clipfrac"] = totals["_value_clipfrac"] / tokens
    return out


def policy_micro_batch(models: Models, ctx: UpdateContext, sub_traces, group, rollout_index, old,
                       ref, advantages, weights, values, returns, train_policy,
                       totals: Counter) -> None:
    config = ctx.config
    batch, pick = on_device(sub_traces, group, rollout_index, ctx.device)
    shared = models.value_head is not None
    logp, entropy, *hidden = policy_logprobs(
        models.policy, batch.input_ids, batch.position_ids, batch.cu_seqlens,
        batch.max_seqlen, temperature=ctx.temperature, return_entropy=True,
        return_hidden=shared, token_mask=batch.action_mask)
    use_ref = models.reference is not None and config.kl_mode == "loss"
    loss, metrics = ppo_loss(
        logp, pick(old), pick(advantages), batch.action_mask,
        token_weights=pick(weights), clip_low=config.clip_low, clip_high=config.clip_high,
        dual_clip=config.dual_clip, ref_logprobs=pick(ref) if use_ref else None,
        kl_coef=ctx.kl_coef if use_ref else 0.0, kl_estimator=config.kl_estimator,
        entropy=entropy, entropy_coef=config.entropy_coef,
        rollout_logprobs=batch.rollout_logprobs if config.tis_cap else None,
        tis_cap=config.tis_cap)
    total = loss if train_policy else loss * 0.0
    if ctx.world is not None:  # the reduction averages over ranks; the loss is a sum
        total = total * ctx.world.size
    if shared:
        v, _ = models.value_head(hidden[0], batch.cu_seqlens)
        vloss, vmetrics = value_loss(v, pick(values), pick(returns), batch.action_mask,
                                     clip=config.value_clip, token_weights=pick(weights))
        total = total + config.value_coef * vloss
        totals["value_loss"] += vloss.item()
        totals["_value_clipfrac"] += float(vmetrics["vf_clipfrac"]) * batch.action_mask.sum().item()
    total.backward()
    share = batch.action_mask.sum().item()
    totals["policy_loss"] += loss.item()
    per_token = {"clipfrac": metrics["pg_clipfrac_upper"] + metrics["pg_clipfrac_lower"],
                 "approx_kl": metrics["approx_kl"], "entropy": metrics["entropy_mean"]}
    for key, value in per_token.items():
        totals[f"_{key}"] += float(value) * share
    totals["_ratio_max"] = max(totals["_ratio_max"], float(metrics["ratio_max"]))
    totals["_action_tokens"] += share


def critic_update(critic, optimizer, ctx: UpdateContext, sub_traces, indices, rollout_index,
                  values, returns) -> Counter:
    config = ctx.config
    critic.train()
    weights = batch_weights(config, sub_traces, indices, rollout_index)
    optimizer.zero_grad(set_to_none=True)
    totals = Counter(loss=0.0, clipped=0.0, tokens=0.0)
    plan = ctx.plan(sub_traces, indices)
    for position, group in enumerate(plan):
        with gradient_sync(critic, ctx.world, last=position == len(plan) - 1):
            if group is None:  # an empty micro-batch: collectives only, zero gradient
                critic_values(critic, *empty_batch(ctx.device))[0].sum().mul(0.0).backward()
                continue
            batch, pick = on_device(sub_traces, group, rollout_index, ctx.device)
            v, _ = critic_values(critic, batch.input_ids, batch.position_ids,
                                 batch.cu_seqlens, batch.max_seqlen)
            loss, metrics = value_loss(v, pick(values), pick(returns), batch.action_mask,
                                       clip=config.value_clip, token_weights=pick(weights))
            (loss * (ctx.world.size if ctx.world is not None else 1)).backward()
            share = int(batch.action_mask.sum())
            totals["loss"] += loss.item()
            totals["clipped"] += float(metrics["vf_clipfrac"]) * share
            totals["tokens"] += share
    if ctx.world is not None:
        totals = ctx.world.summed(totals)
    norm = _total_norm(torch.nn.utils.clip_grad_norm_(critic.parameters(),
                                                      config.max_grad_norm))
    optimizer.step()
    return Counter({"value_loss": totals["loss"],
                    "value_clipfrac": totals["clipped"] / max(totals["tokens"], 1),
                    "critic_grad_norm": norm})


def adapted_kl_coef(kl_coef: float, kl: float | None, episodes: int, config) -> float:
    """Adaptive KL coefficient (Ziegler et al.): move towards ``kl_target``, by the batch's
    number of episodes over ``kl_horizon``."""
    if config.kl_target is None or kl is None or kl_coef == 0:
        return kl_coef
    error = max(min(kl / config.kl_target - 1.0, 0.2), -0.2)
    return kl_coef * (1.0 + error * episodes / config.kl_horizon)
