"""The OpenAI proxy end to end: real uvicorn on 127.0.0.1 (a free port), a briefly warm-started
tiny policy behind it (so it emits tool calls, some malformed), and agents written only against
the ``openai`` client on the vault tasks. Checked: the recorded trajectory's actions are the
sampled ids and only they, its log-probs are the trainer's teacher-forced ones, it decodes to
the template's rendering of the conversation; re-serialized arguments extend a session, a
harness's own compaction starts a sub-trace GAE chains across, eight sessions in parallel stay
apart (and are batched), and 500 hostile requests leave the server up with well-formed errors.

One server and one policy serve the module (``served``); each test uses sessions of its own."""

import copy
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from agentrl_fast.harness import ChatFormat, MemoryStore, rollout_metrics
from agentrl_fast.config import RolloutConfig, SamplingParams
from agentrl_fast.generators import TorchGenerator
from agentrl_fast.envs import VaultEnvironment, build_tokenizer, expert_action
from agentrl_fast.harness.chat_format import OUTPUT, render_pieces
from agentrl_fast.proxy import Proxy, ProxyServer
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.models.tiny import tiny_qwen3
from agentrl_fast.train.advantages import bootstrap_values, gae_advantages
from agentrl_fast.train.sft import demonstrations, sft

TEMPERATURE = 0.8
MAX_TOKENS = 32
LOGPROB_TOLERANCE = 1e-4  # the TorchGenerator TITO tests' (test_rollout, test_generation)


# -- fixtures: one warm-started policy, one server ------------------------------------------------

@pytest.fixture(scope="session")
def world():
    """``(environment, chat, policy)``: the tiny Qwen3 after a short supervised warm-start on
    expert vault rollouts, so it writes tool calls."""
    env = VaultEnvironment()
    chat = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
    rollout = RolloutConfig(samples_per_task=1, context_budget=400, max_turns=24,
                            sampling=SamplingParams(max_new_tokens=MAX_TOKENS))
    policy = tiny_qwen3(len(chat.tokenizer), seed=0)
    demos = demonstrations(expert_action, chat, env, env.tasks("train")[:8], rollout)
    sft(policy, [s for d in demos for s in d.sub_traces], steps=30, batch_sequences=8)
    return env, chat, policy.eval()


class Recorder:
    """The real generator, keeping every (prompt, generation) it produced."""

    def __init__(self, inner):
        self.inner, self.calls, self.lock = inner, [], threading.Lock()
        self.max_batch_size = inner.max_batch_size

    def generate(self, prompts, sampling, seeds=None, on_tokens=None):
        out = self.inner.generate(prompts, sampling, seeds, on_tokens=on_tokens)
        with self.lock:
            self.calls += [(list(p), g) for p, g in zip(prompts, out)]
        return out

    def update_weights(self, model):
        self.inner.update_weights(model)


@pytest.fixture(scope="session")
def served(world):
    env, chat, policy = world
    recorder = Recorder(TorchGenerator(policy, pad_id=0))
    proxy = Proxy(recorder, chat, SamplingParams(temperature=TEMPERATURE, max_new_tokens=MAX_TOKENS),
                  context_budget=1024, max_total_tokens=8192, batch_window=0.02)
    with ProxyServer(proxy, max_body_bytes=256 << 10) as server:
        yield server, recorder
    proxy.close()


