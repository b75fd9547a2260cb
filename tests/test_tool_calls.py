"""``parse_tool_calls``: the model's ``<tool_call>`` blocks, on well-formed and adversarial text.

The block rule (from the module): a block starts at each ``<tool_call>`` not already inside an
earlier block. If a JSON value follows (after whitespace) and is followed (after whitespace) by
``</tool_call>``, the block ends there, so the tags may appear inside JSON strings. Otherwise the
block ends at the next ``</tool_call>`` if that comes before the next ``<tool_call>``; otherwise
it is an unclosed block running to the next ``<tool_call>`` (or the end). Hence:

- every ``<tool_call>`` in the text either starts an entry or lies inside the body of a block
  whose JSON value decoded (and so inside one of that value's strings);
- with no ``<tool_call>`` inside a JSON string the number of entries is exactly
  ``text.count("<tool_call>")``.

Expected names and arguments below are written by hand.
"""

from __future__ import annotations

import json
import random
import string
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl_fast.harness.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    parse_tool_calls,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# 1500 fresh examples per run (hypothesis draws new ones each CI run; 3000 cost CI 10 s more).
FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))


def qwen3(name: str, arguments) -> str:
    """A call as Qwen3's chat template writes it."""
    return (OPEN + '\n{"name": "' + name + '", "arguments": '
            + json.dumps(arguments, ensure_ascii=False) + "}\n" + CLOSE)


def only(text: str) -> ToolCall:
    calls = parse_tool_calls(text)
    assert len(calls) == 1, calls
    return calls[0]


def assert_call(call: ToolCall, name: str, arguments: dict) -> None:
    assert call.error is None, call
    assert call.ok
    assert call.name == name
    assert call.arguments == arguments
    assert type(call.arguments) is dict


def assert_error(call: ToolCall, *fragments: str, name: str | None = None) -> None:
    assert isinstance(call.error, str) and call.error, call
    assert not call.ok
    assert call.arguments == {}
    assert call.name == name
    for fragment in fragments:
        assert fragment in call.error, (fragment, call.error)


def assert_unclosed(call: ToolCall) -> None:
    assert_error(call, "unclosed <tool_call> block", "</tool_call>")


def test_tag_constants():
    assert (TOOL_CALL_OPEN, TOOL_CALL_CLOSE) == (OPEN, CLOSE)


# ---------------------------------------------------------------------------------------------
# Well-formed calls


def test_qwen3_form():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
            '"units": null, "hourly": false, "at": [1.5, -2]}}\n</tool_call>')
    call = only(text)
    assert_call(call, "get_weather",
                {"city": "Paris", "days": 3, "units": None, "hourly": False, "at": [1.5, -2]})
    # ``text`` is the block's raw body, whitespace included.
    assert call.text == ('\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
                         '"units": null, "hourly": false, "at": [1.5, -2]}}\n')


@pytest.mark.parametrize("text", [
    '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>',
    '<tool_call>   {"name": "f", "arguments": {"x": 1}}   </tool_call>',
    '<tool_call>\r\n\t {"name": "f",\n "arguments":\n {"x": 1}\n}\n\n\t</tool_call>',
    '<tool_call>\n\n\n{"arguments": {"x": 1}, "name": "f"}\n\n\n</tool_call>',
])
def test_whitespace_around_and_inside_the_object(text):
    assert_call(only(text), "f", {"x": 1})


def test_no_blocks():
    assert parse_tool_calls("") == []
    assert parse_tool_calls("I will answer directly: 42.") == []
    assert parse_tool_calls('{"name": "f", "arguments": {}}') == []  # JSON without tags
    assert parse_tool_calls("</tool_call> stray close, <tool_call without bracket") == []


def test_text_around_blocks_is_ignored():
    text = ("<think>I need the weather {first}.</think>\nLet me check.\n"
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            "\nThat was the call. </tool_call> {\"name\": \"ignored\"} trailing text")
    assert_call(only(text), "weather", {"city": "Oslo"})


