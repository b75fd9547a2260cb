"""``@tool``, ``ToolRegistry``: schemas from typed functions, and every failure mode of a call
becoming an error ``<tool_response>`` while the episode goes on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from typing import Literal, Optional

import pytest

from agentrl_fast.harness.tool_calls import ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import (
    FAILURE_KINDS,
    Tool,
    ToolRegistry,
    ToolResult,
    count_failures,
    tool,
)

# ---------------------------------------------------------------------------------------------
# Tools used below


@tool
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@tool
async def greet(name: str, punctuation: Literal["!", "?"] = "!") -> str:
    """Greet someone.

    Args:
        name: Who to greet.
        punctuation: How to end the greeting.
    """
    await asyncio.sleep(0)
    return f"Hello, {name}{punctuation}"


@tool
def every_type(count: int, ratio: float, label: str, flag: bool, items: list[int], meta: dict,
               mode: Literal["fast", "slow"], limit: Optional[int] = None,  # noqa: UP045
               note: str | None = None) -> dict:
    """Echo the arguments back.

    Args:
        count: An integer.
        ratio: A number.
        label: A string.
        flag: A boolean.
        items: Integers.
        meta: Anything keyed by strings.
        mode: One of two speeds.
        limit: An optional integer.
        note: An optional string.
    """
    return {"count": count, "ratio": ratio, "label": label, "flag": flag, "items": items,
            "meta": meta, "mode": mode, "limit": limit, "note": note}


@tool
def boom(message: str) -> str:
    """Always fail.

    Args:
        message: The error message.
    """
    raise ValueError(message)


@tool
async def async_boom(message: str) -> str:
    """Always fail, asynchronously.

    Args:
        message: The error message.
    """
    await asyncio.sleep(0)
    raise RuntimeError(message)


@tool(timeout=0.2)
def slow_sync(seconds: float) -> str:
    """Sleep in a thread.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "slept"


@tool(timeout=0.2)
async def slow_async(seconds: float) -> str:
    """Sleep on the event loop.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "slept"


@tool
def sleep_sync(seconds: float) -> float:
    """Sleep in a thread and return the time slept.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return seconds


@tool
async def sleep_async(seconds: float) -> float:
    """Sleep on the event loop and return the time slept.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return seconds


@tool
def exits(code: int) -> None:
    """Call sys.exit.

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


@tool
async def async_exits(code: int) -> None:
    """Call sys.exit from a coroutine.

    Args:
        code: The exit status.
    """
    await asyncio.sleep(0)
    raise SystemExit(code)


def registry(*extra, **kwargs) -> ToolRegistry:
    return ToolRegistry([add, greet, every_type, boom, async_boom, slow_sync, slow_async,
                         sleep_sync, sleep_async, *extra], **kwargs)


def block(name: str, arguments: dict) -> str:
    return ('<tool_call>\n{"name": "' + name + '", "arguments": '
            + json.dumps(arguments, ensure_ascii=False) + "}\n</tool_call>")


# ---------------------------------------------------------------------------------------------
# The decorator and schemas


def test_schema_of_a_sync_tool():
    assert isinstance(add, Tool)
    assert not add.is_async
    assert add.name == "add"
    assert add.description == "Add two integers."
    assert add.timeout is None
    assert add.parameters == {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "The first number."},
                       "b": {"type": "integer", "description": "The second number."}},
        "required": ["a"],
    }
    assert add.schema["type"] == "function"
    function = add.schema["function"]
    assert (function["name"], function["description"]) == ("add", "Add two integers.")
    assert function["parameters"] == add.parameters
    assert add(2, 3) == 5  # still callable
    assert add(a=4) == 4


def test_schema_of_an_async_tool():
    assert greet.is_async
    assert greet.name == "greet"
    assert greet.description == "Greet someone."
    properties = greet.parameters["properties"]
    assert properties["name"] == {"type": "string", "description": "Who to greet."}
    assert properties["punctuation"]["type"] == "string"
    assert properties["punctuation"]["enum"] == ["!", "?"]
    assert greet.parameters["required"] == ["name"]
    assert asyncio.run(greet("Ada")) == "Hello, Ada!"  # still callable (a coroutine function)


