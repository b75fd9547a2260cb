"""Demonstrations from data: a JSONL file of OpenAI-style conversations, each line
``{"messages": [...], "tools": [...]}`` (``tools`` optional: JSON schemas as chat templates take
them), turned into sub-traces the supervised warm-start trains on (:func:`~.sft.sft`).

Messages follow the chat-completions format: ``system`` / ``user`` / ``assistant`` / ``tool``
roles, assistant ``tool_calls`` as ``[{"type": "function", "function": {"name", "arguments"}}]``
(``arguments`` a JSON string or an object), ``tool`` messages' ``content`` the result (their
``tool_call_id`` is not rendered: Qwen3's template pairs results with calls by order). Each
conversation is rendered by :class:`~agentrl_fast.harness.ChatFormat` (token-exact with the
model's tokenizer); its assistant turns, and the stop token that ends each, are the tokens
trained on. The dataset tool environment writes such files from a scripted policy
(:func:`agentrl_fast.envs.demonstrations.write_demonstrations`).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.trajectory import SubTrace


def load_demonstrations(path: str | Path, chat_format: ChatFormat,
                        max_tokens: int | None = None) -> list[SubTrace]:
    """One sub-trace per line of ``path`` (see the module doc). A line that is not a JSON object
    with a ``messages`` list, a conversation the chat format rejects, one without an assistant
    turn, or one longer than ``max_tokens``: a ValueError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"demonstrations {path}: cannot read ({error.strerror or error})") from None
    sub_traces = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        sub_trace = _sub_trace(_conversation(line, where), chat_format, where, len(sub_traces))
        if max_tokens is not None and len(sub_trace) > max_tokens:
            raise ValueError(f"{where}: the conversation is {len(sub_trace)} tokens, over "
                             f"{max_tokens} (the model's context); shorten or drop it")
        sub_traces.append(sub_trace)
    if not sub_traces:
        raise ValueError(f"demonstrations {path}: no conversations in the file")
    return sub_traces


def _conversation(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(f"{where}: expected an object with a 'messages' list, got "
                         f"{line[:80]!r}")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: 'tools' must be a list of JSON schemas, got "
                         f"{type(tools).__name__}")
    return record


def _sub_trace(record: dict, chat_format: ChatFormat, where: str, index: int) -> SubTrace:
    """The conversation's ids, its assistant output and stop tokens as action tokens."""
    if chat_format.stop_mode == "tool_call":  # a model stops at its first </tool_call>
        for i, message in enumerate(record["messages"]):
            if isinstance(message, dict) and len(message.get("tool_calls") or []) > 1:
                raise ValueError(f"{where}: messages[{i}] makes {len(message['tool_calls'])} "
                                 "calls in one turn, but the model stops at its first "
                                 "</tool_call> (stop_mode 'tool_call'): split them into turns")
    try:
        ids, mask = chat_format.encode_messages(record["messages"], record.get("tools"))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    if not any(mask):
        raise ValueError(f"{where}: the conversation has no assistant turn to learn from")
    sub_trace = SubTrace(rollout_id=f"demo-{index}")
    for action, run in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]):
        run_ids = [token for token, _ in run]  # a run of context, then of action, ...
        if action:
            sub_trace.append_action(run_ids, [0.0] * len(run_ids))
        else:
            sub_trace.append_context(run_ids)
    sub_trace.close("terminal")
    return sub_trace
