"""Issue 44: a run on your own model, environment and demonstrations from a config. Every mistake
stops the run when it is built (``build``, ``load_config``, ``make_environment``, the warm-start's
``_demonstrations``; never a training step) with a ConfigError naming the field — and the
folders searched, the file and line, the member and class, the missing tokens — and what the
config names is what the run gets (the checkpoint's weights, tokenizer and dtype; modules and
relative paths from the config file's folder; the library defaults, not the vault-tuned main
job's).

The user's files are written into a temporary folder and the tests run from another one (the
working directory), as ``agentrl-fast train --config some/folder/my.yaml`` does. One tiny Qwen3
checkpoint with the real vocabulary (tests/qwen3_vocab.py) is shared by the module."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from agentrl_fast.config import (ConfigError, EnvConfig, RunConfig, TrainConfig, apply_overrides,
                                 library_defaults, load_config, to_dict, validate,
                                 warmstart_source)
from agentrl_fast.envs.from_config import make_environment
from agentrl_fast.harness import SPECIAL_TOKENS, ChatFormat
from agentrl_fast.train.demos import load_demonstrations
from agentrl_fast.train.run import _demonstrations, build
from qwen3_vocab import EOS_TOKEN_ID, QWEN3_VOCAB_SIZE, tiny_qwen3_checkpoint

MAIN_JOB_BUDGET = RunConfig().train.rollout.context_budget  # tuned for the vault task
LIBRARY_BUDGET = TrainConfig().rollout.context_budget       # 2048

# The user's environment module (docs/own-agent.md's capitals, written from the protocol), with
# the mistakes the tests make: every module the tests write starts with "rc_" (forgotten after
# each test, so a module is found where the test put it, not in sys.modules).
ENV_MODULE = '''
from agentrl_fast.harness import Task, tool

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
            "Canada": "Ottawa", "Egypt": "Cairo"}
NOT_CALLABLE = 3


class CapitalEpisode:
    system_prompt = "Answer with the capital city."

    def __init__(self, task):
        self.prompt = task.prompt
        self.capital = task.data["capital"]
        self.success = False

        @tool
        def lookup(country: str) -> str:
            """Look up the capital of a country.

            Args:
                country: The country's English name.
            """
            return CAPITALS.get(country, "no such country")

        self.tools = [lookup]

    def after_tools(self, calls, results):
        return 0.0

    def finish(self, answer):
        self.success = answer is not None and self.capital in answer
        return float(self.success)


class CapitalEnvironment:
    name = "capitals"

    def __init__(self, held_out=2):
        tasks = [Task(id=country, prompt=f"What is the capital of {country}?",
                      data={"capital": capital}) for country, capital in CAPITALS.items()]
        self.splits = {"train": tasks[held_out:], "eval": tasks[:held_out]}

    def tasks(self, split):
        return self.splits[split]

    def start(self, task, memory, seed):
        return CapitalEpisode(task)


class NoStartEnvironment:
    name = "no-start"

    def tasks(self, split):
        return CapitalEnvironment().tasks(split)


class NoFinishEpisode:
    system_prompt = ""

    def __init__(self, task):
        self.prompt, self.tools, self.success = task.prompt, [], False

    def after_tools(self, calls, results):
        return 0.0


class NoToolsEpisode(NoFinishEpisode):
    def __init__(self, task):
        super().__init__(task)
        del self.tools

    def finish(self, answer):
        return 0.0


class NoFinishEnvironment(CapitalEnvironment):
    def start(self, task, memory, seed):
        return NoFinishEpisode(task)


class NoToolsEnvironment(CapitalEnvironment):
    def start(self, task, memory, seed):
        return NoToolsEpisode(task)


class BrokenStartEnvironment(CapitalEnvironment):
    def start(self, task, memory, seed):
        raise KeyError("capital")


class OwnSeedNameEnvironment(CapitalEnvironment):
    def start(self, task, memory, rng_seed):  # the engine passes it positionally
        return CapitalEpisode(task)
'''

REWARD_MODULE = '''
def score(answer, task):
    return float(answer is not None and str(task["answer"]) in answer)
'''

CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
TOOL_CALL = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n'
             '</tool_call>')
CALCULATOR_CONVERSATION = {"messages": [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator",
                                          "arguments": {"expression": "2 + 3"}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."}], "tools": [CALCULATOR_SCHEMA]}
CAPITAL_CONVERSATION = {"messages": [
    {"role": "system", "content": "Answer with the capital city."},
    {"role": "user", "content": "What is the capital of Peru?"},
    {"role": "assistant", "content": "Lima"}]}


# ---------------------------------------------------------------------------------------------
# Fixtures.


@pytest.fixture(autouse=True)
def isolated_imports(monkeypatch):
    """sys.path as it was (import_object appends the folders it searched) and the user's rc_*
    modules forgotten after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [name for name in sys.modules if name.startswith("rc_")]:
        del sys.modules[name]


