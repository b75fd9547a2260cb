"""A verifiers 0.4 environment trained through the proxy (side environment "verifiers", built by
tools/setup_test_env.sh; under CI=true a missing one fails, elsewhere the tests skip).

The environment is ``examples/verifiers_env`` (taskset ``vf-lookup``: a local JSON-lines
dataset, a shared MCP Toolset with a ``lookup`` tool, a two-part rubric). verifiers runs its own
rollouts (its ``null`` harness, the bundled tool-calling chat loop) in the side environment's
Python, against a real proxy on 127.0.0.1 in front of a tiny Qwen3 built in code: one session
per rollout, finished with verifiers' reward. Checked: the trajectories come back in (task,
sample) order with the rubric's reward recomputed from what the model wrote, the model was shown
the task and the toolset's tool, and a PPO and a GRPO step train on them token-exactly; a
scripted expert's ``lookup`` call runs through verifiers' MCP tool server and its next turn
extends the session (one sub-trace); a bad environment id fails naming it, and a runner killed
mid-rollout leaves trajectories with an error, not open sessions.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

from agentrl_fast.config import RolloutConfig, SamplingParams
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.generators.scripted import ScriptedGenerator
from agentrl_fast.harness import ChatFormat
from agentrl_fast.harness.tool_calls import parse_tool_calls
from agentrl_fast.train import verifiers_driver as vf_driver
from agentrl_fast.models.tiny import tiny_qwen3
from agentrl_fast.proxy import Proxy, ProxyServer
from agentrl_fast.train import TrainConfig, Trainer
from agentrl_fast.train.proxy_driver import proxy_for, train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_envs import ROOT, side_env_python

ENV_PATH = ROOT / "examples" / "verifiers_env"
CODES = {"t0": "4417", "t1": "9023"}  # examples/verifiers_env/vf_lookup/tools.py
MISMATCH = 1e-4  # the proxy tests' log-prob tolerance: token in, token out


@pytest.fixture(scope="module")
def python() -> Path:
    return side_env_python("verifiers")


@pytest.fixture(scope="module")
def world():
    env = VaultEnvironment()  # the trainer's own tasks; the rollouts are verifiers'
    return env, ChatFormat(build_tokenizer(env.corpus(), words=env.words()))


def trainer_for(world, algo: str) -> Trainer:
    env, chat = world
    rollout = RolloutConfig(samples_per_task=2, context_budget=1024, max_turns=3,
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=24))
    config = TrainConfig(algo=algo, tasks_per_step=2, mini_batches=1, micro_batch_tokens=4096,
                         rollout=rollout, seed=1)
    return Trainer(tiny_qwen3(len(chat.tokenizer), seed=0), chat, env, config,
                   log=lambda *a: None)


def final_ids(sub_trace) -> list[int]:
    """The last turn's sampled tokens: the final run of action tokens (the template's turn
    end, ``\\n`` or ``<|im_end|>\\n``, follows them as context)."""
    end = len(sub_trace.action_mask) - sub_trace.action_mask[::-1].index(1)
    start = end
    while start > 0 and sub_trace.action_mask[start - 1]:
        start -= 1
    return sub_trace.ids[start:end]


def final_reply(chat: ChatFormat, sub_trace) -> str:
    """The text of the last turn's sampled tokens, as the harness read it: without the
    end-of-turn token, malformed tool-call tags kept."""
    ids = final_ids(sub_trace)
    if ids[-1] == chat.im_end_id:
        ids = ids[:-1]
    return chat.tokenizer.decode(ids).strip()


def expected_reward(reply: str, code: str) -> float:
    """vf_lookup's rubric: exact code (weight 1) + concision (weight 0.2)."""
    return float(reply == code) + 0.2 / (1.0 + len(reply) / 50)


