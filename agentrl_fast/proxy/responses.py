"""OpenAI's Responses API on the proxy (``POST /s/{session}/v1/responses``): the request is
translated into the chat form the sessions hold (input items into messages), and the reply back
into output items, so a harness on the Responses API (the OpenAI Agents SDK's default model,
for one) extends its session token for token exactly as a chat-completions harness does.

Input items: ``message`` (roles user, system, developer, assistant; text parts
``input_text``/``output_text``), ``function_call`` (joins the assistant message before it, as
its tool calls) and ``function_call_output`` (a tool message); ``instructions`` becomes the
first system message. Tools: ``{"type": "function", "name", "description", "parameters"}``.
``previous_response_id`` continues a stored response of the same session
(:class:`ResponseStore`): its conversation and reply come before the new items, the new
``instructions`` replace the old. Several calls of one turn interleaved with their outputs read
as several turns (a function call after tool outputs opens a new assistant turn, the common
case), so such a harness starts a new sub-trace. ``tool_choice`` as on chat completions (a
named function is ``{"type": "function", "name": ...}``). ``conversation`` objects, hosted
tools, non-text inputs and options that would change the run's sampling are refused. Output: a ``message`` item for the content, a ``function_call`` item
per call (``call_id``: the proxy's call id); a reply cut by ``max_output_tokens`` is
``incomplete``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.proxy.session import ChatRequest, ProxyError, Reply, token_logprobs

__all__ = ["ResponseStore", "chat_body", "response_events", "response_of"]

_IGNORED = ("model", "store", "metadata", "parallel_tool_calls", "truncation", "user",
            "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
            "safety_identifier", "service_tier", "max_tool_calls", "stream_options")


def _bad(message: str, param: str | None) -> ProxyError:
    return ProxyError(400, message, param)


def _text(content: Any, param: str) -> str:
    """A message item's content: a string or text parts (``input_text``/``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                and isinstance(part.get("text"), str)):
            raise _bad(f"{param}[{j}] must be a text part {{\"type\": \"input_text\", \"text\": "
                       f"...}}; the proxy serves a text model", f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _messages(items: Any) -> list[dict]:
    """Chat messages of the ``input`` items (a string is one user message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input must be a string or a non-empty list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            if item["role"] not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got "
                           f"{item['role']!r}", f"{where}.role")
            messages.append({"role": item["role"],
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str) or (name == "name" and not item[name]):
                    raise _bad(f"{where}.{name} must be a string", f"{where}.{name}")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(output, f"{where}.output")})
        else:
            raise _bad(f"{where} must be a message, function_call or function_call_output "
                       f"item, got type {kind!r}", where)
    if messages[-1]["role"] == "assistant":
        raise _bad(f"input[{len(items) - 1}]: the input ends with the assistant's turn; the "
                   "proxy samples the next one after user input or tool outputs",
                   f"input[{len(items) - 1}]")
    return messages


def _tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(tool.get("name"), str)):
            raise _bad(f"tools[{i}] must be a function tool {{\"type\": \"function\", \"name\": "
                       f"..., \"parameters\": {{...}}}}; the proxy runs no hosted tools",
                       f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_body(body: Any, history: list[dict] = ()) -> tuple[dict, list[dict]]:
    """``(the /chat/completions body, the conversation)`` of a ``/responses`` body continuing
    ``history`` (chat messages, :meth:`ResponseStore.history`); the conversation is the history
    and the new messages, without the instructions. :class:`ProxyError` (400) naming the
    parameter for what the proxy cannot serve."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise _bad(f"{name} is not supported: the proxy keeps no conversation objects; "
                       "send the input, or previous_response_id", name)
    if body.get("background"):
        raise _bad("background must be false or omitted", "background")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        reasoning = {k: v for k, v in reasoning.items() if v is not None}
    if reasoning not in (None, {}):
        raise _bad("reasoning must be omitted: the run's model and sampling decide", "reasoning")
    text = body.get("text")
    if text not in (None, {}) and (not isinstance(text, dict)
                                   or text.get("format") not in (None, {"type": "text"})):
        raise _bad("text.format must be {\"type\": \"text\"} or omitted: the proxy does not "
                   "constrain decoding", "text.format")
    known = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
             "top_p", "stream", "previous_response_id", "conversation", "prompt", "background",
             "reasoning", "text", "include", "top_logprobs", *_IGNORED}
    unknown = sorted(set(body) - known)
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r}", unknown[0])
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise _bad(f"max_output_tokens must be an integer >= 1, got {limit!r}",
                   "max_output_tokens")
    conversation = [*history, *_messages(body.get("input"))]
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    include = body.get("include") or []
    if not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise _bad("include must be a list of strings", "include")
    chat = {"messages": messages, "tools": _tools(body.get("tools")),
            "max_tokens": body.get("max_output_tokens"), "stream": body.get("stream", False),
            "logprobs": "message.output_text.logprobs" in include}
    for name in ("tool_choice", "temperature", "top_p", "top_logprobs"):  # checked as in chat
        if body.get(name) is not None:
            chat[name] = body[name]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    return chat, conversation


