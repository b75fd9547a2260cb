"""Anthropic's Messages API on the proxy (``POST /s/{session}/v1/messages``): the request is
translated into the chat form the sessions hold and the reply back into an Anthropic message,
so a Claude-Code-style harness extends its session token for token exactly as a
chat-completions harness does.

Request: ``system`` (a string or text blocks) becomes the first system message; a user
message's ``tool_result`` blocks become consecutive tool messages (the OpenAI form) and its text
blocks one user message after them; an assistant message's ``thinking`` block, text blocks and
``tool_use`` blocks become one assistant message (``tool_use.id`` the call id, ``input`` the
arguments). ``tools`` become function tools; ``tool_choice`` ``auto``/``any``/``tool``/``none``
become ``"auto"``/``"required"``/a named function/``"none"``; ``stop_sequences`` the stop
strings; ``temperature``/``top_p``/``top_k`` may restate the run's only. ``cache_control`` is
accepted anywhere and ignored, as are ``metadata`` and ``thinking`` (the run's model and chat
format decide whether it thinks). Images, documents, server tools, ``redacted_thinking`` (the
proxy never sends one, and cannot render it) and options that would change decoding are refused.

Thinking: Qwen3 writes its reasoning as ``<think>\\n...\\n</think>\\n\\n`` at the start of its
content. :class:`ThinkingSplit` cuts it into a ``thinking`` block and the text (streamed too),
and :func:`join_thinking` puts a returned block back into exactly the content the session
holds (its ``signature`` records the separator the model wrote), so a harness that returns its
thinking blocks extends its session; the template renders that ``<think>`` block as it does an
assistant's ``reasoning_content``.

Reply: ``[thinking?, text?, tool_use...]`` with ``stop_reason`` ``end_turn``, ``tool_use``,
``max_tokens`` or ``stop_sequence``; streamed as Anthropic's server-sent events (text and
thinking deltas as they come, each ``tool_use`` whole at the end). Errors on this route are
Anthropic-shaped: ``{"type": "error", "error": {"type", "message"}}`` (:func:`error_body`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from agentrl_fast.harness.chat_format import ChatFormat, THINK_CLOSE, THINK_OPEN
from agentrl_fast.proxy.session import MAX_STOP_STRINGS, ChatRequest, ProxyError, Reply
from agentrl_fast.proxy.stream import _held_from

__all__ = ["ThinkingSplit", "chat_body", "error_body", "is_messages_path", "join_thinking",
           "message_events", "message_of"]

_IGNORED = ("model", "metadata", "cache_control", "service_tier", "inference_geo", "speed")
_KNOWN = ("messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences",
          "temperature", "top_p", "top_k", "stream", "thinking", "output_config", *_IGNORED)
_REFUSED = {"container": "the proxy runs no code containers",
            "mcp_servers": "the proxy connects to no MCP servers; run the tools in the harness",
            "context_management": "the harness manages its own context"}
_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def _bad(message: str, param: str | None) -> ProxyError:
    return ProxyError(400, message, param)


def error_body(error: ProxyError) -> dict:
    """Anthropic's error body of ``error`` (a session conflict, 409, is an
    ``invalid_request_error``; any other 5xx an ``api_error``)."""
    kind = _ERROR_TYPES.get(error.status,
                            "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is under a session's ``/v1/messages`` (its errors are Anthropic's)."""
    return path.startswith("/s/") and "/v1/messages" in path


# -- thinking: Qwen3's <think> block <-> a thinking block --------------------------------------

_OPEN, _CLOSE, _SEP = THINK_OPEN + "\n", "\n" + THINK_CLOSE, "\n\n"
# A thinking block's signature: what followed </think> (the text's separator), or that the
# block never closed (the reply was cut). Opaque to clients, who send it back unchanged.
_SIGNATURES = {_SEP: "agentrl_fast.think.blank_line", "": "agentrl_fast.think.joined",
               None: "agentrl_fast.think.unclosed"}
_SEPARATORS = {signature: sep for sep, signature in _SIGNATURES.items()}


