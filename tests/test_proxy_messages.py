"""The proxy's Anthropic Messages API (``/s/{session}/v1/messages``) over real HTTP with the real
``anthropic`` SDK: a Claude-style tool loop (plain, streamed through ``messages.stream`` and
``messages.create(stream=True)``) on the warm-started tiny policy records token-exact
trajectories (actions the sampled ids, log-probs the trainer's) that a ``Trainer.train_on`` step
trains on; thinking blocks, several tool results in one user message and stop sequences extend
a session as the chat path does (a scripted policy through the real ChatFormat); what the proxy
cannot serve, and hostile bodies, get Anthropic-shaped errors that the SDK raises typed."""

import copy
import random
import time

import anthropic
import httpx
import pytest

from agentrl_fast.config import RolloutConfig, SamplingParams
from agentrl_fast.generators import ScriptedGenerator, TorchGenerator
from agentrl_fast.harness import MemoryStore
from agentrl_fast.proxy import Proxy, ProxyServer
from agentrl_fast.proxy.messages import ThinkingSplit, chat_body, join_thinking, split_thinking
from agentrl_fast.train import TrainConfig, Trainer
from agentrl_fast.envs import VaultEnvironment, build_tokenizer, expert_action
from agentrl_fast.harness import ChatFormat
from agentrl_fast.models.tiny import tiny_qwen3
from agentrl_fast.train.sft import demonstrations, sft
from test_proxy import (MAX_TOKENS, TEMPERATURE, Recorder, assert_logprobs_are_the_trainers,
                        assert_sampled_exactly, expected_text, new_session, vault_episode)
from test_proxy_responses import CALL, INSTRUCTIONS, TASK, chat, finish, serve  # noqa: F401
from test_proxy_stream import Gated

TOOLS = [{"name": "open_vault", "description": "Open a vault.",
          "input_schema": {"type": "object", "properties": {"name": {"type": "string"}},
                           "required": ["name"]}}]
THINK = "<think>\nThe vault is amber.\n</think>\n\n"


def client_of(server, name: str) -> anthropic.Anthropic:
    """The SDK on session ``name`` (created here): its base URL is the session's, less /v1."""
    httpx.post(f"{server.url}/sessions", json={"session_id": name}).raise_for_status()
    return anthropic.Anthropic(base_url=server.base_url(name).removesuffix("/v1"), api_key="-",
                               max_retries=0)


def create(client, how: str, **request):
    """``(message, text deltas)`` of one request: plain, ``messages.stream`` or
    ``messages.create(stream=True)`` (its raw events folded by the SDK's accumulator)."""
    if how == "plain":
        return client.messages.create(**request), []
    if how == "stream":
        with client.messages.stream(**request) as stream:
            deltas = list(stream.text_stream)
            return stream.get_final_message(), deltas
    from anthropic.lib.streaming._messages import accumulate_event
    message, deltas, types = None, [], []
    for event in client.messages.create(stream=True, **request):
        types.append(event.type)
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            deltas.append(event.delta.text)
        message = accumulate_event(event=event, current_snapshot=message, json_bufs={})
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    return message, deltas


def sent_back(message) -> dict:
    """The reply as a harness appends it to its history."""
    return {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                             for b in message.content]}


# -- thinking: split and joined back --------------------------------------------------------------

