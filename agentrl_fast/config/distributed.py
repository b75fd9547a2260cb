"""How a run uses N ranks (a leaf: standard library only)."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("fsdp", "ddp")
MIXED_PRECISIONS = ("none", "bf16", "fp16")


@dataclass
class DistributedConfig:
    """How a run uses N ranks (only read under ``torchrun``)."""

    strategy: str = "fsdp"  # "fsdp" (FSDP2 fully_shard) or "ddp" (replicas)
    mixed_precision: str = "none"  # FSDP2 parameter dtype in forward/backward: none, bf16, fp16
    timeout_seconds: float = 600.0  # a collective waiting longer fails the job

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {self.strategy!r}")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"mixed_precision must be one of "
                             f"{', '.join(MIXED_PRECISIONS)}, got {self.mixed_precision!r}")
        if self.mixed_precision != "none" and self.strategy != "fsdp":
            raise ValueError("mixed_precision needs strategy='fsdp'")
        if not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, "
                             f"got {self.timeout_seconds!r}")