class ThinkingSplit:
    """An assistant's content, as it comes, cut into ``("thinking", delta)``, one
    ``("signature", s)`` that ends the thinking block, and ``("text", delta)``. Content that
    starts with ``<think>\\n`` and holds ``\\n</think>`` thinks; the blank line after the close
    is the separator. The pieces do not depend on how the content is chunked (a suffix that
    may begin ``\\n</think>`` is held back), so a streamed reply splits as a whole one does."""

    def __init__(self):
        self.state = "start"  # start -> thinking -> closed -> text, or start -> text
        self.buffer = ""  # content not yet handed out

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.buffer += delta
        out: list[tuple[str, str]] = []
        if self.state == "start":
            if self.buffer.startswith(_OPEN):
                self.state, self.buffer = "thinking", self.buffer[len(_OPEN):]
            elif not _OPEN.startswith(self.buffer):
                self.state = "text"
        if self.state == "thinking":
            close = self.buffer.find(_CLOSE)
            if close < 0:
                held = _held_from(self.buffer, _CLOSE)
                out.append(("thinking", self.buffer[:held]))
                self.buffer = self.buffer[held:]
            else:
                out.append(("thinking", self.buffer[:close]))
                self.state, self.buffer = "closed", self.buffer[close + len(_CLOSE):]
        if self.state == "closed" and not _SEP.startswith(self.buffer):
            sep = _SEP if self.buffer.startswith(_SEP) else ""
            out.append(("signature", _SIGNATURES[sep]))
            self.state, self.buffer = "text", self.buffer[len(sep):]
        if self.state == "text":
            out.append(("text", self.buffer))
            self.buffer = ""
        return [(kind, text) for kind, text in out if text]

    def finish(self) -> list[tuple[str, str]]:
        """The rest, once the content is whole."""
        out: list[tuple[str, str]] = []
        if self.state == "thinking":
            out += [("thinking", self.buffer), ("signature", _SIGNATURES[None])]
        elif self.state == "closed":  # "", "\n" or "\n\n" after </think>
            sep = _SEP if self.buffer.startswith(_SEP) else ""
            out += [("signature", _SIGNATURES[sep]), ("text", self.buffer[len(sep):])]
        else:
            out.append(("text", self.buffer))
        self.buffer = ""
        return [(kind, text) for kind, text in out if text]


def split_thinking(content: str) -> tuple[str | None, str | None, str]:
    """``(thinking, signature, text)`` of a whole reply's content (no thinking: ``None``s)."""
    parts = ThinkingSplit()
    pieces = parts.feed(content) + parts.finish()
    signature = next((text for kind, text in pieces if kind == "signature"), None)
    thinking = "".join(text for kind, text in pieces if kind == "thinking")
    return (thinking if signature else None, signature,
            "".join(text for kind, text in pieces if kind == "text"))


def join_thinking(thinking: str, signature: Any, text: str) -> str:
    """The content a thinking block and the text after it came from (the inverse of
    :class:`ThinkingSplit`; a signature the proxy did not write reads as the blank line)."""
    sep = _SEPARATORS.get(signature, _SEP) if isinstance(signature, str) else _SEP
    if sep is None:
        if not text:
            return _OPEN + thinking
        sep = _SEP  # text after an unclosed block: not the proxy's; the template's form
    return f"{_OPEN}{thinking}{_CLOSE}{sep}{text}"


# -- request -> the chat body ---------------------------------------------------------------------

def _blocks(content: Any, where: str) -> list[dict]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content blocks", where)
    for j, block in enumerate(content):
        if not (isinstance(block, dict) and isinstance(block.get("type"), str)):
            raise _bad(f"{where}[{j}] must be a content block {{\"type\": ..., ...}}",
                       f"{where}[{j}]")
    return content