def new_session(server, name, **fields) -> str:
    reply = httpx.post(f"{server.url}/sessions", json={"session_id": name, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()["id"]


# -- the agent: the OpenAI API only ---------------------------------------------------------------

def streamed_message(stream) -> dict:
    """An assistant message from ``chat.completion.chunk`` events."""
    content, calls = "", {}
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                slot["id"] += call.id or ""
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
    return {"role": "assistant", "content": content or None,
            "tool_calls": [calls[k] for k in sorted(calls)] or None}


def reserialized(message: dict) -> dict:
    """As a client that re-serializes: arguments with other key order and spacing and a null
    member, null fields everywhere."""
    message = copy.deepcopy(message)
    for call in message.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"])
        reordered = dict(reversed(list(arguments.items())), comment=None)
        call["function"] = {"arguments": json.dumps(reordered, indent=2), "name": call["function"]["name"]}
    message.update(content=message.get("content") or None, refusal=None, function_call=None)
    return message


def agent(base_url, system, task, tools, run_tool, *, max_turns=6, compact_every=None,
          stream=False, reserialize=False):
    """A tool-using agent loop on the OpenAI API: call tools until a plain answer, tell the
    model when its call was malformed; with ``compact_every``, replace the history by the task
    and notes of the latest tool results every so many turns (the harness's own compaction).
    Returns ``(answer, the messages of each request)``."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    sent = []
    for turn in range(max_turns):
        if compact_every and turn and turn % compact_every == 0:
            notes = [m["content"] for m in messages if m["role"] == "tool"][-2:]
            messages = [messages[0], {"role": "user", "content": f"{task}\nNotes: {'; '.join(notes)}"}]
        sent.append(copy.deepcopy(messages))
        request = dict(model="policy", messages=messages, tools=tools, max_tokens=MAX_TOKENS,
                       temperature=TEMPERATURE)
        if stream:
            message = streamed_message(client.chat.completions.create(stream=True, **request))
        else:
            message = client.chat.completions.create(**request).choices[0].message.model_dump()
        messages.append(reserialized(message) if reserialize else message)
        if not message["tool_calls"]:
            if "<tool_call>" not in (message["content"] or ""):
                return message["content"], sent
            messages.append({"role": "user", "content": "That tool call was malformed."})
            continue
        for call in message["tool_calls"]:
            result = run_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None, sent


# -- the vault task, as plain tools ---------------------------------------------------------------

def vault_episode(env, task, store):
    """``(system, prompt, tool schemas, run_tool, episode)`` of ``task``: its tools called as
    plain functions, errors returned as text."""
    episode = env.start(task, store.namespace(task.id), seed=0)
    by_name = {t.name: t for t in episode.tools}

    def run_tool(name, arguments):
        try:
            return str(by_name[name](**arguments))
        except Exception as error:  # noqa: BLE001 - the model reads what went wrong
            return f"Error: {error}"
    return episode.system_prompt, episode.prompt, [t.schema for t in episode.tools], run_tool, episode


def run_session(server, env, task, name, **options):
    """One agent run in session ``name``, finished with the episode's reward."""
    session = new_session(server, name, task_id=task.id)
    with MemoryStore() as store:
        system, prompt, tools, run_tool, episode = vault_episode(env, task, store)
        answer, sent = agent(server.base_url(session), system, prompt, tools, run_tool, **options)
        trajectory = server.proxy.finish(session, episode.finish(answer))
    return trajectory, sent, tools


# -- checks ---------------------------------------------------------------------------------------

def action_spans(sub_trace) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate(sub_trace.action_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def assert_sampled_exactly(sub_trace, recorder):
    """Each run of action tokens is one generation, verbatim (ids and log-probs), whose prompt
    was everything before it; nothing else is an action."""
    generations = []
    for start, end in action_spans(sub_trace):
        matches = [g for p, g in recorder.calls
                   if p == sub_trace.ids[:start] and g.ids[:end - start] == sub_trace.ids[start:end]]
        assert matches, f"actions {start}:{end} are not what the model sampled after that prefix"
        generation = matches[-1]
        assert generation.ids == sub_trace.ids[start:end]  # no stop string cut these
        assert generation.logprobs == sub_trace.logprobs[start:end]
        generations.append(generation)
    assert sum(sub_trace.action_mask) == sum(len(g.ids) for g in generations)
    return generations


def assert_logprobs_are_the_trainers(policy, sub_trace):
    tokens = torch.tensor(sub_trace.ids)
    with torch.no_grad():
        forced = policy_logprobs(policy, tokens[None], torch.arange(len(tokens))[None],
                                 torch.tensor([0, len(tokens)], dtype=torch.int32), len(tokens),
                                 temperature=TEMPERATURE)
    mask = torch.tensor(sub_trace.action_mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(sub_trace.logprobs)[mask], forced[mask].float(),
                               atol=LOGPROB_TOLERANCE, rtol=0)


def expected_text(chat, messages, tools, generations) -> str:
    """The template's rendering of the last request's ``messages`` with each assistant turn the
    text sampled, then the last reply and its turn's end."""
    outputs = iter(generations)
    text = ""
    for kind, piece in render_pieces(messages, tools, add_generation_prompt=True):
        if kind == OUTPUT:
            ids = next(outputs).ids
            piece = chat.decode(ids[:-1] if ids[-1] == chat.im_end_id else ids)
        text += piece
    last = next(outputs).ids
    return text + chat.decode(last) + chat.decode(chat.turn_end_ids(last))


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("client", ["plain", "reserializing", "streaming"])
def test_trajectories_are_token_exact_with_the_trainers_logprobs(world, served, client):
    env, chat, policy = world
    server, recorder = served
    tool_calls, trajectories = 0, []
    for k, task in enumerate(env.tasks("eval")[:3]):
        trajectory, sent, tools = run_session(server, env, task, f"exact_{client}_{k}",
                                              reserialize=client == "reserializing",
                                              stream=client == "streaming")
        [sub_trace] = trajectory.sub_traces  # every request extended the session
        generations = assert_sampled_exactly(sub_trace, recorder)
        assert len(generations) == len(sent) == trajectory.metrics["turns"]
        assert_logprobs_are_the_trainers(policy, sub_trace)
        assert chat.decode(sub_trace.ids) == expected_text(chat, sent[-1], tools, generations)
        assert sub_trace.end == "terminal" and trajectory.error is None
        tool_calls += trajectory.metrics["calls"]
        trajectories.append(trajectory)
    assert tool_calls >= 2, "the warm-started policy made too few valid calls to test with"
    # A proxy step's metrics count the calls (the client ran them: no error rate from them).
    metrics = rollout_metrics(trajectories)
    assert metrics["tool_calls"] * len(trajectories) == tool_calls
    assert metrics["tool_error_rate"] == 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_sampled_tokens_own(world, served, stream):
    """``logprobs: true`` returns every token of the turn the generator sampled, with the
    log-prob it sampled it with (the trajectory's) and its exact bytes; streamed, they come
    with the finish. ``top_logprobs`` above 0 is refused."""
    env, chat, _ = world
    server, recorder = served
    session = new_session(server, f"logprobs_{stream}")
    client = openai.OpenAI(base_url=server.base_url(session), api_key="-", max_retries=0)
    task = env.tasks("eval")[0]
    request = dict(model="policy", messages=[{"role": "user", "content": task.prompt}],
                   max_tokens=MAX_TOKENS, temperature=TEMPERATURE, logprobs=True, seed=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **request))
        tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    else:
        tokens = client.chat.completions.create(**request).choices[0].logprobs.content
    trajectory = server.proxy.finish(session)
    [sub_trace] = trajectory.sub_traces
    actions = [i for i, m in zip(sub_trace.ids, sub_trace.action_mask) if m]
    assert [t.logprob for t in tokens] == pytest.approx(
        [lp for lp, m in zip(sub_trace.logprobs, sub_trace.action_mask) if m], abs=0)
    assert b"".join(bytes(t.bytes) for t in tokens).decode("utf-8", "replace") == chat.decode(actions)
    assert all(t.top_logprobs == [] for t in tokens) and len(tokens) == len(actions)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**{**request, "top_logprobs": 2})


def test_a_harness_that_compacts_starts_sub_traces_gae_chains_across(world, served):
    env, chat, policy = world
    server, recorder = served
    trajectory = None
    for k, task in enumerate(env.tasks("eval")[3:9]):
        trajectory, sent, tools = run_session(server, env, task, f"compact_{k}", max_turns=5,
                                              compact_every=2)
        if len(sent) >= 3:
            break
    assert len(sent) >= 3, "no agent run went past its first compaction"
    sub_traces = trajectory.sub_traces
    assert len(sub_traces) == 1 + (len(sent) - 1) // 2
    assert [s.end for s in sub_traces] == ["continued"] * (len(sub_traces) - 1) + ["terminal"]
    assert {s.rollout_id for s in sub_traces} == {trajectory.rollout_id}
    for index, sub_trace in enumerate(sub_traces):
        generations = assert_sampled_exactly(sub_trace, recorder)
        assert_logprobs_are_the_trainers(policy, sub_trace)
        last_request = sent[min(2 * index + 1, len(sent) - 1)]
        assert chat.decode(sub_trace.ids) == expected_text(chat, last_request, tools, generations)
    # GAE as for an engine rollout: the bootstrap of a continued sub-trace is V at the next
    # one's first action, and with gamma = lam = 1 and V = 0 every action token's advantage is
    # the rollout's whole remaining reward, wherever it sits.
    for s in sub_traces:
        s.rewards = [0.0] * len(s)
    sub_traces[-1].rewards[sub_traces[-1].last_action_index] = 1.0
    values = [torch.arange(len(s), dtype=torch.float32) / 100 for s in sub_traces]
    last = torch.zeros(len(sub_traces))
    bootstrap = bootstrap_values(sub_traces, values, last)
    first = sub_traces[1].action_mask.index(1)
    assert float(bootstrap[0]) == pytest.approx(float(values[1][first]))
    advantages, _ = gae_advantages(sub_traces, [torch.zeros(len(s)) for s in sub_traces], last,
                                   gamma=1.0, lam=1.0)
    for s, a in zip(sub_traces, advantages):
        mask = torch.tensor(s.action_mask, dtype=torch.bool)
        torch.testing.assert_close(a[mask], torch.ones(int(mask.sum())))


def test_eight_parallel_sessions_stay_apart_and_are_batched(world, served):
    env, chat, policy = world
    server, recorder = served
    tasks = env.tasks("eval")[10:18]
    before = sum(n * c for n, c in server.proxy.batch_sizes.items() if n > 1)
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda k: run_session(server, env, tasks[k], f"parallel_{k}",
                                                   stream=k % 2 == 1), range(8)))
    for task, (trajectory, sent, tools) in zip(tasks, runs):
        assert trajectory.task_id == task.id
        [sub_trace] = trajectory.sub_traces
        text = chat.decode(sub_trace.ids)
        assert task.prompt in text
        assert not any(other.prompt in text for other in tasks if other.prompt != task.prompt)
        generations = assert_sampled_exactly(sub_trace, recorder)
        assert chat.decode(sub_trace.ids) == expected_text(chat, sent[-1], tools, generations)
    batched = sum(n * c for n, c in server.proxy.batch_sizes.items() if n > 1) - before
    assert batched > 0, f"no requests shared a generate call: {server.proxy.batch_sizes}"


