"""Tools the model calls: ``@tool`` functions, their JSON schemas, and a registry that runs calls.

A tool is a Python function (sync or async) with type hints and a Google-style docstring; its
JSON schema comes from ``transformers.utils.get_json_schema`` (the schema HF chat templates
render, so a tool looks the same here as in ``apply_chat_template``). The registry validates a
call's arguments against that schema with ``jsonschema`` and runs the calls of one turn
concurrently, each under a timeout. Nothing the model writes can stop an episode: every failure
becomes a :class:`ToolResult` whose ``content`` is an error message the model reads in its
``<tool_response>``, and whose ``error`` names the failure kind (counted in
``ToolRegistry.metrics``).

Failure kinds (``FAILURE_KINDS``):

- ``parse_error``: the ``<tool_call>`` block was not a call (bad JSON, no name, ...);
- ``unknown_tool``: no tool has that name;
- ``missing_argument`` / ``unexpected_argument`` / ``wrong_type`` / ``invalid_argument``: the
  arguments do not match the schema (a required one is missing, one is not in the schema, one
  has the wrong JSON type, or another constraint such as an enum fails);
- ``tool_exception``: the tool raised;
- ``timeout``: the tool ran past its timeout. An async tool is cancelled; a sync tool runs in a
  worker thread, which Python cannot stop: its result is discarded when it finally returns. A
  tool that can run away (code execution) belongs in a subprocess (:mod:`.sandbox`). A tool
  that keeps a deadline of its own (an MCP server's call, whose server may first have to start)
  raises :class:`ToolTimeout`, which reads the same.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import itertools
import json
import numbers
import os
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import jsonschema

from agentrl_fast.harness.tool_calls import ToolCall

FAILURE_KINDS = ("parse_error", "unknown_tool", "missing_argument", "unexpected_argument",
                 "wrong_type", "invalid_argument", "tool_exception", "timeout")

# jsonschema's failing keyword -> failure kind (anything else is "invalid_argument").
_KIND_OF_KEYWORD = {"required": "missing_argument", "additionalProperties": "unexpected_argument",
                    "type": "wrong_type"}
_KIND_PRIORITY = {"missing_argument": 0, "unexpected_argument": 1, "wrong_type": 2,
                  "invalid_argument": 3}


@dataclass(frozen=True)
class Tool:
    """A function the model can call. Build one with :func:`tool`; calling it calls ``fn``.

    ``parameters`` is the JSON schema (an ``object``) of the arguments; ``timeout`` in seconds
    (``None``: the registry's default). ``inline``: a sync tool runs on the rollout's event-loop
    thread instead of a thread of its own (for short, trusted functions: no thread handoff per
    call, and no timeout).
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]
    timeout: float | None = None
    returns: dict | None = None
    inline: bool = False

    @property
    def is_async(self) -> bool:
        return (inspect.iscoroutinefunction(self.fn)
                or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None)))

    @property
    def schema(self) -> dict:
        """``{"type": "function", "function": {...}}``: what ``render_messages(tools=...)`` takes."""
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters}
        if self.returns is not None:
            function["return"] = self.returns
        return {"type": "function", "function": function}

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         timeout: float | None = None, inline: bool = False):
    """Turn a typed, documented function into a :class:`Tool` (usable bare or with options).

    ::

        @tool
        def add(a: int, b: int = 0) -> int:
            \"\"\"Add two integers.

            Args:
                a: The first number.
                b: The second number.
            \"\"\"
            return a + b

        @tool(name="search", timeout=2.0)
        async def web_search(query: str) -> str: ...

    Every argument needs a type hint and a line under ``Args:``; otherwise a ``TypeError``
    names the function and the argument. ``timeout`` (seconds) overrides the registry default.
    ``inline=True`` runs a sync tool on the event loop's thread (short, trusted functions: the
    built-in environment's); it cannot time out, so it takes no ``timeout``.
    """
    if fn is None:
        return functools.partial(tool, name=name, description=description, timeout=timeout,
                                 inline=inline)
    if isinstance(fn, Tool):
        raise TypeError(f"tool: {fn.name!r} is already a Tool")
    if not callable(fn):
        raise TypeError(f"tool: expected a function, got {type(fn).__name__}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or not timeout > 0):
        raise ValueError(f"tool: timeout must be > 0 seconds, got {timeout!r}")
    if not isinstance(inline, bool):
        raise TypeError(f"tool: inline must be a bool, got {type(inline).__name__}")
    if inline and timeout is not None:
        raise ValueError("tool: an inline tool runs on the event loop's thread and cannot time "
                         "out; give it no timeout")
    from transformers.utils import get_json_schema
    # A callable object is described by its __call__ (self excluded), named by its class.
    described = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else fn.__call__
    try:
        schema = get_json_schema(described)["function"]
    except Exception as error:  # transformers raises its own exception types
        raise TypeError(f"tool: cannot build a JSON schema for {getattr(fn, '__name__', fn)!r}: "
                        f"{error}. Give every argument a type hint and a description under "
                        "'Args:' in a Google-style docstring.") from None
    tool_name = name or (schema["name"] if described is fn else type(fn).__name__)
    if not isinstance(tool_name, str) or not tool_name:
        raise ValueError(f"tool: name must be a non-empty string, got {tool_name!r}")
    return Tool(name=tool_name, description=description or schema.get("description", ""),
                parameters=schema["parameters"], fn=fn, timeout=timeout,
                returns=schema.get("return"), inline=inline)


class ToolTimeout(Exception):
    """Raised by a tool whose own deadline of ``seconds`` passed: a ``timeout`` result, as when
    the registry's timeout fires (any other exception a tool raises is a ``tool_exception``)."""

    def __init__(self, seconds: float):
        super().__init__(f"timed out after {seconds:g} s")
        self.seconds = seconds


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: ``content`` goes into the ``<tool_response>``; ``error`` is
    ``None`` on success or one of ``FAILURE_KINDS``."""

    name: str | None
    content: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _validation_schema(parameters: dict) -> dict:
    """The schema the arguments are checked against: ``get_json_schema``'s ``nullable`` (an
    OpenAPI word jsonschema ignores) becomes a ``null`` type, and unknown arguments are refused."""

    def convert(node):
        if isinstance(node, dict):
            node = {key: convert(value) for key, value in node.items()}
            if node.pop("nullable", False) and "type" in node:
                types = node["type"] if isinstance(node["type"], list) else [node["type"]]
                node["type"] = types + (["null"] if "null" not in types else [])
            return node
        if isinstance(node, list):
            return [convert(value) for value in node]
        return node

    schema = convert(copy.deepcopy(parameters))
    if schema.get("type") == "object":
        schema.setdefault("additionalProperties", False)
        schema.setdefault("properties", {})
    return schema


def _integral_floats_to_int(parameters: dict, arguments: dict) -> dict:
    """JSON Schema's ``integer`` admits ``2.0``; a function typed ``int`` gets ``2``."""
    properties = parameters.get("properties", {})
    out = dict(arguments)
    for name, value in arguments.items():
        kind = properties.get(name, {}).get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "integer" in kinds and isinstance(value, float) and value.is_integer():
            out[name] = int(value)
    return out


