"""Advantages for a step's batch: GAE bootstrapped across the sub-traces of a rollout (PPO with
a critic), and group-relative outcome advantages (GRPO), entries ``"gae"`` and ``"grpo"`` of
the advantage-estimator registry (:data:`ADVANTAGE_ESTIMATORS`; ``train.advantage_estimator``
chooses one, default by ``algo``). An estimator is a function

    estimator(batch: StepBatch, config: TrainConfig) -> (advantages [T], returns [T] | None)

over the step's :class:`~agentrl_fast.train.step_batch.StepBatch` (its ``rewards``, ``values``,
``last_values``, ``action_mask``, ``cu_seqlens``, ``rollout_index``, ``trajectories`` and
``sub_traces``): float32 advantages, 0 on non-action tokens, and the critic's value targets
(None for a run without a critic). Register your own with ``@register_advantage("name")``.

Bootstrap of a sub-trace (docs/design.md, "GAE over packed trajectories"): ``terminal`` 0;
``truncated`` the critic's value after its last token; ``continued`` ``V`` at the first action
token of the rollout's next sub-trace (a sub-trace without action tokens is skipped: the chain
passes through to its own bootstrap). The lambda-return runs on through a compaction unless
asked to restart there (:func:`gae_advantages`).

``bootstrap_truncated=False`` treats a limit as the end of the episode (bootstrap 0), for
environments whose limits are part of the task: the rollout engine scores a truncated episode
(``finish(None)``), so its return is known and a critic's value after it would count the future
twice — and would make running into a limit look as good as the critic's guess, which a policy
learns to exploit (loops until ``max_turns``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch

from agentrl_fast.config.train import TrainConfig
from agentrl_fast.harness.trajectory import SubTrace, Trajectory
from agentrl_fast.ops import adaptive_lam, gae, whiten
from agentrl_fast.train.registry import Registry
from agentrl_fast.train.step_batch import StepBatch

ADVANTAGE_ESTIMATORS = Registry("train.advantage_estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register


def _first_action(sub_trace: SubTrace) -> int | None:
    for i, m in enumerate(sub_trace.action_mask):
        if m:
            return i
    return None


def bootstrap_values(sub_traces: Sequence[SubTrace], values: Sequence[torch.Tensor],
                     last_values: torch.Tensor, *, bootstrap_truncated: bool = True
                     ) -> torch.Tensor:
    """``[B]`` float32 bootstrap values of ``sub_traces`` (whole rollouts, each rollout's
    sub-traces in order). ``values[i]``: ``V`` per token of sub-trace ``i``; ``last_values[i]``:
    the value after its last token (used for ``truncated`` sub-traces unless
    ``bootstrap_truncated`` is False: then 0, as terminal)."""
    position = {(s.rollout_id, s.index): i for i, s in enumerate(sub_traces)}
    out = torch.zeros(len(sub_traces), dtype=torch.float32)
    resolved: dict[int, float] = {}

    def resolve(i: int) -> float:
        if i in resolved:
            return resolved[i]
        s = sub_traces[i]
        if s.end == "terminal":
            value = 0.0
        elif s.end == "truncated":
            value = float(last_values[i]) if bootstrap_truncated else 0.0
        elif s.end == "continued":
            j = position.get((s.rollout_id, s.index + 1))
            if j is None:
                raise ValueError(f"sub-trace {s.rollout_id}#{s.index} was continued but the batch "
                                 f"lacks sub-trace #{s.index + 1} of its rollout; pass whole "
                                 "rollouts")
            first = _first_action(sub_traces[j])
            value = float(values[j][first]) if first is not None else resolve(j)
        else:
            raise ValueError(f"sub-trace {s.rollout_id}#{s.index} is still open (end=None); "
                             "close it as terminal, truncated or continued")
        resolved[i] = value
        return value

    for i in range(len(sub_traces)):
        out[i] = resolve(i)
    return out


def _rollout_lams(sub_traces: Sequence[SubTrace], sequences: list[list[int]],
                  alpha: float) -> torch.Tensor:
    """``[len(sequences)]`` float64: the length-adaptive lambda (:func:`adaptive_lam`) of the
    rollout each sequence belongs to, ``l`` its action tokens over all its sub-traces."""
    actions: dict[str, int] = defaultdict(int)
    for s in sub_traces:
        actions[s.rollout_id] += sum(s.action_mask)
    lengths = torch.tensor([actions[sub_traces[m[0]].rollout_id] for m in sequences])
    return adaptive_lam(lengths, alpha)


def gae_advantages(sub_traces: Sequence[SubTrace], values: Sequence[torch.Tensor],
                   last_values: torch.Tensor, *, gamma: float, lam: float,
                   lam_alpha: float | None = None,
                   rewards: Sequence[torch.Tensor] | None = None,
                   bootstrap_truncated: bool = True, restart_at_compaction: bool = False
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sub-trace ``(advantages, returns)`` (float32, 0 on non-action tokens) by the ``gae``
    op over the whole batch packed, with :func:`bootstrap_values`. ``rewards`` overrides the
    sub-traces' own (for example with a KL penalty folded in); ``bootstrap_truncated`` as in
    :func:`bootstrap_values`.

    At a compaction the next value is ``V`` at the first action token of the rollout's next
    sub-trace either way. By default the lambda-return goes on through it: each rollout's
    sub-traces run as one sequence (``A_t = delta_t + gamma * lam * A_next`` with ``A_next``
    the next sub-trace's first advantage), so with ``lam = 1`` every action token's return is
    the rollout's own return, however many compactions it went through. With
    ``restart_at_compaction`` the sum restarts there (``A_next = 0``): everything after a
    compaction is the critic's estimate, and an outcome reaches the earlier sub-traces only as
    fast as the critic learns it (one sub-trace per round of value targets).

    ``lam_alpha``: each rollout's lambda is its length-adaptive one (:func:`_rollout_lams`), in
    place of ``lam``, in the same single ``gae`` call (a ``[B]`` lambda)."""
    lengths = [len(s) for s in sub_traces]
    if rewards is None:
        rewards = [torch.tensor(s.rewards, dtype=torch.float32) for s in sub_traces]
    rewards = [torch.as_tensor(r, dtype=torch.float32) for r in rewards]
    values = [v.float() for v in values]
    masks = [torch.tensor(s.action_mask, dtype=torch.bool) for s in sub_traces]
    bootstrap = bootstrap_values(sub_traces, values, last_values,
                                 bootstrap_truncated=bootstrap_truncated)
    if not sub_traces:
        return [], []
    if restart_at_compaction:
        sequences = [[i] for i in range(len(sub_traces))]
    else:  # one sequence per rollout, its sub-traces in order (bootstrap_values checked them)
        rollouts: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(sub_traces):
            rollouts[s.rollout_id].append(i)
        sequences = [sorted(members, key=lambda i: sub_traces[i].index)
                     for members in rollouts.values()]
    order = [i for members in sequences for i in members]
    sequence_lengths = [sum(lengths[i] for i in members) for members in sequences]
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(sequence_lengths, dtype=torch.int32).cumsum(0)
    advantages, returns = gae(torch.cat([rewards[i] for i in order]),
                              torch.cat([values[i] for i in order]), cu_seqlens,
                              action_mask=torch.cat([masks[i] for i in order]),
                              bootstrap_values=bootstrap[[m[-1] for m in sequences]],
                              gamma=gamma, lam=lam if lam_alpha is None
                              else _rollout_lams(sub_traces, sequences, lam_alpha))
    out_advantages: list[torch.Tensor] = [torch.zeros(0)] * len(sub_traces)
    out_returns: list[torch.Tensor] = [torch.zeros(0)] * len(sub_traces)
    pieces = zip(order, advantages.split([lengths[i] for i in order]),
                 returns.split([lengths[i] for i in order]))
    for i, advantage, value_target in pieces:
        out_advantages[i], out_returns[i] = advantage, value_target
    return out_advantages, out_returns