def test_schema_types():
    properties = every_type.parameters["properties"]
    assert {k: v["type"] for k, v in properties.items()} == {
        "count": "integer", "ratio": "number", "label": "string", "flag": "boolean",
        "items": "array", "meta": "object", "mode": "string", "limit": "integer",
        "note": "string"}
    assert properties["items"]["items"] == {"type": "integer"}
    assert properties["mode"]["enum"] == ["fast", "slow"]
    assert properties["limit"].get("nullable") is True  # Optional[int]
    assert properties["note"].get("nullable") is True  # str | None
    assert all(not v.get("nullable") for k, v in properties.items() if k not in ("limit", "note"))
    assert properties["label"]["description"] == "A string."
    assert every_type.parameters["required"] == ["count", "ratio", "label", "flag", "items",
                                                  "meta", "mode"]
    assert every_type.schema["function"]["return"] == {"type": "object"}
    json.dumps(every_type.schema)  # plain JSON


def test_tool_options():
    @tool(name="lookup", timeout=2.5, description="Find a thing.")
    def find(query: str) -> str:
        """Search.

        Args:
            query: What to find.
        """
        return query.upper()

    assert (find.name, find.timeout, find.description) == ("lookup", 2.5, "Find a thing.")
    assert find.schema["function"]["name"] == "lookup"
    assert find("x") == "X"
    reg = ToolRegistry([find])
    assert reg.names == ["lookup"]
    assert reg.execute_sync(parse_tool_calls(block("lookup", {"query": "abc"})))[0].content == "ABC"
    assert reg.execute_sync(parse_tool_calls(block("find", {"query": "abc"})))[0].error \
        == "unknown_tool"


def test_missing_type_hint_is_a_type_error_naming_the_function():
    def no_hint(a) -> int:
        """Do it.

        Args:
            a: A thing.
        """
        return 1

    with pytest.raises(TypeError, match=r"no_hint.*\ba\b.*type hint"):
        tool(no_hint)


def test_missing_args_docstring_is_a_type_error_naming_the_function():
    def undocumented_arg(a: int) -> int:
        """Do it."""
        return a

    def no_docstring(a: int) -> int:
        return a

    with pytest.raises(TypeError, match=r"undocumented_arg.*'a'.*Args:"):
        tool(undocumented_arg)
    with pytest.raises(TypeError, match=r"no_docstring.*docstring"):
        tool(no_docstring)


def test_bad_decorator_use():
    with pytest.raises(TypeError, match="already a Tool"):
        tool(add)
    with pytest.raises(TypeError, match="expected a function"):
        tool(42)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        tool(timeout=0)(add.fn)
    with pytest.raises(ValueError, match="default_timeout must be > 0"):
        ToolRegistry([add], default_timeout=0)


def test_duplicate_tool_names():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolRegistry([add, add])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolRegistry([add, tool(name="add")(boom.fn)])
    with pytest.raises(ValueError, match="two tools are named 'greet'"):
        ToolRegistry([greet]).with_tools(greet)


def test_plain_functions_are_wrapped():
    def double(x: int) -> int:
        """Double.

        Args:
            x: A number.
        """
        return 2 * x

    reg = ToolRegistry([double])
    assert isinstance(reg["double"], Tool)
    assert "double" in reg and "triple" not in reg
    assert reg.schemas == [reg["double"].schema]
    assert reg.execute_sync([ToolCall("double", {"x": 21})])[0] == ToolResult("double", "42")