def _string(block: dict, name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise _bad(f"{where}.{name} must be a string, got {type(value).__name__}",
                   f"{where}.{name}")
    return value


def _texts(content: Any, where: str, what: str) -> str:
    """The text of ``content``: a string or text blocks (``cache_control`` ignored)."""
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise _bad(f"{where}[{j}] is a {block['type']!r} block; {what} takes text blocks "
                       "only (the proxy serves a text model)", f"{where}[{j}]")
        texts.append(_string(block, "text", f"{where}[{j}]"))
    return "".join(texts)


def _user(content: Any, where: str) -> list[dict]:
    """A user message: its tool results as tool messages, then its text as a user message."""
    tools, texts = [], []
    for j, block in enumerate(_blocks(content, where)):
        at = f"{where}[{j}]"
        if block["type"] == "tool_result":
            _string(block, "tool_use_id", at)
            result = "" if block.get("content") is None else block["content"]
            if not isinstance(block.get("is_error", False), (bool, type(None))):
                raise _bad(f"{at}.is_error must be a boolean", f"{at}.is_error")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": _texts(result, f"{at}.content", "a tool_result")})
        elif block["type"] == "text":
            texts.append(_string(block, "text", at))
        else:
            raise _bad(f"{at} is a {block['type']!r} block; a user message takes text and "
                       "tool_result blocks (the proxy serves a text model)", at)
    if texts or not tools:
        return [*tools, {"role": "user", "content": "".join(texts)}]
    return tools


def _assistant(content: Any, where: str) -> dict:
    """An assistant message: its thinking block, text and tool_use blocks as one message."""
    thinking, texts, calls = None, [], []
    for j, block in enumerate(_blocks(content, where)):
        at, kind = f"{where}[{j}]", block["type"]
        if kind == "thinking" and j == 0:
            thinking = (_string(block, "thinking", at), block.get("signature"))
        elif kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_use":
            name, call_id = _string(block, "name", at), _string(block, "id", at)
            if not isinstance(block.get("input"), dict):
                raise _bad(f"{at}.input must be an object", f"{at}.input")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": block["input"]}})
        elif kind == "redacted_thinking":
            raise _bad(f"{at}: redacted_thinking blocks are not supported: the proxy never "
                       "sends one and cannot render it; drop it", at)
        elif kind == "thinking":
            raise _bad(f"{at}: a thinking block must be the message's first block", at)
        else:
            raise _bad(f"{at} is a {kind!r} block; an assistant message takes thinking, text "
                       "and tool_use blocks", at)
    text = "".join(texts)
    message = {"role": "assistant",
               "content": join_thinking(*thinking, text) if thinking else text}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(raw: Any, system: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    messages = [] if system is None else [{"role": "system",
                                           "content": _texts(system, "system", "system")}]
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            messages += _user(message.get("content"), f"{where}.content")
        elif role == "assistant":
            messages.append(_assistant(message.get("content"), f"{where}.content"))
        else:
            raise _bad(f"{where}.role must be user or assistant, got {role!r}", f"{where}.role")
    if raw[-1]["role"] == "assistant":
        raise _bad(f"messages[{len(raw) - 1}]: the messages end with the assistant's turn; the "
                   "proxy samples the next one after user input (no prefill)",
                   f"messages[{len(raw) - 1}]")
    return messages


def _tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"{where} must be a client tool {{\"name\", \"input_schema\"}}, got type "
                       f"{kind!r}; the proxy runs no server tools", where)
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"{where}.input_schema must be a JSON schema object",
                       f"{where}.input_schema")
        function = {"name": tool["name"]}  # in OpenAI's order: the template renders it so
        if tool.get("description") is not None:
            function["description"] = _string(tool, "description", where)
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    """Anthropic's tool_choice as OpenAI's (``None``: omitted)."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice must be {\"type\": \"auto\"|\"any\"|\"tool\"|\"none\"}",
                   "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        raise _bad("tool_choice.disable_parallel_tool_use must be false or omitted: the proxy "
                   "does not constrain decoding", "tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def _check_options(body: dict) -> None:
    """The top-level fields: known ones only; what the proxy cannot serve refused."""
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise _bad(f"{name} is not supported: {why}", name)
    unknown = sorted(set(body) - set(_KNOWN))
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r}; the proxy serves "
                   + ", ".join(_KNOWN), unknown[0])
    if body.get("max_tokens") is None:
        raise _bad("max_tokens is required", "max_tokens")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict)
                                     and thinking.get("type") in _THINKING_TYPES):
        raise _bad("thinking must be {\"type\": \"enabled\", \"budget_tokens\": n} or "
                   "{\"type\": \"disabled\"|\"adaptive\"}", "thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if thinking is not None and thinking["type"] == "enabled" and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise _bad(f"thinking.budget_tokens must be an integer >= 1, got {budget!r}",
                   "thinking.budget_tokens")
    output = body.get("output_config")
    if output is not None and not (isinstance(output, dict) and output.get("format") is None):
        raise _bad("output_config.format must be omitted: the proxy does not constrain "
                   "decoding", "output_config.format")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS
                                  and all(isinstance(s, str) and s for s in stops)):
        raise _bad(f"stop_sequences must be a list of at most {MAX_STOP_STRINGS} non-empty "
                   "strings", "stop_sequences")


def chat_body(body: Any) -> dict:
    """The ``/chat/completions`` body of a ``/messages`` body; :class:`ProxyError` (400)
    naming the field for what the proxy cannot serve."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    _check_options(body)
    chat = {"messages": _messages(body.get("messages"), body.get("system")),
            "tools": _tools(body.get("tools")), "max_tokens": body["max_tokens"],
            "stream": body.get("stream", False), "stop": body.get("stop_sequences") or None,
            "tool_choice": _tool_choice(body.get("tool_choice"))}
    for name in ("temperature", "top_p", "top_k"):  # checked as in chat: the run's only
        chat[name] = body.get(name)
    return {name: value for name, value in chat.items() if value is not None}


