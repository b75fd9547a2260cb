"""The proxy's HTTP surface (FastAPI on uvicorn, the ``serve`` extra): OpenAI's
``/chat/completions`` and ``/responses``, Anthropic's ``/messages`` (JSON or server-sent events,
token by token) and ``/models`` under ``/s/{session}/v1``,
and the session endpoints. Every error is an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` (under ``/messages`` Anthropic's,
:func:`~agentrl_fast.proxy.messages.error_body`); no request can stop the server.

Bodies are read and parsed here (not by FastAPI's models) so that every malformed input gets a
message naming the parameter, and bodies over ``max_body_bytes`` are refused while reading.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrl_fast.proxy.service import Proxy
from agentrl_fast.proxy.session import (ChatRequest, ProxyError, Reply, internal_error,
                                        parse_request, token_logprobs)
from agentrl_fast.proxy.responses import chat_body, response_events, response_of
from agentrl_fast.proxy import messages as anthropic
from agentrl_fast.proxy.stream import ContentStream


def _error(error: ProxyError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _read_json(request: Request, limit: int, *, optional: bool = False) -> Any:
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProxyError(413, f"the request body is over {limit} bytes", None,
                             "request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if optional and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
        # Strings with lone surrogates parse but cannot reach a tokenizer: refuse them here.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as error:
        raise ProxyError(400, f"the request body is not valid JSON (UTF-8): "
                         f"{str(error)[:200]}", None, "invalid_json") from None
    return body


def _fields(body: Any, allowed: tuple[str, ...], shape: str) -> dict:
    """``body`` when it is a JSON object holding only ``allowed`` fields, else a 400."""
    if not isinstance(body, dict):
        raise ProxyError(400, f"the body must be a JSON object {shape}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ProxyError(400, f"unknown field {unknown[0]!r}; the fields are "
                         + ", ".join(allowed), unknown[0])
    return body


def _logprobs(proxy: Proxy, request: ChatRequest, reply: Reply) -> dict | None:
    if not request.logprobs:
        return None
    return {"content": token_logprobs(proxy.chat_format, reply), "refusal": None}


def _completion(proxy: Proxy, request: ChatRequest, reply: Reply, usage: dict) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": proxy.model_name,
            "choices": [{"index": 0, "message": reply.openai_message(),
                         "logprobs": _logprobs(proxy, request, reply),
                         "finish_reason": reply.finish_reason}],
            "usage": usage}


_RUNNING: set[asyncio.Task] = set()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


class _Stream:
    """One streamed completion: the request runs as a task of its own (a client that hangs up
    mid-stream loses the rest of the reply, never the session's turn), the generating thread
    leaves sampled ids in ``_pending`` (waking the loop once per batch of them, not per id), and
    :meth:`parts` turns them into content deltas and the reply (each API formats its events)."""

    def __init__(self, proxy: Proxy, session_id: str, request: ChatRequest):
        self.proxy, self.request = proxy, request
        self.content = ContentStream(proxy.chat_format, request.stop, request.parse_calls,
                                     forced_call=request.tool_choice == "required")
        self._pending: list[int] = []
        self._lock = threading.Lock()
        self._arrived = asyncio.Event()  # set: ids are pending, or the request is over
        loop = asyncio.get_running_loop()

        def push(ids: list[int]) -> None:  # on the generating thread
            with self._lock:
                wake = not self._pending
                self._pending += ids
            if wake:
                try:
                    loop.call_soon_threadsafe(self._arrived.set)
                except RuntimeError:  # the server's loop is gone
                    pass

        self.task = asyncio.ensure_future(proxy.complete(session_id, request, push))
        _RUNNING.add(self.task)  # held: the loop keeps only weak references to tasks
        self.task.add_done_callback(_RUNNING.discard)
        self.task.add_done_callback(lambda _: self._arrived.set())
        self.task.add_done_callback(_retrieve)  # its client may be gone: no "never retrieved"

    def _take(self) -> list[int]:
        """The pending ids (the loop's side; a later push sets ``_arrived`` again)."""
        with self._lock:
            ids, self._pending = self._pending, []
        self._arrived.clear()
        return ids

    async def started(self) -> None:
        """Wait for the first sampled ids or the end; a request that failed before sampling
        raises here, so its error is a plain HTTP error, not an event."""
        await self._arrived.wait()
        if self.task.done() and not self._pending and self.task.exception():
            self.task.result()

    async def parts(self):
        """``("content", delta)`` as content becomes certain (:class:`ContentStream`), then
        ``("reply", (reply, usage, rest of the content))`` or ``("error", ProxyError)``."""
        while True:
            over = self.task.done()  # ids told before the end are in by now
            delta = self.content.feed(self._take())
            if delta:  # on a failure too: what was certain before it
                yield "content", delta
            if over:
                break
            await self._arrived.wait()
        try:
            _, reply, usage = self.task.result()
            rest = self.content.finish(reply.content)
        except ProxyError as error:
            yield "error", error
            return
        except Exception as error:  # noqa: BLE001 - the stream ends with an error event
            yield "error", internal_error(error)
            return
        yield "reply", (reply, usage, rest)


async def _chat_events(stream: _Stream):
    """``chat.completion.chunk`` events: the role, the content as it comes, the rest of it,
    each call, the finish reason (and the usage when asked)."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": stream.proxy.model_name}

    def event(delta: dict | None, finish: str | None = None, logprobs: dict | None = None,
              **extra) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish}]
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    yield event({"role": "assistant", "content": ""})
    async for kind, value in stream.parts():
        if kind == "content":
            yield event({"content": value})
        elif kind == "error":
            yield f"data: {json.dumps(value.body())}\n\n"
        else:
            reply, usage, rest = value
            if rest:
                yield event({"content": rest})
            for k, call in enumerate(reply.tool_calls):
                yield event({"tool_calls": [{"index": k, **call}]})
            # All the turn's log-probs with the finish (content is held back, so they cannot
            # follow the deltas token by token); a client that joins the chunks' lists has them.
            yield event({}, reply.finish_reason, _logprobs(stream.proxy, stream.request, reply))
            if stream.request.include_usage:
                yield event(None, usage=usage)
            yield "data: [DONE]\n\n"


def create_app(proxy: Proxy, max_body_bytes: int = 8 << 20) -> FastAPI:
    """The FastAPI app of ``proxy`` (:class:`~agentrl_fast.proxy.server.ProxyServer` serves
    it)."""
    app = FastAPI(title="agentrl_fast proxy", docs_url=None, redoc_url=None, openapi_url=None)

    def answer(request: Request, error: ProxyError) -> JSONResponse:
        """The error in the shape of the API ``request`` was for."""
        if anthropic.is_messages_path(request.url.path):
            return JSONResponse(anthropic.error_body(error), status_code=error.status)
        return _error(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return answer(request, ProxyError(error.status_code, f"{request.method} "
                                          f"{request.url.path}: {error.detail}", None, code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        return answer(request, ProxyError(500, f"internal error: {type(error).__name__}"))

    async def guarded(work, request: Request | None = None) -> Any:
        """``work()``, or its error's answer (in the API's shape, given the ``request``)."""
        try:
            return await work()
        except Exception as error:  # noqa: BLE001 - the server answers and stays up
            failure = error if isinstance(error, ProxyError) else internal_error(error)
            return _error(failure) if request is None else answer(request, failure)

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request):
        async def work():
            chat_request = parse_request(await _read_json(request, max_body_bytes),
                                         proxy.sampling)
            if chat_request.stream:
                stream = _Stream(proxy, session_id, chat_request)
                await stream.started()
                return StreamingResponse(_chat_events(stream), media_type="text/event-stream")
            _, reply, usage = await proxy.complete(session_id, chat_request)
            return JSONResponse(_completion(proxy, chat_request, reply, usage))
        return await guarded(work)

    @app.post("/s/{session_id}/v1/responses")
    async def responses(session_id: str, request: Request):
        async def work():
            body = await _read_json(request, max_body_bytes)
            proxy.session(session_id)  # a 404 before anything is kept for it
            chat, conversation = chat_body(body, proxy.responses.history(session_id, body))
            chat_request = parse_request(chat, proxy.sampling)
            response_id = f"resp_{uuid.uuid4().hex}"
            keep = body.get("store") is not False
            if keep:
                proxy.responses.reserve(session_id, response_id)

            def remember(task: asyncio.Future) -> None:  # also when its client hung up
                ok = keep and not task.cancelled() and task.exception() is None
                proxy.responses.settle(session_id, response_id, conversation,
                                       task.result()[1] if ok else None)
            if chat_request.stream:
                stream = _Stream(proxy, session_id, chat_request)
                stream.task.add_done_callback(remember)
                await stream.started()
                return StreamingResponse(
                    response_events(response_id, stream.parts(), chat_request, body,
                                    proxy.chat_format, proxy.model_name),
                    media_type="text/event-stream")
            turn = asyncio.ensure_future(proxy.complete(session_id, chat_request))
            turn.add_done_callback(remember)
            _, reply, usage = await turn
            return JSONResponse(response_of(response_id, reply, usage, chat_request, body,
                                            proxy.chat_format, proxy.model_name))
        return await guarded(work)

    @app.post("/s/{session_id}/v1/messages")
    async def messages(session_id: str, request: Request):
        async def work():
            body = anthropic.chat_body(await _read_json(request, max_body_bytes))
            chat_request = parse_request(body, proxy.sampling)
            if chat_request.stream:
                stream = _Stream(proxy, session_id, chat_request)
                await stream.started()
                return StreamingResponse(
                    anthropic.message_events(stream.parts(), chat_request, proxy.chat_format,
                                             proxy.model_name),
                    media_type="text/event-stream")
            _, reply, usage = await proxy.complete(session_id, chat_request)
            return JSONResponse(anthropic.message_of(reply, usage, chat_request,
                                                     proxy.chat_format, proxy.model_name))
        return await guarded(work, request)

    @app.get("/s/{session_id}/v1/models")
    async def models(session_id: str):
        async def work():
            proxy.session(session_id)
            return JSONResponse({"object": "list", "data": [
                {"id": proxy.model_name, "object": "model", "created": 0,
                 "owned_by": "agentrl_fast"}]})
        return await guarded(work)

    @app.post("/sessions")
    async def new_session(request: Request):
        async def work():
            body = _fields(await _read_json(request, max_body_bytes, optional=True),
                           ("task_id", "sample_index", "session_id"), "(or empty)")
            session_id = proxy.create_session(body.get("task_id"), body.get("sample_index", 0),
                                              body.get("session_id"))
            return JSONResponse({"id": session_id, "base_path": f"/s/{session_id}/v1"})
        return await guarded(work)

    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        async def work():
            body = _fields(await _read_json(request, max_body_bytes, optional=True),
                           ("reward", "turn_rewards", "truncated"), '{"reward": r}')
            truncated = body.get("truncated", False)
            if not isinstance(truncated, bool):
                raise ProxyError(400, "truncated must be a boolean", "truncated")
            turn_rewards = body.get("turn_rewards")
            if turn_rewards is not None and not isinstance(turn_rewards, list):
                raise ProxyError(400, "turn_rewards must be a list of numbers", "turn_rewards")
            trajectory = proxy.finish(session_id, body.get("reward", 0.0), turn_rewards,
                                      truncated)
            proxy.finished.put(trajectory)
            return JSONResponse({"id": session_id, "reward": trajectory.reward,
                                 "sub_traces": len(trajectory.sub_traces),
                                 "turns": trajectory.metrics["turns"],
                                 "tool_calls": trajectory.metrics["calls"],
                                 "error": trajectory.error})
        return await guarded(work)

    return app
