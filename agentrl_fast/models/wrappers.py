"""Seeing through the distributed wrappers (DDP, FSDP2) a model may be in."""

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (else ``model``)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module or a ``DistributedDataParallel`` wrapper: its forward
    is a collective (or its parameters are shards), so callers run the model itself, never parts
    of it or its weights directly."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, (FSDPModule, DistributedDataParallel))