# -- the reply as an Anthropic message ------------------------------------------------------------

def _stop_reason(reply: Reply, request: ChatRequest, chat_format: ChatFormat
                 ) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``: a stop string cut the reply when its kept ids end
    with one and not with ``<|im_end|>``."""
    if reply.finish_reason == "length":
        return "max_tokens", None
    if reply.tool_calls:
        return "tool_use", None
    if request.stop and reply.ids and reply.ids[-1] != chat_format.im_end_id:
        text = chat_format.decode(reply.ids)
        for stop in request.stop:
            if text.endswith(stop):
                return "stop_sequence", stop
    return "end_turn", None


def _content(reply: Reply) -> list[dict]:
    """``[thinking?, text?, tool_use...]``; a turn without calls always has its text block, so
    a harness that sends the reply back sends the turn the session holds."""
    thinking, signature, text = split_thinking(reply.content or "")
    blocks = []
    if thinking is not None:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": signature})
    if text or not reply.tool_calls:
        blocks.append({"type": "text", "text": text})
    for call in reply.tool_calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def message_of(reply: Reply, usage: dict, request: ChatRequest, chat_format: ChatFormat,
               model: str, message_id: str | None = None) -> dict:
    """The Anthropic message of a completed turn."""
    stop_reason, stop_sequence = _stop_reason(reply, request, chat_format)
    return {"id": message_id or f"msg_{uuid.uuid4().hex}", "type": "message",
            "role": "assistant", "model": model, "content": _content(reply),
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(usage)}


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class _Blocks:
    """The content blocks of a streamed message: which is open, at which index."""

    def __init__(self):
        self.count, self.open = 0, None

    def start(self, block: dict) -> str:
        self.open = block["type"]
        return _event("content_block_start", index=self.count, content_block=block)

    def delta(self, delta: dict) -> str:
        return _event("content_block_delta", index=self.count, delta=delta)

    def stop(self) -> str:
        self.open, self.count = None, self.count + 1
        return _event("content_block_stop", index=self.count - 1)


def _piece_events(blocks: _Blocks, kind: str, text: str) -> list[str]:
    """The events of one :class:`ThinkingSplit` piece."""
    out = []
    if kind == "text" and blocks.open != "text":
        out.append(blocks.start({"type": "text", "text": ""}))
    if kind in ("thinking", "signature") and blocks.open != "thinking":
        out.append(blocks.start({"type": "thinking", "thinking": "", "signature": ""}))
    if kind == "signature":
        return out + [blocks.delta({"type": "signature_delta", "signature": text}),
                      blocks.stop()]
    return out + [blocks.delta({"type": f"{kind}_delta", kind: text})]


async def message_events(parts: AsyncIterator, request: ChatRequest, chat_format: ChatFormat,
                         model: str) -> AsyncIterator[str]:
    """The streamed message of ``parts`` (the proxy's ``("content", delta)`` ...
    ``("reply", ...)`` or ``("error", ...)``): ``message_start``, the thinking and text blocks'
    deltas as they come, each ``tool_use`` block whole, ``message_delta`` (stop reason, usage),
    ``message_stop``; or an ``error`` event."""
    message_id, blocks, split = f"msg_{uuid.uuid4().hex}", _Blocks(), ThinkingSplit()
    yield _event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0}})
    async for kind, value in parts:
        if kind == "error":
            yield _event("error", **{k: v for k, v in error_body(value).items() if k != "type"})
            return
        pieces = split.feed(value if kind == "content" else value[2])
        for piece in pieces + (split.finish() if kind == "reply" else []):
            for line in _piece_events(blocks, *piece):
                yield line
        if kind == "reply":
            reply, usage, _ = value
            message = message_of(reply, usage, request, chat_format, model, message_id)
            for block in message["content"][blocks.count + (blocks.open is not None):]:
                if blocks.open is not None:
                    yield blocks.stop()
                if block["type"] == "text":  # an empty one: none came
                    yield blocks.start(block)
                    continue
                yield blocks.start({**block, "input": {}})
                yield blocks.delta({"type": "input_json_delta",
                                    "partial_json": json.dumps(block["input"])})
            if blocks.open is not None:
                yield blocks.stop()
            yield _event("message_delta", delta={"stop_reason": message["stop_reason"],
                                                 "stop_sequence": message["stop_sequence"]},
                         usage=message["usage"])
            yield _event("message_stop")
