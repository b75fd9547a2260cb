"""Batched multi-turn rollouts: :class:`RolloutEngine` runs N tasks x M samples through a
:class:`~agentrl_fast.generators.base.Generator`, the environment's tools and memory, and
compacts long contexts into sub-traces.

Each rollout lives in a loop: generate until a stop, run the turn's tool calls, append the
results (token in, token out: :func:`~agentrl_fast.harness.trajectory.apply_turn`), repeat
until a final answer or a limit. Before each generation the engine checks the limits:

- ``max_turns``, ``max_total_tokens`` (all sub-traces together, a hard cap: a turn whose tool
  results would pass it ends the rollout without them): hitting one truncates;
- ``context_budget``: if the sub-trace plus ``max_new_tokens`` would exceed it, the sub-trace is
  closed as ``"continued"`` and the next starts from the system prompt, the task and a
  compaction summary (``summarize``; the default lists the memory keys and the latest tool
  results that fit in ``summary_chars``). If even that fresh start cannot fit, or
  ``max_sub_traces`` is reached, the rollout is truncated instead.

A turn that runs out of ``max_new_tokens`` without a stop truncates the rollout; tool responses
longer than ``max_tool_response_chars`` are cut with a visible marker. Rewards: the
environment's per-turn reward and final reward sit on the last action token of their turn
(the final reward of a truncated rollout on its last action token).

Schedules (``RolloutConfig.schedule``): ``"lockstep"`` generates for all waiting rollouts, then
runs all their tools, then generates again — batches are a function of the inputs, so a seed
reproduces the rollouts bit for bit; ``"overlap"`` starts the next generation for whichever
rollouts are ready while other rollouts' tools still run, which hides slow tools (network,
sandboxes) but makes batch composition depend on timing. ``bench/bench_rollout.py`` measures
both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from agentrl_fast.config.rollout import RolloutConfig
from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.environment import (Environment, Episode, Task, check_environment,
                                              check_episode, close_episode, episode_success)
from agentrl_fast.generators.base import Generation, Generator
from agentrl_fast.harness.memory import MemoryNamespace, MemoryStore
from agentrl_fast.harness.tool_calls import ToolCall
from agentrl_fast.harness.tools import ToolRegistry, ToolResult
from agentrl_fast.harness.trajectory import Trajectory, apply_turn
from agentrl_fast.seeds import derive_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompactionState:
    """What a compaction summary may use: the rollout's memory keys, its tool calls and their
    results so far (oldest first), and the summary's size budget in characters."""

    memory_keys: list[str]
    tool_results: list[tuple[ToolCall, ToolResult]]
    max_chars: int


def default_summary(state: CompactionState) -> str:
    """``Your context was reset. Saved in memory: a, b.`` then the latest tool results that
    fit in ``state.max_chars`` (newest kept first, shown oldest first), one per line as
    ``- name {arguments}: content``."""
    keys = ", ".join(state.memory_keys) if state.memory_keys else "nothing"
    text = f"Your context was reset. Saved in memory: {keys}."
    recent: list[str] = []
    used = len(text) + len("\nLatest tool results:")
    for call, result in reversed(state.tool_results):
        called = (f"{call.name} {json.dumps(call.arguments, ensure_ascii=False)}" if call.ok
                  else "(invalid call)")
        line = f"\n- {called}: {result.content}"
        if used + len(line) > state.max_chars:
            break
        recent.append(line)
        used += len(line)
    if recent:
        text += "\nLatest tool results:" + "".join(reversed(recent))
    return text


@dataclass
class _Rollout:
    task: Task
    sample_index: int
    trajectory: Trajectory
    episode: Episode
    registry: ToolRegistry
    memory: MemoryNamespace
    seed: int
    turns: int = 0
    tool_results: list = field(default_factory=list)
    compact_next: bool = False
    done: bool = False
    attempt: int = 0  # restarts of its group before this rollout (astream's abort-and-restart)
    closed: bool = False  # the episode's optional close() was called


