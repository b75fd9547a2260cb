"""Rollouts beside the learner (asynchronous training, ``TrainConfig.max_staleness > 0``).

A :class:`RolloutProducer` runs the rollout engine's endless stream
(:meth:`~agentrl_fast.harness.rollout.RolloutEngine.astream`) in a thread of its own, on a
generator with its own copy of the weights, into a buffer of finished task groups. The learner
takes whole groups in the order they were started (:meth:`RolloutProducer.take`) and publishes
new weights after each step (:meth:`RolloutProducer.publish`); the producer swaps them in
between two generate calls, so a rollout's turns may come from several versions (partial
rollouts: each token keeps the version and log-prob it was sampled with; a turn is never split).

Versions: the learner's step count. The producer holds back new groups while the buffer and
the groups in flight reach ``capacity`` (``max_staleness x tasks_per_step`` groups), so a group
is rarely more than ``max_staleness`` versions old when it is trained on; the learner drops
(and counts) any that is.

Positions: group ``p`` of the stream is task ``task_at(p)`` with seed ``derive_seed(seed,
"group", p)``. Groups finish out of order and the learner takes the finished ones lowest
position first; its checkpoint holds the positions it consumed (trained on or dropped as
stale): the first it has not, and those after it that it has. On resume the stream restarts at
the first and skips the others, so the groups that were buffered or in flight are regenerated
(with the resumed weights), none consumed is repeated and none is lost.

Under torchrun every rank runs a producer of its own over the positions ``p`` with
``p % size == rank`` (:func:`rank_share` says how many groups each rank gives a step); the
ranks' groups are all-gathered, so every rank trains on the same batch and counts the same
consumed positions.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time
from typing import Sequence

import torch

from agentrl_fast.generators.base import Generation, Generator
from agentrl_fast.generators.torch_generator import TorchGenerator
from agentrl_fast.harness.rollout import RolloutEngine
from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.seeds import derive_seed
from agentrl_fast.train.data import task_at
from agentrl_fast.train.step_batch import StepBatch


@dataclasses.dataclass
class Group:
    """A finished task group: its stream position and trajectories (sample order)."""

    position: int
    trajectories: list[Trajectory]

    def oldest_version(self) -> int:
        versions = [v for t in self.trajectories for s in t.sub_traces
                    for v in s.action_versions()]
        return min(versions, default=2 ** 62)  # no action token: never stale


class _VersionedGenerator:
    """The producer's generator: new weights are swapped in before a generate call, and each
    generation is stamped with the version that sampled it."""

    def __init__(self, inner: Generator, producer: "RolloutProducer"):
        self.inner, self.producer = inner, producer

    def generate(self, prompts, sampling, seeds=None) -> list[Generation]:
        # The engine calls this in a worker thread, whose thread count starts at the default.
        torch.set_num_threads(self.producer.threads)
        version = self.producer.swap_weights()
        return [dataclasses.replace(g, version=version)
                for g in self.inner.generate(prompts, sampling, seeds)]


class RolloutProducer:
    """See the module doc. ``engine``'s generator samples from ``model`` (the producer's own
    copy of the policy; for a :class:`~agentrl_fast.generators.torch_generator.TorchGenerator` it is the
    generator's model); ``tasks``: the train split; ``start``: the first stream position;
    ``version``: the weights' version now; ``capacity``: groups buffered or in flight at most."""

    def __init__(self, engine: RolloutEngine, model: torch.nn.Module, tasks: Sequence, *,
                 seed: int, start: int, skip: Sequence[int] = (), version: int, capacity: int,
                 rank: int = 0, size: int = 1, partial_rollouts: bool = True):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 group, got {capacity}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, size={size}), got {rank}")
        self.rank, self.size = rank, size  # this producer's positions: p % size == rank
        self.partial_rollouts = partial_rollouts  # False: abort-and-restart (RolloutEngine.astream)
        self.engine, self.model, self.tasks, self.seed = engine, model, list(tasks), seed
        self.capacity, self.version = capacity, version
        # Intra-op threads are per thread (OpenMP): generation takes half of them and the
        # learner keeps all. A static split (learner on the other half) measured slower on 2
        # cores: the learner is the bottleneck, and it gets the producer's core whenever the
        # producer waits on tools (bench/results/async_static_threads/async.md).
        self.threads = max(torch.get_num_threads() // 2, 1)
        self.inner = engine.generator
        engine.generator = _VersionedGenerator(self.inner, self)
        self.buffer: list[Group] = []
        self._next, self._skip = start, set(skip)  # the stream's next position (producer's)
        self._positions: dict[int, int] = {}  # group seed -> position, while in flight
        self._cond = threading.Condition()
        self._pending: tuple[dict, int] | None = None
        self._error: BaseException | None = None
        self.generated_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._ready, self._stopping = threading.Event(), False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="agentrl_fast-rollouts")
        self._thread.start()

    # -- the producer thread ----------------------------------------------------------------

    def _groups(self):
        while True:
            position, self._next = self._next, self._next + 1
            if position % self.size != self.rank or position in self._skip:
                continue
            seed = derive_seed(self.seed, "group", position)
            self._positions[seed] = position
            yield task_at(self.tasks, position, self.seed), seed

    def _emit(self, trajectories: list[Trajectory]) -> None:
        position = self._positions.pop(int(trajectories[0].rollout_id.split("/", 1)[0]))
        with self._cond:
            self.buffer.append(Group(position, trajectories))
            self.generated_tokens += sum(t.metrics["generated_tokens"] for t in trajectories)
            self._cond.notify_all()

    def _room(self, in_flight: int) -> bool:
        with self._cond:
            return len(self.buffer) + in_flight < self.capacity

    def _run(self) -> None:
        async def main():
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            self._ready.set()
            if self._stopping:
                return
            await self.engine.astream(self._groups(), self._emit, self._room,
                                      None if self.partial_rollouts else self.newest_version)
        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # noqa: BLE001 — raised in the learner by take()
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def swap_weights(self) -> int:
        """In the producer thread, before a generate call: the newest published weights."""
        with self._cond:
            pending, self._pending = self._pending, None
        if pending is not None:
            state, version = pending
            self.model.load_state_dict(state)
            self.inner.update_weights(self.model)
            self.version = version
        return self.version

    def newest_version(self) -> int:
        """The newest published weights' version (swapped in at the next generate call)."""
        with self._cond:
            return self.version if self._pending is None else self._pending[1]

    @property
    def restarted_groups(self) -> int:
        return self.engine.stats.restarted_groups

    # -- the learner's side ----------------------------------------------------------------

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """New weights (a snapshot of ``policy``'s, taken now) for the next generate call."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}
        with self._cond:
            self._pending = (state, version)

    def take(self, count: int, max_lag: int, learner_version: int, accept=None
             ) -> tuple[list[Group], list[Group], float]:
        """``(kept, dropped, waited_seconds)``: finished groups, lowest position first, until
        ``count`` are kept: a group whose oldest token is more than ``max_lag`` versions behind
        ``learner_version``, or that ``accept(group)`` refuses, is dropped (returned, to be
        counted)."""
        kept, dropped, start = [], [], time.perf_counter()
        with self._cond:
            while len(kept) < count:
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                if not self.buffer:
                    self._cond.wait(timeout=1.0)
                    continue
                group = min(self.buffer, key=lambda g: g.position)
                self.buffer.remove(group)
                stale = learner_version - group.oldest_version() > max_lag
                ok = not stale and (accept is None or accept(group))
                (kept if ok else dropped).append(group)
        return kept, dropped, time.perf_counter() - start

    def fill(self) -> int:
        with self._cond:
            return len(self.buffer)

    def close(self) -> None:
        """Stop the stream (groups in flight are dropped) and wait for the thread."""
        self._stopping = True
        self._ready.wait(timeout=30)  # the loop exists (close may come right after the start)
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)
        except RuntimeError:  # the loop already ended
            pass
        self._thread.join(timeout=60)
        self.engine.generator = self.inner


def staleness_metrics(batch: StepBatch, learner_version: int,
                      max_staleness: int) -> dict[str, float]:
    """Trained action tokens per version lag (``staleness_lag_<k>``, k = 0..max_staleness)
    and the largest lag."""
    counts = [0] * (max_staleness + 1)
    worst = 0
    for s in batch.sub_traces:
        for version in s.action_versions():
            lag = learner_version - version
            counts[min(lag, max_staleness)] += 1
            worst = max(worst, lag)
    out = {f"staleness_lag_{k}": float(c) for k, c in enumerate(counts)}
    out["staleness_max"] = float(worst)
    return out


def importance_metrics(batch: StepBatch, cap: float) -> dict[str, float]:
    """The behaviour importance weights ``exp(proximal - behaviour)`` on action tokens (the
    step's old log-probs over the rollout's): mean, max and the fraction the cap cut
    (``is_weight_*``)."""
    w = torch.exp(batch.old_logprobs - batch.packed.rollout_logprobs)[batch.action_mask]
    if w.numel() == 0:
        return {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_weight_capped": 0.0}
    return {"is_weight_mean": float(w.mean()), "is_weight_max": float(w.max()),
            "is_weight_capped": float((w > cap).float().mean())}


def rank_share(count: int, step: int, rank: int, size: int) -> int:
    """How many of a step's ``count`` groups rank ``rank`` of ``size`` gives: slot ``k`` of the
    run (step x count + j) goes to rank ``k % size``, so uneven shares rotate and every rank's
    positions advance at the same rate."""
    return len(range((rank - step * count) % size, count, size))


def gather_groups(world, kept: list[Group], dropped: list[Group], waited: float,
                  totals: dict[str, float]) -> tuple[list[Group], list[Group], float, dict]:
    """Every rank's kept and dropped groups (each by stream position), the longest wait and
    ``totals`` summed over ranks: the same on every rank."""
    parts = world.all_gather((kept, dropped, waited, totals))
    by_position = lambda groups: sorted(groups, key=lambda g: g.position)  # noqa: E731
    return (by_position([g for part in parts for g in part[0]]),
            by_position([g for part in parts for g in part[1]]),
            max(part[2] for part in parts),
            {key: sum(part[3][key] for part in parts) for key in totals})


def consume(position: int, consumed: set[int], positions: Sequence[int]) -> int:
    """Mark ``positions`` consumed; returns the new first unconsumed position (``consumed``
    keeps only those beyond it)."""
    consumed.update(positions)
    while position in consumed:
        consumed.discard(position)
        position += 1
    return position


def start_producer(trainer, custom_generator: bool) -> RolloutProducer:
    """The producer of an asynchronous ``trainer`` (after any resume): its own copy of the
    rollout policy, on the trainer's generator when one was given (it gets the copy's weights
    through ``update_weights``), else a TorchGenerator on the copy."""
    config, world = trainer.config, trainer.world
    rank, size = (0, 1) if world is None else (world.rank, world.size)
    model = copy.deepcopy(unwrap(trainer.rollout_policy)).eval().requires_grad_(False)
    if custom_generator:
        generator = trainer.engine.generator
    else:
        pad_id = trainer.chat_format.tokenizer.pad_token_id
        generator = TorchGenerator(model, pad_id=0 if pad_id is None else pad_id)
    engine = RolloutEngine(generator, trainer.chat_format, trainer.environment, config.rollout,
                           memory=trainer.memory)
    return RolloutProducer(engine, model, trainer.tasks, seed=config.seed,
                           start=trainer.data_position, skip=sorted(trainer.consumed_ahead),
                           version=trainer.step_index, rank=rank, size=size,
                           partial_rollouts=config.partial_rollouts,
                           capacity=config.max_staleness * -(-config.tasks_per_step // size))