def whiten_per_sub_trace(advantages: Sequence[torch.Tensor],
                         sub_traces: Sequence[SubTrace]) -> list[torch.Tensor]:
    """Whiten over all action tokens of the batch (the ``whiten`` op), split back."""
    lengths = [len(s) for s in sub_traces]
    mask = torch.tensor([m for s in sub_traces for m in s.action_mask], dtype=torch.bool)
    return list(whiten(torch.cat(list(advantages)), mask).split(lengths))


def grpo_advantages(trajectories: Sequence[Trajectory], *, normalize_std: bool = True,
                    eps: float = 1e-6) -> list[torch.Tensor]:
    """Group-relative outcome advantages: each rollout's ``reward`` minus its task group's mean
    (divided by the group's standard deviation with ``normalize_std``), broadcast to every
    action token of every sub-trace of the rollout. Returns one ``[len]`` float32 tensor per
    sub-trace, in the order of ``[s for t in trajectories for s in t.sub_traces]``."""
    groups: dict[str | None, list[float]] = defaultdict(list)
    for t in trajectories:
        groups[t.task_id].append(t.reward)
    stats = {}
    for task_id, rewards in groups.items():
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
        stats[task_id] = (mean, std)
    out = []
    for t in trajectories:
        mean, std = stats[t.task_id]
        value = (t.reward - mean) / (std + eps) if normalize_std else t.reward - mean
        for s in t.sub_traces:
            out.append(torch.tensor(s.action_mask, dtype=torch.float32) * value)
    return out


