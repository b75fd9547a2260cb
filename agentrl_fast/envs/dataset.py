"""The built-in dataset-backed tool environment: tasks from JSONL or Parquet files, tools from a
module of ``@tool`` functions, a reward function by import path (``env.name: dataset``).

A run builds it from its config's ``env.args`` mapping (``DatasetToolEnvironment(**env.args,
search=[config folder, working directory])``)::

    env:
      name: dataset
      args:
        train: train.jsonl           # or .parquet (pip install agentrl_fast[data])
        eval: eval.jsonl             # optional; else eval_fraction of train is held out
        tools: tools                 # a module whose @tool functions are the tools
        reward: "reward:score"       # score(answer, task) -> float in [0, 1] or bool
        mcp_servers:                 # optional: MCP tool servers (docs/harness.md)
          - {name: git, command: mcp-server-git, args: [--repository, "{rollout_dir}"],
             scope: rollout, rollout_dir_template: repo}

Task files: one task per JSONL line (or Parquet row), an object with the prompt (``prompt_key``,
default ``"prompt"``), an optional ``id`` (default ``<file stem>-<row index>``), and any other
fields, kept in ``Task.data`` for the reward (never shown to the model). A line that is not a
JSON object, a missing or non-string prompt, a bad or duplicate id: a ``ValueError`` naming
``file:line`` (``file: row N`` for Parquet). Relative paths are looked up in the working
directory, then in the ``search`` folders (where the tool and reward modules are imported from).

Rewards: ``reward(answer, task)`` or ``reward(answer, task, state)`` (three positional
parameters), sync or async; ``answer`` is the final assistant text, ``task`` the task's row
(``id``, the prompt under ``prompt_key``, the other fields), ``state`` a :class:`RewardState`.
A truncated rollout (no final answer) gets 0 without a call, unless ``score_truncated`` (then
``answer`` is ``None`` and ``state.truncated`` is true). A reward function that raises, or
returns anything but a bool or a number in [0, 1], gives the episode reward 0 and no success; the
episode's ``reward_error`` says why, the rollout engine counts it (``reward_errors`` in
``rollout_metrics``) and the first failure's traceback is logged. The rollout goes on either way.

MCP tool servers (``mcp_servers``: a list of :class:`~agentrl_fast.harness.mcp.MCPServerSpec`
mappings; relative folders looked up like the task files) add their tools to every episode's;
they start when the environment is made (the shared servers stay up, the rollout servers' tools
are listed once), an episode's ``close()`` stops its rollout's servers and the environment's
``close()`` every server.

Demonstrations for a warm-start: :func:`agentrl_fast.envs.demonstrations.write_demonstrations`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import numbers
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from agentrl_fast.config.errors import ConfigError
from agentrl_fast.config.imports import import_object
from agentrl_fast.harness.chat_format import render_messages
from agentrl_fast.harness.environment import SPLITS, Task, close_episode
from agentrl_fast.harness.memory import MemoryNamespace, MemoryStore
from agentrl_fast.harness.tool_calls import TOOL_CALL_OPEN, ToolCall
from agentrl_fast.harness.tools import Tool, ToolResult, tool

__all__ = ["DEFAULT_SYSTEM_PROMPT", "DatasetEpisode", "DatasetToolEnvironment", "RewardState",
           "load_tasks", "load_tools"]

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = ("Solve the user's task. Use the tools when they help. When you are done, "
                         "give the final answer as plain text, without a tool call.")
TASK_FILE_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class RewardState:
    """What a three-parameter reward function gets besides the answer and the task: the
    episode's tool calls and their results so far (oldest first, one result per call), and
    whether the rollout was truncated (hit a limit before a final answer)."""

    calls: tuple[ToolCall, ...]
    results: tuple[ToolResult, ...]
    truncated: bool


# ---------------------------------------------------------------------------------------------
# Task files.

def _find_file(path, field: str, search: Iterable[str | Path]) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{field}: expected a path to a .jsonl or .parquet file, got {path!r}")
    given = Path(path).expanduser()
    if given.suffix.lower() not in TASK_FILE_SUFFIXES:
        raise ConfigError(f"{field}: {os.fspath(path)!r} must end in .jsonl (one JSON object a "
                          "line) or .parquet")
    places = [given] if given.is_absolute() else [Path.cwd() / given,
                                                  *(Path(f) / given for f in search)]
    for place in places:
        if place.is_file():
            return place
    raise ConfigError(f"{field}: no file {os.fspath(path)!r} (looked for "
                      f"{', '.join(str(p) for p in dict.fromkeys(places))})")


def _jsonl_rows(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 text ({error.reason} at byte "
                                 f"{error.start})") from None
            if not text.strip():
                continue  # blank lines (a trailing newline) are not tasks
            try:
                rows.append((where, json.loads(text)))
            except (json.JSONDecodeError, RecursionError) as error:
                detail = (f"{error.msg} at column {error.colno}"
                          if isinstance(error, json.JSONDecodeError) else "nested too deeply")
                raise ValueError(f"{where}: not valid JSON ({detail}); write one JSON object "
                                 "per line") from None
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ImportError(f"{path}: reading Parquet task files needs pyarrow: "
                          "pip install agentrl_fast[data]") from None
    try:
        rows = parquet.read_table(path).to_pylist()
    except Exception as error:  # noqa: BLE001 - pyarrow's own error types
        raise ValueError(f"{path}: not a readable Parquet file ({type(error).__name__}: "
                         f"{error})") from None
    return [(f"{path}: row {number}", row) for number, row in enumerate(rows, 1)]


def load_tasks(path: str | os.PathLike, prompt_key: str = "prompt") -> list[Task]:
    """The tasks of one JSONL or Parquet file (see the module doc), in file order."""
    path = Path(path)
    rows = _parquet_rows(path) if path.suffix.lower() == ".parquet" else _jsonl_rows(path)
    tasks, first_at = [], {}
    for index, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            kind = "null" if row is None else type(row).__name__
            raise ValueError(f"{where}: a task must be an object with a {prompt_key!r} field, "
                             f"got {kind}")
        prompt = row.get(prompt_key)
        if not isinstance(prompt, str) or not prompt.strip():
            got = "no such field" if prompt_key not in row else f"{prompt!r:.60}"
            raise ValueError(f"{where}: the task's {prompt_key!r} must be a non-empty string "
                             f"({got}; the prompt field is set by prompt_key)")
        task_id = row.get("id", f"{path.stem}-{index}")
        if isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or task_id == "":
            raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, "
                             f"got {task_id!r:.60}")
        task_id = str(task_id)
        if task_id in first_at:
            raise ValueError(f"{where}: duplicate id {task_id!r} (first at {first_at[task_id]}); "
                             "ids must be unique within a file")
        first_at[task_id] = where
        data = {key: value for key, value in row.items() if key not in (prompt_key, "id")}
        tasks.append(Task(task_id, prompt, data))
    if not tasks:
        raise ValueError(f"{path}: no tasks (the file is empty)")
    return tasks


# ---------------------------------------------------------------------------------------------
# Tools and the reward function.

def _as_tools(obj, where: str) -> list[Tool]:
    """``obj`` (a Tool, a documented function, or a list of them) as tools."""
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out = []
    for item in items:
        if isinstance(item, Tool):
            out.append(item)
        elif callable(item):
            try:
                out.append(tool(item))
            except (TypeError, ValueError) as error:
                raise ConfigError(f"{where}: {error}") from None
        else:
            raise ConfigError(f"{where}: expected a Tool (a function decorated with @tool), "
                              f"got {type(item).__name__}")
    return out


def load_tools(spec, search: Iterable[str | Path] = (),
               field: str = "env.args.tools") -> list[Tool]:
    """The tools ``spec`` names: a module (its ``Tool`` objects, in definition order), a
    ``"module:attr"`` string (a Tool, a function, or a list of them), a Tool or function, or a
    list of any of these; ``None`` means none. Two tools of one name: a ``ConfigError``."""
    if spec is None:
        return []
    single = isinstance(spec, (str, Tool)) or callable(spec)
    items = [spec] if single else list(spec)
    search = list(search)
    found: list[Tool] = []
    for index, item in enumerate(items):
        where = field if single else f"{field}[{index}]"
        if isinstance(item, str) and ":" not in item:
            module = import_object(item, where, search, attribute_required=False)
            tools = [value for value in vars(module).values() if isinstance(value, Tool)]
            if not tools:
                raise ConfigError(f"{where}: module {item!r} ({module.__file__}) defines no "
                                  "tools; decorate its functions with @tool (from "
                                  "agentrl_fast.harness import tool)")
            found += tools
        elif isinstance(item, str):
            found += _as_tools(import_object(item, where, search), where)
        else:
            found += _as_tools(item, where)
    unique: dict[str, Tool] = {}
    for t in found:
        if t.name in unique and unique[t.name] is not t:
            raise ConfigError(f"{field}: two tools are named {t.name!r}")
        unique[t.name] = t
    return list(unique.values())


def _reward_takes_state(fn, field: str) -> bool:
    """Whether ``fn`` takes ``(answer, task, state)`` rather than ``(answer, task)``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): the short form
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(positional) < 2 or len(required) > 3:
        raise ConfigError(f"{field}: {getattr(fn, '__name__', fn)!r} takes {len(positional)} "
                          "positional parameters; write reward(answer, task) or "
                          "reward(answer, task, state)")
    return len(positional) >= 3