def test_thinking_splits_alike_however_chunked_and_joins_back():
    """Random contents made of the think block's pieces split into the same blocks whole or in
    random chunks (what streaming sends is what the plain reply holds), and a thinking block
    with its signature joins back into exactly the content it came from."""
    pieces = ["<think>", "\n", "</think>", "\n\n", "x", " y", "<thi", "nk>", "</th"]
    rng, thought = random.Random(0), 0
    for _ in range(2000):
        content = (rng.choice(["", "<think>\n"])
                   + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10))))
        thinking, signature, text = split_thinking(content)
        split, chunks, k = ThinkingSplit(), [], 0
        while k < len(content):
            step = rng.randint(1, 4)
            chunks += split.feed(content[k:k + step])
            k += step
        chunks += split.finish()
        assert "".join(t for kind, t in chunks if kind == "text") == text
        assert [t for kind, t in chunks if kind == "signature"] == ([signature] if signature
                                                                    else [])
        if thinking is None:
            assert text == content
        else:
            assert "".join(t for kind, t in chunks if kind == "thinking") == thinking
            assert join_thinking(thinking, signature, text) == content, content
            thought += 1
    assert thought > 300
    assert split_thinking(THINK + "Done.") == ("The vault is amber.",
                                               "agentrl_fast.think.blank_line", "Done.")


# -- a Claude-style agent on the tiny policy: token-exact, and it trains ---------------------------

@pytest.fixture(scope="module")
def world():
    """``(environment, chat, policy)``: the tiny Qwen3 after a short supervised warm-start on
    the first two turns of expert vault rollouts, so it writes tool calls (test_proxy's
    warm-start, a quarter of its cost)."""
    env = VaultEnvironment()
    chat_format = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
    rollout = RolloutConfig(samples_per_task=1, context_budget=400, max_turns=2,
                            sampling=SamplingParams(max_new_tokens=MAX_TOKENS))
    policy = tiny_qwen3(len(chat_format.tokenizer), seed=0)
    demos = demonstrations(expert_action, chat_format, env, env.tasks("train")[:8], rollout,
                           successful_only=False)
    sft(policy, [s for d in demos for s in d.sub_traces], steps=25, batch_sequences=4)
    return env, chat_format, policy.eval()


@pytest.fixture(scope="module")
def served(world):
    env, chat_format, policy = world
    recorder = Recorder(TorchGenerator(policy, pad_id=0))
    proxy = Proxy(recorder, chat_format, SamplingParams(temperature=TEMPERATURE,
                                                        max_new_tokens=MAX_TOKENS),
                  context_budget=1024, max_total_tokens=8192, batch_window=0.0)
    with ProxyServer(proxy) as server:
        yield server, recorder
    proxy.close()


def claude_agent(base_url: str, system: str, task: str, tools: list[dict], run_tool, how: str,
                 max_turns: int = 6) -> tuple[str | None, list[dict]]:
    """A tool loop on the Messages API: ``(answer, each request's body)``."""
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="-",
                                 max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in tools]
    messages, sent = [{"role": "user", "content": task}], []
    for _ in range(max_turns):
        request = dict(model="policy", max_tokens=MAX_TOKENS, system=system, tools=tools,
                       messages=copy.deepcopy(messages))
        sent.append(request)
        message, deltas = create(client, how, **request,
                                 extra_body={"temperature": TEMPERATURE})  # the run's, restated
        text = "".join(b.text for b in message.content if b.type == "text")
        if how != "plain":  # text deltas as sampled, adding up to the text
            assert "".join(deltas) == text
        messages.append(sent_back(message))
        calls = [b for b in message.content if b.type == "tool_use"]
        if not calls:
            if "<tool_call>" not in text:
                return text, sent
            messages.append({"role": "user", "content": "That tool call was malformed."})
            continue
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c.id, "content": run_tool(c.name, c.input)}
            for c in calls]})
    return None, sent


