"""What a step trains on: the next tasks of a seeded order of the train split, and (with
``filter_groups``) the groups of rollouts whose rewards differ."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.seeds import derive_seed


def task_at(tasks: Sequence, position: int, seed: int):
    """The task at ``position`` of the seeded order of ``tasks`` (a new order each pass)."""
    epoch, offset = divmod(position, len(tasks))
    order = torch.randperm(len(tasks), generator=torch.Generator().manual_seed(
        derive_seed(seed, "tasks", epoch)))
    return tasks[int(order[offset])]


def next_tasks(tasks: Sequence, position: int, count: int, seed: int) -> tuple[list, int]:
    """``(chosen, position)``: the next ``count`` distinct tasks from ``position`` in a seeded
    order of ``tasks`` (a new order each pass; a task already chosen is skipped at a pass
    boundary), and the position after them."""
    chosen: list = []
    while len(chosen) < count:
        task = task_at(tasks, position, seed)
        position += 1
        if all(task.id != other.id for other in chosen):
            chosen.append(task)
    return chosen, position


def groups_with_signal(batch: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """The groups (rollouts of one task, in batch order) whose rewards differ."""
    groups: dict[Any, list[Trajectory]] = {}
    for t in batch:
        groups.setdefault(t.task_id, []).append(t)
    return [g for g in groups.values() if len({t.reward for t in g}) > 1]