def _await(awaitable):
    """The result of an async reward function, from sync code: the rollout engine calls
    ``finish`` on its event loop's thread, so the coroutine runs on a loop of its own."""
    async def wait():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def _reward_value(value) -> float:
    if not isinstance(value, (bool, numbers.Real)) and callable(getattr(value, "item", None)):
        value = value.item()  # a NumPy or torch scalar
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"the reward function returned a {type(value).__name__}, not a number "
                        "in [0, 1] or a bool")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"the reward function returned {value}, not a number in [0, 1]")
    return value


# ---------------------------------------------------------------------------------------------
# The environment.

class DatasetEpisode:
    """One episode of a dataset task (the :class:`~agentrl_fast.harness.environment.Episode`
    protocol). After ``finish``: ``answer``, ``reward``, ``truncated``, ``reward_error`` (why the
    reward function failed, else ``None``)."""

    def __init__(self, environment: "DatasetToolEnvironment", task: Task,
                 memory: MemoryNamespace):
        self.environment, self.task = environment, task
        self.system_prompt = environment.system_prompt
        self.prompt = task.prompt
        memory_tools = ([t for t in memory.tools() if t.name in environment.memory_tool_names]
                        if environment.memory_tool_names else [])
        mcp = environment.mcp_servers
        self.tools = [*environment.tools, *(mcp.tools(self) if mcp is not None else []),
                      *memory_tools]
        self.calls: list[ToolCall] = []
        self.results: list[ToolResult] = []
        self.answer: str | None = None
        self.truncated = False
        self.reward = 0.0
        self.reward_error: str | None = None

    def after_tools(self, calls: Sequence[ToolCall], results: Sequence[ToolResult]) -> float:
        self.calls += calls
        self.results += results
        return 0.0

    def finish(self, answer: str | None) -> float:
        env = self.environment
        self.answer, self.truncated = answer, answer is None
        self.reward = 0.0
        if self.truncated and not env.score_truncated:
            return self.reward
        arguments = (answer, env.row(self.task))
        if env.reward_takes_state:
            arguments += (RewardState(tuple(self.calls), tuple(self.results), self.truncated),)
        try:
            value = env.reward(*arguments)
            if inspect.isawaitable(value):
                value = _await(value)
            self.reward = _reward_value(value)
        except Exception as error:  # noqa: BLE001 - the user's function: a failed episode
            self.reward_error = f"{type(error).__name__}: {error}"
            env._report_reward_error(self.task, error)
        return self.reward

    @property
    def success(self) -> bool:
        return self.reward_error is None and self.reward >= self.environment.success_threshold

    def close(self) -> None:
        """Stop this rollout's MCP servers (in the background)."""
        if self.environment.mcp_servers is not None:
            self.environment.mcp_servers.release(self)


