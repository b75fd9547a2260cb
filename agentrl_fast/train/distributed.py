"""Training on N ranks with torch.distributed, launched by ``torchrun``:

    torchrun --nproc-per-node N -m agentrl_fast.cli train ...

What each rank does in :meth:`~agentrl_fast.train.ppo.Trainer.step` when the trainer has a
:class:`World`:

1. The step's tasks are the same on every rank (one seeded order of the train split); rank ``r``
   rolls out tasks ``r, r + N, ...`` with the per-episode seeds one process would use (seed,
   task id, sample index), so the global batch is the same whatever N is. Rollouts run on a full,
   unsharded copy of the policy (FSDP; refreshed from the shards before each step) or on the
   replica itself (DDP): generation never waits on another rank.
2. The trajectories are all-gathered: every rank holds the global batch, in task order.
3. The sub-traces are split across ranks by tokens (:func:`~agentrl_fast.train.packing.
   balanced_partition`: per-rank token counts differ by at most one sub-trace's length) for the
   scoring forwards (old log-probs, values, reference log-probs), whose results are all-gathered.
4. Advantages, their whitening and the loss weights are computed on the global batch (the same
   numbers on every rank, which is what all-reducing the statistics would give).
5. Each mini-batch's sub-traces are split by tokens again; each rank runs forward/backward on
   its share with the loss weights of the global mini-batch, so the sum over ranks is the
   single-process loss. FSDP2 reduce-scatters and DDP all-reduces the gradients, both as a mean,
   so each rank's loss is scaled by N. Ranks pad to the same number of micro-batches with an
   empty one (every forward of a sharded model is a collective).
6. Metrics are summed over ranks; rank 0 writes the run folder.

Sharding: ``fsdp`` (default) wraps the policy, critic and reference with FSDP2's
``fully_shard`` (each decoder layer, then the model), with a configurable mixed precision;
``ddp`` replicates them (``DistributedDataParallel`` for the trained ones). Gloo on the CPU, NCCL
on GPUs (one per rank, ``LOCAL_RANK``). Checkpoints are written with
``torch.distributed.checkpoint`` (see :mod:`agentrl_fast.train.checkpoint`), so N ranks' checkpoint
resumes on M ranks (or one process).

Failures: a collective that waits longer than ``timeout_seconds`` raises on its rank; a rank that
dies is noticed by ``torchrun``, which stops the others and exits non-zero naming the rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections import Counter
from typing import Any, Sequence

import torch
import torch.distributed as dist

from agentrl_fast.config.distributed import DistributedConfig
from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.train.packing import balanced_partition, micro_batches

# FSDP2's parameter dtype in forward/backward, per DistributedConfig.mixed_precision
PARAM_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets
    ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class World:
    """This rank's view of the process group: rank, size, device, strategy, and the few
    collectives the trainer needs (all of them on the CPU for Python objects)."""

    def __init__(self, config: DistributedConfig, rank: int, size: int, device: torch.device):
        self.config, self.rank, self.size, self.device = config, rank, size, device

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, strategy={self.config.strategy!r}, "
                f"device={self.device})")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives ----------------------------------------------------------------------------

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (any picklable object), in rank order."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any, source: int = 0) -> Any:
        """``value`` of rank ``source`` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=source)
        return box[0]

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def maximum(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks (float64)."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def summed(self, totals: Counter, maxima: Sequence[str] = ()) -> Counter:
        """``totals`` summed over ranks (``maxima``: the maximum); the same keys on every rank."""
        keys = sorted(set().union(*self.all_gather(sorted(totals))))
        summed = self.sum([totals[k] if k not in maxima else 0.0 for k in keys])
        top = self.maximum([totals[k] if k in maxima else 0.0 for k in keys])
        return Counter({k: (top[j] if k in maxima else summed[j]) for j, k in enumerate(keys)})

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(tensor, op=op)
        return tensor.cpu().tolist()

    def barrier(self) -> None:
        dist.barrier()

    def check(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank when ``what`` failed on any (so no rank waits for a collective
        the failed one never reaches)."""
        failures = self.all_gather(None if error is None else f"{type(error).__name__}: {error}")
        for rank, failure in enumerate(failures):
            if failure is not None:
                if error is not None:
                    raise error
                raise RuntimeError(f"{what} failed on rank {rank}: {failure}")

    @property
    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- work split -----------------------------------------------------------------------------

    def share(self, indices: Sequence[int], lengths: Sequence[int]) -> list[int]:
        """This rank's part of ``indices`` (token counts ``lengths``), split by tokens so that
        per-rank token counts differ by at most one sequence's length; ascending."""
        groups = balanced_partition(list(lengths), self.size)
        # balanced_partition orders its groups by their smallest index: give them out by rank.
        return sorted(indices[j] for j in groups[self.rank])

    def tasks(self, tasks: Sequence[Any]) -> list[Any]:
        """This rank's tasks of a step: ``rank, rank + size, ...``."""
        return list(tasks[self.rank::self.size])

    def in_task_order(self, per_rank: Sequence[Sequence[Any]], num_tasks: int,
                      per_task: int) -> list[Any]:
        """The global list of results (``per_task`` per task, task-major) from each rank's
        results of :meth:`tasks`."""
        out = []
        for i in range(num_tasks):
            rank, position = i % self.size, i // self.size
            out.extend(per_rank[rank][position * per_task:(position + 1) * per_task])
        return out

    # -- models ---------------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, *, trainable: bool) -> torch.nn.Module:
        """``model`` (identical on every rank) made data-parallel: FSDP2 shards it in place
        (each decoder layer, then the whole model) and returns it; DDP returns a
        ``DistributedDataParallel`` of it when ``trainable``, else ``model`` (a frozen replica)."""
        model.to(self.device)
        if self.config.strategy == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            dtype = PARAM_DTYPES[self.config.mixed_precision]
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) \
                if dtype is not None else MixedPrecisionPolicy()
            blocks = set(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if module is not model and type(module).__name__ in blocks:
                    fully_shard(module, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            return model
        if not trainable:
            return model
        from torch.nn.parallel import DistributedDataParallel
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Make every rank's (unsharded) ``model`` rank 0's, parameters and buffers."""
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                if self._collective_device.type == "cpu" and tensor.device.type != "cpu":
                    staged = tensor.detach().cpu()
                    dist.broadcast(staged, src=0)
                    tensor.copy_(staged)
                else:
                    dist.broadcast(tensor.data, src=0)


def local_plan(lengths: Sequence[int], indices: Sequence[int], micro_batch_tokens: int,
               world: World | None, groups: Sequence[Sequence[int]] | None = None
               ) -> list[list[int] | None]:
    """Micro-batches (under ``micro_batch_tokens``) of this rank's share of ``indices``
    (``lengths``: every sequence's tokens); on several ranks padded with ``None`` (an empty
    micro-batch) to the same count on every rank, since each forward of a sharded model, and
    the last backward of a step, is a collective. ``groups`` (covering ``indices``): sequences
    kept in one micro-batch and on one rank (a task's), see :func:`_grouped_plan`."""
    if groups is not None:
        plan = _grouped_plan(lengths, groups, micro_batch_tokens, world)
    else:
        mine = list(indices) if world is None else world.share(indices,
                                                               [lengths[i] for i in indices])
        plan = [[mine[j] for j in group]
                for group in micro_batches([lengths[i] for i in mine], micro_batch_tokens)]
    if world is not None:
        plan += [None] * (int(world.maximum([max(len(plan), 1)])[0]) - len(plan))
    return plan


def _grouped_plan(lengths: Sequence[int], groups: Sequence[Sequence[int]],
                  micro_batch_tokens: int, world: World | None) -> list[list[int]]:
    """Micro-batches (each ascending) of this rank's share of whole ``groups``: ranks and
    micro-batches split by groups' tokens, a group over ``micro_batch_tokens`` into its
    sequences (a rank's token count then differs from another's by up to a group's)."""
    units = [list(g) for group in groups
             for g in ([group] if sum(lengths[i] for i in group) <= micro_batch_tokens
                       else [[i] for i in group])]
    sizes = [sum(lengths[i] for i in unit) for unit in units]
    mine = list(range(len(units))) if world is None else world.share(range(len(units)), sizes)
    return [sorted(i for j in batch for i in units[mine[j]])
            for batch in micro_batches([sizes[j] for j in mine], micro_batch_tokens)]


def rank_token_metrics(world: World, lengths: Sequence[int]) -> dict[str, float]:
    """Tokens per rank in the scoring split (the same split rule as every mini-batch)."""
    mine = sum(lengths[i] for i in world.share(range(len(lengths)), lengths))
    loads = world.all_gather(mine)
    return {"rank_tokens_min": float(min(loads)), "rank_tokens_max": float(max(loads)),
            "sub_trace_tokens_max": float(max(lengths, default=0))}


def empty_batch(device: torch.device) -> tuple:
    """``(input_ids, position_ids, cu_seqlens, max_seqlen)`` of one 2-token sequence (its
    second token's outputs depend on every parameter): the forward, and the backward of zero
    times it, a rank with no work runs to take part in the collectives."""
    return (torch.zeros(1, 2, dtype=torch.long, device=device),
            torch.arange(2, device=device).unsqueeze(0),
            torch.tensor([0, 2], dtype=torch.int32, device=device), 2)


def gradient_sync(model: torch.nn.Module, world: World | None, last: bool):
    """On several ranks: gradients are reduced in the last backward of an optimizer step only
    (FSDP2 ``set_requires_gradient_sync``, DDP ``no_sync``)."""
    if world is None:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else model.no_sync()


def full_state_dict(model: torch.nn.Module, world: World | None) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of ``model`` on every rank: a collective under FSDP."""
    model = unwrap(model)
    if world is None or world.config.strategy != "fsdp":
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def init_world(config: DistributedConfig) -> World | None:
    """Join the process group ``torchrun`` describes in the environment (gloo on the CPU, NCCL
    with one GPU per rank); ``None`` when not launched by it."""
    if not launched():
        return None
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be ints, got "
                         f"{os.environ.get('RANK')!r}, {os.environ.get('WORLD_SIZE')!r}, "
                         f"{os.environ.get('LOCAL_RANK')!r}") from None
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(
            seconds=config.timeout_seconds))
    return World(config, rank, size, device)


def shutdown() -> None:
    """Leave the process group: a barrier first, so no rank tears down its connections while
    another still uses them (gloo aborts the process then)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