# ---------------------------------------------------------------------------------------------
# Every failure mode in one batch, with valid calls around them


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_every_failure_kind_in_one_batch(flavour):
    failing = "boom" if flavour == "sync" else "async_boom"
    slow = "slow_sync" if flavour == "sync" else "slow_async"
    text = "\n".join([
        "I will call several tools.",
        block("add", {"a": 1, "b": 2}),                                     # ok
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # parse_error
        block("subtract", {"a": 1}),                                        # unknown_tool
        block("add", {"b": 2}),                                             # missing_argument
        block("add", {"a": 1, "c": 3}),                                     # unexpected_argument
        block("add", {"a": "1"}),                                           # wrong_type
        block("greet", {"name": "Ada", "punctuation": "."}),                # invalid_argument
        block(failing, {"message": "kaboom ü"}),                           # tool_exception
        block(slow, {"seconds": 1.0}),                                      # timeout
        block("greet", {"name": "世界"}),                                   # ok
        "Done.",
    ])
    reg = registry()
    calls = parse_tool_calls(text)
    assert len(calls) == 10
    start = time.perf_counter()
    results = reg.execute_sync(calls)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.9, elapsed  # the timeout (0.2 s) cut the 1 s sleep short

    assert len(results) == len(calls)
    assert [r.error for r in results] == [
        None, "parse_error", "unknown_tool", "missing_argument", "unexpected_argument",
        "wrong_type", "invalid_argument", "tool_exception", "timeout", None]
    assert {r.error for r in results if r.error} == set(FAILURE_KINDS)
    assert [r.name for r in results] == ["add", None, "subtract", "add", "add", "add", "greet",
                                        failing, slow, "greet"]
    assert results[0] == ToolResult("add", "3")
    assert results[-1] == ToolResult("greet", "Hello, 世界!")
    fragments = {
        "parse_error": ["invalid JSON"],
        "unknown_tool": ["'subtract'", "Available tools", "add", "greet"],
        "missing_argument": ["'add'", "'a' is a required property"],
        "unexpected_argument": ["'add'", "'c'"],
        "wrong_type": ["'add'", "arguments['a']", "'1' is not of type 'integer'"],
        "invalid_argument": ["'greet'", "arguments['punctuation']", "'.'", "is not one of"],
        "tool_exception": [repr(failing), "ValueError" if flavour == "sync" else "RuntimeError",
                           "kaboom ü"],
        "timeout": [repr(slow), "timed out after 0.2 s"],
    }
    for r in results[1:-1]:
        assert not r.ok
        assert r.content.startswith("Error:"), r
        for fragment in fragments[r.error]:
            assert fragment in r.content, (fragment, r.content)

    expected = Counter({kind: 1 for kind in FAILURE_KINDS})
    expected.update({"calls": 10, "ok": 2})
    assert reg.metrics == expected
    assert count_failures(results) == expected

    # The loop goes on: the same registry serves the next turn, and the counters accumulate.
    more = reg.execute_sync(parse_tool_calls(block("add", {"a": 40, "b": 2})))
    assert more == [ToolResult("add", "42")]
    expected.update({"calls": 1, "ok": 1})
    assert reg.metrics == expected


def test_default_timeout_applies_to_tools_without_their_own():
    reg = ToolRegistry([sleep_async, sleep_sync], default_timeout=0.2)
    results = reg.execute_sync([ToolCall("sleep_async", {"seconds": 1.0}),
                                ToolCall("sleep_sync", {"seconds": 0.6}),
                                ToolCall("sleep_async", {"seconds": 0.01})])
    assert [r.error for r in results] == ["timeout", "timeout", None]
    assert "timed out after 0.2 s" in results[0].content
    assert results[2].content == "0.01"


@pytest.mark.parametrize("name", ["exits", "async_exits"])
def test_system_exit_is_contained(name):
    reg = registry(exits, async_exits)
    results = reg.execute_sync([ToolCall(name, {"code": 3}), ToolCall("add", {"a": 1})])
    assert results[0].error == "tool_exception"
    assert results[0].content.startswith(f"Error: tool {name!r} raised SystemExit")
    assert results[1] == ToolResult("add", "1")
    assert reg.metrics == Counter({"calls": 2, "ok": 1, "tool_exception": 1})


@tool
def raises_timeout_error() -> str:
    """Fail the way a network client times out."""
    raise TimeoutError("upstream took too long")


@tool
async def async_raises_timeout_error() -> str:
    """Fail the way a network client times out, asynchronously."""
    await asyncio.sleep(0)
    raise TimeoutError("upstream took too long")


@tool
def raises_cancelled() -> str:
    """Raise CancelledError from a thread."""
    raise asyncio.CancelledError()


@tool
async def async_raises_cancelled() -> str:
    """Raise CancelledError from a coroutine nobody cancelled."""
    await asyncio.sleep(0)
    raise asyncio.CancelledError()


@pytest.mark.parametrize("name", ["raises_timeout_error", "async_raises_timeout_error"])
def test_a_tool_raising_timeout_error_is_an_exception_not_a_timeout(name):
    reg = registry(raises_timeout_error, async_raises_timeout_error)
    [r] = reg.execute_sync([ToolCall(name, {})])
    assert r.error == "tool_exception"
    assert r.content == f"Error: tool {name!r} raised TimeoutError: upstream took too long"