def _oldest_version(rollouts: list[_Rollout]) -> int:
    """The oldest weights version any action token of ``rollouts`` was sampled with."""
    return min((v for r in rollouts for s in r.trajectory.sub_traces
                for v in s.action_versions()), default=2 ** 62)


@dataclass
class RolloutStats:
    """Throughput of one :meth:`RolloutEngine.run` (wall-clock, for benchmarks only)."""

    episodes: int = 0
    generated_tokens: int = 0
    wall_seconds: float = 0.0
    generate_seconds: float = 0.0
    tool_seconds: float = 0.0  # wall time during which at least one tool call ran
    restarted_groups: int = 0  # astream's abort-and-restart mode

    @property
    def episodes_per_second(self) -> float:
        return self.episodes / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def generated_tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def tool_share(self) -> float:
        """Share of the wall time during which at least one tool call was running."""
        return self.tool_seconds / self.wall_seconds if self.wall_seconds else 0.0


class _ToolClock:
    """The union of tool-execution intervals: wall time with at least one call running."""

    def __init__(self):
        self.active, self.since, self.busy = 0, 0.0, 0.0

    async def timed(self, registry: ToolRegistry, calls):
        if self.active == 0:
            self.since = time.perf_counter()
        self.active += 1
        try:
            return await registry.execute(calls)
        finally:
            self.active -= 1
            if self.active == 0:
                self.busy += time.perf_counter() - self.since


class _TimedRegistry:
    """A registry whose ``execute`` is timed by a :class:`_ToolClock` (all else delegated)."""

    def __init__(self, registry: ToolRegistry, clock: _ToolClock):
        self._registry, self._clock = registry, clock

    def __getattr__(self, name):
        return getattr(self._registry, name)

    async def execute(self, calls):
        return await self._clock.timed(self._registry, calls)


