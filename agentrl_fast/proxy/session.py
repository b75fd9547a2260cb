"""The OpenAI proxy's sessions, without HTTP: request checking, the token-exact conversation a
session holds, and the model's output as an OpenAI assistant message
(:mod:`agentrl_fast.proxy.service` serves them).

A session is one rollout. It holds the canonical form of the conversation its current
sub-trace renders (the last request's messages and the reply it got). A request *extends* the
session when its messages start with exactly that conversation: the same roles, the same
content (``None`` == ``""``, text parts joined, an assistant's ``reasoning_content`` as the
leading ``<think>`` block of its content), the same tool calls (names, call ids, and
arguments equal as JSON: parsed, ``null`` members dropped, so a client's re-serialization does
not count as an edit) and the same tools. Then only the new messages are tokenized (the Qwen3
template pieces, :class:`~agentrl_fast.harness.chat_format.ChatFormat`) and appended to the
ids the sub-trace holds, the sampled ids verbatim. Any other request means the harness changed
its own history (dropped, summarised or edited turns): the sub-trace is closed as
``"continued"`` and a new one of the same rollout starts from the request's whole rendering,
as the engine's compaction does (GAE then chains across them).

``tool_choice``: ``"required"`` or a named function appends the call's opening ids
(:func:`forced_ids`) to the prompt as template, so the model's sampled ids continue them with
its own log-probs; :func:`make_reply` parses the forced text and the sampled one together.
``"none"`` returns calls as text (the service also bans ``<tool_call>``).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.harness.chat_format import THINK_CLOSE, THINK_OPEN, ChatFormat, tool_call_text
from agentrl_fast.harness.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.seeds import derive_seed

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
TOOL_CHOICES = ("auto", "none", "required")
MAX_STOP_STRINGS = 4


class ProxyError(ValueError):
    """A request the proxy refuses: an HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error",
                             409: "conflict_error", 413: "invalid_request_error",
                             }.get(status, "server_error" if status >= 500 else
                                   "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _bad(message: str, param: str | None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param, code)


def internal_error(error: Exception) -> ProxyError:
    """The 500 a failure inside the proxy becomes (the server answers and stays up)."""
    return ProxyError(500, f"internal error: {type(error).__name__}: {str(error)[:200]}")


# -- canonical messages ---------------------------------------------------------------------------

def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as one string per JSON value: a JSON string is parsed, ``null``
    members are dropped, keys sorted; a string that is not JSON stays itself (tagged)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return "raw:" + arguments
    return "json:" + json.dumps(_drop_nulls(arguments), sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class Message:
    """One message, checked: ``render`` is what the chat template takes, ``key`` what extension
    compares (role, content, reasoning, and each call's id, name and canonical arguments)."""

    render: dict
    key: tuple


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"{param}[{j}] must be a text part {{\"type\": \"text\", \"text\": "
                           f"...}}; the proxy serves a text model", f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{param} must be a string, null or a list of text parts, got "
               f"{type(content).__name__}", param)


def _tool_calls(raw: Any, param: str) -> tuple[list[dict], tuple]:
    if raw is None:
        return [], ()
    if not isinstance(raw, list):
        raise _bad(f"{param} must be a list, got {type(raw).__name__}", param)
    render, key = [], []
    for j, call in enumerate(raw):
        where = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _bad(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                       f"{{\"name\": ..., \"arguments\": ...}}}}", where)
        name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if not isinstance(arguments, (str, dict)):
            raise _bad(f"{where}.function.arguments must be a JSON string or an object, got "
                       f"{type(arguments).__name__}", f"{where}.function.arguments")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{where}.id must be a string", f"{where}.id")
        render.append({"name": name, "arguments": arguments})
        try:
            key.append((call_id, name, canonical_arguments(arguments)))
        except RecursionError:
            raise _bad(f"{where}.function.arguments is nested too deeply",
                       f"{where}.function.arguments") from None
    return render, tuple(key)


def _as_written(content: str, reasoning: str | None) -> str:
    """An assistant message's text as the model wrote it: a ``reasoning_content`` is its
    leading think block. Clients that move a reply's leading ``<think>...</think>`` out of
    ``content`` (litellm: the text between the tags, and all after them, neither stripped)
    thus send back what the proxy replied."""
    return content if reasoning is None else f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}"