@pytest.mark.parametrize("name", [
    "raises_cancelled",
    pytest.param("async_raises_cancelled", marks=pytest.mark.skipif(
        sys.version_info < (3, 11), reason="needs Task.cancelling (Python 3.11)")),
])
def test_a_tool_raising_cancelled_error_is_contained(name):
    reg = registry(raises_cancelled, async_raises_cancelled)
    results = reg.execute_sync([ToolCall(name, {}), ToolCall("add", {"a": 1})])
    assert results[0].error == "tool_exception"
    assert results[0].content.startswith(f"Error: tool {name!r} raised CancelledError")
    assert results[1] == ToolResult("add", "1")


def test_cancelling_the_turn_cancels_the_tools():
    seen = []

    @tool
    async def waits(seconds: float) -> str:
        """Wait, noting a cancellation.

        Args:
            seconds: How long.
        """
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return "done"

    reg = ToolRegistry([waits])
    start = time.perf_counter()
    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        asyncio.run(asyncio.wait_for(reg.execute([ToolCall("waits", {"seconds": 5.0})]), 0.1))
    assert time.perf_counter() - start < 2.0
    assert seen == ["cancelled"]


def test_every_parse_error_is_a_parse_error_result():
    texts = ['<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": 3}</tool_call>',
             '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>',
             "<tool_call>[]</tool_call>", '<tool_call>{"name": "add", "arguments": {"a": 1}}']
    reg = registry()
    results = reg.execute_sync([c for t in texts for c in parse_tool_calls(t)])
    assert len(results) == len(texts)
    for r in results:
        assert r.error == "parse_error"
        assert r.content.startswith("Error: ")
    assert "unclosed <tool_call>" in results[-1].content
    # A parse error that read the name keeps it (here: arguments not an object).
    assert results[2].name == "add"
    assert reg.metrics == Counter({"calls": 6, "parse_error": 6})


# ---------------------------------------------------------------------------------------------
# Argument validation


def _every_type_arguments(**override):
    arguments = {"count": 1, "ratio": 0.5, "label": "x", "flag": True, "items": [1, 2],
                 "meta": {"k": [None]}, "mode": "fast"}
    arguments.update(override)
    return arguments


def test_optional_argument_accepts_null_and_its_type():
    reg = registry()
    results = reg.execute_sync([
        ToolCall("every_type", _every_type_arguments(limit=None)),
        ToolCall("every_type", _every_type_arguments(limit=5)),
        ToolCall("every_type", _every_type_arguments()),
        ToolCall("every_type", _every_type_arguments(limit="5")),
        ToolCall("every_type", _every_type_arguments(note=None)),
        ToolCall("every_type", _every_type_arguments(note=1)),
    ])
    assert [r.error for r in results] == [None, None, None, "wrong_type", None, "wrong_type"]
    assert json.loads(results[0].content)["limit"] is None
    assert json.loads(results[1].content)["limit"] == 5


@pytest.mark.parametrize("override, kind", [
    ({"count": True}, "wrong_type"),        # bool is not an integer
    ({"count": False}, "wrong_type"),
    ({"count": 1.5}, "wrong_type"),
    ({"count": "1"}, "wrong_type"),
    ({"count": None}, "wrong_type"),        # not Optional
    ({"ratio": True}, "wrong_type"),        # bool is not a number
    ({"ratio": "0.5"}, "wrong_type"),
    ({"flag": 1}, "wrong_type"),            # 1 is not a boolean
    ({"flag": "true"}, "wrong_type"),
    ({"label": 3}, "wrong_type"),
    ({"items": [1, "2"]}, "wrong_type"),    # an item of the wrong type
    ({"items": {"0": 1}}, "wrong_type"),
    ({"meta": [1]}, "wrong_type"),
    ({"mode": "medium"}, "invalid_argument"),
    ({"mode": "FAST"}, "invalid_argument"),
    ({"extra": 1}, "unexpected_argument"),
])
def test_argument_checks(override, kind):
    reg = registry()
    [result] = reg.execute_sync([ToolCall("every_type", _every_type_arguments(**override))])
    assert result.error == kind, result
    assert result.content.startswith("Error: invalid arguments for 'every_type'")
    assert reg.metrics == Counter({"calls": 1, kind: 1})


