"""One step's data, packed once: every sub-trace of the step's rollouts laid end to end
(docs/design.md, "The packed layout"), with the per-token quantities each stage adds.

Scoring writes ``old_logprobs``, ``ref_logprobs``, ``values`` and ``last_values``; the
advantage estimator (:mod:`agentrl_fast.train.advantages`) writes ``advantages`` and
``returns``; the updates read micro-batches of it (:meth:`StepBatch.micro`), each a selection of
its sequences with the same tensors sliced. Per-token tensors are ``[T]`` on the CPU, aligned
with ``packed``'s tokens; per-sequence ones ``[B]``.

    batch = StepBatch.of(trajectories)              # whole rollouts, in task order
    batch.old_logprobs = ...                        # scoring
    batch.advantages, batch.returns = estimator(batch, config)
    micro = batch.micro([3, 0, 5]).to(device)       # three sub-traces, in this order
    micro = batch.micro([3, 0, 5], share_prefixes=True)  # with their shared-prefix layout
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from agentrl_fast.harness.trajectory import SubTrace, Trajectory
from agentrl_fast.models.packing import SharedLayout
from agentrl_fast.train.packing import PackedBatch, pack_sub_traces, shared_layout

# The per-token fields a micro-batch slices out of the step (None stays None).
TOKEN_FIELDS = ("rewards", "old_logprobs", "ref_logprobs", "values", "advantages", "returns",
                "weights")


@dataclass
class MicroBatch:
    """Some of a step's sub-traces packed (``packed``, its ``indices`` the step's sub-trace
    numbers) with the step's per-token tensors for their tokens (``[t]``; None where the step
    has none). ``weights``: the loss weights of the mini-batch it belongs to."""

    packed: PackedBatch
    rewards: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    @property
    def action_mask(self) -> torch.Tensor:
        return self.packed.action_mask

    @property
    def num_action_tokens(self) -> int:
        return int(self.packed.action_mask.sum())

    def model_inputs(self) -> tuple:
        """``(input_ids [1, t], position_ids [1, t], cu_seqlens [b+1], max_seqlen)``."""
        packed = self.packed
        return packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen

    @property
    def layout(self) -> SharedLayout | None:
        """The same sub-traces with shared prefixes (the models' ``layout=``), or None: the
        models run on the plain packing."""
        return self.packed.shared

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {name: getattr(self, name).to(device) for name in TOKEN_FIELDS
                 if getattr(self, name) is not None}
        return dataclasses.replace(self, packed=self.packed.to(device), **moved)


@dataclass
class StepBatch:
    """A step's whole rollouts (``trajectories``) and their sub-traces (``sub_traces``, in
    rollout order, each rollout's in index order), packed once (``packed``).

    Per-token ``[T]`` float32 on the CPU: ``rewards`` (the environment's; a KL penalty folded
    in when ``kl_mode="reward"``), ``old_logprobs`` (PPO's ratio starts from them),
    ``ref_logprobs`` (the reference policy's, when there is one), ``values`` (the critic's
    ``V(x_<t)``), ``advantages`` and ``returns`` (the critic's targets; None without a
    critic). Per-sequence ``[B]``: ``last_values``, the critic's value after each sub-trace's
    last token (GAE's bootstrap of a truncated sub-trace).
    """

    trajectories: list[Trajectory]
    sub_traces: list[SubTrace]
    packed: PackedBatch
    rewards: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    last_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # the current mini-batch's loss weights (updates)
    # Shared-prefix layouts by micro-batch (the policy's and the critic's updates share them;
    # the lock: the critic's thread waits for the policy's layout instead of making its own).
    layouts: dict[tuple[int, ...], SharedLayout] = field(default_factory=dict, repr=False)
    layouts_lock: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                         compare=False)

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory]) -> StepBatch:
        """The sub-traces of ``trajectories`` (whole rollouts), packed."""
        trajectories = list(trajectories)
        sub_traces = [s for t in trajectories for s in t.sub_traces]
        packed = pack_sub_traces(sub_traces)
        return cls(trajectories, sub_traces, packed, packed.rewards.clone(),
                   last_values=torch.zeros(len(sub_traces)))

    @property
    def num_sequences(self) -> int:
        return len(self.sub_traces)

    @property
    def action_mask(self) -> torch.Tensor:
        return self.packed.action_mask

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.packed.cu_seqlens

    @property
    def rollout_index(self) -> torch.Tensor:
        """``[B]`` int64: a dense rollout number per sub-trace (sub-traces of one rollout share
        it)."""
        return self.packed.rollout_index

    @property
    def lengths(self) -> list[int]:
        return self.packed.lengths

    def split(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """``[T, ...]`` -> one ``[len_b, ...]`` view per sub-trace."""
        return self.packed.split(per_token)

    def token_index(self, indices: Sequence[int]) -> torch.Tensor:
        """``[t]`` int64: the step's token positions of sub-traces ``indices``, in that order."""
        starts = list(itertools.accumulate(self.lengths, initial=0))
        if not indices:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(starts[i], starts[i] + self.lengths[i])
                          for i in indices])

    def scatter(self, per_token: torch.Tensor, indices: Sequence[int],
                values: Sequence[torch.Tensor]) -> None:
        """Write ``values[k]`` (``[len]`` each) into ``per_token [T]`` at sub-trace
        ``indices[k]``'s tokens."""
        if indices:
            per_token[self.token_index(indices)] = torch.cat(list(values)).to(per_token.dtype)

    def task_groups(self) -> list[list[int]]:
        """The step's sub-trace numbers of each task (its rollouts' sub-traces, in order), tasks
        in order of first appearance; a rollout without a ``task_id`` is a group of its own."""
        task_of = {t.rollout_id: t.task_id for t in self.trajectories}
        groups: dict[tuple, list[int]] = {}
        for i, sub_trace in enumerate(self.sub_traces):
            task = task_of.get(sub_trace.rollout_id)
            key = ("rollout", sub_trace.rollout_id) if task is None else ("task", task)
            groups.setdefault(key, []).append(i)
        return list(groups.values())

    def micro(self, indices: Sequence[int], share_prefixes: bool = False) -> MicroBatch:
        """Sub-traces ``indices`` (the step's numbering) as a :class:`MicroBatch`, in that
        order: the packed tensors and every per-token field sliced, nothing re-tokenized; with
        ``share_prefixes`` also their shared-prefix layout (:attr:`MicroBatch.layout`)."""
        index = self.token_index(indices)
        packed = _select(self.packed, list(indices), index)
        if share_prefixes:
            packed.shared = self._layout(tuple(indices))
        fields = {name: getattr(self, name).index_select(0, index) for name in TOKEN_FIELDS
                  if getattr(self, name) is not None}
        return MicroBatch(packed, **fields)

    def _layout(self, indices: tuple[int, ...]) -> SharedLayout:
        """Sub-traces ``indices`` with shared prefixes, laid out once per step."""
        with self.layouts_lock:
            if indices not in self.layouts:
                self.layouts[indices] = shared_layout([self.sub_traces[i] for i in indices])
            return self.layouts[indices]


def _select(packed: PackedBatch, positions: list[int], index: torch.Tensor) -> PackedBatch:
    """The sequences at ``positions`` of ``packed`` (its tokens ``index``), packed anew."""
    lengths = [packed.lengths[p] for p in positions]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return PackedBatch(
        input_ids=packed.input_ids[:, index], position_ids=packed.position_ids[:, index],
        cu_seqlens=cu_seqlens, max_seqlen=max(lengths, default=0),
        action_mask=packed.action_mask[index],
        rollout_logprobs=packed.rollout_logprobs[index], rewards=packed.rewards[index],
        rollout_index=packed.rollout_index[positions] if positions
        else torch.zeros(0, dtype=torch.int64),
        indices=[packed.indices[p] for p in positions], ends=[packed.ends[p] for p in positions],
        lengths=lengths)