@pytest.fixture
def folder(tmp_path):
    """The user's folder (their modules and YAML files), not the working directory."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "rc_env.py").write_text(ENV_MODULE)
    (folder / "rc_reward.py").write_text(REWARD_MODULE)
    return folder


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty working directory, elsewhere than the user's folder."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture
def offline(monkeypatch):
    """No hub: a name that is no folder fails at once (huggingface_hub reads the variable when
    imported, so its constant is set too)."""
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen3_tokenizer) -> Path:
    """A tiny Qwen3ForCausalLM (max_position_embeddings 1024) with the real Qwen3 tokenizer."""
    return tiny_qwen3_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-tiny",
                                 tokenizer=qwen3_tokenizer)


@pytest.fixture(scope="module")
def small_tokenizer():
    """A byte-level BPE tokenizer of ~280 ids without Qwen3's chat tokens (a fresh one per
    call: the tests add tokens to it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def make():
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.train_from_iterator(
            ["What is the capital of France? Paris."] * 10,
            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                       pad_token="<|endoftext|>")
    return make


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory, small_tokenizer) -> Path:
    """A tiny Qwen3ForCausalLM (max_position_embeddings 1024) with the small tokenizer and
    Qwen3's chat tokens added: quick to load, for the checks that need no real vocabulary."""
    tokenizer = small_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    return tiny_qwen3_checkpoint(tmp_path_factory.mktemp("models") / "small-chat",
                                 tokenizer=tokenizer, pad_token_id=0, eos_token_id=0)


def write_yaml(folder: Path, data: dict, name: str = "run.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def own_env_config(folder: Path, factory: str = "rc_env:CapitalEnvironment", args=None,
                   **sections) -> RunConfig:
    """``load_config`` of a YAML in ``folder`` naming ``factory`` (2 eval tasks)."""
    data = {"env": {"factory": factory, "args": args or {}}, "eval": {"tasks": 2}, **sections}
    return load_config(write_yaml(folder, data))


def error_of(call, *args) -> str:
    with pytest.raises(ConfigError) as caught:
        call(*args)
    return str(caught.value)


# ---------------------------------------------------------------------------------------------
# 1. env.factory: found where the config is, and its protocol checked before any model loads.


def test_an_unknown_module_names_env_factory_and_the_folders_searched(folder, cwd):
    message = error_of(make_environment, own_env_config(folder, "rc_no_such_module:Make"))
    assert message.startswith("env.factory: no module named 'rc_no_such_module'"), message
    assert str(cwd) in message and str(folder) in message, message


def test_a_module_without_the_attribute_names_it_and_the_file(folder, cwd):
    message = error_of(make_environment, own_env_config(folder, "rc_env:NoSuchEnvironment"))
    assert message.startswith("env.factory: module 'rc_env'"), message
    assert "'NoSuchEnvironment'" in message and str(folder / "rc_env.py") in message, message


def test_an_attribute_that_is_not_callable(folder, cwd):
    message = error_of(make_environment, own_env_config(folder, "rc_env:NOT_CALLABLE"))
    assert message.startswith("env.factory: 'rc_env:NOT_CALLABLE'"), message
    assert "int" in message and "not a callable" in message, message


def test_a_module_whose_own_import_fails_names_what_it_imports(folder, cwd):
    (folder / "rc_needs.py").write_text("import rc_not_installed_anywhere\nMake = dict\n")
    message = error_of(make_environment, own_env_config(folder, "rc_needs:Make"))
    assert message.startswith("env.factory: importing 'rc_needs' failed"), message
    assert "rc_not_installed_anywhere" in message, message