def test_numbers_accepted():
    reg = registry()
    results = reg.execute_sync([ToolCall("every_type", _every_type_arguments(ratio=2)),
                                ToolCall("every_type", _every_type_arguments(count=10**30))])
    assert [r.error for r in results] == [None, None]


def test_several_problems_the_first_kind_wins():
    # Missing beats unexpected beats wrong type beats other constraints; up to three are listed.
    reg = registry()
    [r] = reg.execute_sync([ToolCall("every_type", {"count": "x", "mode": "z", "zzz": 1})])
    assert r.error == "missing_argument"
    assert r.content.count("arguments") >= 3 and "more)" in r.content
    [r] = reg.execute_sync([ToolCall("add", {"a": "x", "zzz": 1})])
    assert r.error == "unexpected_argument"


def test_deeply_nested_argument_values():
    """A value nested deeper than the stack allows (its repr in the error message recurses)
    is an error result, not an exception out of ``execute``."""
    deep = []
    for _ in range(100_000):
        deep = [deep]
    reg = registry()
    results = reg.execute_sync([ToolCall("add", {"a": deep}), ToolCall("add", {"a": 1}),
                                ToolCall("every_type", _every_type_arguments(meta={"d": deep}))])
    assert results[0].error in ("wrong_type", "invalid_argument")
    assert results[0].content.startswith("Error: invalid arguments for 'add'")
    assert results[1] == ToolResult("add", "1")
    assert results[2].error == "tool_exception"  # accepted, but echoed back too deep to print


def test_every_decodable_depth_through_parse():
    # Depths just under the decoder's limit decode, then fail the schema: none may raise.
    depths = range(1, sys.getrecursionlimit() + 20)
    calls = [c for d in depths for c in parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * d + "]" * d + "}}</tool_call>")]
    assert len(calls) == len(depths)
    results = registry().execute_sync(calls)
    assert all(r.error in ("wrong_type", "invalid_argument", "parse_error") for r in results)
    assert all(r.content.startswith("Error:") for r in results)


# ---------------------------------------------------------------------------------------------
# Execution


def test_results_keep_call_order():
    durations = [0.3, 0.0, 0.2, 0.1, 0.25]
    calls = [ToolCall("sleep_async" if i % 2 else "sleep_sync", {"seconds": d})
             for i, d in enumerate(durations)]
    results = registry().execute_sync(calls)
    assert [r.content for r in results] == [json.dumps(d) for d in durations]
    assert [r.name for r in results] == [c.name for c in calls]


@pytest.mark.parametrize("name", ["sleep_async", "sleep_sync"])
def test_calls_run_concurrently(name):
    reg = registry()
    calls = [ToolCall(name, {"seconds": 0.5}) for _ in range(4)]
    start = time.perf_counter()
    results = reg.execute_sync(calls)
    elapsed = time.perf_counter() - start
    assert all(r.ok for r in results)
    assert 0.5 <= elapsed < 1.5, elapsed


def test_return_values_become_text():
    @tool
    def give(kind: str):
        """Return a value of some kind.

        Args:
            kind: Which value.
        """
        return {"dict": {"city": "東京", "emoji": "🚀", "n": [1, 2.5, None, True]},
                "list": ["é", {"a": []}], "none": None, "str": "plain \"text\"", "int": 7,
                "float": 0.25, "bool": False, "bytes": "héllo".encode(), "tuple": (1, "x"),
                "object": Counter(a=1), "set": {3}}[kind]

    reg = ToolRegistry([give])
    kinds = ["dict", "list", "none", "str", "int", "float", "bool", "bytes", "tuple", "object",
             "set"]
    results = reg.execute_sync([ToolCall("give", {"kind": k}) for k in kinds])
    content = dict(zip(kinds, (r.content for r in results)))
    assert all(r.ok for r in results)
    assert content["dict"] == '{"city": "東京", "emoji": "🚀", "n": [1, 2.5, null, true]}'
    assert content["list"] == '["é", {"a": []}]'
    assert content["none"] == "null"
    assert content["str"] == 'plain "text"'  # strings as they are
    assert (content["int"], content["float"], content["bool"]) == ("7", "0.25", "false")
    assert content["bytes"] == "héllo"
    assert content["tuple"] == '[1, "x"]'
    assert content["object"] == '{"a": 1}'
    assert content["set"] == '"{3}"'  # not JSON-serializable: str() of it, as a JSON string


