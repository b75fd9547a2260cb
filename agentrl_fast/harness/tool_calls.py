"""Parsing the model's tool calls out of its text: ``<tool_call>{json}</tool_call>`` blocks.

:func:`parse_tool_calls` is total: whatever the model wrote, it returns one :class:`ToolCall` per
block, either a call or an error the model will read back, and never raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_WHITESPACE = " \t\n\r"


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block. A call has ``name`` (str), ``arguments`` (dict) and
    ``error is None``; a block that is not a valid call has ``error`` (a message for the model),
    ``arguments == {}`` and ``name`` when one could be read. ``text`` is the block's raw body."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _decode_error(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno} column {error.colno}"
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error)


def _call_from_object(obj, body: str) -> ToolCall:
    expected = 'write {"name": <tool name>, "arguments": {<argument>: <value>, ...}}'
    if not isinstance(obj, dict):
        return ToolCall(None, error=f"a tool call must be a JSON object; {expected}", text=body)
    name = obj.get("name")
    if "name" not in obj:
        return ToolCall(None, error=f'the tool call has no "name"; {expected}', text=body)
    if not isinstance(name, str) or not name:
        try:
            shown = json.dumps(name)
        except RecursionError:  # decoded just under the stack limit, too deep to encode again
            shown = "a value nested too deeply"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return ToolCall(None, error=f'"name" must be a non-empty string, got {shown}', text=body)
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _DECODER.decode(arguments)
        except Exception as error:  # noqa: BLE001 - any failure is the model's to read
            return ToolCall(name, error=f'"arguments" is a string that is not a JSON object '
                            f"({_decode_error(error)}); {expected}", text=body)
    if not isinstance(arguments, dict):
        kind = "null" if arguments is None else type(arguments).__name__
        kind = {"str": "string", "list": "array", "int": "number", "float": "number",
                "bool": "boolean"}.get(kind, kind)
        return ToolCall(name, error=f'"arguments" must be a JSON object, got {kind}; {expected}',
                        text=body)
    return ToolCall(name, arguments, text=body)


def _parse_body(body: str) -> ToolCall:
    try:
        obj = _DECODER.decode(body.strip(_WHITESPACE))
    except Exception as error:  # noqa: BLE001
        return ToolCall(None, error=f"invalid JSON in <tool_call>: {_decode_error(error)}",
                        text=body)
    return _call_from_object(obj, body)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """All ``<tool_call>`` blocks of ``text`` in order, each a call or a parse error.

    A block runs from ``<tool_call>`` to the ``</tool_call>`` after its JSON object (so the tag
    may appear inside a JSON string), else to the next ``</tool_call>``. Errors: invalid JSON,
    a non-object, a missing or non-string ``name``, ``arguments`` that is not an object (a JSON
    string holding an object is accepted; a missing ``arguments`` means ``{}``), and a block
    with no ``</tool_call>`` before the next ``<tool_call>`` or the end. Text outside blocks is
    ignored. Never raises on a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls: text must be a str, got {type(text).__name__}")
    calls: list[ToolCall] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, position)
        if start < 0:
            return calls
        body_start = start + len(TOOL_CALL_OPEN)
        # The JSON object first: a closing tag inside one of its strings does not end the block.
        try:
            obj, end = _DECODER.raw_decode(text, _skip_whitespace(text, body_start))
        except Exception:  # noqa: BLE001 - not a clean JSON value; fall back to the tags
            obj, end = None, -1
        if end >= 0:
            close = _skip_whitespace(text, end)
            if text.startswith(TOOL_CALL_CLOSE, close):
                calls.append(_call_from_object(obj, text[body_start:close]))
                position = close + len(TOOL_CALL_CLOSE)
                continue
        close = text.find(TOOL_CALL_CLOSE, body_start)
        following = text.find(TOOL_CALL_OPEN, body_start)
        if close >= 0 and (following < 0 or close < following):
            calls.append(_parse_body(text[body_start:close]))
            position = close + len(TOOL_CALL_CLOSE)
            continue
        block_end = following if following >= 0 else len(text)
        body = text[body_start:block_end]
        calls.append(ToolCall(None, error="unclosed <tool_call> block: end each call with "
                              "</tool_call>", text=body))
        if following < 0:
            return calls
        position = following