def test_an_unexpected_env_args_key_lists_the_args(folder, cwd):
    config = own_env_config(folder, args={"held_out": 2, "colour": "red"})
    message = error_of(make_environment, config)
    assert message.startswith("env.factory (rc_env:CapitalEnvironment): "), message
    assert "colour" in message and "(env.args: ['colour', 'held_out'])" in message, message


def test_an_environment_lacking_start_names_the_member_and_the_class(folder, cwd):
    message = error_of(make_environment, own_env_config(folder, "rc_env:NoStartEnvironment"))
    assert message.startswith("env.factory: environment NoStartEnvironment lacks start()"), \
        message


@pytest.mark.parametrize("factory, episode, member", [
    ("NoFinishEnvironment", "NoFinishEpisode", "finish()"),
    ("NoToolsEnvironment", "NoToolsEpisode", "tools")])
def test_an_episode_lacking_a_member_stops_the_build_before_the_model_loads(
        folder, cwd, offline, factory, episode, member):
    # model.path names no checkpoint: the episode's error must come first.
    config = own_env_config(folder, f"rc_env:{factory}", model={"path": "rc-no-such-model"})
    message = error_of(build, config)
    assert message.startswith(f"env.factory: {factory}.start returned a {episode} that lacks "
                              f"{member} of the Episode protocol"), message


def test_a_start_that_raises_names_the_class_and_the_task(folder, cwd):
    message = error_of(make_environment, own_env_config(folder, "rc_env:BrokenStartEnvironment"))
    assert message.startswith("env.factory: BrokenStartEnvironment.start('Kenya') raised "
                              "KeyError"), message


def test_the_first_episode_is_started_as_the_engine_starts_episodes(folder, cwd):
    environment = make_environment(own_env_config(folder, "rc_env:OwnSeedNameEnvironment"))
    assert environment.name == "capitals"


def test_an_empty_eval_split(folder, cwd):
    message = error_of(make_environment, own_env_config(folder, args={"held_out": 0}))
    assert message == "env: CapitalEnvironment.tasks('eval') is empty", message


def test_more_eval_tasks_than_the_held_out_split(folder, cwd):
    config = own_env_config(folder, eval={"tasks": 3})
    message = error_of(make_environment, config)
    assert message.startswith("eval.tasks (3) exceeds the environment's held-out split "
                              "(2 tasks)"), message


def test_the_module_is_found_in_the_config_files_folder_from_elsewhere(folder, cwd):
    assert "rc_env" not in sys.modules and str(folder) not in sys.path
    config = own_env_config(folder)
    assert config.base_dir == str(folder.resolve())
    environment = make_environment(config)
    assert environment.name == "capitals"
    assert [t.id for t in environment.tasks("eval")] == ["France", "Japan"]


def test_the_module_is_found_in_the_working_directory_without_a_file(folder, monkeypatch):
    monkeypatch.chdir(folder)
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # (python -m's "": the cwd)
    assert "rc_env" not in sys.modules and str(folder) not in sys.path
    config = apply_overrides(load_config(None, base=library_defaults()),
                             ["env.factory=rc_env:CapitalEnvironment", "env.args={held_out: 3}",
                              "eval.tasks=3"])
    assert config.base_dir is None
    environment = make_environment(config)
    assert len(environment.tasks("eval")) == 3


# ---------------------------------------------------------------------------------------------
# 2. env.name: the built-in environments.


def test_an_unknown_env_name_lists_the_built_in_ones():
    config = apply_overrides(library_defaults(), ["env.name=gridworld"])
    message = error_of(validate, config)
    assert message.startswith("env.name: unknown environment 'gridworld' (built in: vault, "
                              "dataset"), message
    assert error_of(build, config) == message


def test_the_vault_environment_refuses_env_args():
    config = apply_overrides(RunConfig(), ["env.args={min_vaults: 3}"])
    assert error_of(validate, config).startswith("env.args: the vault environment takes its "
                                                 "settings as env fields")


def test_the_dataset_environment_needs_a_train_file():
    config = apply_overrides(library_defaults(),
                             ["env.name=dataset", "env.args={reward: 'rc_reward:score'}"])
    assert error_of(validate, config).startswith("env.args.train: the dataset environment needs "
                                                 "a train task file")