class ResponseStore:
    """The conversations of a proxy's recent responses, for ``previous_response_id``: per
    session (dropped when it finishes) its latest ``per_session`` responses, each the chat
    messages it continued (without the instructions) and its reply as an assistant message. A
    response is reserved when its request starts (a request continuing it before it is done is
    a 409) and kept only when ``store`` is not false."""

    def __init__(self, per_session: int = 16):
        self.per_session = per_session
        self._sessions: dict[str, OrderedDict[str, list[dict] | None]] = {}

    def history(self, session_id: str, body: Any) -> list[dict]:
        """The conversation ``body`` continues: ``[]`` without ``previous_response_id``."""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise _bad("previous_response_id must be a string", "previous_response_id")
        turns = self._sessions.get(session_id, {})
        if previous not in turns:
            raise ProxyError(404, f"previous_response_id {previous!r} is no response of session "
                             f"{session_id} kept by the proxy (its latest {self.per_session}, "
                             "stored ones)", "previous_response_id", "previous_response_not_found")
        if turns[previous] is None:
            raise ProxyError(409, f"previous_response_id {previous!r} is still in flight",
                             "previous_response_id", "session_busy")
        return list(turns[previous])

    def reserve(self, session_id: str, response_id: str) -> None:
        turns = self._sessions.setdefault(session_id, OrderedDict())
        turns[response_id] = None
        while len(turns) > self.per_session:
            turns.popitem(last=False)

    def settle(self, session_id: str, response_id: str, conversation: list[dict] | None,
               reply: Reply | None = None) -> None:
        """Keep the finished response (``reply``), or forget it (``None``: failed, or not to be
        stored)."""
        turns = self._sessions.get(session_id)
        if turns is None or response_id not in turns:
            return
        if reply is None:
            del turns[response_id]
            return
        turns[response_id] = [*conversation, reply.openai_message()]

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


def _head(response_id: str, body: dict, model: str) -> dict:
    """The fields a response has from its start: what it is and what it was asked."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "model": model, "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or []}


def response_of(response_id: str, reply: Reply, usage: dict, request: ChatRequest, body: dict,
                chat_format: ChatFormat, model: str, message_id: str | None = None) -> dict:
    """The ``response`` object of a completed turn (its message item's id ``message_id``). With
    ``include: ["message.output_text.logprobs"]`` the text part carries every sampled token's
    log-prob (the turn's, tool-call blocks included, as in chat completions)."""
    output: list[dict] = []
    logprobs = token_logprobs(chat_format, reply) if request.logprobs else None
    # A turn without calls always has its message, empty or not: a harness that sends the
    # output back then sends the turn the session holds.
    if reply.content or logprobs is not None or not reply.tool_calls:
        part = {"type": "output_text", "text": reply.content or "", "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        output.append({"type": "message", "id": message_id or f"msg_{uuid.uuid4().hex}",
                       "status": "completed", "role": "assistant", "content": [part]})
    for call in reply.tool_calls:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    cut = reply.finish_reason == "length"
    return {**_head(response_id, body, model), "previous_response_id":
            body.get("previous_response_id"),
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None, "instructions": body.get("instructions"), "output": output,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": request.max_tokens,
            "metadata": body.get("metadata") or {}, "store": False,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


class _Events:
    """Server-sent events of the Responses API, numbered."""

    def __init__(self):
        self.number = -1

    def __call__(self, kind: str, **fields) -> str:
        self.number += 1
        payload = {"type": kind, "sequence_number": self.number, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


async def response_events(response_id: str, parts, request: ChatRequest, body: dict,
                          chat_format: ChatFormat, model: str):
    """The streamed response of ``parts`` (the proxy's ``("content", delta)`` ...
    ``("reply", ...)`` or ``("error", ...)``): ``response.created``, the message item with its
    ``output_text`` deltas as they come, each ``function_call`` item, then
    ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``) with the
    whole response, or an ``error`` event."""
    event, message_id, text = _Events(), f"msg_{uuid.uuid4().hex}", None
    start = {**_head(response_id, body, model), "status": "in_progress", "output": []}
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)

    def open_message() -> list[str]:
        part = {"type": "output_text", "text": "", "annotations": []}
        return [event("response.output_item.added", output_index=0, item={
                    "type": "message", "id": message_id, "status": "in_progress",
                    "role": "assistant", "content": []}),
                event("response.content_part.added", part=part, **where)]

    async for kind, value in parts:
        if kind == "error":
            yield event("error", code=value.code, message=value.message, param=value.param)
            return
        delta = value if kind == "content" else value[2]
        if delta:
            if text is None:
                text = ""
                for line in open_message():
                    yield line
            text += delta
            yield event("response.output_text.delta", delta=delta, **where)
        if kind == "reply":
            reply, usage, _ = value
            response = {**response_of(response_id, reply, usage, request, body, chat_format,
                                      model, message_id), "created_at": start["created_at"]}
            for index, item in enumerate(response["output"]):
                if item["type"] == "message":
                    if text is None:  # no text came early: an empty one (log-probs only)
                        for line in open_message():
                            yield line
                    part = item["content"][0]
                    yield event("response.output_text.done", text=part["text"], **where)
                    yield event("response.content_part.done", part=part, **where)
                else:
                    yield event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
            yield event(f"response.{response['status']}", response=response)
