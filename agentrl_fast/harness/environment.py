"""What the rollout engine needs from an environment: tasks, and episodes that give the model a
system prompt, a task prompt and tools, and score its final answer.

An :class:`Environment` lists :class:`Task` objects per split (``"train"``, ``"eval"``) and
starts an :class:`Episode` for a task with the rollout's memory namespace and a seed. The
episode's tools are ordinary :class:`~agentrl_fast.harness.tools.Tool` objects (memory tools
bound to that namespace among them); the engine runs them through a ``ToolRegistry``. Rewards:
``after_tools`` may return a per-turn reward (on the turn's last action token), ``finish`` the
episode's final reward in [0, 1] (``answer`` is ``None`` when the rollout was truncated).
Optional members: an episode's ``close()`` releases what it holds for its rollout (its MCP
servers: :mod:`agentrl_fast.harness.mcp`), an environment's ``close()`` what it holds for the
run (shared MCP servers); the engine and the run call them whatever way a rollout or a run ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, runtime_checkable

from agentrl_fast.harness.memory import MemoryNamespace
from agentrl_fast.harness.tool_calls import ToolCall
from agentrl_fast.harness.tools import Tool, ToolResult

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Task:
    """One task: a stable ``id`` (seeds derive from it), the user ``prompt``, and ``data`` the
    environment keeps for scoring (never shown to the model)."""

    id: str
    prompt: str
    data: Mapping = field(default_factory=dict)


@runtime_checkable
class Episode(Protocol):
    """One rollout's view of a task: what the model is told, the tools it may call, and how
    its turns and final answer are scored. Any object with these members works (no base class);
    docs/own-agent.md writes one from scratch."""

    system_prompt: str
    """The system message (before the tools header); ``""`` for none."""
    prompt: str
    """The user message that states the task; a compaction restart repeats it."""
    tools: Sequence[Tool]
    """The tools this episode offers (``@tool`` functions; memory tools bound to the rollout's
    namespace among them): their schemas form the tools header, calls run through a
    ``ToolRegistry`` that turns every failure into an error the model reads."""

    def after_tools(self, calls: Sequence[ToolCall], results: Sequence[ToolResult]) -> float:
        """Reward for a turn that called tools (usually 0)."""

    def finish(self, answer: str | None) -> float:
        """The final reward in [0, 1]; ``answer`` is the final assistant text, ``None`` if the
        rollout was truncated."""

    @property
    def success(self) -> bool:
        """Whether the finished episode solved its task."""

    # Optional (not checked): ``close()``, called once when the rollout ends, however it ends
    # (a final answer, a truncation, an error, a dropped or restarted group), after ``finish``
    # when there is one: release the rollout's resources (:func:`close_episode`).


@runtime_checkable
class Environment(Protocol):
    """Tasks, and episodes of them. ``agentrl-fast train`` builds one from ``env.factory`` (any
    callable, given ``env.args``) and checks these members, and an episode's, before it runs."""

    name: str
    """A short name for logs."""

    def tasks(self, split: str) -> Sequence[Task]:
        """The tasks of a split (``"train"`` or ``"eval"``; ``"eval"`` is held out)."""

    def start(self, task: Task, memory: MemoryNamespace, seed: int) -> Episode:
        """A fresh episode of ``task``; ``memory`` is the rollout's namespace (its
        ``tools()`` are the memory tools), ``seed`` derived from the run's seed and the rollout
        (for an environment with randomness of its own)."""

    # Optional (not checked): ``close()``, called when the run ends (``agentrl-fast train``,
    # ``eval``): release what the environment holds for the run (:func:`close_environment`).


# Each protocol's members (True: a method) checked where the engine first needs them, so a
# missing one is an error naming it and the class, not an AttributeError deep in a rollout.
ENVIRONMENT_MEMBERS = {"name": False, "tasks": True, "start": True}
EPISODE_MEMBERS = {"system_prompt": False, "prompt": False, "tools": False, "after_tools": True,
                   "finish": True}


def _missing(obj, members: Mapping[str, bool]) -> list[str]:
    missing = []
    for name, method in members.items():
        value = getattr(obj, name, _MISSING)
        if value is _MISSING or (method and not callable(value)):
            missing.append(f"{name}()" if method else name)
    return missing


_MISSING = object()


def check_environment(environment) -> None:
    """TypeError naming what ``environment`` lacks of the :class:`Environment` protocol."""
    missing = _missing(environment, ENVIRONMENT_MEMBERS)
    if missing:
        raise TypeError(f"environment {type(environment).__name__} lacks {', '.join(missing)} of "
                        "the Environment protocol (name, tasks(split), start(task, memory, seed); "
                        "agentrl_fast.harness.environment)")


def check_episode(episode, environment) -> None:
    """TypeError naming what an episode ``environment.start`` returned lacks of the
    :class:`Episode` protocol (``success`` is checked once the episode finished)."""
    missing = _missing(episode, EPISODE_MEMBERS)
    if missing:
        raise TypeError(f"{type(environment).__name__}.start returned a "
                        f"{type(episode).__name__} that lacks {', '.join(missing)} of the "
                        "Episode protocol (system_prompt, prompt, tools, after_tools(calls, "
                        "results), finish(answer), success; agentrl_fast.harness.environment)")


def episode_success(episode) -> bool:
    """``episode.success`` once finished, or a TypeError naming the class that lacks it."""
    try:
        return bool(episode.success)
    except AttributeError:
        raise TypeError(f"{type(episode).__name__} has no 'success' after finish(): the Episode "
                        "protocol needs it (whether the finished episode solved its task)") from None


def close_episode(episode) -> None:
    """Call ``episode.close()`` when it has one (an optional member of the protocol)."""
    close = getattr(episode, "close", None)
    if callable(close):
        close()


def close_environment(environment) -> None:
    """Call ``environment.close()`` when it has one (an optional member of the protocol)."""
    close = getattr(environment, "close", None)
    if callable(close):
        close()