def check_message(message: Any, index: int) -> Message:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(f"{param} must be an object with 'role' and 'content', got "
                   f"{type(message).__name__}", param)
    role = ROLE_ALIASES.get(message.get("role"), message.get("role"))
    if role not in ROLES:
        raise _bad(f"{param}.role must be one of {', '.join(ROLES)} (or developer), got "
                   f"{message.get('role')!r}", f"{param}.role")
    content = _text(message.get("content"), f"{param}.content")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise _bad(f"{param}.reasoning_content must be a string or null", f"{param}.reasoning_content")
    calls, call_key = _tool_calls(message.get("tool_calls"), f"{param}.tool_calls")
    if calls and role != "assistant":
        raise _bad(f"{param} has tool_calls but role {role!r}; only assistant messages carry "
                   "them", f"{param}.tool_calls")
    render = {"role": role, "content": content}
    if calls:
        render["tool_calls"] = calls
    if reasoning:
        render["reasoning_content"] = reasoning
    if role == "assistant":  # a think block in reasoning_content or in content: the same
        return Message(render, (role, _as_written(content, reasoning), "", call_key))
    return Message(render, (role, content, reasoning or "", call_key))


# -- requests -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatRequest:
    """A checked ``/chat/completions`` request (see :func:`parse_request`)."""

    messages: list[Message]
    tools: list[dict] | None
    tools_key: str
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    tool_choice: str = "auto"  # one of TOOL_CHOICES; a named function is "required"
    forced_function: str | None = None  # the function a named tool_choice calls
    logprobs: bool = False  # return each sampled token's log-prob

    @property
    def parse_calls(self) -> bool:
        """Whether calls become ``tool_calls`` (``tool_choice: "none"``: all is text)."""
        return self.tool_choice != "none"


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def _check_sampling(body: dict, sampling: SamplingParams) -> None:
    """The trainer's sampling is the run's: a request may restate it, not change it."""
    for name, run in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = _number(body, name)
        if value is not None and value != run:
            raise _bad(f"{name} must be {run:g} (the run's sampling: the trainer recomputes "
                       f"log-probs with it) or omitted, got {value:g}", name, "unsupported_value")
    top_k = body.get("top_k")  # vLLM's extension
    if top_k is not None and top_k != sampling.top_k and not (top_k == -1 and sampling.top_k == 0):
        raise _bad(f"top_k must be {sampling.top_k} (the run's sampling) or omitted, got "
                   f"{top_k!r}", "top_k", "unsupported_value")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name)
        if value:
            raise _bad(f"{name} must be 0 or omitted (the run's sampling has no penalty), got "
                       f"{value:g}", name, "unsupported_value")
    if body.get("logit_bias"):
        raise _bad("logit_bias must be empty or omitted (the run's sampling)", "logit_bias",
                   "unsupported_value")
    if body.get("n") not in (None, 1):
        raise _bad(f"n must be 1 or omitted (one sample per session turn), got {body.get('n')!r}",
                   "n", "unsupported_value")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _bad("response_format must be {\"type\": \"text\"} or omitted: the proxy does "
                   "not constrain decoding", "response_format", "unsupported_value")