def test_a_bad_task_line_is_named_by_file_and_line_through_build(folder, cwd, offline):
    tasks = folder / "tasks.jsonl"
    tasks.write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n{"prompt": "What is\n'
                     '{"prompt": "What is 2 + 2?", "answer": 4}\n')
    config = load_config(write_yaml(folder, {
        "model": {"path": "rc-no-such-model"},
        "env": {"name": "dataset", "args": {"train": "tasks.jsonl", "reward": "rc_reward:score"}},
        "eval": {"tasks": 1}}))
    message = error_of(build, config)
    assert message.startswith(f"env.args: {tasks}:2: not valid JSON"), message


# ---------------------------------------------------------------------------------------------
# 3. model.path: the checkpoint, its tokenizer and dtype, checked against the chat format.


def model_config(folder: Path, path, *overrides: str) -> RunConfig:
    """The capitals environment from ``folder`` on the checkpoint at ``path``."""
    config = own_env_config(folder, model={"path": str(path)},
                            train={"rollout": {"context_budget": 1000}})
    return apply_overrides(config, list(overrides))


def test_a_tokenizer_without_the_chat_tokens_is_refused_naming_them(
        folder, cwd, tmp_path, small_tokenizer):
    path = tiny_qwen3_checkpoint(tmp_path / "bpe-model", tokenizer=small_tokenizer(),
                                 pad_token_id=0, eos_token_id=0)
    message = error_of(build, model_config(folder, path))
    assert message.startswith("model.path: the tokenizer lacks Qwen3's chat tokens"), message
    assert all(repr(token) in message for token in SPECIAL_TOKENS), message
    assert "resize_token_embeddings" in message, message


def test_a_model_tokenizer_without_the_chat_tokens_names_model_tokenizer(
        folder, cwd, tmp_path, checkpoint, small_tokenizer):
    small_tokenizer().save_pretrained(tmp_path / "bpe-tokenizer")
    config = model_config(folder, checkpoint, f"model.tokenizer={tmp_path / 'bpe-tokenizer'}")
    message = error_of(build, config)
    assert message.startswith("model.tokenizer: the tokenizer lacks Qwen3's chat tokens"), message


def test_a_tokenizer_larger_than_the_embeddings_names_resize(
        folder, cwd, tmp_path, small_tokenizer):
    tokenizer = small_tokenizer()
    path = tiny_qwen3_checkpoint(tmp_path / "grown", tokenizer=tokenizer, pad_token_id=0,
                                 eos_token_id=0)
    rows = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.save_pretrained(path)  # the tokenizer grown, the model not resized
    message = error_of(build, model_config(folder, path))
    assert message.startswith(f"model.path: the tokenizer has {rows + len(SPECIAL_TOKENS)} "
                              f"tokens but the model's embeddings only {rows} rows"), message
    assert "resize_token_embeddings(len(tokenizer))" in message, message


def test_a_context_budget_beyond_the_models_positions_names_both(folder, cwd, small_checkpoint):
    config = model_config(folder, small_checkpoint, "train.rollout.context_budget=2048")
    message = error_of(build, config)
    assert message == ("train.rollout.context_budget (2048) exceeds the model's "
                       "max_position_embeddings (1024)"), message


@pytest.mark.parametrize("name", ["rc-no-such-folder", "rc-nobody/rc-no-such-model"])
def test_a_missing_folder_or_hub_id_offline_names_model_path(folder, cwd, offline, name):
    message = error_of(build, model_config(folder, name))
    assert message.startswith(f"model.path: cannot load a tokenizer from '{name}'"), message


def test_model_dtype_bfloat16_loads_bfloat16_weights(folder, cwd, small_checkpoint):
    _, _, policy = build(model_config(folder, small_checkpoint, "model.dtype=bfloat16"))
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def built(checkpoint, tmp_path_factory):
    """``build`` of a YAML beside the checkpoint naming it by its relative folder name, from
    another working directory."""
    folder = checkpoint.parent
    (folder / "rc_env.py").write_text(ENV_MODULE)
    path = write_yaml(folder, {"model": {"path": checkpoint.name},
                               "env": {"factory": "rc_env:CapitalEnvironment"},
                               "train": {"rollout": {"context_budget": 512}},
                               "eval": {"tasks": 2}})
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("elsewhere"))
        patch.setattr(sys, "path", list(sys.path))
        config = load_config(path)
        environment, chat, policy = build(config)
    for name in [name for name in sys.modules if name.startswith("rc_")]:
        del sys.modules[name]
    return config, environment, chat, policy