def test_a_claude_style_agent_is_token_exact_and_trains(world, served):
    """Each loop is one sub-trace whose actions are exactly the sampled ids (the mask only
    them), with the trainer's teacher-forced log-probs, decoding to the template's rendering of
    the last request; a ``Trainer.train_on`` step on them recomputes the same log-probs."""
    env, chat_format, policy = world
    server, recorder = served
    trajectories, calls = [], 0
    for k, task in enumerate(env.tasks("eval")[:3]):
        how = ["plain", "stream", "raw_stream"][k]
        session = new_session(server, f"claude_{how}", task_id=task.id)
        with MemoryStore() as store:
            system, prompt, tools, run_tool, episode = vault_episode(env, task, store)
            answer, sent = claude_agent(server.base_url(session), system, prompt, tools,
                                        run_tool, how)
            trajectory = server.proxy.finish(session, episode.finish(answer))
        [sub_trace] = trajectory.sub_traces  # every request extended the session
        generations = assert_sampled_exactly(sub_trace, recorder)
        assert len(generations) == len(sent) == trajectory.metrics["turns"]
        assert_logprobs_are_the_trainers(policy, sub_trace)
        last = chat_body(sent[-1])
        assert chat_format.decode(sub_trace.ids) == expected_text(
            chat_format, last["messages"], last["tools"], generations)
        calls += trajectory.metrics["calls"]
        trajectories.append(trajectory)
    assert calls >= 1, "the warm-started policy made no valid call to test with"
    rollout = RolloutConfig(samples_per_task=1, context_budget=1024, max_turns=6,
                            sampling=SamplingParams(temperature=TEMPERATURE,
                                                    max_new_tokens=MAX_TOKENS))
    config = TrainConfig(algo="ppo", steps=1, tasks_per_step=3, mini_batches=1,
                         micro_batch_tokens=2048, rollout=rollout, seed=1)
    trainer = Trainer(copy.deepcopy(policy), chat_format, env, config, log=lambda *a: None)
    metrics = trainer.train_on(trajectories)
    assert metrics["logprob_mismatch_max"] < 1e-4  # token in, token out
    assert metrics["step"] == 1


# -- the protocol on a scripted policy ------------------------------------------------------------

class Paced(ScriptedGenerator):
    """A scripted generator whose ids come one at a time, 5 ms apart (as sampled ones do)."""

    def generate(self, prompts, sampling, seeds=None, on_tokens=None):
        def each(index, ids):
            time.sleep(0.005)
            on_tokens(index, ids)
        return super().generate(prompts, sampling, seeds, None if on_tokens is None else each)


@pytest.mark.parametrize("how", ["plain", "stream", "raw_stream"])
def test_thinking_text_and_calls_round_trip_in_one_sub_trace(chat, how):
    """``<think>`` opens a thinking block (streamed as thinking deltas), the calls are tool_use
    blocks with the proxy's call ids; sent back with the tool results, the reply extends the
    session; the text streams in several deltas as it is sampled."""
    outputs = [THINK + "Opening it now. " + CALL, THINK + "The code is 4711."]
    proxy = Proxy(Paced(lambda context: outputs.pop(0), chat), chat,
                  SamplingParams(temperature=1.0, max_new_tokens=64), batch_window=0.0)
    try:
        with ProxyServer(proxy) as server:
            think_and_call(server, how)
    finally:
        proxy.close()


def think_and_call(server, how: str) -> None:
    """Two turns with thinking, a call and its result, checked (see the test above)."""
    client = client_of(server, "think")
    messages = [{"role": "user", "content": TASK}]
    request = dict(model="m", max_tokens=64, system=INSTRUCTIONS, tools=TOOLS,
                   thinking={"type": "enabled", "budget_tokens": 1024})
    first, deltas = create(client, how, messages=messages, **request)
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == "The vault is amber."
    assert first.content[1].text == "Opening it now." and first.stop_reason == "tool_use"
    call = first.content[2]
    assert (call.name, call.input) == ("open_vault", {"name": "amber"})
    assert call.id.startswith("call_")
    if how != "plain":
        assert len(deltas) > 1 and "".join(deltas) == "Opening it now."
    messages += [sent_back(first), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "4711",
         "cache_control": {"type": "ephemeral"}}]}]
    second, _ = create(client, how, messages=messages, **request)
    assert second.content[-1].text == "The code is 4711." and second.stop_reason == "end_turn"
    assert second.usage.input_tokens > first.usage.input_tokens > 0
    assert second.usage.output_tokens > 0
    done = finish(server, "think")
    assert done["turns"] == 2 and done["sub_traces"] == 1 and done["tool_calls"] == 1


