"""Training: packing sub-traces into micro-batches, advantages (GAE bootstrapped across
sub-traces; GRPO), the PPO/GRPO trainer, and atomic checkpoints. Semantics: docs/design.md
("Training")."""

from agentrl_fast.train.advantages import (bootstrap_values, gae_advantages, grpo_advantages,
                                           whiten_per_sub_trace)
from agentrl_fast.train.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint,
                                           save_checkpoint)
from agentrl_fast.train.export import export_pretrained
from agentrl_fast.train.packing import (PackedBatch, balanced_partition, micro_batches,
                                        pack_sub_traces, rollout_index_map)
from agentrl_fast.train.ppo import TrainConfig, Trainer

__all__ = [
    "CheckpointError", "PackedBatch", "TrainConfig", "Trainer", "balanced_partition",
    "bootstrap_values", "export_pretrained", "gae_advantages", "grpo_advantages",
    "latest_checkpoint", "load_checkpoint", "micro_batches", "pack_sub_traces",
    "rollout_index_map", "save_checkpoint", "whiten_per_sub_trace",
]
