"""Scoring a step's batch before the update: the old log-probs PPO's ratio starts from
(recomputed, or the rollout's own), the reference log-probs (for the KL), the critic's values
and the value after each sub-trace's last token (GAE's bootstrap), written into the
:class:`~agentrl_fast.train.step_batch.StepBatch`."""

from __future__ import annotations

from typing import Callable

import torch

from agentrl_fast.models.critic import critic_values
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.train.context import StepContext
from agentrl_fast.train.distributed import empty_batch
from agentrl_fast.train.models import Models
from agentrl_fast.train.step_batch import MicroBatch, StepBatch


def policy_scores(models: Models, config) -> bool:
    """Whether the policy (or the reference) has scoring to do: the critic then scores beside
    it (``config``: a TrainConfig)."""
    return (config.recomputes or models.value_head is not None
            or models.reference is not None)


def _values_without_grad(critic, micro: MicroBatch):
    """``critic_values`` on the CPU, out of autograd (grad mode is per thread)."""
    with torch.no_grad():
        return tuple(x.cpu() for x in critic_values(critic, *micro.model_inputs(),
                                                    layout=micro.layout))


class _Scored:
    """Per-sub-trace results of this rank, before they are written into the batch."""

    def __init__(self):
        self.old, self.ref, self.values, self.last = {}, {}, {}, {}

    def put(self, name: str, group: list[int], micro: MicroBatch, per_token) -> None:
        for i, piece in zip(group, micro.packed.split(per_token)):
            getattr(self, name)[i] = piece


@torch.no_grad()
def score(models: Models, batch: StepBatch, ctx: StepContext,
          beside: Callable) -> dict[str, float]:
    """Fill ``batch``'s ``old_logprobs``, ``ref_logprobs``, ``values`` and ``last_values``.
    On several ranks each scores its share (``ctx.plan``; None: an empty micro-batch,
    collectives only), then all are gathered. ``beside(fn, *args) -> result()`` runs the critic
    beside the policy. Returns ``scoring_shared_token_fraction`` when a model ran on shared
    prefixes."""
    for model in (models.policy, models.critic, models.reference, models.value_head):
        if model is not None:
            model.eval()  # targets without dropout noise
    scored, tokens = _Scored(), [0, 0]  # shared layouts' saved, plain tokens
    share = ctx.share_prefixes and (models.critic is not None or policy_scores(models, ctx.config))
    for group in ctx.plan(batch, range(batch.num_sequences)):
        if group is None:  # take part in the sharded models' collectives
            _score_nothing(models, ctx)
            continue
        micro = batch.micro(group, share_prefixes=share).to(ctx.device)
        if micro.layout is not None:
            tokens = [tokens[0] + micro.layout.saved_tokens, tokens[1] + micro.layout.num_tokens]
        # Results are kept on the CPU (advantages are computed there, ranks gather them).
        critic_job = beside(_values_without_grad, models.critic, micro) \
            if models.critic is not None else None
        _score_policy(models, ctx, group, micro, scored)
        if critic_job is not None:
            v, v_last = critic_job()
            scored.put("values", group, micro, v)
            scored.last.update(zip(group, v_last))
    if ctx.world is not None:
        _gather(ctx, scored)
    _write(batch, scored, ctx.config.recomputes)
    return _shared_fraction(ctx.world, tokens) if share else {}


def _shared_fraction(world, tokens: list[int]) -> dict[str, float]:
    """``{"scoring_shared_token_fraction": saved / plain tokens}`` over every rank (``tokens``:
    this rank's ``[saved, plain]``)."""
    saved, plain = tokens if world is None else world.sum(tokens)
    return {"scoring_shared_token_fraction": saved / plain} if plain else {}


def _gather(ctx: StepContext, scored: _Scored) -> None:
    """Every rank's results on every rank."""
    mine = {i: (scored.old.get(i), scored.ref.get(i), scored.values.get(i),
                float(scored.last.get(i, 0.0)))
            for i in set(scored.old) | set(scored.ref) | set(scored.values) | set(scored.last)}
    for part in ctx.world.all_gather(mine):
        for i, (o, r, v, lv) in part.items():
            for name, value in (("old", o), ("ref", r), ("values", v)):
                if value is not None:
                    getattr(scored, name)[i] = value
            scored.last[i] = lv


def _write(batch: StepBatch, scored: _Scored, recomputed: bool) -> None:
    for name, field in (("old", "old_logprobs"), ("ref", "ref_logprobs"), ("values", "values")):
        parts = getattr(scored, name)
        if parts:
            per_token = torch.zeros(batch.packed.num_tokens)
            batch.scatter(per_token, list(parts), list(parts.values()))
            setattr(batch, field, per_token)
    for i, value in scored.last.items():
        batch.last_values[i] = value
    if not recomputed:  # the rollout's own sampling log-probs
        batch.old_logprobs = batch.packed.rollout_logprobs.clone()


def logprob_mismatch(batch: StepBatch) -> dict[str, float]:
    """Rollout vs trainer log-probs on action tokens (measured every step)."""
    mask = batch.action_mask
    diff = (batch.packed.rollout_logprobs - batch.old_logprobs)[mask]
    if diff.numel() == 0:
        return {"logprob_mismatch_mean": 0.0, "logprob_mismatch_max": 0.0}
    return {"logprob_mismatch_mean": float(diff.abs().mean()),
            "logprob_mismatch_max": float(diff.abs().max())}


def _score_nothing(models: Models, ctx: StepContext) -> None:
    """The forwards a rank with no work runs so the sharded models' collectives match."""
    inputs = empty_batch(ctx.device)
    if ctx.config.recomputes or models.value_head is not None:
        policy_logprobs(models.policy, *inputs, temperature=ctx.temperature)
    if models.reference is not None:
        policy_logprobs(models.reference, *inputs, temperature=ctx.temperature)
    if models.critic is not None:
        critic_values(models.critic, *inputs)


def _score_policy(models: Models, ctx: StepContext, group: list[int], micro: MicroBatch,
                  scored: _Scored) -> None:
    """Old (and reference) log-probs of a micro-batch; with a shared head, its values."""
    inputs, mask = micro.model_inputs(), micro.action_mask  # no loss reads the other tokens'
    temperature, layout = ctx.temperature, micro.layout
    if models.value_head is not None:
        logp, hidden = policy_logprobs(models.policy, *inputs, temperature=temperature,
                                       return_hidden=True, token_mask=mask, layout=layout)
        v, v_last = (x.cpu() for x in models.value_head(hidden, micro.packed.cu_seqlens))
        scored.put("values", group, micro, v)
        scored.last.update(zip(group, v_last))
    elif ctx.config.recomputes:
        logp = policy_logprobs(models.policy, *inputs, temperature=temperature, token_mask=mask,
                               layout=layout)
    else:
        logp = None  # the rollout's log-probs stand in (``_write``)
    if logp is not None:
        scored.put("old", group, micro, logp.cpu())
    if models.reference is not None:
        scored.put("ref", group, micro, policy_logprobs(
            models.reference, *inputs, temperature=temperature, token_mask=mask,
            layout=layout).cpu())