def test_several_tool_results_and_text_become_tool_messages_then_a_user_turn(serve, chat):
    """Two tool_result blocks and a text block in one user message are two tool messages and
    a user message after them: the Qwen3 template's one user turn of tool responses, then the
    user's, appended to the session as the chat path appends them."""
    two = CALL + "\n" + CALL.replace("amber", "birch")
    proxy, server = serve(two, "Both open.")
    client = client_of(server, "results")
    messages = [{"role": "user", "content": [{"type": "text", "text": TASK,
                                              "cache_control": {"type": "ephemeral"}}]}]
    first = client.messages.create(model="m", max_tokens=64, tools=TOOLS, messages=messages,
                                   system=[{"type": "text", "text": INSTRUCTIONS}])
    calls = [b for b in first.content if b.type == "tool_use"]
    assert [c.input["name"] for c in calls] == ["amber", "birch"]
    assert calls[0].id != calls[1].id
    messages += [sent_back(first), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": calls[0].id, "content": "4711"},
        {"type": "tool_result", "tool_use_id": calls[1].id, "is_error": True,
         "content": [{"type": "text", "text": "jammed"}]},
        {"type": "text", "text": "Go on."}]}]
    client.messages.create(model="m", max_tokens=64, tools=TOOLS, messages=messages,
                           system=[{"type": "text", "text": INSTRUCTIONS}])
    trajectory = proxy.finish("results", 1.0)
    [sub_trace] = trajectory.sub_traces
    assert ("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4711\n</tool_response>"
            "\n<tool_response>\njammed\n</tool_response><|im_end|>\n<|im_start|>user\nGo on."
            "<|im_end|>\n<|im_start|>assistant\n") in chat.decode(sub_trace.ids)


def test_a_tool_use_id_sent_back_changed_starts_a_new_sub_trace(serve):
    """The proxy's call ids are part of the conversation a session holds: a harness that
    rewrites one has edited its history (as on chat completions)."""
    _, server = serve(CALL, "Done.")
    client = client_of(server, "renamed")
    messages = [{"role": "user", "content": TASK}]
    first = client.messages.create(model="m", max_tokens=64, tools=TOOLS, messages=messages)
    returned = sent_back(first)
    returned["content"][-1]["id"] = "toolu_01"
    messages += [returned, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "4711"}]}]
    client.messages.create(model="m", max_tokens=64, tools=TOOLS, messages=messages)
    assert finish(server, "renamed")["sub_traces"] == 2


