"""How a run uses N ranks (a leaf: standard library only)."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("fsdp", "ddp")
MIXED_PRECISIONS = ("none", "bf16", "fp16")


@dataclass
class DistributedConfig:
    """How a run uses N ranks (only read under ``torchrun``; docs/scaling.md)."""

    strategy: str = "fsdp"
    """``"fsdp"``: FSDP2's ``fully_shard`` on policy, critic and reference (each decoder layer,
    then the model): parameters, gradients and optimizer states sharded across ranks, for
    models a device cannot hold with their optimizer; ``"ddp"``: a whole replica per rank under
    ``DistributedDataParallel``, simpler for small models."""
    mixed_precision: str = "none"
    """FSDP2's parameter dtype in forward and backward: ``"none"`` (the parameters' own),
    ``"bf16"`` or ``"fp16"`` (less memory, faster matmuls on GPUs; gradients still reduce in
    float32). Needs ``strategy="fsdp"``."""
    timeout_seconds: float = 600.0
    """Seconds a collective may wait before it raises on its rank, so a stuck rank fails the
    job instead of hanging it. Raise it if ranks legitimately wait on each other longer."""

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