def test_unprintable_return_values_are_tool_exceptions():
    class Weird:
        def __str__(self):
            raise RuntimeError("no str for you")

    deep = []
    for _ in range(100_000):
        deep = [deep]

    @tool
    def give(kind: str):
        """Return something hard to print.

        Args:
            kind: Which.
        """
        return {"weird": Weird(), "deep": deep}[kind]

    reg = ToolRegistry([give, add])
    results = reg.execute_sync([ToolCall("give", {"kind": "weird"}),
                                ToolCall("give", {"kind": "deep"}), ToolCall("add", {"a": 2})])
    assert [r.error for r in results] == ["tool_exception", "tool_exception", None]
    assert all(r.content.startswith("Error: tool 'give'") for r in results[:2])
    assert "no str for you" in results[0].content
    assert reg.metrics == Counter({"calls": 3, "ok": 1, "tool_exception": 2})


def test_with_tools_makes_a_new_registry():
    base = ToolRegistry([add], default_timeout=5.0)
    base_tools = base.tools
    more = base.with_tools(greet, boom)
    assert more is not base
    assert more.names == ["add", "greet", "boom"]
    assert more.default_timeout == 5.0
    assert base.names == ["add"] and base.tools is base_tools and "greet" not in base
    more.execute_sync([ToolCall("greet", {"name": "x"}), ToolCall("boom", {"message": "m"})])
    assert more.metrics == Counter({"calls": 2, "ok": 1, "tool_exception": 1})
    assert base.metrics == Counter()
    assert base.execute_sync([ToolCall("greet", {"name": "x"})])[0].error == "unknown_tool"
    assert more.metrics["unknown_tool"] == 0
    assert more.metrics is not base.metrics


def test_execute_inside_a_running_event_loop():
    reg = registry()

    async def episode():
        first = await reg.execute(parse_tool_calls(block("greet", {"name": "Ada"})
                                                   + block("add", {"a": 2, "b": 3})))
        second = await reg.execute([ToolCall("nope", {}), ToolCall("sleep_sync", {"seconds": 0})])
        return first, second

    first, second = asyncio.run(episode())
    assert first == [ToolResult("greet", "Hello, Ada!"), ToolResult("add", "5")]
    assert [r.error for r in second] == ["unknown_tool", None]
    assert reg.metrics == Counter({"calls": 4, "ok": 3, "unknown_tool": 1})


def test_empty_batch():
    reg = registry()
    assert reg.execute_sync([]) == []
    assert reg.execute_sync(parse_tool_calls("no calls here")) == []
    assert reg.metrics == Counter()


def test_count_failures():
    results = [ToolResult("a", "1"), ToolResult("b", "Error: x", "timeout"),
               ToolResult(None, "Error: y", "parse_error"), ToolResult("a", "2")]
    assert count_failures(results) == Counter({"calls": 4, "ok": 2, "timeout": 1,
                                               "parse_error": 1})
    assert count_failures([]) == Counter()
    assert ToolResult("a", "1").ok and not results[1].ok


# ---------------------------------------------------------------------------------------------
# Integral floats, async callables, hung sync tools, option checks.

@tool
def repeat(text: str, times: int) -> str:
    """Repeat a text.

    Args:
        text: The text.
        times: How many times.
    """
    assert isinstance(times, int), type(times)
    return text * times


def test_integral_float_reaches_an_int_argument_as_int():
    results = registry(repeat).execute_sync(parse_tool_calls(
        block("repeat", {"text": "ab", "times": 2.0}) + block("repeat", {"text": "x", "times": 1.5})))
    assert results[0].ok and results[0].content == "abab"
    assert results[1].error == "invalid_argument" or results[1].error == "wrong_type"


class AsyncCallable:
    """An object with an async __call__ (not a coroutine function itself)."""

    __name__ = "async_callable"

    async def __call__(self, x: int) -> int:
        """Double.

        Args:
            x: A number.
        """
        await asyncio.sleep(0)
        return 2 * x


