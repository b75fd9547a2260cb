"""What every stage of a step after the rollouts needs besides the models and the batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agentrl_fast.config.train import TrainConfig
from agentrl_fast.train.distributed import World, local_plan
from agentrl_fast.train.overlap import CriticOverlap
from agentrl_fast.train.step_batch import MicroBatch, StepBatch


@dataclass
class StepContext:
    """The run's ``config``, the models' ``device``, the sampling ``temperature``, this step's
    ``kl_coef`` and number (``step``), the ``world`` (None: one process), the critic's
    ``overlap`` beside the policy (CPU), ``critic_only``: a critic warm-up step, in which
    only the critic (or a shared critic's value head) learns, and ``share_prefixes``: the
    models run each micro-batch's shared prefixes once (``config.share_prefixes`` where every
    model can, :func:`~agentrl_fast.train.models.plain_packing_reason`)."""

    config: TrainConfig
    device: torch.device
    temperature: float
    kl_coef: float
    step: int
    world: World | None = None
    overlap: CriticOverlap | None = None
    critic_only: bool = False
    share_prefixes: bool = False

    def plan(self, batch: StepBatch, indices: Sequence[int]) -> list[list[int] | None]:
        """This rank's micro-batches of sub-traces ``indices`` (None: an empty one, so every
        rank runs as many; :func:`~agentrl_fast.train.distributed.local_plan`); with
        ``mini_batch_order="task"`` each task's sub-traces kept together."""
        groups = None
        if self.config.mini_batch_order == "task":
            chosen = set(indices)
            groups = [kept for group in batch.task_groups()
                      if (kept := [i for i in group if i in chosen])]
        return local_plan(batch.lengths, indices, self.config.micro_batch_tokens, self.world,
                          groups)

    def micro(self, batch: StepBatch, indices: Sequence[int]) -> MicroBatch:
        """Sub-traces ``indices`` of ``batch`` on the device, with their shared-prefix layout
        when sharing."""
        return batch.micro(indices, share_prefixes=self.share_prefixes).to(self.device)
