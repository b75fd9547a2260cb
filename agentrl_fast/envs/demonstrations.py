"""Demonstrations for a warm-start from a scripted policy: :func:`write_demonstrations` runs a
policy written in plain Python (no model) through episodes of any environment, its tool calls
through the episode's real tools, and writes the conversations as OpenAI-style messages, one
JSON object a line (what ``warmstart.data`` and :mod:`agentrl_fast.train.demos` read)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

from agentrl_fast.harness.environment import Task, check_episode, close_episode, episode_success
from agentrl_fast.harness.memory import MemoryStore
from agentrl_fast.harness.tool_calls import TOOL_CALL_OPEN, ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import ToolRegistry
from agentrl_fast.seeds import derive_seed

__all__ = ["write_demonstrations"]


def _call_message(call: Mapping, where: str, index: int, default_id: str) -> dict:
    """One of a policy's tool calls (``{"name", "arguments"}`` or OpenAI's ``{"function":
    {...}}``, arguments a dict or a JSON string) in OpenAI's form, arguments as a JSON string."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: tool_calls[{index}] must be a dict with a 'name' (or "
                         f"'function': {{'name', 'arguments'}}), got {call!r:.80}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}: tool_calls[{index}] arguments must be an object")
    return {"id": call.get("id") or default_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _assistant_message(output, where: str, turn: int) -> dict:
    """A policy's output (a message dict, or text whose ``<tool_call>`` blocks are its calls) as
    an OpenAI assistant message with call ids unique in the conversation."""
    if isinstance(output, str):
        calls = parse_tool_calls(output)
        bad = next((c for c in calls if not c.ok), None)
        if bad is not None:
            raise ValueError(f"{where}: the policy wrote a bad tool call ({bad.error})")
        output = {"content": output.split(TOOL_CALL_OPEN)[0].strip() if calls else output,
                  "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}
    if not isinstance(output, Mapping):
        raise TypeError(f"{where}: the policy must return an assistant message dict or text, "
                        f"got {type(output).__name__}")
    content = output.get("content") or ""
    if not isinstance(content, str):
        raise TypeError(f"{where}: the message's content must be text")
    message = {"role": "assistant", "content": content}
    calls = output.get("tool_calls") or []
    if calls:
        message["tool_calls"] = [_call_message(c, where, j, f"call_{turn}_{j}")
                                 for j, c in enumerate(calls)]
    return message


def write_demonstrations(environment, policy: Callable[[Task, list[dict]], Mapping | str],
                         path: str | os.PathLike, tasks: Sequence[Task] | None = None, *,
                         keep_failed: bool = False, max_turns: int = 16,
                         tool_timeout: float = 30.0, seed: int = 0) -> int:
    """Run ``policy`` on ``tasks`` (default: the train split) through ``environment``'s real
    episodes and write the conversations to ``path`` (JSONL); returns the lines written.

    ``policy(task, messages) -> message``: the next assistant message given the conversation so
    far (OpenAI-style dicts): ``{"content": ..., "tool_calls": [{"name", "arguments"}, ...]}``
    (OpenAI's ``{"function": {...}}`` form too), or text with ``<tool_call>`` blocks. The calls
    run through a :class:`~agentrl_fast.harness.tools.ToolRegistry` of the episode's tools
    (memory tools on a namespace of their own per task); a message without calls is the final
    answer, which the episode scores. After ``max_turns`` calling turns the episode is
    truncated (``finish(None)``). Only successful episodes are written unless ``keep_failed``.

    Each line: ``{"messages": [system, user, assistant (with "tool_calls": [{"id", "type":
    "function", "function": {"name", "arguments": <JSON string>}}]), tool ({"tool_call_id",
    "name", "content"}), ..., final assistant], "tools": [the episode's tool schemas],
    "task_id": ..., "reward": ...}`` — what ``render_messages(messages, tools)`` and TRL's SFT
    trainer read. Call it outside a running event loop (the tools run under ``asyncio.run``).
    """
    tasks = environment.tasks("train") if tasks is None else tasks
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with MemoryStore() as store, open(path, "w", encoding="utf-8") as out:
        for task in tasks:
            memory = store.namespace(f"demonstration/{task.id}")
            memory.clear()
            episode = environment.start(task, memory, derive_seed(seed, task.id, 0))
            check_episode(episode, environment)
            registry = ToolRegistry(episode.tools, default_timeout=tool_timeout)
            messages = [{"role": "system", "content": episode.system_prompt},
                        {"role": "user", "content": episode.prompt}]
            answer = None
            for turn in range(max_turns + 1):
                where = f"write_demonstrations: task {task.id!r}, turn {turn}"
                message = _assistant_message(policy(task, json.loads(json.dumps(messages))),
                                             where, turn)
                if "tool_calls" not in message:
                    messages.append(message)
                    answer = message["content"]
                    break
                if turn == max_turns:
                    break  # truncated: the calls of a turn past the limit never ran
                messages.append(message)
                calls = [ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in message["tool_calls"]]
                results = registry.execute_sync(calls)
                messages += [{"role": "tool", "tool_call_id": c["id"], "name": r.name,
                              "content": r.content} for c, r in zip(message["tool_calls"],
                                                                    results)]
                episode.after_tools(calls, results)
            reward = episode.finish(answer)
            close_episode(episode)
            if keep_failed or episode_success(episode):
                out.write(json.dumps({"messages": messages, "tools": registry.schemas,
                                      "task_id": task.id, "reward": reward},
                                     ensure_ascii=False) + "\n")
                written += 1
    return written
