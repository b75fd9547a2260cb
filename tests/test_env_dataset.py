"""The dataset tool environment (agentrl_fast/envs/dataset.py): task files (JSONL, Parquet) and
their errors by file and line, the eval split, tools from a user's module, rewards by import
path (sync, async, with the episode's state), a failing reward counted and not raised, memory
tools, rollouts through the real engine, demonstrations, and the calculator example."""

import json
import logging
import re
import sys
import uuid
from pathlib import Path

import pytest

from agentrl_fast.config.errors import ConfigError
from agentrl_fast.config.rollout import RolloutConfig
from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.envs import DatasetToolEnvironment, build_tokenizer
from agentrl_fast.envs.dataset import DEFAULT_SYSTEM_PROMPT, RewardState, load_tasks
from agentrl_fast.envs.demonstrations import write_demonstrations
from agentrl_fast.generators.scripted import ScriptedGenerator
from agentrl_fast.harness import ChatFormat, MemoryStore, RolloutEngine, Task, render_messages
from agentrl_fast.harness import ToolResult, rollout_metrics, tool
from agentrl_fast.harness.tool_calls import ToolCall

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator"

TOOLS_SOURCE = '''
from agentrl_fast.harness import tool


@tool
def calculator(expression: str) -> str:
    """Evaluate a sum of integers.

    Args:
        expression: Integers joined by "+", for example "2 + 3".
    """
    return str(sum(int(part) for part in expression.split("+")))


@tool
def shout(text: str, times: int = 1) -> str:
    """Repeat a text in capitals.

    Args:
        text: What to shout.
        times: How many times.
    """
    return " ".join([text.upper()] * times)


def helper(x):  # not a tool
    return x
'''

