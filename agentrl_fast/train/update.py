"""The updates of a step: K epochs over seeded mini-batches of whole rollouts; per mini-batch
the policy's optimizer step over its micro-batches (the configured policy loss,
:mod:`agentrl_fast.train.losses`, and with a shared head ``value_loss``, in one backward) and
the separate critic's (``value_loss``), with the loss weights of the mini-batch; then the
adaptive KL coefficient. Everything is read from the step's
:class:`~agentrl_fast.train.step_batch.StepBatch`."""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import torch

from agentrl_fast.models.critic import critic_values
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.ops import loss_weights, value_loss
from agentrl_fast.seeds import derive_seed
from agentrl_fast.train.context import StepContext
from agentrl_fast.train.distributed import empty_batch, gradient_sync
from agentrl_fast.train.losses import POLICY_LOSSES
from agentrl_fast.train.models import Models
from agentrl_fast.train.step_batch import MicroBatch, StepBatch


class Optimizers(NamedTuple):
    policy: torch.optim.Optimizer
    critic: torch.optim.Optimizer | None


class Sums:
    """A metric's sums over micro-batches (and ranks): plain sums (losses), sums weighted by
    action tokens (averaged per token at the end) and maxima."""

    def __init__(self):
        self.plain: Counter = Counter()
        self.per_token: Counter = Counter()
        self.maxima: dict[str, float] = {}
        self.tokens = 0.0

    def add_tokens(self, tokens: float, metrics: dict[str, float]) -> None:
        self.tokens += tokens
        for key, value in metrics.items():
            self.per_token[key] += float(value) * tokens

    def add_max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, 0.0), float(value))

    def reduced(self, world) -> Sums:
        """The sums over every rank (the same keys everywhere)."""
        if world is None:
            return self
        flat = Counter({**{f"plain {k}": v for k, v in self.plain.items()},
                        **{f"token {k}": v for k, v in self.per_token.items()},
                        **{f"max {k}": v for k, v in self.maxima.items()}, "tokens": self.tokens})
        flat = world.summed(flat, maxima=[k for k in flat if k.startswith("max ")])
        out = Sums()
        for key, value in flat.items():
            kind, _, name = key.partition(" ")
            if key == "tokens":
                out.tokens = value
            else:
                {"plain": out.plain, "token": out.per_token, "max": out.maxima}[kind][name] = value
        return out

    def averages(self, least_tokens: float = 1.0) -> dict[str, float]:
        tokens = max(self.tokens, least_tokens)
        return {**self.plain, **{k: v / tokens for k, v in self.per_token.items()},
                **self.maxima}


SHARED_KEYS = ("saved_tokens", "plain_tokens")  # shared layouts' saved / plain tokens


def count_shared(sums: Sums, micro: MicroBatch) -> None:
    """A shared layout's saved and plain tokens into ``sums`` (nothing without one)."""
    if micro.layout is not None:
        sums.plain["saved_tokens"] += micro.layout.saved_tokens
        sums.plain["plain_tokens"] += micro.layout.num_tokens


def mini_batches(num_rollouts: int, count: int, seed: int, step: int, epoch: int
                 ) -> list[list[int]]:
    """``count`` mini-batches of rollout positions ``0..num_rollouts-1`` in a seeded order."""
    order = torch.randperm(num_rollouts, generator=torch.Generator().manual_seed(
        derive_seed(seed, "minibatch", step, epoch))).tolist()
    size = math.ceil(num_rollouts / count)
    return [order[i:i + size] for i in range(0, num_rollouts, size)]


def mini_batch_units(batch: StepBatch, order: str) -> list[list[int]]:
    """What mini-batches are drawn from: the step's sub-trace numbers of each rollout
    (``"shuffle"``) or of each task (``"task"``)."""
    return batch.task_groups() if order == "task" else _by_rollout(batch)


def _by_rollout(batch: StepBatch) -> list[list[int]]:
    """The step's sub-trace numbers of each rollout, in rollout-number order."""
    members: dict[int, list[int]] = {}
    for i, rollout in enumerate(batch.rollout_index.tolist()):
        members.setdefault(rollout, []).append(i)
    return [members[r] for r in sorted(members)]