def reference_kl(batch: StepBatch) -> tuple[torch.Tensor, float]:
    """``(kl [T], mean)``: the k1 estimate ``old - ref`` on action tokens (0 elsewhere), and
    its mean over the batch's action tokens (the ``kl_ref`` metric)."""
    mask = batch.action_mask
    kl = torch.where(mask, batch.old_logprobs - batch.ref_logprobs, torch.zeros(()))
    action_tokens = max(int(mask.sum()), 1)
    return kl, float(sum(piece.sum() for piece in batch.split(kl))) / action_tokens


@register_advantage("gae")
def gae_estimator(batch: StepBatch, config: TrainConfig
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GAE across each rollout's sub-traces (:func:`gae_advantages`): ``lam`` (or the
    length-adaptive ``lam_alpha``) for the policy, ``critic_lam`` for the critic's targets;
    whitened over the batch on request."""
    sub_traces, values = batch.sub_traces, batch.split(batch.values)
    kwargs = dict(gamma=config.gamma, rewards=batch.split(batch.rewards),
                  bootstrap_truncated=config.bootstrap_truncated,
                  restart_at_compaction=config.gae_restart_at_compaction)
    advantages, returns = gae_advantages(sub_traces, values, batch.last_values, lam=config.lam,
                                         lam_alpha=config.lam_alpha, **kwargs)
    if config.critic_lam is not None and (config.critic_lam != config.lam
                                          or config.lam_alpha is not None):
        _, returns = gae_advantages(sub_traces, values, batch.last_values, lam=config.critic_lam,
                                    **kwargs)
    if config.whiten_advantages:
        advantages = whiten_per_sub_trace(advantages, sub_traces)
    return _cat(advantages), _cat(returns)


@register_advantage("grpo")
def grpo_estimator(batch: StepBatch, config: TrainConfig
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Group-relative outcome advantages (:func:`grpo_advantages`); no value targets."""
    advantages = grpo_advantages(batch.trajectories, normalize_std=config.grpo_normalize_std)
    return _cat(advantages), None


def _cat(per_sub_trace: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(per_sub_trace)) if per_sub_trace else torch.zeros(0)


def step_advantages(batch: StepBatch, config: TrainConfig) -> None:
    """Fill ``batch.advantages`` and ``batch.returns`` with the configured estimator, checking
    what it returns (a user's function fails here, naming itself, not deep in the loss)."""
    name = config.advantage
    advantages, returns = ADVANTAGE_ESTIMATORS.get(name)(batch, config)
    tokens = batch.packed.num_tokens
    for what, value in (("advantages", advantages), ("returns", returns)):
        if value is None and what == "advantages":
            raise ValueError(f"advantage estimator {name!r} returned no advantages")
        if value is not None and (not isinstance(value, torch.Tensor)
                                  or tuple(value.shape) != (tokens,)):
            raise ValueError(f"advantage estimator {name!r} must return [T] = [{tokens}] "
                             f"tensors, got {what} of "
                             f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    if returns is None and config.algo == "ppo":
        raise ValueError(f"advantage estimator {name!r} returned no value targets (returns), "
                         "which PPO's critic trains on; return them, or use algo='grpo'")
    batch.advantages = advantages.float()
    batch.returns = None if returns is None else returns.float()
