"""The OpenAI proxy's sessions without HTTP (agentrl_fast.proxy.session and Proxy):
extension vs a new sub-trace, re-serialized arguments, the reply as an OpenAI message
(tool calls, malformed calls as text, stop strings on token boundaries), rewards on finish,
refused requests naming their parameter, and an HTTP stack that stays unimported. A scripted
text policy runs through the real ChatFormat and tokenizer."""

import asyncio
import json
import subprocess
import sys

import pytest

from agentrl_fast.harness import ChatFormat, render_messages
from agentrl_fast.config import SamplingParams
from agentrl_fast.generators import ScriptedGenerator
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.proxy.service import Proxy
from agentrl_fast.proxy.session import ProxyError, canonical_arguments

TOOLS = [{"type": "function", "function": {
    "name": "open_vault", "description": "Open a vault.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}]
SYSTEM = {"role": "system", "content": "You open vaults."}
USER = {"role": "user", "content": "Collect the codes of vaults amber, birch."}
CALL = '<tool_call>\n{"name": "open_vault", "arguments": {"name": "amber"}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat():
    env = VaultEnvironment()
    return ChatFormat(build_tokenizer(env.corpus(), words=env.words()))


class Script:
    """A text policy answering from a queue of outputs (the next one per call)."""

    def __init__(self, *outputs):
        self.outputs = list(outputs)

    def __call__(self, context):
        return self.outputs.pop(0)


def make_proxy(chat, *outputs, **options):
    options.setdefault("batch_window", 0.0)
    return Proxy(ScriptedGenerator(Script(*outputs), chat), chat,
                 SamplingParams(temperature=1.0, max_new_tokens=48), **options)


def complete(proxy, session, messages, **body):
    return asyncio.run(proxy.complete(session, {"model": "m", "messages": messages,
                                                "tools": TOOLS, **body}))


def echo(reply):
    """The assistant message as an OpenAI client sends it back."""
    message = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [dict(c) for c in reply.tool_calls]
    return message


def tool_message(reply, content):
    return {"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": content}


def test_a_request_that_extends_appends_only_the_new_messages(chat):
    proxy = make_proxy(chat, CALL, "Done.")
    session = proxy.create_session(task_id="t")
    _, first, _ = complete(proxy, session, [SYSTEM, USER])
    assert first.finish_reason == "tool_calls" and first.content is None
    call = first.tool_calls[0]
    assert call["function"] == {"name": "open_vault", "arguments": '{"name": "amber"}'}
    assert call["id"].startswith("call_")
    messages = [SYSTEM, USER, echo(first), tool_message(first, "vault amber: code falcon")]
    _, second, usage = complete(proxy, session, messages)
    assert second.content == "Done." and second.finish_reason == "stop"
    trajectory = proxy.finish(session, reward=1.0)
    [sub_trace] = trajectory.sub_traces
    # Token in, token out: the template's rendering of the conversation, each assistant turn
    # the sampled text, ids appended piece by piece.
    want = render_messages(messages, TOOLS, add_generation_prompt=True) + "Done.<|im_end|>\n"
    assert chat.decode(sub_trace.ids) == want
    assert usage["prompt_tokens"] == len(sub_trace.ids) - len(second.ids) - 1
    actions = [i for i, m in zip(sub_trace.ids, sub_trace.action_mask) if m]
    assert actions == first.ids + second.ids
    assert sub_trace.end == "terminal" and trajectory.reward == 1.0
    assert sub_trace.rewards[sub_trace.last_action_index] == 1.0
    assert trajectory.task_id == "t" and trajectory.rollout_id == f"proxy/{session}"


def test_reserialized_arguments_and_null_fields_still_extend(chat):
    proxy = make_proxy(chat, CALL, "Done.")
    session = proxy.create_session()
    _, first, _ = complete(proxy, session, [SYSTEM, USER])
    sent = echo(first)
    sent.update(content="", refusal=None, audio=None, function_call=None)
    sent["tool_calls"][0] = {"id": first.tool_calls[0]["id"], "type": "function",
                             "function": {"arguments": '{\n  "name" :"amber", "x": null}',
                                          "name": "open_vault"}}
    complete(proxy, session, [SYSTEM, USER, sent, tool_message(first, "ok")])
    assert len(proxy.finish(session).sub_traces) == 1


@pytest.mark.parametrize("edit", ["arguments", "call_id", "content", "dropped_turn", "tools",
                                  "system"])
def test_a_changed_history_starts_a_new_sub_trace(chat, edit):
    proxy = make_proxy(chat, CALL, "Done.")
    session = proxy.create_session()
    _, first, _ = complete(proxy, session, [SYSTEM, USER])
    sent, tools = echo(first), TOOLS
    history = [SYSTEM, USER, sent, tool_message(first, "ok")]
    if edit == "arguments":
        sent["tool_calls"][0]["function"]["arguments"] = '{"name": "birch"}'
    elif edit == "call_id":
        sent["tool_calls"][0]["id"] = "call_mine"
    elif edit == "content":
        sent["content"] = "I open it."
    elif edit == "dropped_turn":
        history = [SYSTEM, {"role": "user", "content": USER["content"] + " Amber: falcon."}]
    elif edit == "tools":
        tools = TOOLS + [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    else:
        history[0] = {"role": "system", "content": "Be brief."}
    complete(proxy, session, history, tools=tools)
    trajectory = proxy.finish(session)
    assert [s.end for s in trajectory.sub_traces] == ["continued", "terminal"]
    assert trajectory.metrics["compactions"] == 1
    second = chat.decode(trajectory.sub_traces[1].ids)
    assert second == render_messages(history, tools, add_generation_prompt=True) + "Done.<|im_end|>\n"


THOUGHT = "<think>\nAmber first.\n</think>\n\n"


@pytest.mark.parametrize("reasoning, before, extends", [
    (None, THOUGHT, True),  # as replied
    ("\nAmber first.\n", "\n\n", True),  # litellm's split
    ("\nAmber first.\n", "", False),  # the "\n\n" after the block lost
    ("Amber first.", "\n\n", False),  # stripped: edited
    ("\nBirch first.\n", "\n\n", False),
    (None, "<thinking>\nAmber first.\n</thinking>\n\n", False),  # other tags: other text
    (None, "\n\n", False),  # the think block dropped
])
def test_a_think_block_in_reasoning_content_or_content_is_the_same_text(chat, reasoning, before,
                                                                        extends):
    """An assistant message is compared as the text the model wrote: ``reasoning_content`` is
    its leading ``<think>`` block, exactly (no tags other than ``<think>``, nothing stripped)."""
    proxy = make_proxy(chat, THOUGHT + "Opening. " + CALL, "Done.")
    session = proxy.create_session()
    _, first, _ = complete(proxy, session, [SYSTEM, USER])
    assert first.content == THOUGHT + "Opening."
    sent = {**echo(first), "reasoning_content": reasoning, "content": before + "Opening."}
    complete(proxy, session, [SYSTEM, USER, sent, tool_message(first, "ok")])
    assert len(proxy.finish(session).sub_traces) == (1 if extends else 2)


def test_malformed_calls_come_back_as_text_and_valid_ones_as_calls(chat):
    bad = '<tool_call>\n{"name": "open_vault", "arguments": {"name": }\n</tool_call>'
    proxy = make_proxy(chat, bad, "Let me see." + CALL, "text <tool_call>{\"name\": 1}</tool_call> more")
    session = proxy.create_session()
    _, reply, _ = complete(proxy, session, [SYSTEM, USER])
    assert reply.tool_calls == [] and reply.content == bad and reply.finish_reason == "stop"
    _, reply, _ = complete(proxy, session, [SYSTEM, USER, echo(reply),
                                            {"role": "user", "content": "Fix your call."}])
    assert reply.content == "Let me see." and len(reply.tool_calls) == 1
    # tool_choice "none" bans <tool_call>: a script that writes one fails (a sampler cannot)
    with pytest.raises(ProxyError, match="banned_ids forbids") as error:
        complete(proxy, session, [SYSTEM, USER], tool_choice="none")
    assert error.value.status == 502


def test_stop_strings_cut_on_token_boundaries_only(chat):
    text = "alpha beta gamma"
    proxy = make_proxy(chat, text, text, text)
    ids = chat.encode(text)
    boundary = chat.decode(ids[:2])  # a prefix that ends where a token ends
    stop = text[len(boundary) - 2:len(boundary)]  # ends on that boundary
    session = proxy.create_session()
    _, reply, _ = complete(proxy, session, [USER], stop=stop)
    assert reply.finish_reason == "stop" and reply.ids == ids[:2]
    assert reply.content == boundary[:-2]
    # A stop string whose every occurrence ends inside a token is no stop.
    bounds = {len(chat.decode(ids[:j])) for j in range(len(ids) + 1)}
    inside = next(text[k - 2:k] for k in range(2, len(text)) if all(
        end not in bounds for end in range(2, len(text) + 1) if text[end - 2:end] == text[k - 2:k]))
    _, reply, _ = complete(proxy, proxy.create_session(), [USER], stop=inside)
    assert reply.ids == ids + [chat.im_end_id] and reply.content == text
    trajectory = proxy.finish(session)
    assert [i for i, m in zip(trajectory.current.ids, trajectory.current.action_mask) if m] == ids[:2]


def test_finish_places_rewards_and_marks_empty_sessions(chat):
    proxy = make_proxy(chat, CALL, "Done.")
    session = proxy.create_session()
    _, first, _ = complete(proxy, session, [SYSTEM, USER])
    complete(proxy, session, [SYSTEM, USER, echo(first), tool_message(first, "ok")])
    with pytest.raises(ProxyError, match="turn_rewards has 1 entries but the session made 2"):
        proxy.finish(session, 1.0, turn_rewards=[0.5])
    trajectory = proxy.finish(session, 1.0, turn_rewards=[-0.25, 0.5], truncated=True)
    sub_trace = trajectory.current
    ends = [i for i in range(len(sub_trace.ids) - 1)
            if sub_trace.action_mask[i] and not sub_trace.action_mask[i + 1]]
    assert [sub_trace.rewards[i] for i in ends] == [-0.25, 1.5]
    assert trajectory.reward == 1.25 and sub_trace.end == "truncated"
    with pytest.raises(ProxyError, match="is finished") as error:
        complete(proxy, session, [USER])
    assert error.value.status == 409
    empty = proxy.create_session()
    assert proxy.finish(empty).error == "the session made no completion"
    with pytest.raises(ProxyError, match="no session 'nope'") as error:
        proxy.finish("nope")
    assert error.value.status == 404


def test_a_second_request_in_flight_is_refused(chat):
    proxy = make_proxy(chat, "one", "two", batch_window=0.2)  # the first waits in the batcher
    session = proxy.create_session()

    async def both():
        return await asyncio.gather(proxy.complete(session, {"messages": [USER]}),
                                    proxy.complete(session, {"messages": [USER]}),
                                    return_exceptions=True)
    first, second = asyncio.run(both())
    assert first[1].content == "one"
    assert isinstance(second, ProxyError) and second.status == 409 and second.code == "session_busy"


def test_requests_of_sessions_are_batched_into_one_generate_call(chat):
    proxy = make_proxy(chat, *["Done."] * 6, batch_window=0.2)
    sessions = [proxy.create_session() for _ in range(6)]

    async def all_of_them():
        return await asyncio.gather(*(proxy.complete(s, {"messages": [USER]}) for s in sessions))
    asyncio.run(all_of_them())
    assert proxy.batch_sizes == {6: 1}
    proxy.close()


@pytest.mark.parametrize("body, param, message", [
    ([], None, "the request body must be a JSON object"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "text part"),
    ({"messages": [USER, {"role": "assistant", "content": "x"}]}, "messages[1]", "prefill"),
    ({"messages": [USER], "temperature": 0.5}, "temperature", "temperature must be 1"),
    ({"messages": [USER], "top_p": 0.9}, "top_p", "top_p must be 1"),
    ({"messages": [USER], "n": 2}, "n", "n must be 1"),
    ({"messages": [USER], "max_tokens": 0}, "max_tokens", "integer >= 1"),
    ({"messages": [USER], "stop": ["a", ""]}, "stop", "non-empty strings"),
    ({"messages": [USER], "tools": None, "tool_choice": "required"}, "tool_choice",
     "needs tools"),
    ({"messages": [USER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice", "'fly', which is not one of the tools"),
    ({"messages": [USER], "tool_choice": "any"}, "tool_choice", "named function"),
    ({"messages": [USER], "seed": "7"}, "seed", "integer"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0]", "function"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only assistant"),
])
def test_bad_requests_are_refused_naming_the_parameter(chat, body, param, message):
    proxy = make_proxy(chat)
    session = proxy.create_session()
    with pytest.raises(ProxyError, match=message) as error:
        asyncio.run(proxy.complete(session, body))
    assert error.value.status == 400 and error.value.param == param
    assert set(error.value.body()["error"]) == {"message", "type", "param", "code"}


def test_over_the_context_budget_is_refused_and_max_tokens_is_capped(chat):
    proxy = make_proxy(chat, "Done.", context_budget=200)
    session = proxy.create_session()
    with pytest.raises(ProxyError, match="over the context budget of 200") as error:
        complete(proxy, session, [SYSTEM, {"role": "user", "content": "vault " * 300}])
    assert error.value.code == "context_length_exceeded"
    request, reply, _ = complete(proxy, session, [USER], max_tokens=10 ** 6, tools=None)
    assert request.max_tokens == 48 and reply.content == "Done."


def test_canonical_arguments_compare_parsed_json():
    assert canonical_arguments('{"b": 1, "a": [1, {"c": null}]}') == canonical_arguments(
        {"a": [1, {}], "b": 1})
    assert canonical_arguments('{"a": 1}') != canonical_arguments('{"a": 1.5}')
    assert canonical_arguments("not json") == "raw:not json"


def test_importing_the_harness_does_not_import_the_http_stack():
    code = ("import sys, agentrl_fast, agentrl_fast.harness, agentrl_fast.proxy.service\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_message_content_parts_and_developer_role_render_as_text(chat):
    proxy = make_proxy(chat, "Done.")
    session = proxy.create_session()
    complete(proxy, session, [{"role": "developer", "content": [{"type": "text", "text": "Sys"}]},
                              {"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}],
             tools=None)
    text = chat.decode(proxy.finish(session).current.ids)
    assert text == render_messages([{"role": "system", "content": "Sys"},
                                    {"role": "user", "content": "ab"}],
                                   add_generation_prompt=True) + "Done.<|im_end|>\n"
    assert json.loads(json.dumps(text))  # plain text


def test_generations_carry_the_proxy_version_and_stale_sessions_are_dropped(chat):
    from agentrl_fast.train.proxy_driver import fresh
    proxy = make_proxy(chat, CALL, "Done.")
    session = proxy.create_session()
    _, first, _ = complete(proxy, session, [SYSTEM, USER])
    proxy.version = 3  # an update between the session's two turns
    complete(proxy, session, [SYSTEM, USER, echo(first), tool_message(first, "ok")])
    trajectory = proxy.finish(session)
    assert sorted(set(trajectory.current.action_versions())) == [0, 3]
    assert fresh([trajectory], version=3, max_staleness=3) == [trajectory]
    assert fresh([trajectory], version=3, max_staleness=2) == []