def test_verifiers_rollouts_carry_the_rubric_reward_and_train_ppo(python, world):
    trainer = trainer_for(world, "ppo")
    proxy = proxy_for(trainer)
    with ProxyServer(proxy) as server:
        trajectories = vf_driver.collect(server, python, "vf-lookup", tasks=2, samples=2,
                                         env_paths=[ENV_PATH], max_turns=3)
    proxy.close()
    assert [(t.task_id, t.sample_index) for t in trajectories] == [
        ("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1)]
    assert all(t.error is None for t in trajectories), [t.error for t in trajectories]
    chat = world[1]
    for t in trajectories:
        first = t.sub_traces[0]
        prompt = chat.tokenizer.decode(first.ids[:first.action_mask.index(1)])
        assert "Find the code with the lookup tool" in prompt  # the task's system prompt
        assert "What is the code of vault" in prompt
        assert '"name": "lookup"' in prompt  # the Toolset's tool, advertised through MCP
        reply = final_reply(chat, t.sub_traces[-1])
        # verifiers' verdict (Trace.is_truncated): the episode is cut, and the critic
        # bootstraps, when the final reply ran out of max_new_tokens (its last sampled token is
        # no stop token: finish_reason "length") or the episode ran out of turns (the third
        # reply's tool calls ran and the fourth turn was refused: max_turns). A reply that
        # stopped on <|im_end|> or </tool_call> without a call is the episode's end: terminal.
        last, calls = final_ids(t.sub_traces[-1])[-1], parse_tool_calls(reply)
        cut = (last not in chat.stop_ids
               or (t.metrics["turns"] == 3 and any(call.ok for call in calls)))
        assert t.sub_traces[-1].end == ("truncated" if cut else "terminal"), (
            t.metrics, chat.tokenizer.decode(final_ids(t.sub_traces[-1])))
        assert t.reward == pytest.approx(expected_reward(reply, CODES[t.task_id]), abs=1e-6)
    assert len({t.reward for t in trajectories[:2]}) == 2  # a group GRPO can learn from
    before = copy.deepcopy(trainer.policy.state_dict())
    metrics = train_step(trainer, proxy, trajectories)
    assert metrics["reward"] == pytest.approx(sum(t.reward for t in trajectories) / 4)
    assert_trained(trainer, before, metrics)


def test_train_runs_grpo_steps_on_the_next_tasks(python, world):
    trainer = trainer_for(world, "grpo")
    trainer.data_position = 3  # the 4-task taskset wraps: t3, t0
    before = copy.deepcopy(trainer.policy.state_dict())
    proxy = proxy_for(trainer)
    with ProxyServer(proxy) as server:
        history = vf_driver.train(trainer, server, python, "vf-lookup", steps=1,
                                  env_paths=[ENV_PATH], max_turns=3)
    proxy.close()
    assert trainer.data_position == 5 and trainer.step_index == 1
    assert 0 < history[0]["reward"] < 1.2, history
    assert_trained(trainer, before, history[0])


def assert_trained(trainer: Trainer, before: dict, metrics: dict) -> None:
    """The step trained on the recorded tokens (log-probs as sampled) and moved the policy."""
    assert metrics["logprob_mismatch_max"] < MISMATCH, metrics
    changed = [k for k, v in trainer.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, f"{trainer.config.algo}: the step changed no weight"


def lookup_expert(context: str) -> str:
    """A scripted policy for vf-lookup: call ``lookup`` for the vault asked about, then answer
    with what the tool returned."""
    results = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", context, re.DOTALL)
    if results:
        return results[-1]
    vault = re.findall(r"code of vault (\w+)\?", context)[-1]
    call = {"name": "lookup", "arguments": {"vault": vault}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def test_a_tool_call_runs_through_the_verifiers_toolset(python, world):
    chat = world[1]
    proxy = Proxy(ScriptedGenerator(lookup_expert, chat), chat,
                  SamplingParams(temperature=1.0, max_new_tokens=64), context_budget=1024)
    with ProxyServer(proxy) as server:
        trajectories = vf_driver.collect(server, python, "vf-lookup", tasks=2,
                                         env_paths=[ENV_PATH], max_turns=3)
    proxy.close()
    for t in trajectories:
        assert t.error is None, t.error
        # One sub-trace: the turn after the tool's result extended the session token-exactly.
        assert len(t.sub_traces) == 1 and t.metrics["turns"] == 2 and t.metrics["calls"] == 1
        assert t.sub_traces[0].end == "terminal"
        assert CODES[t.task_id] in chat.tokenizer.decode(t.sub_traces[0].ids)  # from the tool
        assert t.reward == pytest.approx(expected_reward(CODES[t.task_id], CODES[t.task_id]))


def test_unknown_environment_fails_naming_it(python, world):
    proxy = proxy_for(trainer_for(world, "grpo"))
    with ProxyServer(proxy) as server, pytest.raises(RuntimeError, match="vf-nowhere"):
        vf_driver.collect(server, python, "vf-nowhere", tasks=1, env_paths=[ENV_PATH])
    proxy.close()


@pytest.mark.parametrize("field, value", [("tasks", 0), ("samples", -1), ("max_turns", 1.5)])
def test_bad_arguments_name_the_argument(python, field, value):
    options = {"tasks": 1, field: value}
    with pytest.raises(ValueError, match=field):
        vf_driver.runner_command(python, "http://127.0.0.1:1", "vf-lookup", **options)


def test_missing_side_environment_python_is_named(tmp_path):
    with pytest.raises(ValueError, match="setup_test_env.sh verifiers"):
        vf_driver.runner_command(tmp_path / "python", "http://127.0.0.1:1", "vf-lookup",
                                 tasks=1)


class Held:
    """The real generator, each call held until ``release`` is set: rollouts stay open."""

    def __init__(self, inner):
        self.inner, self.release = inner, threading.Event()
        self.max_batch_size = inner.max_batch_size

    def generate(self, prompts, sampling, seeds=None, on_tokens=None):
        self.release.wait(60)
        return self.inner.generate(prompts, sampling, seeds, on_tokens=on_tokens)

    def update_weights(self, model):
        self.inner.update_weights(model)


def test_a_runner_killed_mid_rollout_leaves_errors_not_open_sessions(python, world):
    trainer = trainer_for(world, "grpo")
    held = Held(trainer.engine.generator)  # every completion waits: killed mid-rollout
    proxy = Proxy(held, trainer.chat_format, trainer.config.rollout.sampling,
                  context_budget=1024)
    timeout = 12.0  # the runner imports verifiers (~4 s) and opens both sessions well before
    releaser = threading.Timer(timeout + 1, held.release.set)
    releaser.start()
    with ProxyServer(proxy) as server:
        trajectories = vf_driver.collect(server, python, "vf-lookup", tasks=1, samples=2,
                                         env_paths=[ENV_PATH], timeout=timeout)
    releaser.cancel()
    proxy.close()
    assert [t.sample_index for t in trajectories] == [0, 1]
    assert all("killed" in (t.error or "") for t in trajectories), [t.error for t in trajectories]
