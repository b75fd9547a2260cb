"""What every stage of a step after the rollouts needs besides the models and the batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agentrl_fast.config.train import TrainConfig
from agentrl_fast.train.distributed import World, local_plan
from agentrl_fast.train.overlap import CriticOverlap
from agentrl_fast.train.step_batch import StepBatch


@dataclass
class StepContext:
    """The run's ``config``, the models' ``device``, the sampling ``temperature``, this step's
    ``kl_coef`` and number (``step``), the ``world`` (None: one process), the critic's
    ``overlap`` beside the policy (CPU), and ``critic_only``: a critic warm-up step, in which
    only the critic (or a shared critic's value head) learns."""

    config: TrainConfig
    device: torch.device
    temperature: float
    kl_coef: float
    step: int
    world: World | None = None
    overlap: CriticOverlap | None = None
    critic_only: bool = False

    def plan(self, batch: StepBatch, indices: Sequence[int]) -> list[list[int] | None]:
        """This rank's micro-batches of sub-traces ``indices`` (None: an empty one, so every
        rank runs as many; :func:`~agentrl_fast.train.distributed.local_plan`)."""
        return local_plan(batch.lengths, indices, self.config.micro_batch_tokens, self.world)