def test_two_and_three_calls_with_text_between():
    two = ("first " + qwen3("a", {"n": 1}) + "\nbetween {braces} \"quotes\"\n"
           + qwen3("b", {"n": 2}) + " after")
    calls = parse_tool_calls(two)
    assert len(calls) == 2
    assert_call(calls[0], "a", {"n": 1})
    assert_call(calls[1], "b", {"n": 2})

    three = qwen3("a", {}) + qwen3("b", {"s": "x"}) + "\n\n" + qwen3("c", {"l": [1, {"d": {}}]})
    calls = parse_tool_calls(three)
    assert [c.name for c in calls] == ["a", "b", "c"]
    assert [c.arguments for c in calls] == [{}, {"s": "x"}, {"l": [1, {"d": {}}]}]
    assert all(c.ok for c in calls)


def test_arguments_missing_means_empty():
    assert_call(only('<tool_call>{"name": "now"}</tool_call>'), "now", {})
    assert_call(only('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'), "now", {})


def test_extra_keys_are_ignored():
    assert_call(only('<tool_call>{"name": "f", "arguments": {"a": 1}, "id": "c1"}</tool_call>'),
                "f", {"a": 1})


def test_arguments_as_a_json_string_holding_an_object():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1, \\"b\\": [true]}"}</tool_call>'
    assert_call(only(text), "f", {"a": 1, "b": [True]})
    text = '<tool_call>{"name": "f", "arguments": " {} "}</tool_call>'
    assert_call(only(text), "f", {})


# ---------------------------------------------------------------------------------------------
# Adversarial strings inside JSON values


def test_braces_inside_strings():
    code = "def f():\n    return {'a': {1: 2}}}}} {{{"
    text = OPEN + json.dumps({"name": "python", "arguments": {"code": code}}) + CLOSE
    assert_call(only(text), "python", {"code": code})
    text = '<tool_call>{"name": "f", "arguments": {"s": "}", "t": "{", "u": "}}{"}}</tool_call>'
    assert_call(only(text), "f", {"s": "}", "t": "{", "u": "}}{"})


def test_tags_inside_strings():
    text = ('<tool_call>\n{"name": "echo", "arguments": {"text": "a </tool_call> b <tool_call> c"}}'
            '\n</tool_call>')
    assert_call(only(text), "echo", {"text": "a </tool_call> b <tool_call> c"})
    # ... and the call after it is still found.
    text += ' then <tool_call>{"name": "g", "arguments": {"t": "<tool_call>"}}</tool_call>'
    calls = parse_tool_calls(text)
    assert len(calls) == 2
    assert_call(calls[0], "echo", {"text": "a </tool_call> b <tool_call> c"})
    assert_call(calls[1], "g", {"t": "<tool_call>"})
    # A tag in the name, too.
    assert_call(only('<tool_call>{"name": "</tool_call>"}</tool_call>'), "</tool_call>", {})


def test_closing_tag_inside_a_string_of_a_block_with_trailing_junk():
    # The JSON value is not followed by </tool_call>, so the block ends at the first
    # </tool_call>, which is inside the string: invalid JSON, and the rest is outside text.
    text = '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}} oops</tool_call>'
    call = only(text)
    assert_error(call, "invalid JSON in <tool_call>")
    assert call.text == '{"name": "f", "arguments": {"s": "'


def test_escaped_quotes_and_backslashes():
    text = (r'<tool_call>{"name": "say", "arguments": {"text": "she said \"hi\" \\ \"}\" \\\""}}'
            "</tool_call>")
    assert_call(only(text), "say", {"text": 'she said "hi" \\ "}" \\"'})
    text = (r'<tool_call>{"name": "p", "arguments": {"path": "C:\\tmp\\", "tab": "\t\n\u00e9"}}'
            "</tool_call>")
    assert_call(only(text), "p", {"path": "C:\\tmp\\", "tab": "\t\né"})


# ---------------------------------------------------------------------------------------------
# Unicode


