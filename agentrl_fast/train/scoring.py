"""Scoring a batch before the update: per sub-trace, the old log-probs PPO's ratio starts from
(recomputed, or the rollout's own), the reference log-probs (for the KL), the critic's values
and the value after each sub-trace's last token (GAE's bootstrap)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from agentrl_fast.harness.trajectory import SubTrace
from agentrl_fast.models.critic import critic_values, policy_logprobs
from agentrl_fast.train.distributed import World, empty_batch
from agentrl_fast.train.models import Models
from agentrl_fast.train.packing import PackedBatch, pack_sub_traces


class Scores(NamedTuple):
    """Per sub-trace ``[len]`` CPU tensors (None where not computed) and ``last[B]``."""

    old: list
    ref: list
    values: list
    last: torch.Tensor


def policy_scores(models: Models, config) -> bool:
    """Whether the policy (or the reference) has scoring to do: the critic then scores beside
    it (``config``: a TrainConfig)."""
    return (config.recomputes or models.value_head is not None
            or models.reference is not None)


def _values_without_grad(critic, inputs):
    """``critic_values`` on the CPU, out of autograd (grad mode is per thread)."""
    with torch.no_grad():
        return tuple(x.cpu() for x in critic_values(critic, *inputs))


@torch.no_grad()
def score(models: Models, sub_traces: Sequence[SubTrace], rollout_index: dict,
          plan: list[list[int] | None], *, device: torch.device, temperature: float,
          recompute_logprobs: bool, world: World | None, beside: Callable) -> Scores:
    """The batch's :class:`Scores`. ``plan``: this rank's micro-batches (None: an empty one,
    collectives only); on several ranks each scores its share, then all are gathered.
    ``beside(fn, *args) -> result()`` runs the critic beside the policy."""
    for model in (models.policy, models.critic, models.reference, models.value_head):
        if model is not None:
            model.eval()  # targets without dropout noise
    n = len(sub_traces)
    old, ref, values = [None] * n, [None] * n, [None] * n
    last = torch.zeros(n)
    scored: list[int] = []
    for group in plan:
        if group is None:  # take part in the sharded models' collectives
            _score_nothing(models, empty_batch(device), temperature, recompute_logprobs)
            continue
        scored += group
        batch = pack_sub_traces(sub_traces, group, rollout_index).to(device)
        inputs = (batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
        # Results are kept on the CPU (advantages are computed there, ranks gather them).
        critic_job = beside(_values_without_grad, models.critic, inputs) \
            if models.critic is not None else None
        _score_policy(models, group, batch, inputs, old, ref, values, last, temperature,
                      recompute_logprobs)
        if critic_job is not None:
            v, v_last = critic_job()
            for k, (i, vi) in enumerate(zip(group, batch.split(v))):
                values[i], last[i] = vi, v_last[k]
    if world is not None:
        for part in world.all_gather({i: (old[i], ref[i], values[i], float(last[i]))
                                      for i in scored}):
            for i, (o, r, v, lv) in part.items():
                old[i], ref[i], values[i], last[i] = o, r, v, lv
    if not recompute_logprobs:
        old = [torch.tensor(s.logprobs, dtype=torch.float32) for s in sub_traces]
    return Scores(old, ref, values, last)


def logprob_mismatch(sub_traces: Sequence[SubTrace], old: list) -> dict[str, float]:
    """Rollout vs trainer log-probs on action tokens (measured every step)."""
    diffs = [(torch.tensor(s.logprobs) - o)[torch.tensor(s.action_mask, dtype=torch.bool)]
             for s, o in zip(sub_traces, old)]
    diff = torch.cat(diffs) if diffs else torch.zeros(0)
    if diff.numel() == 0:
        return {"logprob_mismatch_mean": 0.0, "logprob_mismatch_max": 0.0}
    return {"logprob_mismatch_mean": float(diff.abs().mean()),
            "logprob_mismatch_max": float(diff.abs().max())}


def _score_nothing(models: Models, inputs: tuple, temperature: float,
                   recompute_logprobs: bool) -> None:
    """The forwards a rank with no work runs so the sharded models' collectives match."""
    if recompute_logprobs or models.value_head is not None:
        policy_logprobs(models.policy, *inputs, temperature=temperature)
    if models.reference is not None:
        policy_logprobs(models.reference, *inputs, temperature=temperature)
    if models.critic is not None:
        critic_values(models.critic, *inputs)


def _score_policy(models: Models, group: list[int], batch: PackedBatch, inputs: tuple, old: list,
                  ref: list, values: list, last: torch.Tensor, temperature: float,
                  recompute_logprobs: bool) -> None:
    """Old (and reference) log-probs of a packed group; with a shared head, its values."""
    mask = batch.action_mask  # no loss reads the other tokens' log-probs
    if models.value_head is not None:
        logp, hidden = policy_logprobs(models.policy, *inputs, temperature=temperature,
                                       return_hidden=True, token_mask=mask)
        v, v_last = (x.cpu() for x in models.value_head(hidden, batch.cu_seqlens))
        for k, (i, vi) in enumerate(zip(group, batch.split(v))):
            values[i], last[i] = vi, v_last[k]
    elif recompute_logprobs:
        logp = policy_logprobs(models.policy, *inputs, temperature=temperature, token_mask=mask)
    else:
        logp = None  # the rollout's log-probs stand in (``score``)
    if logp is not None:
        for i, lp in zip(group, batch.split(logp.cpu())):
            old[i] = lp
    if models.reference is not None:
        for i, lp in zip(group, batch.split(policy_logprobs(
                models.reference, *inputs, temperature=temperature, token_mask=mask).cpu())):
            ref[i] = lp