def _to_text(value: Any) -> str:
    """A tool's return value as the text of its ``<tool_response>``."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


class _ToolThreads:
    """Daemon threads for sync tools, reused: a call takes an idle thread or starts a new one,
    so a tool that overruns its timeout holds only its own thread, never a slot other calls
    queue behind (as a thread per call would), without a thread start per call. At most
    ``max_idle`` threads wait for work; more finish."""

    def __init__(self, max_idle: int = 32):
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []
        self._started = itertools.count()

    def reset(self) -> None:
        """Forget the idle threads (in a forked child, which has none of them)."""
        self._lock = threading.Lock()
        self._idle = []

    def run(self, work: Callable[[], object], done: Callable[[object], None]) -> None:
        """Run ``work()`` on an idle thread (or a new one), then ``done(its outcome)``."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                             name=f"agentrl_fast-tool-{next(self._started)}").start()
        inbox.put((work, done))

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            work, done = inbox.get()
            outcome = work()
            # Idle again before the caller hears of the outcome: a call it makes next finds
            # this thread instead of starting another.
            with self._lock:
                stay = len(self._idle) < self.max_idle
                if stay:
                    self._idle.append(inbox)
            done(outcome)
            if not stay:
                return


_TOOL_THREADS = _ToolThreads()
os.register_at_fork(after_in_child=_TOOL_THREADS.reset)