@pytest.mark.parametrize("name, arguments", [
    ("搜索", {"查询": "东京的天气", "页": 2}),
    ("🔍", {"emoji": "👩‍👩‍👧‍👦🏳️‍🌈", "flag": "🇯🇵"}),
    ("cafe\u0301", {"combining": "e\u0301\u0308\u20dd", "zalgo": "Z\u0351\u0346\u0300"}),
    ("f", {"rtl": "\u202eabc\u202c", "zero_width": "a\u200bb\ufeff", "nul": "\x00"}),
])
def test_unicode_names_and_arguments(name, arguments):
    assert_call(only(qwen3(name, arguments)), name, arguments)
    escaped = OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=True) + CLOSE
    assert_call(only(escaped), name, arguments)


def test_lone_surrogates():
    # In the text around blocks, raw inside a JSON string, and as a JSON escape.
    text = ("\ud800 before \udfff" + OPEN + '{"name": "f\ud800", "arguments": {"s": "x\udc00y", '
            '"e": "\\ud800"}}' + CLOSE + "\udbff")
    assert_call(only(text), "f\ud800", {"s": "x\udc00y", "e": "\ud800"})
    assert_unclosed(only(OPEN + "\ud800"))
    assert_error(only(OPEN + "\ud800" + CLOSE), "invalid JSON")


# ---------------------------------------------------------------------------------------------
# The defined errors


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": 1,}}',  # trailing comma
    "{'name': 'f'}",  # Python, not JSON
    '{"name": "f", "arguments": {"a": 1}',  # one brace short
    '{"name": "f", "arguments": {"a": 1}}}',  # one brace too many
    '{"name": "f"} {"name": "g"}',  # two values
    '{"name": "f", "arguments": {"a": undefined}}',
    "",
    "   \n  ",
    "not json at all",
    '{"name": "f", "arguments": {"a": 0x10}}',
    '{"name": "f", "arguments": {"a": 01}}',
])
def test_invalid_json(body):
    call = only(OPEN + body + CLOSE)
    assert_error(call, "invalid JSON in <tool_call>")
    assert call.text == body


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_rejected(constant):
    call = only(OPEN + '{"name": "f", "arguments": {"x": ' + constant + "}}" + CLOSE)
    assert_error(call, "invalid JSON", constant.lstrip("-"), "not valid JSON")
    # Inside an arguments string, too.
    call = only(OPEN + '{"name": "f", "arguments": "{\\"x\\": ' + constant + '}"}' + CLOSE)
    assert_error(call, '"arguments" is a string that is not a JSON object', "not valid JSON",
                 name="f")


def test_number_overflow_is_not_an_error():
    # Ambiguity pinned: a finite literal too large for a float becomes inf (json's rule); only the
    # NaN/Infinity tokens are refused.
    assert_call(only('<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'),
                "f", {"x": float("inf")})