def test_a_relative_model_path_is_found_from_the_config_files_folder(built, checkpoint):
    config, _, chat, policy = built
    assert config.model.path == "qwen3-tiny" and config.base_dir == str(checkpoint.parent)
    assert Path(policy.name_or_path) == checkpoint
    assert Path(chat.tokenizer.name_or_path) == checkpoint


def test_the_policy_is_the_checkpoints(built, checkpoint):
    from transformers import AutoModelForCausalLM
    _, _, chat, policy = built
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([chat.tokenizer.encode("<|im_start|>user\nWhat is the capital of Peru?"
                                              "<|im_end|>")])
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(policy(ids).logits, reference(ids).logits)
    assert policy.dtype == torch.float32


def test_the_chat_format_uses_the_checkpoints_tokenizer(built):
    _, _, chat, _ = built
    assert len(chat.tokenizer) == QWEN3_VOCAB_SIZE
    assert chat.im_end_id == EOS_TOKEN_ID == 151645
    assert chat.stop_ids == (chat.tokenizer.convert_tokens_to_ids("</tool_call>"), 151645)


# ---------------------------------------------------------------------------------------------
# 4. The warm-start: what it imitates, and demonstrations from data.


def test_source_data_needs_warmstart_data():
    config = apply_overrides(library_defaults(), ["model.path=x", "warmstart.source=data"])
    assert error_of(validate, config).startswith("warmstart.source=data needs warmstart.data")


def test_source_expert_needs_the_vault_environment():
    config = apply_overrides(library_defaults(), [
        "env.name=dataset", "env.args={train: t.jsonl, reward: 'rc_reward:score'}",
        "warmstart.source=expert"])
    assert error_of(validate, config).startswith("warmstart.source=expert: the scripted expert "
                                                 "plays the vault task only")


@pytest.mark.parametrize("overrides, source", [
    ([], "expert"),                                                  # the main job
    (["model.path=x"], "none"),                                      # a checkpoint, as it is
    (["env.factory=rc_env:CapitalEnvironment"], "none"),             # no expert for it
    (["model.path=x", "warmstart.data=demos.jsonl"], "data"),
    (["warmstart.data=demos.jsonl"], "data"),                        # even on the vault task
])
def test_auto_resolves(overrides, source):
    config = apply_overrides(RunConfig(), overrides)
    assert config.warmstart.source == "auto"
    assert warmstart_source(config) == source


def demos_config(folder: Path, lines: list[str], budget: int = 512) -> RunConfig:
    """A config in ``folder`` whose ``warmstart.data`` is ``demos.jsonl`` there (relative)."""
    (folder / "demos.jsonl").write_text("".join(line + "\n" for line in lines))
    return own_env_config(folder, model={"path": "x"}, warmstart={"data": "demos.jsonl"},
                          train={"rollout": {"context_budget": budget,
                                             "sampling": {"max_new_tokens": 16}}})


@pytest.fixture
def chat(qwen3_tokenizer):
    return ChatFormat(qwen3_tokenizer)


def test_a_bad_json_line_names_warmstart_data_file_and_line(folder, cwd, chat):
    config = demos_config(folder, [json.dumps(CAPITAL_CONVERSATION), '{"messages": [',
                                   json.dumps(CAPITAL_CONVERSATION)])
    message = error_of(_demonstrations, config, chat, None)
    assert message.startswith(f"warmstart.data: {folder / 'demos.jsonl'}:2: not JSON"), message


def test_a_conversation_without_an_assistant_turn_names_the_line(folder, cwd, chat):
    config = demos_config(folder, [json.dumps(CAPITAL_CONVERSATION), "",
                                   json.dumps({"messages": CAPITAL_CONVERSATION["messages"][:2]})])
    message = error_of(_demonstrations, config, chat, None)
    assert message == (f"warmstart.data: {folder / 'demos.jsonl'}:3: the conversation has no "
                       "assistant turn to learn from"), message