def _in_thread(fn: Callable, arguments: dict) -> asyncio.Future:
    """Run a sync tool on a thread of its own (:class:`_ToolThreads`): a tool that overruns its
    timeout keeps only its own thread, never a slot other calls queue behind."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: tuple[object, bool]) -> None:
        value, failed = outcome
        if not future.done():
            (future.set_exception if failed else future.set_result)(value)

    def work() -> tuple[object, bool]:
        try:
            return _call_sync(fn, arguments), False
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
            return error, True

    def done(outcome: tuple[object, bool]) -> None:
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop closed while the abandoned tool was still running
            pass

    _TOOL_THREADS.run(work, done)
    return future


class _Raised(Exception):
    """What a tool raised, carried out of the task or thread that ran it. asyncio re-raises a
    ``SystemExit`` out of the event loop from any task, and a ``TimeoutError`` the tool raises
    itself must not read as the registry's timeout."""

    def __init__(self, error: BaseException):
        super().__init__(error)
        self.error = error


async def _call_async(fn: Callable, arguments: dict):
    try:
        return await fn(**arguments)
    except asyncio.CancelledError as error:
        # Cancelled from outside (wait_for's timeout, or the turn) unless the task is not being
        # cancelled: then the tool raised it itself (Task.cancelling is Python >= 3.11).
        cancelling = getattr(asyncio.current_task(), "cancelling", None)
        if cancelling is None or cancelling():
            raise
        raise _Raised(error) from None
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as error:  # noqa: BLE001
        raise _Raised(error) from None


def _call_sync(fn: Callable, arguments: dict):
    try:
        return fn(**arguments)
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as error:  # noqa: BLE001
        raise _Raised(error) from None