def test_object_with_async_call_is_awaited():
    double = tool(AsyncCallable(), name="double")
    assert double.is_async
    result, = registry(double).execute_sync(parse_tool_calls(block("double", {"x": 21})))
    assert result.ok and result.content == "42"


@tool(timeout=0.3)
def hang(seconds: float) -> str:
    """Sleep for a long time.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def test_hung_sync_tools_do_not_starve_later_calls():
    # 40 tools hang past their timeout (more than any fixed pool); the next batch still runs
    # at once: each sync call has a thread of its own.
    reg = registry(hang)
    hung = reg.execute_sync(parse_tool_calls(block("hang", {"seconds": 3}) * 40))
    assert [r.error for r in hung] == ["timeout"] * 40
    start = time.perf_counter()
    results = reg.execute_sync(parse_tool_calls(block("add", {"a": 1, "b": 2}) * 4))
    assert [r.content for r in results] == ["3"] * 4
    assert time.perf_counter() - start < 1.0  # not behind the 3 s hung tools


@tool
def which_thread() -> str:
    """The name of the thread the call runs on."""
    return threading.current_thread().name


def test_sync_tools_reuse_idle_threads_and_a_forked_child_starts_its_own():
    # Threads are named in start order, so "started" is exact even while an earlier test's
    # hung tools wake up and rejoin the idle threads mid-test.
    reg = registry(which_thread)
    before = {t.name for t in threading.enumerate()}
    threads = {reg.execute_sync(parse_tool_calls(block("which_thread", {})))[0].content
               for _ in range(30)}
    started = threads - before
    assert len(started) <= 1, f"30 calls one after another started {len(started)} threads"
    assert threading.current_thread().name not in threads  # never on the caller's thread
    assert all(name.startswith("agentrl_fast-tool-") for name in threads)
    # A forked child has none of the parent's idle threads: it must not hand work to them.
    pid = os.fork()
    if pid == 0:  # the child: a call that found no thread would hang until the alarm
        signal.alarm(10)
        result, = reg.execute_sync(parse_tool_calls(block("which_thread", {})))
        os._exit(0 if result.ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_inline_tools_run_on_the_loop_thread_and_fail_like_others():
    @tool(inline=True)
    def where() -> str:
        """The id of the thread the call runs on."""
        return str(threading.get_ident())

    @tool(inline=True)
    def broken(x: int) -> str:
        """Fail.

        Args:
            x: Anything.
        """
        raise RuntimeError(f"broken {x}")

    assert where.inline and not which_thread.inline
    reg = registry(where, broken, which_thread)
    here = str(threading.get_ident())  # execute_sync runs its event loop on this thread
    results = reg.execute_sync(parse_tool_calls(block("where", {}) + block("which_thread", {})
                                                + block("broken", {"x": 3})
                                                + block("broken", {"x": "no"})))
    assert results[0].content == here and results[1].content != here
    assert results[2].error == "tool_exception" and "RuntimeError: broken 3" in results[2].content
    assert results[3].error == "wrong_type"  # arguments are checked before an inline call too
    with pytest.raises(ValueError, match="inline tool .* cannot time out"):
        tool(add.fn, name="inline_add", inline=True, timeout=1.0)
    with pytest.raises(TypeError, match="inline must be a bool"):
        tool(add.fn, name="inline_add", inline="yes")


@pytest.mark.parametrize("timeout", [True, "1", 0, -1.0, float("nan")])
def test_bad_timeouts_are_refused_naming_the_option(timeout):
    with pytest.raises((TypeError, ValueError), match="timeout must be > 0 seconds"):
        tool(add.fn, name="other", timeout=timeout)
    with pytest.raises((TypeError, ValueError), match="default_timeout must be > 0 seconds"):
        ToolRegistry([add], default_timeout=timeout)


def test_a_tool_keeping_its_own_deadline_reads_as_a_timeout():
    from agentrl_fast.harness import ToolTimeout

    @tool
    async def remote(seconds: float) -> str:
        """Wait on a deadline of its own.

        Args:
            seconds: How long to wait.
        """
        raise ToolTimeout(seconds)

    result = ToolRegistry([remote]).execute_sync([ToolCall("remote", {"seconds": 1.5})])[0]
    assert (result.error, result.content) == ("timeout", "Error: tool 'remote' timed out after "
                                                         "1.5 s.")
