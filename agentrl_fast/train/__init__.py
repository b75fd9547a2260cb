"""Training: a step's sub-traces packed once (``StepBatch``), advantages from a registry of
estimators (GAE bootstrapped across sub-traces; GRPO) and policy losses (PPO), the PPO/GRPO
trainer, atomic checkpoints, the metrics log, and training an unchanged agent through the
proxy (``proxy_driver``). Semantics: docs/design.md ("Training")."""

from agentrl_fast.train.advantages import (bootstrap_values, gae_advantages, grpo_advantages,
                                           whiten_per_sub_trace)
from agentrl_fast.train.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint,
                                           save_checkpoint)
from agentrl_fast.train.export import export_pretrained
from agentrl_fast.train.metrics_log import MetricsLogger
from agentrl_fast.train.packing import (PackedBatch, balanced_partition, micro_batches,
                                        pack_sub_traces, rollout_index_map)
from agentrl_fast.train.ppo import TrainConfig, Trainer
from agentrl_fast.train.step_batch import MicroBatch, StepBatch

__all__ = [
    "CheckpointError", "MetricsLogger", "MicroBatch", "PackedBatch", "StepBatch", "TrainConfig",
    "Trainer", "balanced_partition",
    "bootstrap_values", "export_pretrained", "gae_advantages", "grpo_advantages",
    "latest_checkpoint", "load_checkpoint", "micro_batches", "pack_sub_traces",
    "rollout_index_map", "save_checkpoint", "whiten_per_sub_trace",
]