def _max_tokens(body: dict, sampling: SamplingParams) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return sampling.max_new_tokens
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"{name} must be an integer >= 1, got {value!r}", name)
    return min(value, sampling.max_new_tokens)  # the run's cap per turn


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or not 0 < len(stop) <= MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise _bad(f"stop must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} "
                   "non-empty strings", "stop")
    return tuple(stop)


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad(f"tools must be a list, got {type(tools).__name__}", "tools")
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                       "..., \"parameters\": {...}}}", f"tools[{i}]")
    return tools


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None]:
    """``(tool_choice, forced function)``: one of :data:`TOOL_CHOICES`, and for a named
    function ``("required", its name)``, which must be one of ``tools``."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", None
    names = [t["function"]["name"] for t in tools or []]
    if choice in TOOL_CHOICES:
        if choice == "required" and not names:
            raise _bad("tool_choice \"required\" needs tools to call; none were given",
                       "tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        got = json.dumps(choice, default=repr)[:200]
        raise _bad(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function "
                   f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} (on /responses "
                   f"{{\"type\": \"function\", \"name\": ...}}), got {got}", "tool_choice")
    if name not in names:
        raise _bad(f"tool_choice names function {name!r}, which is not one of the tools "
                   f"({', '.join(map(repr, names)) or 'none were given'})", "tool_choice")
    return "required", name


def parse_request(body: Any, sampling: SamplingParams) -> ChatRequest:
    """Check a ``/chat/completions`` body against the run's ``sampling``; raises
    :class:`ProxyError` (400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    _check_sampling(body, sampling)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    messages = [check_message(m, i) for i, m in enumerate(raw)]
    if messages[-1].render["role"] == "assistant":
        raise _bad("the last message is an assistant message; the proxy samples the next "
                   "assistant turn after user or tool messages (no assistant prefill)",
                   f"messages[{len(raw) - 1}]")
    tools = _tools(body)
    tool_choice, forced_function = _tool_choice(body, tools)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"seed must be an integer, got {seed!r}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs must be a boolean", "logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise _bad("top_logprobs must be 0 or omitted: the generator returns the sampled "
                   "token's log-prob only", "top_logprobs", "unsupported_value")
    return ChatRequest(messages, tools, json.dumps(tools, sort_keys=True) if tools else "",
                       _max_tokens(body, sampling), _stop(body),
                       None if seed is None else seed % (2 ** 63), bool(stream),
                       bool(options.get("include_usage")), tool_choice, forced_function,
                       bool(logprobs))


