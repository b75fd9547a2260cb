"""Advantages for a global batch of sub-traces: GAE bootstrapped across the sub-traces of a
rollout (PPO with a critic), and group-relative outcome advantages (GRPO).

Bootstrap of a sub-trace (DESIGN.md, "GAE over packed trajectories"): ``terminal`` 0;
``truncated`` the critic's value after its last token; ``continued`` ``V`` at the first action
token of the rollout's next sub-trace (a sub-trace without action tokens is skipped: the chain
passes through to its own bootstrap).

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

from agentrl_fast.harness.trajectory import SubTrace, Trajectory
from agentrl_fast.ops import gae, whiten


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


def gae_advantages(sub_traces: Sequence[SubTrace], values: Sequence[torch.Tensor],
                   last_values: torch.Tensor, *, gamma: float, lam: float,
                   rewards: Sequence[torch.Tensor] | None = None,
                   bootstrap_truncated: bool = True
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sub-trace ``(advantages, returns)`` (float32, 0 on non-action tokens) by the ``gae``
    op over the whole batch packed, with :func:`bootstrap_values`. ``rewards`` overrides the
    sub-traces' own (for example with a KL penalty folded in); ``bootstrap_truncated`` as in
    :func:`bootstrap_values`."""
    lengths = [len(s) for s in sub_traces]
    cu_seqlens = torch.zeros(len(sub_traces) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    if rewards is None:
        rewards = [torch.tensor(s.rewards, dtype=torch.float32) for s in sub_traces]
    flat_rewards = torch.cat([torch.as_tensor(r, dtype=torch.float32) for r in rewards]) \
        if sub_traces else torch.zeros(0)
    flat_values = torch.cat([v.float() for v in values]) if sub_traces else torch.zeros(0)
    mask = torch.tensor([m for s in sub_traces for m in s.action_mask], dtype=torch.bool)
    advantages, returns = gae(flat_rewards, flat_values, cu_seqlens, action_mask=mask,
                              bootstrap_values=bootstrap_values(
                                  sub_traces, values, last_values,
                                  bootstrap_truncated=bootstrap_truncated),
                              gamma=gamma, lam=lam)
    return list(advantages.split(lengths)), list(returns.split(lengths))


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