@pytest.mark.parametrize("how", ["plain", "stream"])
def test_stop_sequences_and_max_tokens_set_the_stop_reason(serve, how):
    _, server = serve("The code is 4711. END of it.", "A long answer that will not fit.")
    client = client_of(server, "stops")
    ask = [{"role": "user", "content": TASK}]
    stopped, _ = create(client, how, model="m", max_tokens=64, messages=ask,
                        stop_sequences=["END", "never"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    assert stopped.content[0].text == "The code is 4711. "
    cut, _ = create(client, how, model="m", max_tokens=3, messages=ask)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_tool_choice_maps_onto_the_chat_request():
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS}
    expected = {"auto": "auto", "any": "required", "none": "none",
                "tool": {"type": "function", "function": {"name": "open_vault"}}}
    for kind, chat_choice in expected.items():
        choice = {"type": kind, **({"name": "open_vault"} if kind == "tool" else {})}
        assert chat_body({**base, "tool_choice": choice})["tool_choice"] == chat_choice


def test_tool_choice_any_and_tool_reach_the_session(serve):
    """``any`` and a named ``tool`` run as chat's ``"required"`` and named tool_choice
    (``parse_request``'s); ``none`` leaves a call in the text."""
    _, server = serve(CALL, CALL, CALL)
    client = client_of(server, "choice")
    ask = dict(model="m", max_tokens=64, tools=TOOLS,
               messages=[{"role": "user", "content": TASK}])
    for choice in ({"type": "any"}, {"type": "tool", "name": "open_vault"}):
        reply = client.messages.create(tool_choice=choice, **ask)
        assert [b.name for b in reply.content if b.type == "tool_use"] == ["open_vault"]
        assert reply.stop_reason == "tool_use"


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, named", [
    ("messages", [{"role": "user", "content": [{"type": "image", "source": {}}]}],
     "messages[0].content[0]"),
    ("messages", [{"role": "user", "content": [{"type": "document", "source": {}}]}],
     "messages[0].content[0]"),
    ("messages", [{"role": "user", "content": [{"type": "frob"}]}], "messages[0].content[0]"),
    ("messages", [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "abc"}]}, {"role": "user", "content": "y"}],
     "redacted_thinking"),
    ("messages", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
     "messages[1]"),
    ("messages", [{"role": "system", "content": "x"}], "messages[0].role"),
    ("messages", [], "messages"),
    ("messages", [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}],
     "messages[0].content[0].tool_use_id"),
    ("tools", [{"type": "web_search_20250305", "name": "web_search"}], "tools[0]"),
    ("tools", [{"name": "f"}], "tools[0].input_schema"),
    ("tool_choice", {"type": "sometimes"}, "tool_choice"),
    ("system", [{"type": "image"}], "system[0]"),
    ("container", "c_1", "container"),
    ("mcp_servers", [{"type": "url", "url": "http://x"}], "mcp_servers"),
    ("output_config", {"format": {"type": "json_schema"}}, "output_config.format"),
    ("thinking", {"type": "sometimes"}, "thinking"),
    ("thinking", {"type": "enabled"}, "thinking.budget_tokens"),
    ("stop_sequences", "END", "stop_sequences"),
    ("temperature", 0.2, "temperature"),
    ("top_k", 5, "top_k"),
    ("max_tokens", 0, "max_tokens"),
    ("frobnicate", 1, "frobnicate"),
])
def test_what_the_proxy_cannot_serve_is_an_anthropic_400(serve, field, value, named):
    _, server = serve("Fine.")
    client = client_of(server, "refused")
    ask = dict(model="m", max_tokens=16, messages=[{"role": "user", "content": TASK}])
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(**ask, extra_body={field: value})
    assert refused.value.body["type"] == "error", refused.value.body
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert named in refused.value.body["error"]["message"]
    ignored = dict(metadata={"user_id": "u"}, thinking={"type": "disabled"},
                   extra_body={"cache_control": {"type": "ephemeral"}})
    assert client.messages.create(**ask, **ignored).content[0].text == "Fine."  # still up


def test_errors_are_anthropic_shaped_and_typed_in_the_sdk(serve):
    """Bad JSON and a missing max_tokens (400), an unknown session (404), a finished one
    (409, an invalid_request_error), a body over the limit (413), and FastAPI's own 404/405
    on the route: Anthropic's error body, and the SDK's typed errors."""
    _, server = serve("Fine.")
    client = client_of(server, "errors")
    ask = dict(model="m", max_tokens=16, messages=[{"role": "user", "content": TASK}])
    url = f"{server.url}/s/errors/v1/messages"

    def error_of(reply: httpx.Response, status: int) -> dict:
        assert reply.status_code == status, reply.text
        body = reply.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]
    assert error_of(httpx.post(url, content=b"{"), 400)["type"] == "invalid_request_error"
    assert "max_tokens is required" in error_of(
        httpx.post(url, json={"model": "m", "messages": ask["messages"]}), 400)["message"]
    assert error_of(httpx.get(url), 405)["type"] == "invalid_request_error"
    assert error_of(httpx.post(url + "/count_tokens", json=ask), 404)["type"] == \
        "not_found_error"
    with pytest.raises(anthropic.ContentTooLargeError) as large:
        client.messages.create(model="m", max_tokens=16,
                               messages=[{"role": "user", "content": "x" * (9 << 20)}])
    assert large.value.body["error"]["type"] == "request_too_large"
    lost = anthropic.Anthropic(base_url=f"{server.url}/s/nobody", api_key="-", max_retries=0)
    for how in ("plain", "stream"):
        with pytest.raises(anthropic.NotFoundError, match="no session 'nobody'"):
            create(lost, how, **ask)
    assert create(client, "plain", **ask)[0].content[0].text == "Fine."
    finish(server, "errors")
    with pytest.raises(anthropic.ConflictError, match="is finished") as conflict:
        client.messages.create(**ask)
    assert conflict.value.body["error"]["type"] == "invalid_request_error"