def test_huge_integer_is_an_error_not_a_crash():
    # Python refuses int literals over 4300 digits (a ValueError inside the decoder).
    call = only(OPEN + '{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}" + CLOSE)
    assert_error(call, "invalid JSON")


@pytest.mark.parametrize("body", ['{"arguments": {"a": 1}}', "{}", '{"Name": "f"}'])
def test_missing_name(body):
    assert_error(only(OPEN + body + CLOSE), 'the tool call has no "name"')


@pytest.mark.parametrize("value, shown", [
    ("null", "null"), ("3", "3"), ("-1.5", "-1.5"), ('""', '""'), ("true", "true"),
    ("[\"f\"]", '["f"]'), ('{"n": "f"}', '{"n": "f"}'),
])
def test_name_not_a_non_empty_string(value, shown):
    call = only(OPEN + '{"name": ' + value + ', "arguments": {}}' + CLOSE)
    assert_error(call, '"name" must be a non-empty string', "got " + shown)


@pytest.mark.parametrize("value, kind", [
    ("[1, 2]", "array"), ("3", "number"), ("2.5", "number"), ("null", "null"),
    ("true", "boolean"), ('"[1, 2]"', "array"), ('"7"', "number"), ('"null"', "null"),
    ('"\\"{}\\""', "string"),
])
def test_arguments_not_an_object(value, kind):
    call = only(OPEN + '{"name": "f", "arguments": ' + value + "}" + CLOSE)
    assert_error(call, '"arguments" must be a JSON object, got ' + kind, name="f")


@pytest.mark.parametrize("value", ['"hello"', '""', '"{\\"a\\": 1"', '"{\'a\': 1}"'])
def test_arguments_string_not_json(value):
    call = only(OPEN + '{"name": "f", "arguments": ' + value + "}" + CLOSE)
    assert_error(call, '"arguments" is a string that is not a JSON object', name="f")


@pytest.mark.parametrize("body", ['[{"name": "f", "arguments": {}}]', '"f"', "42", "null", "[]"])
def test_top_level_not_an_object(body):
    assert_error(only(OPEN + body + CLOSE), "a tool call must be a JSON object")


def test_unclosed_final_block():
    call = only('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert_unclosed(call)
    assert call.text == '\n{"name": "f", "arguments": {"a": 1}}\n'
    calls = parse_tool_calls(qwen3("f", {}) + "\n" + '<tool_call>\n{"name": "g", "argu')
    assert len(calls) == 2
    assert_call(calls[0], "f", {})
    assert_unclosed(calls[1])
    assert_unclosed(only(OPEN))
    assert_unclosed(only("text " + OPEN + "  "))


def test_unclosed_block_before_another_block():
    # No </tool_call> before the next <tool_call>: the first block is unclosed and does not
    # swallow the second.
    calls = parse_tool_calls('<tool_call>{"name": "f"}\n<tool_call>{"name": "g"}</tool_call>')
    assert len(calls) == 2
    assert_unclosed(calls[0])
    assert calls[0].text == '{"name": "f"}\n'
    assert_call(calls[1], "g", {})
    calls = parse_tool_calls(OPEN + OPEN + OPEN + '{"name": "h"}' + CLOSE)
    assert len(calls) == 3
    assert_unclosed(calls[0])
    assert_unclosed(calls[1])
    assert_call(calls[2], "h", {})


def test_errors_do_not_stop_later_calls():
    text = (OPEN + "{bad json" + CLOSE + qwen3("ok1", {"a": 1}) + OPEN + '{"name": 5}' + CLOSE
            + OPEN + '{"name": "x", "arguments": [1]}' + CLOSE + qwen3("ok2", {}))
    calls = parse_tool_calls(text)
    assert len(calls) == 5
    assert_error(calls[0], "invalid JSON")
    assert_call(calls[1], "ok1", {"a": 1})
    assert_error(calls[2], '"name" must be a non-empty string')
    assert_error(calls[3], '"arguments" must be a JSON object', name="x")
    assert_call(calls[4], "ok2", {})


# ---------------------------------------------------------------------------------------------
# Truncation: every prefix of a two-call text


TWO_CALLS_PARTS = [
    ("search", {"query": 'a {b} "c" \\ d', "k": 3, "nested": {"l": [1, 2.5, None, True]}}),
    ("fetch", {"url": "https://example.com/?q={}&r=[1]", "note": "東京 🚀"}),
]
TWO_CALLS = "Let me look that up.\n" + qwen3(*TWO_CALLS_PARTS[0]) + "\nand then\n" \
    + qwen3(*TWO_CALLS_PARTS[1]) + "\n"


def test_every_prefix_of_two_calls():
    """Rule: a prefix has one entry per complete ``<tool_call>`` tag in it; an entry is the call
    iff its ``</tool_call>`` is wholly in the prefix, else an unclosed-block error (so only the
    last entry can be an error)."""
    opens = [i for i in range(len(TWO_CALLS)) if TWO_CALLS.startswith(OPEN, i)]
    assert len(opens) == 2
    close_ends = [TWO_CALLS.index(CLOSE, i) + len(CLOSE) for i in opens]
    for cut in range(len(TWO_CALLS) + 1):
        prefix = TWO_CALLS[:cut]
        calls = parse_tool_calls(prefix)
        complete_opens = [i for i in opens if i + len(OPEN) <= cut]
        assert len(calls) == len(complete_opens) == prefix.count(OPEN), cut
        for k, call in enumerate(calls):
            if cut >= close_ends[k]:
                assert_call(call, *TWO_CALLS_PARTS[k])
            else:
                assert k == len(calls) - 1, cut
                assert_unclosed(call)


def test_truncated_json_then_close_tag():
    body = json.dumps({"name": "search", "arguments": TWO_CALLS_PARTS[0][1]}, ensure_ascii=False)
    for cut in range(len(body)):  # every proper prefix of the object is invalid JSON
        call = only(OPEN + body[:cut] + CLOSE)
        assert_error(call, "invalid JSON in <tool_call>")
        assert call.text == body[:cut]
    assert_call(only(OPEN + body + CLOSE), "search", TWO_CALLS_PARTS[0][1])


def test_truncated_json_then_next_call():
    body = json.dumps({"name": "search", "arguments": TWO_CALLS_PARTS[0][1]}, ensure_ascii=False)
    following = qwen3(*TWO_CALLS_PARTS[1])
    for cut in range(len(body) + 1):
        calls = parse_tool_calls(OPEN + body[:cut] + following)
        assert len(calls) == 2, cut
        assert_unclosed(calls[0])
        assert calls[0].text == body[:cut]
        assert_call(calls[1], *TWO_CALLS_PARTS[1])


# ---------------------------------------------------------------------------------------------
# Depth, types


@pytest.mark.parametrize("text", [
    OPEN + "[" * 100_000,
    OPEN + "{" * 100_000,
    OPEN + '{"name": "f", "arguments": ' + "[" * 100_000,
])
def test_deep_nesting_unclosed(text):
    assert_unclosed(only(text))


@pytest.mark.parametrize("body", [
    "[" * 100_000,
    "[" * 100_000 + "]" * 100_000,
    '{"k": ' * 100_000 + "1" + "}" * 100_000,
    '{"name": "f", "arguments": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}",
    '{"name": "f", "arguments": "' + "[" * 100_000 + "]" * 100_000 + '"}',
    '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}",
])
def test_deep_nesting_is_an_error_not_a_recursion_error(body):
    call = only(OPEN + body + CLOSE)
    assert call.error, call
    assert call.arguments == {}


def test_every_nesting_depth_up_to_the_recursion_limit():
    """Near the recursion limit the decoder may just succeed while later work on the decoded
    value (an error message showing it) runs out of stack: no depth may raise. Depths are swept
    because where that edge lies depends on the caller's stack depth."""
    limit = sys.getrecursionlimit() + 50
    for template in ['{"name": %s, "arguments": {}}', '{"name": "f", "arguments": %s}', "%s",
                     '{"name": "f", "arguments": "%s"}']:
        for depth in range(1, limit):
            call = only(OPEN + template % ("[" * depth + "]" * depth) + CLOSE)
            assert call.error and call.arguments == {}, (template, depth)
    for depth in range(1, limit):
        call = only(OPEN + '{"name": "f", "arguments": {"a": %s}}' % ("[" * depth + "]" * depth)
                    + CLOSE)
        if call.ok:
            value = call.arguments["a"]
            for _ in range(depth - 1):
                assert value.__class__ is list and len(value) == 1
                value = value[0]
            assert value == []
        else:
            assert_error(call, "nested too deeply")


@pytest.mark.parametrize("value", [None, b"<tool_call>{}</tool_call>", 3, ["<tool_call>"],
                                   bytearray(b"x")])
def test_non_str_raises_type_error(value):
    with pytest.raises(TypeError, match="text must be a str"):
        parse_tool_calls(value)


def test_str_subclass():
    class Text(str):
        pass

    assert_call(only(Text(qwen3("f", {"a": 1}))), "f", {"a": 1})


# ---------------------------------------------------------------------------------------------
# Fuzz


def _check_entries(text: str, calls) -> None:
    """The invariants every result satisfies, on any text, with the block rule checked exactly:
    blocks are consecutive, each starts at the first <tool_call> after the previous block, the
    closed ones end with </tool_call>, the unclosed ones end at the next <tool_call> or the end,
    and no <tool_call> is left over."""
    assert isinstance(calls, list)
    position = 0
    for call in calls:
        assert isinstance(call, ToolCall)
        if call.error is None:
            assert isinstance(call.name, str) and call.name
            assert type(call.arguments) is dict
        else:
            assert isinstance(call.error, str) and call.error
            assert call.arguments == {}
            assert call.name is None or (isinstance(call.name, str) and call.name)
        start = text.find(OPEN, position)
        assert start >= 0
        body_start = start + len(OPEN)
        assert text.startswith(call.text, body_start)
        position = body_start + len(call.text)
        if call.error is not None and call.error.startswith("unclosed"):
            assert OPEN not in call.text
            assert position == len(text) or text.startswith(OPEN, position)
        else:
            assert text.startswith(CLOSE, position)
            position += len(CLOSE)
            if OPEN in call.text or CLOSE in call.text:
                # Only a block whose JSON value decoded may hold tags (in its strings).
                assert call.error is None or not call.error.startswith("invalid JSON")
    assert text.find(OPEN, position) < 0
    # Every <tool_call> starts an entry or lies inside a decoded block.
    assert len(calls) + sum(c.text.count(OPEN) for c in calls) == text.count(OPEN)


def _reference(body: str):
    """What a closed block holds: (name, arguments) or None for an error."""
    def refuse(constant):
        raise ValueError(constant)

    try:
        obj = json.loads(body, parse_constant=refuse)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments, parse_constant=refuse)
    except (ValueError, RecursionError):
        return None
    return (obj["name"], arguments) if isinstance(arguments, dict) else None


def _check_against_reference(calls) -> None:
    for call in calls:
        if call.error is not None and call.error.startswith("unclosed"):
            continue
        expected = _reference(call.text)
        if expected is None:
            assert call.error is not None, call
        else:
            assert call.error is None, (call, expected)
            assert (call.name, call.arguments) == expected


def _json_pool(strings: list[str], seed: int) -> list[str]:
    """JSON texts (compact, spaced, ASCII-escaped, raw unicode) of random values built from
    ``strings``: a fixed pool, so that the grammar below costs hypothesis one choice each."""
    rng = random.Random(seed)
    numbers = [0, -1, 7, 10**20, -(2**63), 0.5, -1e-300, 1e308, 3.14, -0.0]

    def value(depth: int):
        kind = rng.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rng.choice(numbers)
        if kind in (2, 3, 4):
            return rng.choice(strings)
        if kind in (5, 6):
            return {rng.choice(strings): value(depth + 1) for _ in range(rng.randrange(4))}
        return [value(depth + 1) for _ in range(rng.randrange(4))]

    pool = ['{"name": "f", "arguments": {}}', '{"name": "f"}', '{"name": "f", "arguments": "{}"}',
            '{"name": "g", "arguments": {"a": [1, {"b": null}]}}', '{"name": ""}', "[]", "{}"]
    for _ in range(300):
        v = value(0)
        pool.append(json.dumps(v))
        pool.append(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
    return pool


_CLEAN_STRINGS = ["", "a", "name", "arguments", "hello world", "東京", "🚀", "e\u0301", "{",
                  "}", "[1]", ":", ",", "\\", '"', "\n\t", "\u2028", "\x00", "\ud800", "f"]
_DIRTY_STRINGS = _CLEAN_STRINGS + [OPEN, CLOSE, "a</tool_call>b", OPEN + "{}" + CLOSE,
                                   '"}' + CLOSE, CLOSE + OPEN]
_STRUCTURE = [OPEN, CLOSE, OPEN + "\n", "\n" + CLOSE, "{", "}", '"name"', '"arguments"', ":",
              ": ", ",", "[", "]", " ", "\n", '"f"', '"get_weather"', "{}", "null", "NaN", "1e400",
              '"{\\"a\\": 1}"']
_NAMES = ['"f"', '"get_weather"', '"搜索"', '"a b"', '""', "null", "3", "[]", '{"n": 1}']
_MUTATIONS = ["", "cut-close", "cut-brace", "junk", "no-close", "double-open"]


def _call_shaped(pool: list[str], extra_names: list[str]):
    """A call block built from pool values, whole or damaged in one of a few ways."""

    def build(parts) -> str:
        before, name, arguments, has_arguments, after, mutation = parts
        obj = "{" + '"name": ' + name + (', "arguments": ' + arguments if has_arguments else "")
        if mutation != "cut-brace":
            obj += "}"
        if mutation == "junk":
            obj += " junk"
        block = OPEN + before + obj + after
        if mutation == "cut-close":
            return block + CLOSE[:-1]
        if mutation == "double-open":
            return OPEN + block + CLOSE
        return block if mutation == "no-close" else block + CLOSE

    whitespace = st.sampled_from(["", "\n", " ", "\n\n", "\t \r\n"])
    return st.tuples(whitespace, st.sampled_from(_NAMES + extra_names + pool[:40]),
                     st.sampled_from(pool + ['"{}"', '"[1]"', '"{\\"a\\": 1}"']), st.booleans(),
                     whitespace, st.sampled_from(_MUTATIONS)).map(build)


# Clean: no <tool_call> inside any JSON string; text fragments have no '"', so every JSON string
# the decoder can read is a whole string token of one fragment. Dirty: tags inside strings and
# stray quotes and backslashes.
_CLEAN_POOL = _json_pool(_CLEAN_STRINGS, 0)
_DIRTY_POOL = _json_pool(_DIRTY_STRINGS, 1)
_clean_grammar = st.lists(_call_shaped(_CLEAN_POOL, [])
                          | st.sampled_from(_STRUCTURE) | st.sampled_from(_CLEAN_POOL)
                          | st.text(alphabet=st.characters(blacklist_characters='"'), max_size=8),
                          max_size=16).map("".join)
_dirty_grammar = st.lists(_call_shaped(_DIRTY_POOL, ['"' + CLOSE + '"', '"' + OPEN + '"'])
                          | st.sampled_from(_STRUCTURE) | st.sampled_from(_DIRTY_POOL)
                          | st.text(max_size=8)
                          | st.sampled_from(['"', '\\"', "\\", '"' + OPEN + '"']),
                          max_size=16).map("".join)


@FUZZ
@given(st.text(max_size=300))
def test_fuzz_random_strings(text):
    calls = parse_tool_calls(text)
    _check_entries(text, calls)
    _check_against_reference(calls)


@FUZZ
@given(st.one_of(_clean_grammar.map(lambda text: (text, True)),
                 _dirty_grammar.map(lambda text: (text, False))))
def test_fuzz_grammar(case):
    text, clean = case
    calls = parse_tool_calls(text)
    _check_entries(text, calls)
    _check_against_reference(calls)
    if clean:
        assert len(calls) == text.count(OPEN)


_IDENTIFIER = string.ascii_letters + "_"
_names = st.tuples(st.sampled_from(_IDENTIFIER),
                   st.text(alphabet=_IDENTIFIER + string.digits + ".-", max_size=30)).map("".join)
_tag_heavy_text = st.text(max_size=10) | st.sampled_from([OPEN, CLOSE, "{", "}", '"', "\\",
                                                          '"}' + CLOSE, "\ud800"])
_argument_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | _tag_heavy_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_tag_heavy_text, inner, max_size=3),
    max_leaves=6)
_arguments = st.dictionaries(_tag_heavy_text, _argument_values, max_size=4)


@FUZZ
@given(_names, _arguments)
def test_round_trip_qwen3_rendering(name, arguments):
    text = ('<tool_call>\n{"name": "' + name + '", "arguments": '
            + json.dumps(arguments, ensure_ascii=False) + '}\n</tool_call>')
    assert_call(only(text), name, arguments)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(_names, _arguments), min_size=1, max_size=4),
       st.lists(st.text(alphabet=st.characters(blacklist_characters="<"), max_size=15),
                min_size=5, max_size=5))
def test_round_trip_several_calls_with_text_between(calls, between):
    text = between[0] + "".join(qwen3(n, a) + between[i + 1] for i, (n, a) in enumerate(calls))
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in parsed] == [(n, a, None) for n, a in calls]