REWARD_SOURCE = '''
import asyncio
import re

CALLS = []


def exact(answer, task):
    CALLS.append((answer, dict(task)))
    found = re.findall(r"-?\\d+", answer)
    return bool(found) and int(found[-1]) == task["answer"]


async def later(answer, task):
    await asyncio.sleep(0)
    return 0.5 if str(task["answer"]) in answer else 0.0


def used_tools(answer, task, state):
    CALLS.append(state)
    return 1.0 if state.calls and all(r.ok for r in state.results) else 0.25


def broken(answer, task):
    raise KeyError("no_such_field")


def not_a_number(answer, task):
    return "yes"


def too_big(answer, task):
    return 3.0
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's folder: ``write(source) -> module name`` (unique per test); the modules and the
    folder leave sys.modules and sys.path after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    names = []

    def write(source: str) -> str:
        name = f"user_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    write.path = tmp_path
    yield write
    for name in names:
        sys.modules.pop(name, None)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in rows))
    return path


def sums(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"What is {i} + {i + 1}?", "answer": 2 * i + 1}
            for i in range(start, start + n)]


@pytest.fixture
def parts(user_dir):
    """(tools module, reward module, search) in a fresh user folder."""
    return user_dir(TOOLS_SOURCE), user_dir(REWARD_SOURCE), [user_dir.path]


def make_env(user_dir, parts, reward="exact", rows=None, **kwargs):
    tools, rewards, search = parts
    train = write_jsonl(user_dir.path / "train.jsonl", rows if rows is not None else sums(20))
    return DatasetToolEnvironment(train=str(train), tools=tools, reward=f"{rewards}:{reward}",
                                  search=search, **kwargs)


def finish(env, task, answer, calls=(), results=()):
    with MemoryStore() as store:
        episode = env.start(task, store.namespace("t"), seed=0)
        if calls:
            episode.after_tools(list(calls), list(results))
        reward = episode.finish(answer)
    return episode, reward


# -- task files -------------------------------------------------------------------------------

def test_jsonl_tasks_ids_data_and_prompt_key(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [
        {"prompt": "one", "answer": 1, "level": "easy"}, "", {"id": "x7", "prompt": "two"},
        {"id": 12, "prompt": "three", "answer": [3]}])
    tasks = load_tasks(path)
    assert [(t.id, t.prompt, dict(t.data)) for t in tasks] == [
        ("math-0", "one", {"answer": 1, "level": "easy"}), ("x7", "two", {}),
        ("12", "three", {"answer": [3]})]
    other = write_jsonl(tmp_path / "q.jsonl", [{"question": "why?", "prompt": "kept as data"}])
    [task] = load_tasks(other, prompt_key="question")
    assert (task.prompt, dict(task.data)) == ("why?", {"prompt": "kept as data"})


def test_parquet_tasks_load_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [{"id": "a", "prompt": "p1", "answer": 1}, {"id": "b", "prompt": "p2", "answer": 2}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    write_jsonl(tmp_path / "t.jsonl", rows)
    assert load_tasks(tmp_path / "t.parquet") == load_tasks(tmp_path / "t.jsonl")
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok"}, {"prompt": None}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'bad.parquet'}: row 2: ")):
        load_tasks(tmp_path / "bad.parquet")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=re.escape("pip install agentrl_fast[data]")):
        load_tasks(tmp_path / "t.parquet")


@pytest.mark.parametrize("lines, line, message", [
    (['{"prompt": "a"}', '{"prompt": "b",}'], 2, "not valid JSON"),
    (['{"prompt": "a"}', "", '["prompt", "b"]'], 3, "must be an object"),
    (['{"prompt": "a"}', "null"], 2, "got null"),
    (['{"answer": 3}'], 1, "'prompt' must be a non-empty string (no such field"),
    (['{"prompt": "a"}', '{"prompt": 7}'], 2, "'prompt' must be a non-empty string (7"),
    (['{"prompt": "  "}'], 1, "non-empty string"),
    (['{"id": "q", "prompt": "a"}', '{"prompt": "b"}', '{"id": "q", "prompt": "c"}'], 3,
     "duplicate id 'q' (first at {path}:1)"),
    (['{"id": 1.5, "prompt": "a"}'], 1, "'id' must be a non-empty string or an integer"),
])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, lines, line, message):
    path = write_jsonl(tmp_path / "tasks.jsonl", lines)
    with pytest.raises(ValueError) as error:
        load_tasks(path)
    assert str(error.value).startswith(f"{path}:{line}: "), str(error.value)
    assert message.format(path=path) in str(error.value)


def test_undecodable_and_empty_files(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not UTF-8")):
        load_tasks(path)
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no tasks"):
        load_tasks(path)


def test_file_paths_suffixes_and_search_folders(user_dir, parts, tmp_path, monkeypatch):
    tools, rewards, search = parts
    write_jsonl(user_dir.path / "train.jsonl", sums(5))
    monkeypatch.chdir(ROOT)  # not in the working directory: found in a search folder
    env = DatasetToolEnvironment(train="train.jsonl", tools=tools, reward=f"{rewards}:exact",
                                 search=search)
    assert len(env.tasks("train")) + len(env.tasks("eval")) == 5
    with pytest.raises(ConfigError, match=r"env.args.eval: no file 'missing.jsonl' \(looked"):
        DatasetToolEnvironment(train="train.jsonl", eval="missing.jsonl", tools=tools,
                               reward=f"{rewards}:exact", search=search)
    with pytest.raises(ConfigError, match=r"env.args.train: 'train.csv' must end in .jsonl"):
        DatasetToolEnvironment(train="train.csv", tools=tools, reward=f"{rewards}:exact",
                               search=search)


def test_eval_split_from_a_file_or_a_fixed_fraction(user_dir, parts):
    write_jsonl(user_dir.path / "held.jsonl", sums(3, start=100))
    env = make_env(user_dir, parts, eval=str(user_dir.path / "held.jsonl"))
    assert [t.id for t in env.tasks("train")] == [f"train-{i}" for i in range(20)]
    assert [t.id for t in env.tasks("eval")] == ["held-0", "held-1", "held-2"]
    split = make_env(user_dir, parts, rows=sums(50), eval_fraction=0.2)
    train, held = split.tasks("train"), split.tasks("eval")
    assert (len(train), len(held)) == (40, 10)
    assert {t.id for t in train}.isdisjoint(t.id for t in held)
    assert [t.id for t in train] == sorted((t.id for t in train), key=lambda i: int(i[6:]))
    again = make_env(user_dir, parts, rows=sums(50), eval_fraction=0.2)
    assert [t.id for t in again.tasks("eval")] == [t.id for t in held]  # deterministic
    other = make_env(user_dir, parts, rows=sums(50), eval_fraction=0.2, split_seed=1)
    assert [t.id for t in other.tasks("eval")] != [t.id for t in held]
    assert make_env(user_dir, parts, rows=sums(3)).tasks("eval")  # at least one held out
    assert make_env(user_dir, parts, eval_fraction=0).tasks("eval") == []
    with pytest.raises(ValueError, match="split must be one of"):
        env.tasks("test")


# -- tools ------------------------------------------------------------------------------------

def test_tools_from_a_module_its_attributes_or_objects(user_dir, parts):
    tools, rewards, search = parts
    env = make_env(user_dir, parts)
    assert [t.name for t in env.tools] == ["calculator", "shout"]
    schema = env.tools[0].schema["function"]
    assert schema["description"] == "Evaluate a sum of integers."
    assert schema["parameters"]["properties"]["expression"] == {
        "type": "string", "description": 'Integers joined by "+", for example "2 + 3".'}
    assert schema["parameters"]["required"] == ["expression"]
    assert env.tools[1].schema["function"]["parameters"]["properties"]["times"]["type"] \
        == "integer"
    picked = DatasetToolEnvironment(train=str(user_dir.path / "train.jsonl"),
                                    tools=[f"{tools}:shout"], reward=f"{rewards}:exact",
                                    search=search)
    assert [t.name for t in picked.tools] == ["shout"]

    def double(x: int) -> int:
        """Double a number.

        Args:
            x: The number.
        """
        return 2 * x

    mixed = DatasetToolEnvironment(train=str(user_dir.path / "train.jsonl"),
                                   tools=[double, f"{tools}:calculator"], tool_timeout=2.5,
                                   reward=lambda answer, task: 1.0, search=search)
    assert [(t.name, t.timeout) for t in mixed.tools] == [("double", 2.5), ("calculator", 2.5)]


def test_tool_errors_name_the_module_or_field(user_dir, parts):
    tools, rewards, search = parts
    empty = user_dir("def helper(x):\n    return x\n")
    train = str(write_jsonl(user_dir.path / "train.jsonl", sums(3)))
    with pytest.raises(ConfigError, match=rf"env.args.tools: module '{empty}' .* defines no tools"):
        DatasetToolEnvironment(train=train, tools=empty, reward=f"{rewards}:exact", search=search)
    with pytest.raises(ConfigError, match=r"env.args.tools: no module named 'nowhere_xyz'"):
        DatasetToolEnvironment(train=train, tools="nowhere_xyz", reward=f"{rewards}:exact")
    with pytest.raises(ConfigError, match=r"env.args.tools\[1\]: .* has no attribute 'nope'"):
        DatasetToolEnvironment(train=train, tools=[tools, f"{tools}:nope"],
                               reward=f"{rewards}:exact", search=search)
    def zero() -> int:
        """Zero."""
        return 0

    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        DatasetToolEnvironment(train=train, tools=[tools, tool(zero, name="calculator")],
                               reward=f"{rewards}:exact", search=search)
    with pytest.raises(ConfigError, match="env.args.tools.*Google-style docstring"):
        DatasetToolEnvironment(train=train, tools=[lambda x: x], reward=f"{rewards}:exact")


def test_memory_tools_on_off_or_named(user_dir, parts):
    def episode_tools(env):
        with MemoryStore() as store:
            return [t.name for t in env.start(env.tasks("train")[0], store.namespace("n"),
                                              seed=0).tools]

    assert episode_tools(make_env(user_dir, parts)) == ["calculator", "shout"]
    env = make_env(user_dir, parts, memory_tools=True)
    assert episode_tools(env) == ["calculator", "shout", "memory_write", "memory_read",
                                  "memory_search", "memory_delete", "memory_list"]
    assert "memory_write" in env.words()
    named = make_env(user_dir, parts, memory_tools=["memory_write", "memory_read"])
    assert episode_tools(named)[2:] == ["memory_write", "memory_read"]
    with pytest.raises(ConfigError, match="'memory_forget' is not a memory tool"):
        make_env(user_dir, parts, memory_tools=["memory_forget"])
    # Bound to the rollout's namespace: a write lands there.
    with MemoryStore() as store:
        episode = env.start(env.tasks("train")[0], store.namespace("r1"), seed=0)
        [write] = [t for t in episode.tools if t.name == "memory_write"]
        write(key="k", value="v")
        assert store.namespace("r1").read("k") == "v" and store.namespace("r2").read("k") is None


# -- rewards ----------------------------------------------------------------------------------

def test_rewards_sync_async_bool_and_with_state(user_dir, parts):
    env = make_env(user_dir, parts)
    task = env.tasks("train")[0]
    episode, reward = finish(env, task, f"It is {task.data['answer']}.")
    assert (reward, episode.success, episode.reward_error) == (1.0, True, None)
    module = sys.modules[parts[1]]
    assert module.CALLS[-1] == (f"It is {task.data['answer']}.",
                                {"id": task.id, "prompt": task.prompt, "answer": task.data["answer"]})
    assert finish(env, task, "no idea")[1] == 0.0
    later = make_env(user_dir, parts, reward="later", success_threshold=0.5)
    episode, reward = finish(later, task, f"{task.data['answer']}")
    assert (reward, episode.success) == (0.5, True)
    assert not finish(make_env(user_dir, parts, reward="later"), task, "1")[0].success
    stated = make_env(user_dir, parts, reward="used_tools")
    assert stated.reward_takes_state and not env.reward_takes_state
    calls = [ToolCall("calculator", {"expression": "1 + 2"})]
    episode, reward = finish(stated, task, "3", calls, [ToolResult("calculator", "3")])
    assert reward == 1.0
    assert module.CALLS[-1] == RewardState(tuple(calls), (ToolResult("calculator", "3"),), False)
    assert finish(stated, task, "3")[1] == 0.25


def test_truncated_rollouts_get_zero_unless_scored(user_dir, parts):
    module_calls = lambda: sys.modules[parts[1]].CALLS  # noqa: E731
    env = make_env(user_dir, parts, reward="used_tools")
    task = env.tasks("train")[0]
    before = len(module_calls())
    episode, reward = finish(env, task, None)
    assert (reward, episode.success, episode.truncated, len(module_calls())) == (0.0, False, True,
                                                                                 before)
    scored = make_env(user_dir, parts, reward="used_tools", score_truncated=True,
                      success_threshold=0.25)
    episode, reward = finish(scored, task, None)
    assert reward == 0.25 and module_calls()[-1].truncated and episode.success


@pytest.mark.parametrize("name, error", [("broken", "KeyError: 'no_such_field'"),
                                         ("not_a_number", "returned a str, not a number"),
                                         ("too_big", "returned 3.0, not a number in [0, 1]")])
def test_a_failing_reward_is_a_failed_episode_not_a_crash(user_dir, parts, name, error):
    env = make_env(user_dir, parts, reward=name)
    episode, reward = finish(env, env.tasks("train")[0], "42")
    assert (reward, episode.success) == (0.0, False)
    assert error in episode.reward_error


def test_reward_signature_and_value_checks(user_dir, parts):
    train = str(write_jsonl(user_dir.path / "t.jsonl", sums(2)))
    with pytest.raises(ConfigError, match=r"env.args.reward: .* takes 1 positional parameters"):
        DatasetToolEnvironment(train=train, tools=parts[0], reward=lambda answer: 1.0,
                               search=parts[2])
    with pytest.raises(ConfigError, match=r"env.args.reward: .* has no attribute 'nope'"):
        make_env(user_dir, parts, reward="nope")
    with pytest.raises(ConfigError, match="success_threshold"):
        make_env(user_dir, parts, success_threshold=0)
    with pytest.raises(ConfigError, match="eval_fraction"):
        make_env(user_dir, parts, eval_fraction=1.0)


# -- through the rollout engine ----------------------------------------------------------------

def calculator_policy(context: str) -> str:
    """Call the calculator on the task's sum, then answer with its result."""
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, flags=re.S)
    if responses:
        return f"The answer is {responses[-1]}."
    expression = re.findall(r"What is (.*?)\?", context)[-1]
    return ("<tool_call>\n" + json.dumps({"name": "calculator",
                                          "arguments": {"expression": expression}})
            + "\n</tool_call>")


@pytest.fixture(scope="module")
def chat_for():
    cache = {}

    def chat(env):
        key = tuple(env.words())
        if key not in cache:
            cache[key] = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
        return cache[key]
    return chat


def test_rollouts_through_the_engine_hold_the_call_result_and_reward(user_dir, parts, chat_for,
                                                                     caplog):
    env = make_env(user_dir, parts, memory_tools=True)
    chat = chat_for(env)
    config = RolloutConfig(samples_per_task=2, sampling=SamplingParams(max_new_tokens=64))
    engine = RolloutEngine(ScriptedGenerator(calculator_policy, chat), chat, env, config)
    tasks = env.tasks("train")[:3]
    trajectories = engine.run(tasks, seed=0)
    assert [t.reward for t in trajectories] == [1.0] * 6
    text = chat.decode(trajectories[0].sub_traces[0].ids)
    answer = tasks[0].data["answer"]
    assert DEFAULT_SYSTEM_PROMPT in text and '"name": "memory_write"' in text
    assert f"<tool_response>\n{answer}\n</tool_response>" in text
    assert text.endswith(f"The answer is {answer}.<|im_end|>\n")
    metrics = rollout_metrics(trajectories)
    assert (metrics["success"], metrics["reward_errors"], metrics["tool_calls"]) == (1.0, 0.0, 1.0)

    # An async reward function, awaited from inside the engine's event loop.
    later = make_env(user_dir, parts, reward="later", memory_tools=True, success_threshold=0.5)
    engine = RolloutEngine(ScriptedGenerator(calculator_policy, chat), chat, later, config)
    metrics = rollout_metrics(engine.run(later.tasks("train")[:2], seed=0))
    assert (metrics["reward"], metrics["success"]) == (0.5, 1.0)

    # A reward function that raises: reward 0, no success, counted, logged once; no crash.
    broken = make_env(user_dir, parts, reward="broken", memory_tools=True)
    engine = RolloutEngine(ScriptedGenerator(calculator_policy, chat), chat, broken, config)
    with caplog.at_level(logging.WARNING, logger="agentrl_fast.envs.dataset"):
        trajectories = engine.run(broken.tasks("train")[:3], seed=0)
    metrics = rollout_metrics(trajectories)
    assert (metrics["reward"], metrics["success"], metrics["reward_errors"]) == (0.0, 0.0, 1.0)
    assert all(t.error is None and t.sub_traces[-1].end == "terminal" for t in trajectories)
    logged = [r for r in caplog.records if "reward function" in r.getMessage()]
    assert len(logged) == 1 and "no_such_field" in caplog.text  # the traceback


# -- demonstrations ---------------------------------------------------------------------------

def message_policy(task: Task, messages: list[dict]) -> dict:
    if messages[-1]["role"] == "tool":
        return {"role": "assistant", "content": f"The answer is {messages[-1]['content']}."}
    expression = re.findall(r"What is (.*?)\?", task.prompt)[0]
    return {"role": "assistant", "content": "",
            "tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}]}


def test_write_demonstrations_writes_renderable_openai_conversations(user_dir, parts, tmp_path):
    env = make_env(user_dir, parts, memory_tools=["memory_write"])
    tasks = env.tasks("train")[:4]
    wrong = {tasks[1].id}

    def sometimes_wrong(task, messages):
        message = message_policy(task, messages)
        if task.id in wrong and messages[-1]["role"] == "tool":
            message["content"] = "The answer is 0."
        return message

    path = tmp_path / "demos" / "calc.jsonl"
    assert write_demonstrations(env, sometimes_wrong, path, tasks) == 3
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["task_id"] for line in lines] == [t.id for t in tasks if t.id not in wrong]
    first = lines[0]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool",
                                                      "assistant"]
    call = first["messages"][2]["tool_calls"][0]
    assert call == {"id": "call_0_0", "type": "function",
                    "function": {"name": "calculator",
                                 "arguments": json.dumps({"expression": "0 + 1"})}}
    assert first["messages"][3] == {"role": "tool", "tool_call_id": "call_0_0",
                                    "name": "calculator", "content": "1"}
    assert [t["function"]["name"] for t in first["tools"]] == ["calculator", "shout",
                                                               "memory_write"]
    assert first["reward"] == 1.0
    text = render_messages(first["messages"], tools=first["tools"])
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "0 + 1"}}' in text
    assert "<tool_response>\n1\n</tool_response>" in text
    # Every episode with keep_failed; a text policy (tool_call blocks) works too; a policy that
    # never answers is truncated after max_turns.
    assert write_demonstrations(env, lambda task, messages: calculator_policy(
        render_messages(messages)), path, tasks, keep_failed=True) == 4
    looping = lambda task, messages: message_policy(task, messages[:2])  # noqa: E731
    assert write_demonstrations(env, looping, path, tasks[:1], max_turns=3,
                                keep_failed=True) == 1
    [line] = [json.loads(line) for line in path.read_text().splitlines()]
    assert line["reward"] == 0.0 and [m["role"] for m in line["messages"]][-1] == "tool"
    assert sum(m["role"] == "assistant" for m in line["messages"]) == 3


# -- the calculator example -------------------------------------------------------------------

@pytest.fixture
def example_modules(monkeypatch):
    """The example's modules (``tools``, ``reward``) leave sys.modules after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in ("tools", "reward"):
        module = sys.modules.get(name)
        if module is not None and str(EXAMPLE) in str(getattr(module, "__file__", "")):
            del sys.modules[name]


def test_the_calculator_example_loads_and_its_expert_solves_it(example_modules, tmp_path,
                                                               monkeypatch):
    config = (EXAMPLE / "config.yaml").read_text()
    assert "name: dataset" in config and 'reward: "reward:score"' in config
    monkeypatch.chdir(EXAMPLE)
    env = DatasetToolEnvironment(train="train.jsonl", eval="eval.jsonl", tools="tools",
                                 reward="reward:score", search=[EXAMPLE])
    assert (len(env.tasks("train")), len(env.tasks("eval"))) == (300, 50)
    assert {t.prompt for t in env.tasks("train")}.isdisjoint(t.prompt for t in env.tasks("eval"))
    assert [t.name for t in env.tools] == ["calculator", "round_number"]
    calculator = env.tools[0]
    assert calculator(expression="(40 - 63) * 7") == "-161"
    assert calculator(expression="7 / 2") == "3.5"
    for attack in ("__import__('os')", "2 ** 99999", "x + 1", "[1] * 9"):
        with pytest.raises(ValueError):
            calculator(expression=attack)

    def expert(task, messages):
        if messages[-1]["role"] == "tool":
            return {"content": f"{messages[-1]['content']}"}
        expression = task.prompt.removeprefix("What is ").removesuffix("?")
        return {"tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}]}

    path = tmp_path / "demos.jsonl"
    assert write_demonstrations(env, expert, path, env.tasks("eval")) == 50  # answers are right
    episode, reward = finish(env, env.tasks("eval")[0], "I think it is 12, no: 13.")
    assert reward == float(env.tasks("eval")[0].data["answer"] == 13)