def test_a_failure_mid_stream_is_an_error_event_and_before_it_a_5xx(chat):
    """The engine failing after some ids: an Anthropic ``error`` event in the 200 stream (the
    SDK raises it as an APIStatusError); before the first id: a plain 5xx."""
    for fail_after, error in ((6, anthropic.APIStatusError), (1, anthropic.InternalServerError)):
        proxy = Proxy(Gated(chat, ["Some text that fails later on."], fail_after=fail_after),
                      chat, SamplingParams(temperature=1.0, max_new_tokens=64),
                      batch_window=0.0)
        try:
            with ProxyServer(proxy) as server:
                client = client_of(server, "failing")
                with pytest.raises(error, match="the engine failed mid-reply") as raised:
                    list(client.messages.create(model="m", max_tokens=64, stream=True,
                                                messages=[{"role": "user", "content": TASK}]))
                assert type(raised.value) is error
                assert raised.value.body["error"]["type"] == "api_error"
        finally:
            proxy.close()


def test_hostile_messages_requests_get_anthropic_errors(serve):
    """100 mutations of a valid body (each field, and each message's fields and blocks, set to
    values of every JSON type): each is a 200 from the script or a 400 with Anthropic's error
    body, never a 5xx, and the server stays up."""
    _, server = serve(*["Fine."] * 200)
    client_of(server, "hostile")
    url = f"{server.url}/s/hostile/v1/messages"
    values = [None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"type": "x"}, [{"type": None}],
              [{"type": "text"}], [{"type": "tool_result"}], [{"type": "tool_use", "id": 1}],
              [{"type": "thinking", "thinking": 3}], {"type": "tool", "name": 7}]
    valid = {"model": "m", "max_tokens": 8, "system": INSTRUCTIONS, "tools": TOOLS,
             "messages": [{"role": "user", "content": [{"type": "text", "text": TASK}]}]}
    rng = random.Random(0)
    for _ in range(100):
        body = copy.deepcopy(valid)
        for _ in range(rng.randint(1, 3)):
            value = copy.deepcopy(rng.choice(values))
            if rng.random() < 0.4:
                body[rng.choice([*valid, "tool_choice", "stop_sequences", "thinking",
                                 "stream"])] = value
            elif isinstance(body.get("messages"), list) and body["messages"]:
                message = body["messages"][0]
                if isinstance(message, dict) and isinstance(message.get("content"), list) \
                        and message["content"] and rng.random() < 0.5:
                    block = message["content"][0]
                    if isinstance(block, dict):
                        block[rng.choice(["type", "text", "content", "tool_use_id", "input",
                                          "id", "name"])] = value
                elif isinstance(message, dict):
                    message[rng.choice(["role", "content"])] = value
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code in (200, 400), (body, reply.text)
        if reply.status_code == 400:
            error = reply.json()
            assert error["type"] == "error" and error["error"]["message"], (body, reply.text)
        elif body.get("stream") is not True:
            assert reply.json()["type"] == "message"
    assert httpx.post(url, json=valid).json()["content"] == [{"type": "text", "text": "Fine."}]