# -- tool_choice: a forced call's head, a banned <tool_call> ---------------------------------------

def first_turn(server, env, task, name, stream=False, **body):
    """``(message, finished trajectory)`` of a vault agent's first request with ``body``'s
    options, in a session of its own."""
    session = new_session(server, name, task_id=task.id)
    with MemoryStore() as store:
        system, prompt, tools, _, _ = vault_episode(env, task, store)
    client = openai.OpenAI(base_url=server.base_url(session), api_key="unused", max_retries=0)
    request = dict(model="policy", messages=[{"role": "system", "content": system},
                                             {"role": "user", "content": prompt}],
                   tools=tools, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, **body)
    if stream:
        message = streamed_message(client.chat.completions.create(stream=True, **request))
    else:
        message = client.chat.completions.create(**request).choices[0].message.model_dump()
    return message, server.proxy.finish(session, 0.0)


@pytest.mark.parametrize("choice, stream", [("required", False), ("open_vault", False),
                                            ("open_vault", True)])
def test_a_forced_tool_choice_is_context_and_the_sampled_rest_the_trainers(world, served,
                                                                           choice, stream):
    """The call's head goes after the generation prompt as context; the model samples the
    rest, with the trainer's teacher-forced log-probs on that context; a streamed reply leaks
    none of the head as content."""
    env, chat, policy = world
    server, recorder = served
    named = choice != "required"
    tool_choice = {"type": "function", "function": {"name": choice}} if named else choice
    head = f'<tool_call>\n{{"name": "{choice}", "arguments": ' if named else "<tool_call>"
    calls = 0
    for k, task in enumerate(env.tasks("eval")[20:23]):
        message, trajectory = first_turn(server, env, task, f"forced_{choice}_{stream}_{k}",
                                         stream, tool_choice=tool_choice)
        [sub_trace] = trajectory.sub_traces
        start = sub_trace.action_mask.index(1)
        forced = chat.decode(sub_trace.ids[:start]).rsplit("<|im_start|>assistant\n", 1)[1]
        # This word-level tokenizer merges a call's head with its arguments: only <tool_call>
        # is split off alike in every call, the model picks the function (a byte-level BPE
        # pins the name too: tests/test_proxy_clients.py).
        assert forced == "<tool_call>" and head.startswith(forced)
        assert_sampled_exactly(sub_trace, recorder)  # the forced ids were in its prompt
        assert_logprobs_are_the_trainers(policy, sub_trace)
        for call in message["tool_calls"] or []:
            calls += 1
            assert not message["content"]  # the head is no content
    assert calls, "the policy never completed a forced call"