# -- the model's output as an assistant message ---------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """What one completion returns: the ``ids`` kept as the turn's actions (the sampled ids, cut
    after a stop string), the message's ``content`` and ``tool_calls`` (OpenAI form) and the
    ``finish_reason``; ``message`` is its :class:`Message` as the session holds it."""

    ids: list[int]
    logprobs: list[float]
    content: str | None
    tool_calls: list[dict]
    finish_reason: str
    message: Message

    def openai_message(self) -> dict:
        """The assistant message as the OpenAI API returns it (and a client sends it back)."""
        message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def token_logprobs(chat_format: ChatFormat, reply: Reply) -> list[dict]:
    """OpenAI's ``logprobs.content`` of a reply: every kept id of the turn (tool-call blocks
    and the stop token included: the trajectory's actions) with its sampling log-prob, its text
    and its bytes (exact for byte-level tokenizers, else the text's UTF-8)."""
    out = []
    for token_id, logprob in zip(reply.ids, reply.logprobs):
        text = chat_format.decode([token_id])
        raw = chat_format.token_bytes(token_id)
        out.append({"token": text, "logprob": logprob, "top_logprobs": [],
                    "bytes": list(raw if raw is not None else text.encode("utf-8"))})
    return out


def _token_ends(chat_format: ChatFormat, ids: Sequence[int], text: str) -> dict[int, int]:
    """``{character offset: number of ids}`` for every prefix of ``ids`` whose text ends at a
    token boundary of ``text`` (a prefix that splits a character is not one)."""
    ends = {}
    for k in range(1, len(ids) + 1):
        prefix = chat_format.decode(ids[:k])
        if text.startswith(prefix):
            ends[len(prefix)] = k
    return ends


def cut_at_stop(chat_format: ChatFormat, ids: list[int], stop: Sequence[str]
                ) -> tuple[int, str] | None:
    """``(kept ids, text before the stop)`` at the first stop string that ends on a token
    boundary of the output, else ``None``. An occurrence ending inside a token is no stop:
    cutting there would leave a token the harness never saw in the trajectory."""
    if not stop:
        return None
    text = chat_format.decode(ids)
    ends = _token_ends(chat_format, ids, text)
    best = None
    for s in stop:
        start = text.find(s)
        while start >= 0:
            end = start + len(s)
            if end in ends:
                if best is None or end < best[0]:
                    best = (end, ends[end], text[:start])
                break
            start = text.find(s, start + 1)
    return None if best is None else best[1:]


def _call_spans(text: str, calls) -> list[tuple[int, int]]:
    """Where each parsed block sits in ``text`` (the parser's own walk: open tag, body, and
    the close tag when the block has one)."""
    spans, position = [], 0
    for call in calls:
        start = text.find(TOOL_CALL_OPEN, position)
        end = start + len(TOOL_CALL_OPEN) + len(call.text)
        if text.startswith(TOOL_CALL_CLOSE, end):
            end += len(TOOL_CALL_CLOSE)
        spans.append((start, end))
        position = end
    return spans


def forced_ids(chat_format: ChatFormat, request: ChatRequest) -> list[int]:
    """The ids a forced ``tool_choice`` puts after the generation prompt, as template (the
    model continues them; they are not its actions): ``<tool_call>`` for ``"required"``; for a
    named function as much of the call's head (up to its arguments) as the tokenizer splits
    off alike in the calls of it as the template renders them (probed with no arguments, and
    with each of the function's parameters, and another), so they are the ids the model itself
    writes there. A byte-level BPE splits after the name's closing quote, pinning the name; a
    tokenizer that merges the head with the arguments leaves ``<tool_call>`` alone."""
    if request.tool_choice != "required":
        return []
    if request.forced_function is None:
        return [chat_format.token_ids[TOOL_CALL_OPEN]]
    name = request.forced_function
    function = next(t["function"] for t in request.tools if t["function"]["name"] == name)
    properties = (function.get("parameters") or {}).get("properties")
    keys = [*(properties if isinstance(properties, dict) else ()), "a"]
    calls = [tool_call_text(name, {})] + [tool_call_text(name, {k: "b"}) for k in keys]
    head = calls[0][:calls[0].rindex("{}")]  # <tool_call>\n{"name": "NAME", "arguments":_
    probes = [chat_format.encode(call) for call in calls]
    kept = 1  # <tool_call>, an added token: always its own id
    while (kept < len(probes[0]) and all(p[:kept + 1] == probes[0][:kept + 1] for p in probes)
           and head.startswith(chat_format.decode(probes[0][:kept + 1]))):
        kept += 1
    return probes[0][:kept]


def make_reply(chat_format: ChatFormat, ids: list[int], logprobs: list[float],
               finish_reason: str, request: ChatRequest, call_id,
               forced: Sequence[int] = ()) -> Reply:
    """The assistant message for sampled ``ids`` after the ``forced`` ones
    (:func:`forced_ids`; their text begins the output): valid ``<tool_call>`` blocks become
    OpenAI ``tool_calls`` (ids from ``call_id(k)``), everything else (malformed blocks
    included) is the content, so the harness sees what the model wrote."""
    cut = cut_at_stop(chat_format, ids, request.stop)
    if cut is not None:
        kept, text = cut
        ids, logprobs, finish_reason = ids[:kept], logprobs[:kept], "stop"
    else:
        text = chat_format.decode(ids[:-1] if ids and ids[-1] == chat_format.im_end_id else ids)
    text = chat_format.decode(forced) + text
    calls = parse_tool_calls(text) if request.parse_calls else []
    tool_calls, content = [], text
    if any(c.ok for c in calls):
        pieces, position = [], 0
        for call, (start, end) in zip(calls, _call_spans(text, calls)):
            if call.ok:
                pieces.append(text[position:start])
                position = end
                arguments = json.dumps(call.arguments, ensure_ascii=False)
                tool_calls.append({"id": call_id(len(tool_calls)), "type": "function",
                                   "function": {"name": call.name, "arguments": arguments}})
        content = ("".join(pieces) + text[position:]).strip()
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    message = check_message({"role": "assistant", "content": content or None,
                             "tool_calls": tool_calls or None}, 0)
    return Reply(ids, logprobs, content or None if tool_calls else content, tool_calls,
                 finish_reason, message)


# -- sessions -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """How a request enters its session: ``extend`` the current sub-trace with ``context`` ids,
    or start a new sub-trace from them; ``prompt`` is what the model continues. Both end with
    the ``forced`` ids of the request's ``tool_choice`` (:func:`forced_ids`)."""

    extend: bool
    context: list[int]
    prompt: list[int]
    forced: list[int] = field(default_factory=list)


@dataclass
class Session:
    """One rollout served through the proxy (see the module doc). ``turns``: where each
    completion's last action token sits (sub-trace index, position), for per-turn rewards."""

    id: str
    trajectory: Trajectory
    seed: int
    held: list[tuple] | None = None
    held_tools: str = ""
    turns: list[tuple[int, int]] = field(default_factory=list)
    busy: bool = False
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def extends(self, request: ChatRequest) -> bool:
        keys = [m.key for m in request.messages]
        return (self.held is not None and request.tools_key == self.held_tools
                and len(keys) > len(self.held) and keys[:len(self.held)] == self.held)

    def plan(self, request: ChatRequest, chat_format: ChatFormat) -> Plan:
        renders = [m.render for m in request.messages]
        forced = forced_ids(chat_format, request)
        if self.extends(request):
            new = chat_format.render_ids(renders[len(self.held):], None,
                                         add_generation_prompt=True) + forced
            return Plan(True, new, self.trajectory.current.ids + new, forced)
        fresh = chat_format.render_ids(renders, request.tools, add_generation_prompt=True) + forced
        return Plan(False, fresh, fresh, forced)

    def commit(self, plan: Plan, request: ChatRequest, reply: Reply, chat_format: ChatFormat,
               version: int) -> None:
        """Record a completion: the plan's context, the kept ids as actions, the turn's end."""
        sub_trace = (self.trajectory.current if plan.extend
                     else self.trajectory.new_sub_trace())  # closes the last one: "continued"
        sub_trace.append_context(plan.context)
        sub_trace.append_action(reply.ids, reply.logprobs, version)
        self.turns.append((sub_trace.index, len(sub_trace) - 1))
        sub_trace.append_context(chat_format.turn_end_ids(reply.ids))
        self.held = [m.key for m in request.messages] + [reply.message.key]
        self.held_tools = request.tools_key
        metrics = self.trajectory.metrics
        metrics["turns"] += 1
        metrics["generated_tokens"] += len(reply.ids)
        # Tool calls the model made (the engine's "calls"); the client runs them, so the proxy
        # never sees their outcome: they count as calls, not in the error rate.
        metrics["calls"] += len(reply.tool_calls)
        metrics["calls_unjudged"] += len(reply.tool_calls)
        metrics["compactions"] += not plan.extend and len(self.trajectory.sub_traces) > 1

    def call_id(self, k: int) -> str:
        return f"call_{derive_seed(self.seed, len(self.turns), k):016x}"

    def turn_seed(self) -> int:
        return derive_seed(self.seed, "turn", len(self.turns))

    def finish(self, reward: float, turn_rewards: Sequence[float] | None = None,
               truncated: bool = False) -> Trajectory:
        """Close the rollout: ``reward`` on its last action token (as the engine puts the final
        reward), ``turn_rewards[i]`` on completion ``i``'s last action token; the last sub-trace
        ends ``"terminal"`` (``"truncated"``: GAE bootstraps with the critic)."""
        rewards = list(turn_rewards or [])
        for name, value in [("reward", reward)] + [(f"turn_rewards[{i}]", r)
                                                    for i, r in enumerate(rewards)]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise _bad(f"{name} must be a finite number, got {value!r}", name)
        if len(rewards) not in (0, len(self.turns)):
            raise _bad(f"turn_rewards has {len(rewards)} entries but the session made "
                       f"{len(self.turns)} completions; give one per completion or none",
                       "turn_rewards")
        trajectory = self.trajectory
        if not self.turns:
            trajectory.error = "the session made no completion"
            return trajectory
        for (index, position), value in zip(self.turns, rewards):
            trajectory.sub_traces[index].rewards[position] += float(value)
        index, position = self.turns[-1]
        trajectory.sub_traces[index].rewards[position] += float(reward)
        trajectory.reward = float(reward) + float(sum(rewards))
        trajectory.current.close("truncated" if truncated else "terminal")
        return trajectory