class _Pump:
    """The ``"overlap"`` schedule's moving parts: rollouts ready for a generation, one
    generation in flight (of all that were ready when it started), and each rollout's step
    (tools) running as soon as its generation is back; ``settle(rollout)`` decides what follows
    a step."""

    def __init__(self, engine: "RolloutEngine", settle: Callable[[_Rollout], None]):
        self.engine, self.settle = engine, settle
        self.ready: deque[_Rollout] = deque()
        self.stepping: dict[asyncio.Task, _Rollout] = {}
        self.generating: asyncio.Task | None = None
        self.batch: list[_Rollout] = []

    @property
    def busy(self) -> bool:
        return bool(self.ready or self.stepping or self.generating is not None)

    async def advance(self, timeout: float | None = None) -> None:
        """Start a generation if none runs, then handle what finished (within ``timeout``)."""
        if self.generating is None and self.ready:
            self.batch = list(self.ready)
            self.ready.clear()
            self.generating = asyncio.ensure_future(self.engine._generate(self.batch))
        waiting = set(self.stepping) | ({self.generating} if self.generating is not None
                                       else set())
        if not waiting:
            return
        finished, _ = await asyncio.wait(waiting, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            if task is self.generating:
                for rollout, generation in zip(self.batch, task.result()):
                    step = asyncio.ensure_future(self.engine._step(rollout, generation))
                    self.stepping[step] = rollout
                self.generating = None
            else:
                rollout = self.stepping.pop(task)
                task.result()
                self.settle(rollout)


class RolloutEngine:
    """Runs rollouts of ``environment``'s tasks with ``generator`` (see the module doc).

    ``memory``: the store the rollouts' memory namespaces live in (default: a fresh in-memory
    store); ``summarize``: the compaction summary (``CompactionState -> str``).
    """

    def __init__(self, generator: Generator, chat_format: ChatFormat, environment: Environment,
                 config: RolloutConfig = RolloutConfig(), memory: MemoryStore | None = None,
                 summarize: Callable[[CompactionState], str] = default_summary):
        if not callable(getattr(generator, "generate", None)):
            raise TypeError(f"generator must have a generate(prompts, sampling, seeds) method, "
                            f"got {type(generator).__name__}")
        if not isinstance(chat_format, ChatFormat):
            raise TypeError(f"chat_format must be a ChatFormat, got {type(chat_format).__name__}")
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"config must be a RolloutConfig, got {type(config).__name__}")
        check_environment(environment)
        self.generator = generator
        self.chat_format = chat_format
        self.environment = environment
        self.config = config
        self.memory = memory if memory is not None else MemoryStore()
        self.summarize = summarize
        self.sampling = dataclasses.replace(config.sampling, stop_ids=chat_format.stop_ids)
        # Room for the template ids that close a turn, which follow the sampled ids.
        self._turn_end_room = max(len(chat_format.turn_end_ids([chat_format.im_end_id])),
                                  len(chat_format.turn_end_ids([])))
        self.stats = RolloutStats()

    # -- public ---------------------------------------------------------------------------------

    def run(self, tasks: Sequence[Task], seed: int = 0) -> list[Trajectory]:
        """Roll out every task ``samples_per_task`` times; trajectories in (task, sample) order.
        Rollout ids are ``"{seed}/{task.id}/{sample}"``; episode seeds derive from
        ``(seed, task.id, sample)``."""
        return asyncio.run(self.arun(tasks, seed))

    async def arun(self, tasks: Sequence[Task], seed: int = 0) -> list[Trajectory]:
        start = time.perf_counter()
        self.stats = RolloutStats()
        self._clock = _ToolClock()
        reset = getattr(self.generator, "reset_prefix_cache", None)
        if reset is not None:  # a run's outputs do not depend on the runs before it
            reset()
        rollouts: list[_Rollout] = []
        try:
            for task in tasks:
                for sample in range(self.config.samples_per_task):
                    rollouts.append(self._start(task, sample, seed))
            if self.config.schedule == "lockstep":
                await self._lockstep(rollouts)
            else:
                await self._overlap(rollouts)
        finally:  # an error or a cancellation: the unfinished rollouts' episodes are closed too
            for rollout in rollouts:
                self._close(rollout)
        self.stats.episodes = len(rollouts)
        self.stats.tool_seconds = self._clock.busy
        self.stats.wall_seconds = time.perf_counter() - start
        return [r.trajectory for r in rollouts]

    async def astream(self, groups: Iterator[tuple[Task, int]],
                      emit: Callable[[list[Trajectory]], None],
                      room: Callable[[int], bool],
                      newest_version: Callable[[], int] | None = None) -> None:
        """Rollouts without end, as the asynchronous trainer needs them: while ``room(n)``
        (``n``: groups in flight) the next ``(task, seed)`` of ``groups`` starts a group of
        ``samples_per_task`` rollouts; every rollout steps as in the ``"overlap"`` schedule
        (the next generation batches whichever are ready); a group is passed to ``emit`` (its
        trajectories in sample order) once all its rollouts are done. Returns when ``groups``
        is exhausted and every group was emitted; cancel it to stop (in-flight groups are
        dropped).

        ``newest_version`` (abort-and-restart instead of partial rollouts): when one of a
        group's rollouts finishes a step while the group holds tokens sampled before
        ``newest_version()``, the whole group starts again from its first turn (the same
        episodes, under rollout ids of their own so that no old tool call touches the new
        memory); what the old rollouts still had in flight is discarded
        (``stats.restarted_groups``)."""
        self.stats = RolloutStats()
        self._clock = _ToolClock()
        members: dict[int, list[_Rollout]] = {}
        started_as: dict[int, tuple[Task, int]] = {}  # a group's (task, seed), for restarts
        group_of: dict[int, int] = {}
        left: dict[int, int] = {}  # rollouts of a group not yet settled as done
        source = iter(groups)

        def start(key: int, attempt: int = 0) -> None:
            task, seed = started_as[key]
            members[key] = [self._start(task, sample, seed, attempt)
                            for sample in range(self.config.samples_per_task)]
            left[key] = len(members[key])
            for rollout in members[key]:
                group_of[id(rollout)] = key
            for rollout in list(members[key]):
                settle(rollout)

        def restart(key: int) -> None:
            for rollout in members[key]:
                self._close(rollout)
            old = {id(r) for r in members[key]}
            for rollout_id in old:
                group_of.pop(rollout_id, None)
            pump.ready = deque(r for r in pump.ready if id(r) not in old)
            self.stats.restarted_groups += 1
            start(key, attempt=members[key][0].attempt + 1)

        def settle(rollout: _Rollout) -> None:  # ready for a generation, or done
            key = group_of.get(id(rollout))
            if key is None:  # a rollout of a group that was restarted: discarded
                return
            if newest_version is not None and _oldest_version(members[key]) < newest_version():
                restart(key)
                return
            if not rollout.done and self._prepare(rollout):
                pump.ready.append(rollout)
                return
            del group_of[id(rollout)]
            left[key] -= 1
            if not left[key]:  # the group's last rollout settled
                del left[key], started_as[key]
                self.stats.episodes += self.config.samples_per_task
                self.stats.tool_seconds = self._clock.busy
                emit([r.trajectory for r in members.pop(key)])

        pump = _Pump(self, settle)
        try:
            await self._stream(pump, source, members, started_as, start, room)
        finally:  # cancelled (or failed): the groups in flight are dropped, their episodes closed
            for rollout in (r for group in members.values() for r in group):
                self._close(rollout)

    async def _stream(self, pump: "_Pump", source: Iterator, members: dict, started_as: dict,
                      start: Callable[[int], None], room: Callable[[int], bool]) -> None:
        """:meth:`astream`'s loop: start groups while there is room, step the rollouts."""
        exhausted, started = False, 0
        while True:
            while not exhausted and room(len(members)):
                try:
                    task, seed = next(source)
                except StopIteration:
                    exhausted = True
                    break
                key, started = started, started + 1
                started_as[key] = (task, seed)
                start(key)
            if pump.busy:
                await pump.advance(timeout=0.05)  # room may come from another thread meanwhile
            elif exhausted and not members:
                return
            else:
                await asyncio.sleep(0.02)  # no room: the consumer frees it from another thread

    def prompt_ids(self, task: Task) -> list[int]:
        """The ids a rollout of ``task`` starts from: system prompt, tools header, task,
        generation prompt (to check budgets before a run)."""
        rollout = self._start(task, 0, seed=0, check=False)
        self._close(rollout)
        return list(rollout.trajectory.current.ids)

    # -- one rollout ----------------------------------------------------------------------------

    def _start(self, task: Task, sample_index: int, seed: int, attempt: int = 0,
               check: bool = True) -> _Rollout:
        rollout_id = f"{seed}/{task.id}/{sample_index}" + (f"/restart{attempt}" if attempt else "")
        if self.config.memory_scope == "rollout":
            memory = self.memory.namespace(rollout_id)
            memory.clear()
        else:
            memory = self.memory.namespace("agent")
        episode_seed = derive_seed(seed, task.id, sample_index)
        episode = self.environment.start(task, memory, episode_seed)
        check_episode(episode, self.environment)
        registry = ToolRegistry(episode.tools, default_timeout=self.config.tool_timeout)
        trajectory = Trajectory(rollout_id, task_id=task.id, sample_index=sample_index)
        rollout = _Rollout(task, sample_index, trajectory, episode, registry, memory, episode_seed,
                           attempt=attempt)
        first = self._prompt_ids(rollout, summary=None)
        if check:
            self._check_fits(task, len(first))
        trajectory.new_sub_trace().append_context(first)
        return rollout

    def _check_fits(self, task: Task, prompt_tokens: int) -> None:
        """A first prompt with no room for a turn would end every rollout before it generates
        (a step trained on no tokens): an error instead, with the budget it needs."""
        need = prompt_tokens + self.sampling.max_new_tokens + self._turn_end_room
        if need > self.config.context_budget:
            raise ValueError(
                f"task {task.id!r}: the first prompt (system prompt, tools header, task) is "
                f"{prompt_tokens} tokens; with sampling.max_new_tokens "
                f"({self.sampling.max_new_tokens}) and the turn's end a rollout needs "
                f"context_budget >= {need}, but RolloutConfig.context_budget is "
                f"{self.config.context_budget} (train.rollout.context_budget in a run config)")

    def _prompt_ids(self, rollout: _Rollout, summary: str | None) -> list[int]:
        prompt = rollout.episode.prompt + (f"\n\n{summary}" if summary else "")
        messages = [{"role": "system", "content": rollout.episode.system_prompt},
                    {"role": "user", "content": prompt}]
        return self.chat_format.render_ids(messages, rollout.registry.schemas,
                                           add_generation_prompt=True)

    def _truncate(self, rollout: _Rollout, reason: str) -> None:
        trajectory = rollout.trajectory
        trajectory.current.close("truncated")
        trajectory.metrics[f"truncated_{reason}"] += 1
        self._finish(rollout, answer=None)

    def _finish(self, rollout: _Rollout, answer: str | None) -> None:
        reward = rollout.episode.finish(answer)
        trajectory = rollout.trajectory
        trajectory.reward += reward
        for sub_trace in reversed(trajectory.sub_traces):
            if sub_trace.last_action_index is not None:
                sub_trace.rewards[sub_trace.last_action_index] += reward
                break
        trajectory.metrics["success"] = int(episode_success(rollout.episode))
        if getattr(rollout.episode, "reward_error", None) is not None:  # its reward function failed
            trajectory.metrics["reward_error"] = 1
        rollout.done = True
        self._close(rollout)

    def _close(self, rollout: _Rollout) -> None:
        """The episode's optional ``close()``, once; its failure is logged, the rollout kept."""
        if rollout.closed:
            return
        rollout.closed = True
        try:
            close_episode(rollout.episode)
        except Exception:  # noqa: BLE001 - the environment's code: the trajectory stands
            logger.warning("%s.close() failed for rollout %s", type(rollout.episode).__name__,
                           rollout.trajectory.rollout_id, exc_info=True)

    def _prepare(self, rollout: _Rollout) -> bool:
        """Enforce the limits before a generation; compact if needed. False: rollout over."""
        config, trajectory = self.config, rollout.trajectory
        new = self.sampling.max_new_tokens
        if rollout.turns >= config.max_turns:
            self._truncate(rollout, "max_turns")
            return False
        if trajectory.num_tokens + new + self._turn_end_room > config.max_total_tokens:
            self._truncate(rollout, "max_total_tokens")
            return False
        if (not rollout.compact_next
                and len(trajectory.current) + new + self._turn_end_room <= config.context_budget):
            return True
        if len(trajectory.sub_traces) >= config.max_sub_traces:
            self._truncate(rollout, "max_sub_traces")
            return False
        state = CompactionState(rollout.memory.list(limit=1000), list(rollout.tool_results),
                                config.summary_chars)
        fresh = self._prompt_ids(rollout, self.summarize(state))
        if trajectory.num_tokens + len(fresh) + new + self._turn_end_room > config.max_total_tokens:
            self._truncate(rollout, "max_total_tokens")
            return False
        if (len(fresh) + new + self._turn_end_room > config.context_budget
                or trajectory.current.last_action_index is None):
            self._truncate(rollout, "context_budget")  # a fresh start would not fit either
            return False
        trajectory.new_sub_trace().append_context(fresh)  # closes the current one: "continued"
        trajectory.metrics["compactions"] += 1
        rollout.compact_next = False
        return True

    async def _step(self, rollout: _Rollout, generation: Generation) -> None:
        """Record one generated turn, run its tools, and close the rollout if it ended."""
        if generation.finish_reason == "error":  # the server failed it, not the model
            rollout.trajectory.error = generation.error or "generation failed"
            self._truncate(rollout, "generation_error")
            return
        rollout.turns += 1
        sub_trace = rollout.trajectory.current
        self.stats.generated_tokens += len(generation.ids)
        turn_end = len(sub_trace) + len(generation.ids) + len(
            self.chat_format.turn_end_ids(generation.ids))
        outcome = await apply_turn(sub_trace, self.chat_format,
                                   _TimedRegistry(rollout.registry, self._clock), generation.ids,
                                   generation.logprobs, rollout.trajectory.metrics,
                                   max_response_chars=self.config.max_tool_response_chars,
                                   version=generation.version)
        rollout.trajectory.metrics["generated_tokens"] += len(generation.ids)
        if outcome.results:
            rollout.tool_results += list(zip(outcome.calls, outcome.results))
            turn_reward = rollout.episode.after_tools(outcome.calls, outcome.results)
            if turn_reward:
                sub_trace.add_reward(turn_reward)
                rollout.trajectory.reward += turn_reward
        if rollout.trajectory.num_tokens > self.config.max_total_tokens and not outcome.final:
            # The tool results would pass the rollout's token cap: it ends with this turn.
            sub_trace.rewind(turn_end)
            self._truncate(rollout, "max_total_tokens")
            return
        if len(sub_trace) > self.config.context_budget and not outcome.final:
            # The tool results do not fit: this sub-trace ends with the turn, and the results
            # reach the model through the next sub-trace's summary.
            sub_trace.rewind(turn_end)
            rollout.compact_next = True
            rollout.trajectory.metrics["results_moved_to_summary"] += 1
        if outcome.final:
            answer = self.chat_format.decode(generation.ids[:-1])
            sub_trace.close("terminal")
            self._finish(rollout, answer)
        elif outcome.stop == "length":
            self._truncate(rollout, "length")

    # -- schedules ------------------------------------------------------------------------------

    async def _generate(self, batch: list[_Rollout]) -> list[Generation]:
        prompts = [r.trajectory.current.ids for r in batch]
        seeds = [derive_seed(r.seed, r.turns) for r in batch]
        start = time.perf_counter()
        generations = await asyncio.to_thread(self.generator.generate, prompts, self.sampling,
                                              seeds)
        self.stats.generate_seconds += time.perf_counter() - start
        if len(generations) != len(batch):
            raise RuntimeError(f"generator returned {len(generations)} generations for "
                               f"{len(batch)} prompts")
        return generations

    async def _lockstep(self, rollouts: list[_Rollout]) -> None:
        while True:
            batch = [r for r in rollouts if not r.done and self._prepare(r)]
            if not batch:
                return
            generations = await self._generate(batch)
            await asyncio.gather(*(self._step(r, g) for r, g in zip(batch, generations)))

    async def _overlap(self, rollouts: list[_Rollout]) -> None:
        def settle(rollout: _Rollout) -> None:
            if not rollout.done and self._prepare(rollout):
                pump.ready.append(rollout)

        pump = _Pump(self, settle)
        pump.ready.extend(r for r in rollouts if self._prepare(r))
        while pump.busy:
            await pump.advance()


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Means over rollouts: reward, success, sub-traces, turns, tokens, tool calls, tool
    failures per call whose outcome the harness saw (not the proxy's: its client runs the
    tools), and ``reward_errors`` (rollouts whose reward function failed: an episode's
    ``reward_error``); for logs and benchmarks."""
    count = max(len(trajectories), 1)
    totals = Counter()
    for t in trajectories:
        totals.update(t.metrics)
    judged = max(totals["calls"] - totals["calls_unjudged"], 1)  # the proxy's are unjudged
    out = {"reward": sum(t.reward for t in trajectories) / count,
           "success": totals["success"] / count,
           "sub_traces": sum(len(t.sub_traces) for t in trajectories) / count,
           "turns": totals["turns"] / count,
           "tokens": sum(t.num_tokens for t in trajectories) / count,
           "generated_tokens": totals["generated_tokens"] / count,
           "tool_calls": totals["calls"] / count,
           "tool_error_rate": (totals["calls"] - totals["calls_unjudged"] - totals["ok"])
           / judged,
           "reward_errors": totals["reward_error"] / count}
    return out