@dataclass
class ToolRegistry:
    """The tools of an environment, by name; validates and executes the model's calls.

    ``tools``: :class:`Tool` objects (plain functions are wrapped with :func:`tool`);
    ``default_timeout``: seconds per call for tools without their own. ``metrics`` counts
    ``calls``, ``ok`` and each failure kind over the registry's life; :meth:`with_tools` makes a
    registry with more tools (for example memory tools bound to one rollout's namespace) that
    shares nothing mutable with this one.
    """

    tools: Iterable[Tool | Callable] = ()
    default_timeout: float = 30.0
    metrics: Counter = field(default_factory=Counter, init=False)

    def __post_init__(self):
        if (isinstance(self.default_timeout, bool) or not isinstance(self.default_timeout,
                                                                     numbers.Real)
                or not self.default_timeout > 0):
            raise ValueError(f"ToolRegistry: default_timeout must be > 0 seconds, "
                             f"got {self.default_timeout!r}")
        by_name: dict[str, Tool] = {}
        for item in self.tools:
            item = item if isinstance(item, Tool) else tool(item)
            if item.name in by_name:
                raise ValueError(f"ToolRegistry: two tools are named {item.name!r}")
            by_name[item.name] = item
        self.tools = tuple(by_name.values())
        self._metrics_lock = threading.Lock()
        self._by_name = by_name
        self._validators = {name: jsonschema.Draft202012Validator(_validation_schema(t.parameters))
                            for name, t in by_name.items()}

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def schemas(self) -> list[dict]:
        """The JSON schemas, in registration order, for ``render_messages(tools=...)``."""
        return [t.schema for t in self.tools]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Tool:
        return self._by_name[name]

    def with_tools(self, *tools: Tool | Callable) -> "ToolRegistry":
        return ToolRegistry(tools=(*self.tools, *tools), default_timeout=self.default_timeout)

    def check(self, call: ToolCall) -> ToolResult | None:
        """The error result for a call that cannot run (parse error, unknown tool, arguments not
        matching the schema), or ``None`` when it can."""
        if call.error is not None:
            return ToolResult(call.name, f"Error: {call.error}", "parse_error")
        if call.name not in self._by_name:
            available = ", ".join(self._by_name) or "(none)"
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}. "
                              f"Available tools: {available}.", "unknown_tool")
        try:
            errors = sorted(self._validators[call.name].iter_errors(call.arguments),
                            key=lambda e: (_KIND_PRIORITY[_KIND_OF_KEYWORD.get(e.validator,
                                                                               "invalid_argument")],
                                           list(e.absolute_path)))
        except RecursionError:  # jsonschema's messages repr the value: too deeply nested to print
            return ToolResult(call.name, f"Error: invalid arguments for {call.name!r}: a value "
                              "is nested too deeply.", "invalid_argument")
        if not errors:
            return None
        kind = _KIND_OF_KEYWORD.get(errors[0].validator, "invalid_argument")
        messages = []
        for e in errors[:3]:
            where = "".join(f"[{p!r}]" for p in e.absolute_path)
            messages.append(f"arguments{where}: {e.message}")
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        return ToolResult(call.name, f"Error: invalid arguments for {call.name!r}: "
                          + "; ".join(messages) + more + ".", kind)

    async def _run_one(self, call: ToolCall) -> ToolResult:
        failed = self.check(call)
        if failed is not None:
            return failed
        t = self._by_name[call.name]
        arguments = _integral_floats_to_int(t.parameters, call.arguments)
        timeout = t.timeout if t.timeout is not None else self.default_timeout
        try:
            if t.is_async:
                value = await asyncio.wait_for(_call_async(t.fn, arguments), timeout)
            elif t.inline:
                value = _call_sync(t.fn, arguments)
            else:
                value = await asyncio.wait_for(_in_thread(t.fn, arguments), timeout)
        except (asyncio.TimeoutError, TimeoutError):  # only wait_for's: the tool's own are _Raised
            return ToolResult(call.name, f"Error: tool {call.name!r} timed out after "
                              f"{timeout:g} s.", "timeout")
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - a tool may raise anything, even SystemExit
            if isinstance(error, _Raised):
                error = error.error
            if isinstance(error, (KeyboardInterrupt, GeneratorExit)):
                raise
            if isinstance(error, ToolTimeout):
                return ToolResult(call.name, f"Error: tool {call.name!r} timed out after "
                                  f"{error.seconds:g} s.", "timeout")
            return ToolResult(call.name, f"Error: tool {call.name!r} raised "
                              f"{type(error).__name__}: {error}", "tool_exception")
        try:
            return ToolResult(call.name, _to_text(value))
        except Exception as error:  # noqa: BLE001 - e.g. too deeply nested, or a failing __str__
            return ToolResult(call.name, f"Error: tool {call.name!r} returned a value that cannot "
                              f"be shown as text: {type(error).__name__}: {error}",
                              "tool_exception")

    async def execute(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run the calls of one turn concurrently; one result per call, in order. Never raises
        for anything the model wrote."""
        results = list(await asyncio.gather(*(self._run_one(c) for c in calls)))
        with self._metrics_lock:
            self.metrics.update(count_failures(results))
        return results

    def execute_sync(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """:meth:`execute` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.execute(calls))


def count_failures(results: Iterable[ToolResult]) -> Counter:
    """``Counter`` of ``calls``, ``ok`` and each failure kind over ``results``."""
    counter = Counter()
    for r in results:
        counter["calls"] += 1
        counter["ok" if r.ok else r.error] += 1
    return counter