def teacher_forced(policy, ids: list[int], banned: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, log-probs with banned renormalized away)`` of each token of ``ids`` (0 at
    the first) under the trainer's forward at the run's temperature."""
    tokens = torch.tensor(ids)
    with torch.no_grad():
        logprobs, hidden = policy_logprobs(
            policy, tokens[None], torch.arange(len(tokens))[None],
            torch.tensor([0, len(tokens)], dtype=torch.int32), len(tokens),
            temperature=TEMPERATURE, return_hidden=True)
        logits = policy.get_output_embeddings()(hidden).float()[:-1] / TEMPERATURE
    out = []
    for masked in (logits, logits.index_fill(-1, torch.tensor([banned]), float("-inf"))):
        picked = torch.log_softmax(masked, -1).gather(-1, tokens[1:, None])[:, 0]
        out.append(torch.cat([torch.zeros(1), picked]))
    torch.testing.assert_close(out[0], logprobs.float(), atol=LOGPROB_TOLERANCE, rtol=0)
    return out[0], out[1]


def test_tool_choice_none_bans_tool_call_with_the_renormalized_logprobs(world, served):
    """``<tool_call>`` is never sampled, and each recorded log-prob is the teacher-forced one
    renormalized without it (the behaviour policy's), not the policy's own."""
    env, chat, policy = world
    server, recorder = served
    banned = chat.token_ids["<tool_call>"]
    shift = 0.0
    for k, task in enumerate(env.tasks("eval")[24:27]):
        message, trajectory = first_turn(server, env, task, f"none_{k}", tool_choice="none")
        [sub_trace] = trajectory.sub_traces
        assert_sampled_exactly(sub_trace, recorder)
        mask = torch.tensor(sub_trace.action_mask, dtype=torch.bool)
        assert banned not in torch.tensor(sub_trace.ids)[mask] and not message["tool_calls"]
        plain, renormalized = teacher_forced(policy, sub_trace.ids, banned)
        torch.testing.assert_close(torch.tensor(sub_trace.logprobs)[mask], renormalized[mask],
                                   atol=LOGPROB_TOLERANCE, rtol=0)
        shift = max(shift, float((renormalized - plain)[mask].max()))
    assert shift > 0.1, "the policy never wanted <tool_call> here: nothing was renormalized"


def test_openai_client_errors_and_models(served):
    server, _ = served
    session = new_session(server, "errors")
    client = openai.OpenAI(base_url=server.base_url(session), api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["agentrl-policy"]
    with pytest.raises(openai.BadRequestError, match="temperature must be 0.8"):
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}],
                                       temperature=1.0)
    lost = openai.OpenAI(base_url=server.base_url("nobody"), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no session 'nobody'"):
        lost.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    reply = client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finished = httpx.post(f"{server.url}/sessions/{session}/finish",
                          json={"reward": 0.5, "turn_rewards": [0.25]})
    assert finished.status_code == 200 and finished.json()["reward"] == 0.75
    [trajectory] = server.proxy.take_finished(1, timeout=5)
    assert trajectory.rollout_id == f"proxy/{session}" and trajectory.reward == 0.75
    with pytest.raises(openai.ConflictError, match="is finished"):
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])


def hostile_requests(rng: random.Random, url: str, session: str) -> list[tuple[str, str, dict]]:
    """``(method, path, httpx keyword arguments)`` of malformed or hostile requests."""
    chat_path = f"/s/{session}/v1/chat/completions"
    good = [{"role": "user", "content": "hi"}]
    bodies = [
        b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"messages": [' * 3000, b'"\\ud800"',
        json.dumps({"messages": good, "temperature": "hot"}).encode(),
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        json.dumps({"messages": good, "max_tokens": -1}).encode(),
        json.dumps({"messages": good, "top_p": float("nan")}).encode(),
        json.dumps({"messages": good, "stop": [1, 2]}).encode(),
        json.dumps({"messages": good, "tools": "all"}).encode(),
        json.dumps({"messages": good, "stream": "yes"}).encode(),
        json.dumps({"messages": [{"role": "system"}] * 3}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "vault " * 3000}]}).encode(),
        json.dumps({"messages": [{"role": "assistant", "tool_calls": [{"function": 7}]},
                                 {"role": "user", "content": "x"}]}).encode(),
        json.dumps({"messages": [{"role": rng.choice(["bot", "", None, 3, "function"]),
                                  "content": "x"}]}).encode(),
        b"x" * (300 << 10),
    ]
    requests = []
    for _ in range(500):
        kind = rng.randrange(6)
        if kind <= 2:
            body = rng.choice(bodies)
            if rng.random() < 0.3:  # random damage
                cut = rng.randrange(len(body) + 1)
                body = body[:cut] + bytes([rng.randrange(256)]) + body[cut + 1:]
            requests.append(("POST", chat_path, {"content": body}))
        elif kind == 3:
            requests.append(("POST", rng.choice([f"/s/ghost{rng.randrange(9)}/v1/chat/completions",
                                                 "/sessions/ghost/finish", "/s//v1/models"]),
                             {"content": json.dumps({"messages": good, "reward": "x"}).encode()}))
        elif kind == 4:
            requests.append((rng.choice(["GET", "PUT", "DELETE"]), rng.choice(
                [chat_path, "/sessions", "/nowhere", f"/s/{session}/v1/embeddings"]), {}))
        else:
            requests.append(("POST", rng.choice(["/sessions", f"/sessions/{session}/finish"]),
                             {"content": rng.choice([b"[1]", b'{"reward": "lots"}',
                                                     b'{"reward": NaN}', b'{"task_id": 5}',
                                                     b'{"session_id": "../x"}',
                                                     b'{"turn_rewards": {}}'])}))
    return requests


def test_500_hostile_requests_get_well_formed_errors_and_the_server_stays_up(served):
    server, _ = served
    session = new_session(server, "fuzz")
    rng = random.Random(0)
    statuses = set()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for method, path, kwargs in hostile_requests(rng, server.url, session):
            reply = client.request(method, path, **kwargs)
            statuses.add(reply.status_code)
            if reply.status_code == 200:  # random damage may leave a valid request
                assert reply.json()["object"] == "chat.completion", reply.text[:300]
                continue
            assert 400 <= reply.status_code < 500, (path, reply.status_code, reply.text[:300])
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert isinstance(error["message"], str) and error["message"]
        # A session is one conversation: a second request while one runs is refused.
        with ThreadPoolExecutor(2) as pool:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS}
            replies = list(pool.map(lambda _: client.post(f"/s/{session}/v1/chat/completions",
                                                          json=body), range(2)))
    codes = sorted(r.status_code for r in replies)
    assert codes in ([200, 409], [200, 200]), [r.text for r in replies]
    assert {400, 404, 405, 413} <= statuses
    # Still serving.
    trajectory, _, _ = run_session(server, VaultEnvironment(), VaultEnvironment().tasks("eval")[0],
                                   "after_fuzz", max_turns=2)
    assert trajectory.error is None