def update_epochs(models: Models, optimizers: Optimizers, ctx: StepContext,
                  batch: StepBatch) -> dict[str, float]:
    """The step's updates: ``epochs`` (policy) and ``critic_epochs`` (critic) passes over
    mini-batches of whole rollouts, the critic's beside the policy's. ``ctx.critic_only``
    (critic warm-up): the separate critic's passes alone, or a shared critic's value head in
    the policy's passes (:func:`head_update`). Returns the metrics averaged over the updates,
    ``ratio_max`` the maximum, ``shared_token_fraction`` over every micro-batch when sharing
    prefixes."""
    config = ctx.config
    units = mini_batch_units(batch, config.mini_batch_order)
    critic_epochs = config.critic_epochs if config.critic_epochs is not None else config.epochs
    policy_epochs = 0 if ctx.critic_only and models.value_head is None else config.epochs
    totals = {"policy": Counter(), "critic": Counter()}
    counts, ratio_max, shared = Counter(), None, Counter()
    for epoch in range(max(policy_epochs, critic_epochs if models.critic is not None else 0)):
        for group in mini_batches(len(units), config.mini_batches, config.seed, ctx.step,
                                  epoch):
            indices = sorted(i for r in group for i in units[r])
            if not any(batch.sub_traces[i].num_action_tokens for i in indices):
                continue
            run_critic = models.critic is not None and epoch < critic_epochs
            out = _update_mini_batch(models, optimizers, ctx, batch, indices,
                                     (epoch < policy_epochs, run_critic))
            counts["policy"] += epoch < policy_epochs
            for kind, metrics in out.items():
                if metrics is None:
                    continue
                if "ratio_max" in metrics:
                    ratio = metrics.pop("ratio_max")
                    ratio_max = ratio if ratio_max is None else max(ratio_max, ratio)
                shared.update({key: metrics.pop(key) for key in SHARED_KEYS if key in metrics})
                totals[kind].update(metrics)
                counts[kind + " updates"] += 1
    result = {key: value / max(counts["policy"], 1) for key, value in totals["policy"].items()}
    result.update({key: value / max(counts["critic updates"], 1)
                   for key, value in totals["critic"].items()})
    if ratio_max is not None:
        result["ratio_max"] = ratio_max
    if shared["plain_tokens"]:
        result["shared_token_fraction"] = shared["saved_tokens"] / shared["plain_tokens"]
    return result


def _update_mini_batch(models: Models, optimizers: Optimizers, ctx: StepContext,
                       batch: StepBatch, indices: list[int], runs: tuple[bool, bool]) -> dict:
    """One mini-batch: the critic's optimizer step beside the policy's (``runs``: whether
    each runs this epoch). ``{"policy": metrics or None, "critic": metrics or None}``."""
    run_policy, run_critic = runs
    batch.weights = batch_weights(ctx.config, batch, indices)
    with ctx.overlap.beside(run_policy and run_critic) as beside:
        critic_job = beside(critic_update, models.critic, optimizers.critic, ctx, batch,
                            indices) if run_critic else None
        policy = None
        if run_policy:
            update = head_update if ctx.critic_only else policy_update
            policy = update(models, optimizers.policy, ctx, batch, indices)
        critic = critic_job() if critic_job is not None else None
    return {"policy": policy, "critic": critic}


