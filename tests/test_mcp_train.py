"""MCP tool servers in rollouts and in a run: the rollout engine releases a rollout's servers
however the rollout ends, and a YAML config of the dataset tool environment with one
``mcp-server-git`` per rollout (a repository seeded from a template) and a shared
``server-memory`` trains two PPO steps through ``train_run(load_config(...))`` (what
``agentrl-fast train --config`` runs), after which no server process is left."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from agentrl_fast.config import load_config
from agentrl_fast.config.rollout import RolloutConfig
from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.envs import DatasetToolEnvironment, build_tokenizer
from agentrl_fast.envs.demonstrations import write_demonstrations
from agentrl_fast.generators.scripted import ScriptedGenerator
from agentrl_fast.harness import ChatFormat, RolloutEngine
from agentrl_fast.harness.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from agentrl_fast.train.run import train_run
from test_mcp_tools import (TOY, _children, gone, memory_server, no_process_with,  # noqa: F401
                            template)
from test_sandbox_isolation import processes_with

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups, /proc")

REWARD = '''
def score(answer, task):
    return float(task["answer"] in (answer or ""))
'''


def write_tasks(folder: Path, prompts: list[tuple[str, str]]) -> Path:
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in prompts))
    (folder / "mcp_reward.py").write_text(REWARD)
    return path


def call(name: str, arguments: dict) -> str:
    return f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": name, "arguments": arguments}) + \
        f"\n{TOOL_CALL_CLOSE}"


# ---------------------------------------------------------------------------------------------
# The engine closes episodes: their rollout servers stop.

@pytest.fixture(scope="module")
def toy_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy_env")
    marker = f"engine-{uuid.uuid4().hex}"
    train = write_tasks(folder, [(f"Echo {i}.", str(i)) for i in range(4)])
    env = DatasetToolEnvironment(
        train=str(train), reward="mcp_reward:score", eval_fraction=0.25, search=[folder],
        mcp_servers=[{"name": "toy", "command": sys.executable, "args": [TOY, "--marker", marker],
                      "scope": "rollout", "include": ["echo", "slow"]}])
    env.marker = marker
    yield env
    env.close()
    assert no_process_with(marker)


@pytest.fixture(scope="module")
def chat(toy_env):
    return ChatFormat(build_tokenizer(toy_env.corpus(), vocab_size=512, words=toy_env.words()))


def test_the_engine_releases_rollout_servers_however_rollouts_end(toy_env, chat):
    settings = RolloutConfig(samples_per_task=2, max_turns=3, context_budget=2048,
                             sampling=SamplingParams(max_new_tokens=64))

    def agent(context: str) -> str:  # calls echo, then answers with what it read
        if context.count("<tool_response>") == 0:
            return call("echo", {"text": "1"})
        return context.rsplit("<tool_response>\n", 1)[1].split("\n")[0]

    before = set(processes_with(toy_env.marker))
    engine = RolloutEngine(ScriptedGenerator(agent, chat), chat, toy_env, settings)
    trajectories = engine.run(toy_env.tasks("train")[:2])
    assert [t.metrics["ok"] for t in trajectories] == [1, 1, 1, 1]  # each rollout's own server
    assert gone(set(processes_with(toy_env.marker)) - before)  # stopped at each rollout's end

    def crashing(context: str) -> str:  # a call, then the generator fails mid-run
        if context.count("<tool_response>"):
            raise RuntimeError("the generator broke")
        return call("echo", {"text": "x"})

    failing = RolloutEngine(ScriptedGenerator(crashing, chat), chat, toy_env, settings)
    with pytest.raises(RuntimeError, match="the generator broke"):
        failing.run(toy_env.tasks("train")[:1])
    assert gone(set(processes_with(toy_env.marker)) - before)

    truncating = RolloutEngine(ScriptedGenerator(lambda c: call("echo", {"text": "y"}), chat),
                               chat, toy_env, RolloutConfig(samples_per_task=1, max_turns=1,
                                                            context_budget=2048))
    truncated, = truncating.run(toy_env.tasks("train")[:1])
    assert truncated.metrics["truncated_max_turns"] == 1 and truncated.metrics["ok"] == 1
    assert gone(set(processes_with(toy_env.marker)) - before)


# ---------------------------------------------------------------------------------------------
# Acceptance: two PPO steps with MCP servers from a YAML config.

def write_mcp_run(folder: Path, template: Path, steps: int = 2) -> Path:
    """A run's YAML config (beside its tasks, reward and demonstrations) of the dataset tool
    environment with ``mcp-server-git`` per rollout on a copy of ``template`` and a shared
    ``server-memory``: ``steps`` PPO steps of 2 tasks x 2 samples."""
    memory = memory_server()
    prompts = [(f"Find the first commit's message (repository '.'), then say it. #{i}",
                "the first commit") for i in range(6)]
    train = write_tasks(folder, prompts)
    servers = [
        {"name": "git", "command": "mcp-server-git", "args": ["--repository", "{rollout_dir}"],
         "scope": "rollout", "rollout_dir_template": str(template),
         "include": ["git_log", "git_status"], "timeout": 20},
        {"name": "memory", "command": "node", "args": [memory],
         "env": {"MEMORY_FILE_PATH": str(folder / "memory.jsonl")},
         "include": ["read_graph"], "prefix": "memory_"}]
    args = {"train": train.name, "reward": "mcp_reward:score", "eval_fraction": 0.34,
            "mcp_servers": servers}

    def expert(task, messages):  # demonstrations: git_log, then the answer
        if messages[-1]["role"] == "tool":
            return {"content": task.data["answer"]}
        return {"tool_calls": [{"name": "git_log", "arguments": {"repo_path": "."}}]}

    env = DatasetToolEnvironment(**args, search=[folder])
    try:
        assert write_demonstrations(env, expert, folder / "demos.jsonl") == 4
    finally:
        env.close()
    config = {
        "run_dir": str(folder / "run"),
        "env": {"name": "dataset", "args": args},
        "model": {"vocab_size": 512},
        "warmstart": {"data": "demos.jsonl", "steps": 30, "lr": 1.0e-2, "batch_sequences": 4,
                      "target_success": None},
        "train": {"steps": steps, "tasks_per_step": 2, "rollout": {
            "samples_per_task": 2, "context_budget": 1024, "max_turns": 2,
            "sampling": {"max_new_tokens": 48}}},
        "eval": {"tasks": 2}}
    (folder / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder / "run.yaml"


def test_a_config_with_mcp_servers_trains_two_ppo_steps(tmp_path, template):  # noqa: F811
    config = write_mcp_run(tmp_path, template)
    before = _children()
    summary = train_run(load_config(config), progress=False, print_fn=print)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["tool_calls"] for r in steps) > 0, steps  # the rollouts called MCP tools
    assert min(r["tool_error_rate"] for r in steps) < 1, steps  # and some calls answered
    assert gone(_children() - before)  # every server stopped with the run


def test_no_server_outlives_a_sigkilled_trainer(tmp_path, template):  # noqa: F811
    """``agentrl-fast train`` SIGKILLed while its rollouts' git servers run: the shared
    server and the rollout servers die with it (parent-death signal). The run is long (killed
    once the servers are seen): two steps could end between two looks at the processes."""
    config = write_mcp_run(tmp_path, template, steps=1000)
    trainer = subprocess.Popen([sys.executable, "-c", "from agentrl_fast.cli import main; main()",
                                "train", "--config", str(config)], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    servers: set[int] = set()
    git: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and trainer.poll() is None:
            servers |= _children(trainer.pid)
            git |= servers & set(processes_with("--repository"))
            # tool discovery starts the shared memory server beside a git probe (either may come
            # first); a second git server is a rollout's
            if len(git) >= 2 and servers & set(processes_with(memory_server())):
                break
            time.sleep(0.05)
        assert trainer.poll() is None, trainer.stderr.read()[-2000:]
        servers |= _children(trainer.pid)
    finally:
        trainer.kill()
        trainer.wait()
    assert len(servers) >= 3 and len(git) >= 2, (servers, git)  # memory, probe, a rollout's git
    assert gone(servers), servers


def test_a_cancelled_stream_releases_the_servers_of_its_groups_in_flight(toy_env, chat):
    """The asynchronous trainer's ``astream``: cancelled while its rollouts' calls run, the
    dropped groups' servers stop."""
    before = set(processes_with(toy_env.marker))
    settings = RolloutConfig(samples_per_task=2, max_turns=2, context_budget=2048)
    engine = RolloutEngine(ScriptedGenerator(lambda c: call("slow", {"seconds": 60}), chat),
                           chat, toy_env, settings)

    async def stream_then_cancel() -> set[int]:
        groups = iter([(task, 0) for task in toy_env.tasks("train")[:2]])
        stream = asyncio.ensure_future(engine.astream(groups, emit=lambda g: None,
                                                      room=lambda n: True))
        for _ in range(400):  # until the 4 rollouts' servers run their calls
            await asyncio.sleep(0.05)
            started = set(processes_with(toy_env.marker)) - before
            if len(started) == 4:
                break
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
        return started

    started = asyncio.run(stream_then_cancel())
    assert len(started) == 4 and gone(started)