class DatasetToolEnvironment:
    """Tasks from files, tools from a module, a reward by import path (see the module doc).

    ``train``, ``eval``: task files (``.jsonl`` or ``.parquet``); without ``eval``,
    ``eval_fraction`` of the train tasks (a fixed choice by ``split_seed``) are the eval split and
    left out of train. ``tools``: see :func:`load_tools`. ``reward``: ``"module:function"`` or a
    callable. ``success_threshold``: success is ``reward >= success_threshold``.
    ``system_prompt``: default :data:`DEFAULT_SYSTEM_PROMPT`. ``memory_tools``: ``True`` adds the
    five memory tools bound to the rollout's namespace, a list adds those named.
    ``tool_timeout``: seconds, for tools without a timeout of their own (default: the rollout
    config's). ``mcp_servers``: MCP tool servers (see the module doc; ``mcp_servers`` holds the
    :class:`~agentrl_fast.harness.mcp.MCPServers`, ``None`` without). ``search``: folders the
    modules are imported from after ``sys.path`` (the run passes the config's folder and the
    working directory)."""

    name = "dataset"

    def __init__(self, *, train: str | os.PathLike, reward: str | Callable, tools=None,
                 eval: str | os.PathLike | None = None, eval_fraction: float = 0.1,
                 split_seed: int = 0, prompt_key: str = "prompt",
                 system_prompt: str | None = None, success_threshold: float = 1.0,
                 memory_tools: bool | Sequence[str] = False, tool_timeout: float | None = None,
                 score_truncated: bool = False, mcp_servers: Sequence[Mapping] | None = None,
                 search: Iterable[str | Path] = ()):
        search = list(search)
        if not isinstance(prompt_key, str) or not prompt_key:
            raise ConfigError(f"env.args.prompt_key: expected a field name, got {prompt_key!r}")
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, numbers.Real) \
                or not 0.0 <= eval_fraction < 1.0:
            raise ConfigError(f"env.args.eval_fraction: expected a number in [0, 1), "
                              f"got {eval_fraction!r}")
        if isinstance(success_threshold, bool) or not isinstance(success_threshold, numbers.Real) \
                or not 0.0 < success_threshold <= 1.0:
            raise ConfigError(f"env.args.success_threshold: expected a number in (0, 1], "
                              f"got {success_threshold!r}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ConfigError(f"env.args.system_prompt: expected text, got "
                              f"{type(system_prompt).__name__}")
        if tool_timeout is not None and (isinstance(tool_timeout, bool)
                                         or not isinstance(tool_timeout, numbers.Real)
                                         or not tool_timeout > 0):
            raise ConfigError(f"env.args.tool_timeout: expected seconds > 0, got {tool_timeout!r}")
        self.prompt_key = prompt_key
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.success_threshold = float(success_threshold)
        self.score_truncated = bool(score_truncated)
        self.tools = [t if tool_timeout is None or t.inline or t.timeout is not None
                      else dataclasses.replace(t, timeout=float(tool_timeout))
                      for t in load_tools(tools, search)]
        self.memory_tool_names = self._memory_tool_names(memory_tools)
        clash = {t.name for t in self.tools} & set(self.memory_tool_names)
        if clash:
            raise ConfigError(f"env.args.tools: {', '.join(sorted(clash))} is also a memory "
                              "tool's name; rename the tool or leave memory_tools off")
        if isinstance(reward, str):
            reward = import_object(reward, "env.args.reward", search)
        if not callable(reward):
            raise ConfigError(f"env.args.reward: expected a function (answer, task) -> float, "
                              f"got {type(reward).__name__}")
        self.reward = reward
        self.reward_takes_state = _reward_takes_state(reward, "env.args.reward")
        self._reward_error_logged = False
        tasks = load_tasks(_find_file(train, "env.args.train", search), prompt_key)
        if eval is not None:
            self._tasks = {"train": tasks,
                           "eval": load_tasks(_find_file(eval, "env.args.eval", search),
                                              prompt_key)}
        else:
            held = round(len(tasks) * eval_fraction)
            held = min(max(held, 1 if eval_fraction > 0 else 0), len(tasks) - 1)
            chosen = set(random.Random(f"dataset/eval/{split_seed}").sample(range(len(tasks)),
                                                                            held))
            self._tasks = {"train": [t for i, t in enumerate(tasks) if i not in chosen],
                           "eval": [t for i, t in enumerate(tasks) if i in chosen]}
        self.mcp_servers = self._mcp_servers(mcp_servers, search)

    def _mcp_servers(self, specs, search: list):
        """The MCP servers, started (last: nothing else can fail after them), or ``None``."""
        if not specs:
            return None
        from agentrl_fast.harness.mcp import MCPServerError, MCPServers
        taken = {t.name: f"the Python tool {t.name!r} (env.args.tools)" for t in self.tools}
        taken.update((n, f"the memory tool {n!r}") for n in self.memory_tool_names)
        try:
            servers = MCPServers(specs, search=search, reserved=taken,
                                 where="env.args.mcp_servers")
        except (ValueError, TypeError) as error:
            raise ConfigError(str(error)) from None
        try:
            servers.start()
        except (MCPServerError, ValueError) as error:
            servers.close()
            raise ConfigError(f"env.args.mcp_servers: {error}") from None
        except BaseException:
            servers.close()
            raise
        return servers

    def close(self) -> None:
        """Stop the MCP servers (every rollout's and the shared ones); idempotent."""
        if self.mcp_servers is not None:
            self.mcp_servers.close()

    @staticmethod
    def _memory_tool_names(memory_tools) -> tuple[str, ...]:
        if memory_tools is False or memory_tools is None:
            return ()
        if not isinstance(memory_tools, (bool, str, list, tuple)):
            raise ConfigError(f"env.args.memory_tools: expected true, false or a list of memory "
                              f"tool names, got {memory_tools!r}")
        with MemoryStore() as store:
            every = tuple(t.name for t in store.namespace("names").tools())
        if memory_tools is True:
            return every
        names = [memory_tools] if isinstance(memory_tools, str) else list(memory_tools)
        unknown = [n for n in names if n not in every]
        if unknown:
            raise ConfigError(f"env.args.memory_tools: {unknown[0]!r} is not a memory tool; "
                              f"pass true, or some of {', '.join(every)}")
        return tuple(names)

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        return self._tasks[split]

    def start(self, task: Task, memory: MemoryNamespace, seed: int) -> DatasetEpisode:
        return DatasetEpisode(self, task, memory)

    def row(self, task: Task) -> dict:
        """What the reward function gets as ``task``: the task's row (a fresh dict)."""
        return {"id": task.id, self.prompt_key: task.prompt, **task.data}

    def _report_reward_error(self, task: Task, error: Exception) -> None:
        if not self._reward_error_logged:
            self._reward_error_logged = True
            logger.warning("the reward function %s failed on task %r; the episode's reward is 0 "
                           "and it counts in the reward_errors metric (later failures are "
                           "counted, not logged)", getattr(self.reward, "__name__", self.reward),
                           task.id, exc_info=error)

    def words(self) -> tuple[str, ...]:
        """Names the built-in tokenizer keeps whole: the tool names."""
        mcp = tuple(self.mcp_servers.tool_names) if self.mcp_servers is not None else ()
        return tuple(t.name for t in self.tools) + mcp + self.memory_tool_names

    def corpus(self, max_tasks: int = 2000) -> list[str]:
        """Text for the built-in tokenizer: the system prompt with the tools header (weighted:
        it starts every sub-trace), call skeletons of each tool, the train prompts and answers."""
        train = self.tasks("train")[:max_tasks]
        with MemoryStore() as store:
            episode = self.start(train[0], store.namespace("corpus"), seed=0)
            schemas = [t.schema for t in episode.tools]
            close_episode(episode)
        header = render_messages([{"role": "system", "content": self.system_prompt}],
                                 tools=schemas)
        calls = [f'{TOOL_CALL_OPEN}\n{{"name": "{s["function"]["name"]}", "arguments": '
                 + json.dumps({p: "" for p in s["function"]["parameters"].get("properties", {})})
                 for s in schemas]
        answers = [str(t.data["answer"]) for t in train if isinstance(t.data.get("answer"),
                                                                      (str, int, float))]
        return [header] * 50 + calls * 20 + [t.prompt for t in train] + answers