def _total_norm(norm) -> float:
    """``clip_grad_norm_``'s result as a float (a DTensor under FSDP2)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def batch_weights(config, batch: StepBatch, indices: list[int]) -> torch.Tensor:
    """``[T]``: the ``loss_weights`` of the mini-batch ``indices`` at its tokens, 0 elsewhere."""
    whole = batch.micro(indices).packed
    weights = loss_weights(config.loss_aggregation, whole.action_mask, whole.cu_seqlens,
                           whole.rollout_index, config.loss_norm_constant)
    out = torch.zeros(batch.packed.num_tokens, dtype=weights.dtype)
    out[batch.token_index(indices)] = weights
    return out


def _clip_and_step(optimizer, parameters, max_norm: float) -> float:
    norm = _total_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    optimizer.step()
    return norm


def policy_update(models: Models, optimizer, ctx: StepContext, batch: StepBatch,
                  indices: list[int]) -> dict[str, float]:
    """One optimizer step of the policy (and, when shared, of the value head: the loss is
    ``pg + value_coef * value loss``)."""
    models.policy.train()
    optimizer.zero_grad(set_to_none=True)
    sums = Sums()
    plan = ctx.plan(batch, indices)
    for position, group in enumerate(plan):
        with gradient_sync(models.policy, ctx.world, last=position == len(plan) - 1):
            if group is None:  # an empty micro-batch: collectives only, zero gradient
                policy_logprobs(models.policy, *empty_batch(ctx.device),
                                temperature=ctx.temperature).sum().mul(0.0).backward()
                continue
            policy_micro_batch(models, ctx, ctx.micro(batch, group), sums)
    sums = sums.reduced(ctx.world)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    norm = _clip_and_step(optimizer, parameters, ctx.config.max_grad_norm)
    out = sums.averages()
    return {"policy_loss": out.pop("policy_loss", 0.0), "policy_grad_norm": norm,
            "ratio_max": out.pop("ratio_max", 0.0), **out}


def policy_micro_batch(models: Models, ctx: StepContext, micro: MicroBatch, sums: Sums) -> None:
    """The forward and backward of one micro-batch of the policy; its metrics into ``sums``."""
    config, shared = ctx.config, models.value_head is not None
    logp, entropy, *hidden = policy_logprobs(
        models.policy, *micro.model_inputs(), temperature=ctx.temperature,
        return_entropy=True, return_hidden=shared, token_mask=micro.action_mask,
        layout=micro.layout)
    loss, metrics = POLICY_LOSSES.get(config.policy_loss)(logp, entropy, micro, ctx)
    total = loss
    if ctx.world is not None:  # the reduction averages over ranks; the loss is a sum
        total = total * ctx.world.size
    share = micro.action_mask.sum().item()
    if shared:
        v, _ = models.value_head(hidden[0], micro.packed.cu_seqlens)
        vloss, vmetrics = value_loss(v, micro.values, micro.returns, micro.action_mask,
                                     clip=config.value_clip, token_weights=micro.weights)
        total = total + config.value_coef * vloss
        sums.plain["value_loss"] += vloss.item()
        sums.per_token["value_clipfrac"] += float(vmetrics["vf_clipfrac"]) * share
    total.backward()
    sums.plain["policy_loss"] += loss.item()
    per_token = {}
    if "pg_clipfrac_upper" in metrics:
        per_token["clipfrac"] = metrics["pg_clipfrac_upper"] + metrics["pg_clipfrac_lower"]
    per_token.update({key: metrics[name] for key, name in (("approx_kl", "approx_kl"),
                                                           ("entropy", "entropy_mean"))
                      if name in metrics})
    sums.add_tokens(share, per_token)
    count_shared(sums, micro)
    if "ratio_max" in metrics:
        sums.add_max("ratio_max", metrics["ratio_max"])


def head_update(models: Models, optimizer, ctx: StepContext, batch: StepBatch,
                indices: list[int]) -> dict[str, float]:
    """Critic warm-up with a shared critic: one step of the value head alone on the frozen
    backbone's features (the policy must not move). It steps the policy's optimizer, in which
    the head's parameters are: the policy's have no gradient, so their state stays as it is.
    One process only (a shared critic is)."""
    optimizer.zero_grad(set_to_none=True)
    sums = Sums()
    for group in ctx.plan(batch, indices):
        micro = ctx.micro(batch, group)
        with torch.no_grad():
            _, hidden = policy_logprobs(models.policy, *micro.model_inputs(),
                                        temperature=ctx.temperature, return_hidden=True,
                                        token_mask=micro.action_mask, layout=micro.layout)
        v, _ = models.value_head(hidden, micro.packed.cu_seqlens)
        loss, metrics = value_loss(v, micro.values, micro.returns, micro.action_mask,
                                   clip=ctx.config.value_clip, token_weights=micro.weights)
        loss.backward()
        sums.plain["value_loss"] += loss.item()
        sums.add_tokens(micro.num_action_tokens, {"value_clipfrac": metrics["vf_clipfrac"]})
        count_shared(sums, micro)
    norm = _clip_and_step(optimizer, list(models.value_head.parameters()),
                          ctx.config.max_grad_norm)
    return {**sums.averages(), "critic_grad_norm": norm}


def critic_update(critic, optimizer, ctx: StepContext, batch: StepBatch,
                  indices: list[int]) -> dict[str, float]:
    """One optimizer step of the separate critic on the mini-batch ``indices``."""
    critic.train()
    optimizer.zero_grad(set_to_none=True)
    sums = Sums()
    plan = ctx.plan(batch, indices)
    for position, group in enumerate(plan):
        with gradient_sync(critic, ctx.world, last=position == len(plan) - 1):
            if group is None:  # an empty micro-batch: collectives only, zero gradient
                critic_values(critic, *empty_batch(ctx.device))[0].sum().mul(0.0).backward()
                continue
            micro = ctx.micro(batch, group)
            v, _ = critic_values(critic, *micro.model_inputs(), layout=micro.layout)
            loss, metrics = value_loss(v, micro.values, micro.returns, micro.action_mask,
                                       clip=ctx.config.value_clip, token_weights=micro.weights)
            (loss * (ctx.world.size if ctx.world is not None else 1)).backward()
            sums.plain["value_loss"] += loss.item()
            sums.add_tokens(int(micro.action_mask.sum()),
                            {"value_clipfrac": metrics["vf_clipfrac"]})
            count_shared(sums, micro)
    sums = sums.reduced(ctx.world)
    norm = _clip_and_step(optimizer, critic.parameters(), ctx.config.max_grad_norm)
    return {**sums.averages(), "critic_grad_norm": norm}


def adapted_kl_coef(kl_coef: float, kl: float | None, episodes: int, config) -> float:
    """Adaptive KL coefficient (Ziegler et al.): move towards ``kl_target``, by the batch's
    number of episodes over ``kl_horizon``."""
    if config.kl_target is None or kl is None or kl_coef == 0:
        return kl_coef
    error = max(min(kl / config.kl_target - 1.0, 0.2), -0.2)
    return kl_coef * (1.0 + error * episodes / config.kl_horizon)