def test_a_conversation_longer_than_the_context_budget_names_the_line(folder, cwd, chat):
    long_one = len(chat.encode_messages(CALCULATOR_CONVERSATION["messages"],
                                        CALCULATOR_CONVERSATION["tools"])[0])
    budget = long_one - 1
    config = demos_config(folder, [json.dumps(CAPITAL_CONVERSATION),
                                   json.dumps(CALCULATOR_CONVERSATION)], budget=budget)
    message = error_of(_demonstrations, config, chat, None)
    assert message.startswith(f"warmstart.data: {folder / 'demos.jsonl'}:2: the conversation is "
                              f"{long_one} tokens, over {budget}"), message


def action_runs(sub_trace) -> list[list[int]]:
    """The sub-trace's runs of action tokens, in order."""
    runs, run = [], []
    for token, action in zip(sub_trace.ids, sub_trace.action_mask):
        if action:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    return runs + [run] if run else runs


def test_a_good_file_gives_the_assistant_outputs_and_their_stop_tokens(folder, cwd, chat):
    config = demos_config(folder, [json.dumps(CALCULATOR_CONVERSATION),
                                   json.dumps(CAPITAL_CONVERSATION)])
    sub_traces = _demonstrations(config, chat, None)
    assert len(sub_traces) == 2 and {s.end for s in sub_traces} == {"terminal"}
    decode = chat.tokenizer.decode
    assert [decode(run) for run in action_runs(sub_traces[0])] == [
        TOOL_CALL, "The answer is 5.<|im_end|>"]
    assert [decode(run) for run in action_runs(sub_traces[1])] == ["Lima<|im_end|>"]
    assert [run[-1] for s in sub_traces for run in action_runs(s)] == [
        chat.tokenizer.convert_tokens_to_ids("</tool_call>"), chat.im_end_id, chat.im_end_id]
    assert all(s.logprobs == [0.0] * len(s) for s in sub_traces)
    # The same as the loader gives for the file itself.
    direct = load_demonstrations(folder / "demos.jsonl", chat)
    assert [s.ids for s in direct] == [s.ids for s in sub_traces]
    assert [s.action_mask for s in direct] == [s.action_mask for s in sub_traces]


def test_the_warm_starts_validation_tasks_stay_out_of_the_final_evaluation(
        folder, cwd, small_checkpoint):
    (folder / "demos.jsonl").write_text(json.dumps(CAPITAL_CONVERSATION) + "\n")
    config = model_config(folder, small_checkpoint, "warmstart.data=demos.jsonl")
    assert config.warmstart.target_success is not None and config.warmstart.steps > 0
    with pytest.raises(ConfigError, match="warmstart.check_tasks"):
        build(config)


# ---------------------------------------------------------------------------------------------
# 5. load_config and `agentrl-fast config`: which defaults a config starts from, base_dir.


@pytest.mark.parametrize("data", [
    {"model": {"path": "qwen3-tiny"}},
    {"env": {"factory": "rc_env:CapitalEnvironment"}},
    {"env": {"name": "dataset", "args": {"train": "t.jsonl"}}},
], ids=["model.path", "env.factory", "env.name"])
def test_a_yaml_naming_its_own_agent_starts_from_the_library_defaults(tmp_path, data):
    config = load_config(write_yaml(tmp_path, data))
    assert LIBRARY_BUDGET != MAIN_JOB_BUDGET
    assert config.train.rollout.context_budget == LIBRARY_BUDGET
    assert config.train == TrainConfig()
    assert config.env.min_vaults == EnvConfig().min_vaults != RunConfig().env.min_vaults


def test_a_yaml_tweaking_the_vault_task_keeps_the_main_jobs_values(tmp_path):
    config = load_config(write_yaml(tmp_path, {"env": {"jam_probability": 0.5}}))
    assert config.env.jam_probability == 0.5
    assert config.train.rollout.context_budget == MAIN_JOB_BUDGET
    assert config.train == RunConfig().train
    assert config.env.min_vaults == RunConfig().env.min_vaults


def test_base_dir_is_the_yaml_folder_and_kept_when_a_saved_run_config_is_loaded(folder, cwd):
    config = load_config(Path("..") / "user" / write_yaml(folder, {
        "env": {"factory": "rc_env:CapitalEnvironment"}, "eval": {"tasks": 2}}).name)
    assert config.base_dir == str(folder.resolve())
    # A run writes its config as train_run does; `agentrl-fast eval` loads it from the run folder.
    run_dir = cwd / "runs" / "capitals"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    again = load_config(run_dir / "config.yaml")
    assert again.base_dir == str(folder.resolve())
    assert again == config
    assert make_environment(again).name == "capitals"  # its module still found


def test_agentrl_fast_config_with_set_model_path_prints_the_library_defaults(capsys):
    from agentrl_fast.cli import main
    assert main(["config", "--set", "model.path=x"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["path"] == "x"
    assert printed["train"]["rollout"]["context_budget"] == LIBRARY_BUDGET == 2048
    assert printed["env"]["min_vaults"] == EnvConfig().min_vaults
    assert main(["config"]) == 0  # the main job
    assert yaml.safe_load(capsys.readouterr().out)["train"]["rollout"]["context_budget"] == MAIN_JOB_BUDGET


def test_set_model_path_over_a_vault_yaml_also_starts_from_the_library_defaults(tmp_path, capsys):
    """--set naming one's own model picks the same base with or without a --config file."""
    from agentrl_fast.cli import main
    path = write_yaml(tmp_path, {"env": {"jam_probability": 0.5}})
    assert main(["config", "--config", str(path), "--set", "model.path=x"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["rollout"]["context_budget"] == LIBRARY_BUDGET
    assert printed["env"]["jam_probability"] == 0.5


def test_set_env_args_key_refines_the_mapping():
    config = apply_overrides(RunConfig(), ["env.name=dataset", "env.args.train=t.jsonl",
                                           "env.args.tools=tools"])
    config = apply_overrides(config, ["env.args.eval=e.jsonl"])
    assert config.env.args == {"train": "t.jsonl", "tools": "tools", "eval": "e.jsonl"}


def test_relative_paths_are_saved_absolute_so_eval_finds_them_from_anywhere(folder, cwd):
    from agentrl_fast.train.run import resolve_paths
    (folder / "demos.jsonl").write_text(json.dumps(CALCULATOR_CONVERSATION) + "\n")
    (folder / "ckpt").mkdir()
    config = load_config(write_yaml(folder, {"model": {"path": "ckpt"},
                                             "env": {"factory": "rc_env:CapitalEnvironment"},
                                             "warmstart": {"data": "demos.jsonl"}}))
    resolved = resolve_paths(config)
    assert resolved.model.path == str((folder / "ckpt").resolve())
    assert resolved.warmstart.data == str((folder / "demos.jsonl").resolve())
    hub = resolve_paths(apply_overrides(config, ["model.path=Qwen/Qwen3-0.6B"]))
    assert hub.model.path == "Qwen/Qwen3-0.6B"  # found nowhere: a hub id, as given


def test_warmstart_data_missing_or_unused_is_an_error(folder, cwd):
    base = own_env_config(folder)
    message = error_of(validate, apply_overrides(base, ["warmstart.data=nope.jsonl"]))
    assert message.startswith("warmstart.data: no such file 'nope.jsonl' (looked in"), message
    (folder / "demos.jsonl").write_text(json.dumps(CALCULATOR_CONVERSATION) + "\n")
    unused = apply_overrides(base, ["warmstart.data=demos.jsonl", "warmstart.source=none"])
    assert "warmstart.data is set but not used" in error_of(validate, unused)


def test_a_demonstration_turn_with_two_calls_names_the_line(tmp_path):
    from agentrl_fast.envs import build_tokenizer
    from agentrl_fast.harness import ChatFormat
    tokenizer = build_tokenizer(vocab_size=400)
    call = {"type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    record = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "", "tool_calls": [call, call]}]}
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(CALCULATOR_CONVERSATION) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: messages\[1\] makes 2 calls in one turn"):
        load_demonstrations(path, ChatFormat(tokenizer))
    assert len(load_demonstrations(path, ChatFormat(tokenizer, stop_mode="im_end"))) == 2
