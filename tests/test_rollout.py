"""RolloutEngine with a real tiny Qwen3 (config in code), the built-in vault environment, real
tools and a real SQLite memory: rollouts and training see the same tokens, compaction keeps the
budget and carries memory, failures stay inside their rollout, seeds reproduce rollouts."""

import asyncio
import copy
import time
from collections import Counter

import re

import pytest
import torch

from agentrl_fast.harness import ChatFormat, MemoryStore, tool
from agentrl_fast.envs import build_tokenizer
from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.generators.torch_generator import TorchGenerator
from agentrl_fast.harness.rollout import (CompactionState, RolloutEngine, default_summary,
                                          rollout_metrics)
from agentrl_fast.config.rollout import RolloutConfig
from agentrl_fast.seeds import derive_seed
from agentrl_fast.generators.scripted import ScriptedGenerator
from agentrl_fast.envs.vault import (CODE_WORDS, VAULT_NAMES, VaultEnvironment, VaultEpisode,
                                     expert_action, score)
from agentrl_fast.models import pack, packed_forward, use_packed_attention
from agentrl_fast.models.tiny import tiny_qwen3, with_token_bias

BUDGET = 240


@pytest.fixture(scope="module")
def env():
    return VaultEnvironment()


@pytest.fixture(scope="module")
def chat(env):
    return ChatFormat(build_tokenizer(env.corpus(), vocab_size=1024,
                                      words=VAULT_NAMES + CODE_WORDS))


@pytest.fixture(scope="module")
def model(chat):
    """A tiny random Qwen3 whose LM head is biased towards the stop tokens, so its turns are
    short and rollouts go many turns (parse errors fed back, compaction, limits)."""
    model = tiny_qwen3(len(chat.tokenizer), max_positions=1024, seed=0).eval()
    return with_token_bias(model, {chat.tool_call_close_id: 5.0, chat.im_end_id: 2.0})


def config(**overrides):
    base = dict(samples_per_task=4, sampling=SamplingParams(temperature=1.0, top_p=0.95,
                                                            max_new_tokens=24),
                context_budget=BUDGET, max_turns=16, summary_chars=100)
    base.update(overrides)
    return RolloutConfig(**base)


class RecordingGenerator:
    """Wraps a generator and keeps every (prompt, generation) it produced."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def generate(self, prompts, sampling, seeds=None):
        out = self.inner.generate(prompts, sampling, seeds)
        self.calls += [(list(p), g) for p, g in zip(prompts, out)]
        return out


def teacher_forced_logprobs(model, sub_traces, temperature):
    """log_softmax(logits / temperature) of each token given its prefix, by one packed forward
    over all sub-traces (position convention: row t-1 predicts token t)."""
    packed_model = use_packed_attention(copy.deepcopy(model))
    ids, positions, cu_seqlens, max_seqlen = pack([s.ids for s in sub_traces])
    with torch.no_grad():
        logits = packed_forward(packed_model, ids, positions, cu_seqlens, max_seqlen).logits[0]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = []
    for k, s in enumerate(sub_traces):
        start = int(cu_seqlens[k])
        targets = torch.tensor(s.ids[1:])
        rows = logprobs[start:start + len(s) - 1]
        out.append(torch.cat([torch.zeros(1), rows.gather(-1, targets[:, None])[:, 0]]))
    return out


@pytest.mark.parametrize("schedule", ["lockstep", "overlap"])
def test_sampling_logprobs_equal_teacher_forced_logprobs(env, chat, model, schedule):
    recorder = RecordingGenerator(TorchGenerator(model, pad_id=chat.tokenizer.pad_token_id))
    engine = RolloutEngine(recorder, chat, env, config(schedule=schedule, sampling=SamplingParams(
        temperature=0.8, top_k=50, max_new_tokens=24)))
    trajectories = engine.run(env.tasks("train")[:3], seed=7)
    sub_traces = [s for t in trajectories for s in t.sub_traces]
    assert sum(s.num_action_tokens for s in sub_traces) > 100
    assert max(len(t.sub_traces) for t in trajectories) > 1  # compaction happened
    forced = teacher_forced_logprobs(model, sub_traces, temperature=0.8)
    for s, expected in zip(sub_traces, forced):
        mask = torch.tensor(s.action_mask, dtype=torch.bool)
        recorded = torch.tensor(s.logprobs)
        assert not mask[0]
        torch.testing.assert_close(recorded[mask], expected[mask], atol=1e-4, rtol=0)
        assert (recorded[~mask] == 0).all()
    # The ids the model saw at every step are the trajectory's ids: each prompt is a prefix of
    # its sub-trace, followed verbatim by the sampled ids (stop included).
    for prompt, generation in recorder.calls:
        turn = slice(len(prompt), len(prompt) + len(generation.ids))
        homes = [s for s in sub_traces if s.ids[:len(prompt)] == prompt
                 and s.ids[turn] == generation.ids and s.logprobs[turn] == generation.logprobs
                 and all(s.action_mask[turn])]
        assert homes, "a prompt the model saw, or what it sampled, is not in any sub-trace"


def test_compaction_keeps_the_budget_and_sub_trace_counts_vary(env, chat, model):
    engine = RolloutEngine(TorchGenerator(model, pad_id=chat.tokenizer.pad_token_id), chat, env,
                           config(samples_per_task=6))
    trajectories = engine.run(env.tasks("train")[:2], seed=3)
    for t in trajectories:
        assert all(len(s) <= BUDGET for s in t.sub_traces)
        assert [s.index for s in t.sub_traces] == list(range(len(t.sub_traces)))
        assert all(s.end == "continued" for s in t.sub_traces[:-1])
        assert t.sub_traces[-1].end in ("terminal", "truncated")
        assert all(s.last_action_index is not None for s in t.sub_traces)
        assert t.metrics["compactions"] == len(t.sub_traces) - 1
    for task_index in range(2):
        counts = {len(t.sub_traces) for t in trajectories[6 * task_index:6 * task_index + 6]}
        assert len(counts) > 1, "rollouts of one task should end with different sub-trace counts"
    # Every sub-trace after the first restarts from the system prompt, task and summary.
    t = max(trajectories, key=lambda t: len(t.sub_traces))
    second = chat.decode(t.sub_traces[1].ids)
    assert "Your context was reset. Saved in memory:" in second
    assert second.startswith("<|im_start|>system\n")


def test_same_seed_same_rollouts(env, chat, model):
    generator = TorchGenerator(model, pad_id=chat.tokenizer.pad_token_id)
    engine = RolloutEngine(generator, chat, env, config())
    tasks = env.tasks("train")[:2]
    first, second = engine.run(tasks, seed=11), engine.run(tasks, seed=11)
    other = engine.run(tasks, seed=12)
    flat = lambda ts: [(s.ids, s.logprobs, s.rewards, s.end) for t in ts for s in t.sub_traces]
    assert flat(first) == flat(second)  # the second run did not reuse the first's prefix cache
    assert generator.prefix_cache.entries, "later turns did not extend kept sequences"
    assert flat(first) != flat(other)
    assert [t.rollout_id for t in first] == [f"11/{t.id}/{m}" for t in tasks for m in range(4)]
    # A rollout's tokens do not depend on which other rollouts share its batches (per-sequence
    # sampling generators); its log-probs only up to float rounding (padding changes the
    # reduction shapes).
    alone = engine.run(tasks[1:], seed=11)
    assert [(s.ids, s.end) for t in alone for s in t.sub_traces] == [
        (s.ids, s.end) for t in first[4:] for s in t.sub_traces]
    for a, b in zip([s for t in alone for s in t.sub_traces],
                    [s for t in first[4:] for s in t.sub_traces]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)


def test_expert_solves_the_environment_through_the_engine(env, chat):
    store = MemoryStore()
    engine = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, env,
                           config(samples_per_task=1, context_budget=200, max_turns=30,
                                  summary_chars=200), memory=store)
    tasks = env.tasks("eval")[:40]
    trajectories = engine.run(tasks, seed=0)
    metrics = rollout_metrics(trajectories)
    assert metrics["success"] == 1.0 and metrics["reward"] == 1.0
    assert all(t.sub_traces[-1].end == "terminal" for t in trajectories)
    assert all(len(s) <= 200 for t in trajectories for s in t.sub_traces)
    # Jammed vaults: tool errors the expert recovered from.
    assert sum(t.metrics["tool_exception"] for t in trajectories) > 0
    # Memory across compaction: codes written in one sub-trace are read in a later one.
    carried = 0
    for t in trajectories:
        written_in = {}
        for s in t.sub_traces:
            text = chat.decode(s.ids)
            for vault in VAULT_NAMES:
                if f'"name": "memory_write", "arguments": {{"key": "{vault}"' in text:
                    written_in.setdefault(vault, s.index)
                if (f'"name": "memory_read", "arguments": {{"key": "{vault}"' in text
                        and written_in.get(vault, s.index) < s.index):
                    carried += 1
    assert carried > 0
    # Rewards: the final reward on the last action token of the final sub-trace only.
    for t in trajectories:
        last = t.sub_traces[-1]
        assert last.rewards[last.last_action_index] == 1.0
        assert sum(sum(s.rewards) for s in t.sub_traces) == 1.0
    # Namespaces: one per rollout, holding that rollout's codes.
    for t, task in zip(trajectories, tasks):
        world = task.data["world"]
        namespace = store.namespace(t.rollout_id)
        assert {k: namespace.read(k) for k in namespace.list()} == dict(zip(world.vaults,
                                                                           world.codes))


def test_held_out_split_never_repeats_a_train_vault_list_and_says_when_it_cannot():
    small = VaultEnvironment(max_vaults=2, train_size=300, eval_size=50)
    seen = {t.data["world"].vaults for t in small.tasks("train")}
    assert len(small.tasks("eval")) == 50
    assert not any(t.data["world"].vaults in seen for t in small.tasks("eval"))
    # 2 vaults of 30 make 870 lists, all of them among 10,000 train tasks: no held-out list left.
    with pytest.raises(ValueError, match="cannot draw 200 held-out tasks .* use 870 of the 870 "
                                         "possible lists"):
        VaultEnvironment(max_vaults=2).tasks("eval")


def test_a_vault_shows_its_code_once(env):
    task = next(t for t in env.tasks("train") if set(t.data["world"].vaults) - t.data["world"].jammed)
    world = task.data["world"]
    with MemoryStore() as store:
        episode = env.start(task, store.namespace("once"), seed=0)
        open_vault = next(t for t in episode.tools if t.name == "open_vault")
        vault = next(v for v in world.vaults if v not in world.jammed)
        code = world.codes[world.vaults.index(vault)]
        assert open_vault.fn(name=vault) == f"vault {vault}: code {code}"
        with pytest.raises(RuntimeError, match=f"vault {vault} is empty; it showed its code once"):
            open_vault.fn(name=vault)


@pytest.mark.parametrize("careless", [{"read_probability": 0.0}, {"save_probability": 0.0},
                                      {"read_probability": 0.5}, {"retry_probability": 0.0},
                                      {"retry_probability": 0.5}])
def test_a_careless_expert_loses_codes_and_submits_none(env, chat, careless):
    import functools
    expert = functools.partial(expert_action, **careless)
    engine = RolloutEngine(ScriptedGenerator(expert, chat), chat, env,
                           config(samples_per_task=1, context_budget=200, max_turns=30,
                                  summary_chars=200))
    tasks = env.tasks("train")[:60]
    trajectories = engine.run(tasks, seed=0)
    again = engine.run(tasks, seed=1)  # its choices are fixed per task and vault
    assert [t.reward for t in trajectories] == [t.reward for t in again]
    texts = ["".join(chat.decode(s.ids) for s in t.sub_traces) for t in trajectories]
    assert all(t.sub_traces[-1].end == "terminal" for t in trajectories)  # it still answers
    lost = [t for t in texts if '"name": "submit_code", "arguments": {"vault": ' in t
            and '"code": "none"}' in t]
    assert lost, "a careless expert loses some codes"
    assert 0.0 < rollout_metrics(trajectories)["success"] < 1.0
    if careless.get("read_probability") == 0.0:
        assert not any('<tool_call>\n{"name": "memory_read"' in t for t in texts)
    if careless.get("save_probability") == 0.0:
        assert not any('<tool_call>\n{"name": "memory_write"' in t for t in texts)
    if "retry_probability" in careless:  # a jammed vault's code is lost when not retried
        retried = [t for t in texts if re.search(
            r'vault (\w+) is jammed; open it again\n</tool_response><\|im_end\|>\n'
            r'<\|im_start\|>assistant\n<tool_call>\n\{"name": "open_vault", "arguments": '
            r'\{"name": "\1"', t)]
        assert bool(retried) == (careless["retry_probability"] > 0)


def test_a_habitual_expert_skips_saving_the_same_vault_names_in_every_task(env, chat):
    """careless_vaults < 1: careless (here: never saves) about one share of vault names, the
    same in every task, and saves every other vault's code."""
    import functools
    from agentrl_fast.envs.vault import VAULT_NAMES, _chooses
    habit = {n for n in VAULT_NAMES if not _chooses(["x"], n, "save", 0.0, 0.3)}
    assert 0 < len(habit) < len(VAULT_NAMES) / 2
    expert = functools.partial(expert_action, save_probability=0.0, careless_vaults=0.3)
    engine = RolloutEngine(ScriptedGenerator(expert, chat), chat, env,
                           config(samples_per_task=1, context_budget=200, max_turns=30,
                                  summary_chars=200))
    trajectories = engine.run(env.tasks("train")[:60], seed=0)
    texts = ["".join(chat.decode(s.ids) for s in t.sub_traces) for t in trajectories]
    saved = {key for t in texts for key in re.findall(
        r'"name": "memory_write", "arguments": \{"key": "(\w+)"', t)}
    opened = {name for t in texts for name in re.findall(
        r'"name": "open_vault", "arguments": \{"name": "(\w+)"', t)}
    assert saved and not saved & habit  # never a habit vault's code
    assert opened & habit and saved >= opened - habit, "every other code is saved"
    assert 0.0 < rollout_metrics(trajectories)["success"] < 1.0


class FlakyVaultEnvironment(VaultEnvironment):
    """Sample 0 of every task gets an extra tool that hangs past its timeout or raises; the
    expert calls it first. Other rollouts never see it."""

    def start(self, task, memory, seed):
        episode = super().start(task, memory, seed)
        if memory.name.endswith("/0"):
            @tool(timeout=0.2)
            def check_lock(name: str) -> str:
                """Check a lock (hangs).

                Args:
                    name: The vault.
                """
                time.sleep(2)
                return "ok"
            episode.tools = [*episode.tools, check_lock]
        return episode


def flaky_expert(context: str) -> str:
    first_turn = (context.count("<|im_start|>assistant") == 1
                  and "Your context was reset" not in context)
    if "check_lock" in context and first_turn:
        return '<tool_call>\n{"name": "check_lock", "arguments": {"name": "x"}}\n</tool_call>'
    return expert_action(context)


@pytest.mark.parametrize("schedule", ["lockstep", "overlap"])
def test_tool_failures_do_not_stop_other_rollouts(chat, schedule):
    env = FlakyVaultEnvironment()
    engine = RolloutEngine(ScriptedGenerator(flaky_expert, chat), chat, env,
                           config(samples_per_task=2, context_budget=260, max_turns=30,
                                  summary_chars=200, schedule=schedule))
    trajectories = engine.run(env.tasks("train")[:3], seed=0)
    assert [t.metrics["timeout"] for t in trajectories] == [1, 0] * 3
    # Tool time is wall time with a call running: the three 0.2 s timeouts, at least partly
    # overlapping, never more than the run.
    assert 0.2 <= engine.stats.tool_seconds <= engine.stats.wall_seconds
    assert 0 < engine.stats.tool_share <= 1
    assert all(t.metrics["success"] == 1 for t in trajectories)  # the hung rollout recovered too


def test_tool_responses_over_the_cap_are_truncated_visibly(chat):
    class LongEnvironment(VaultEnvironment):
        def start(self, task, memory, seed):
            episode = super().start(task, memory, seed)
            memory.write("note", "x" * 500)
            return episode

    def reader(context):
        if "[truncated:" not in context:
            return '<tool_call>\n{"name": "memory_read", "arguments": {"key": "note"}}\n</tool_call>'
        return "Done."

    engine = RolloutEngine(ScriptedGenerator(reader, chat), chat, LongEnvironment(),
                           config(samples_per_task=1, max_tool_response_chars=50,
                                  context_budget=400))
    trajectory, = engine.run(VaultEnvironment().tasks("train")[:1])
    text = chat.decode(trajectory.sub_traces[0].ids)
    assert "<tool_response>\n" + "x" * 50 + "\n[truncated: 450 more characters]\n</tool_response>" in text
    assert trajectory.sub_traces[-1].end == "terminal" and trajectory.reward == 0.0


def test_limits_truncate(chat, env):
    def caller(context):
        return '<tool_call>\n{"name": "open_vault", "arguments": {"name": "nowhere"}}\n</tool_call>'

    for overrides, reason in [({"max_turns": 3}, "max_turns"),
                              ({"max_sub_traces": 2, "max_turns": 50}, "max_sub_traces"),
                              ({"max_total_tokens": 300, "max_turns": 50}, "max_total_tokens")]:
        engine = RolloutEngine(ScriptedGenerator(caller, chat), chat, env,
                               config(samples_per_task=1, **overrides))
        trajectory, = engine.run(env.tasks("train")[:1])
        assert trajectory.metrics[f"truncated_{reason}"] == 1, (reason, trajectory.metrics)
        assert trajectory.sub_traces[-1].end == "truncated"
        assert trajectory.num_tokens <= overrides.get("max_total_tokens", 10 ** 9)


def test_derive_seed_and_summary():
    assert derive_seed(1, "a", 0) == derive_seed(1, "a", 0) != derive_seed(1, "a", 1)
    assert 0 <= derive_seed("x") < 2 ** 63
    from agentrl_fast.harness.tool_calls import ToolCall
    from agentrl_fast.harness.tools import ToolResult
    results = [(ToolCall("open_vault", {"name": "kite"}), ToolResult("open_vault", "vault kite: code yak")),
               (ToolCall(None, error="bad"), ToolResult(None, "Error: bad", "parse_error"))]
    text = default_summary(CompactionState(["kite"], results, max_chars=500))
    assert text == ("Your context was reset. Saved in memory: kite.\nLatest tool results:\n"
                    '- open_vault {"name": "kite"}: vault kite: code yak\n- (invalid call): Error: bad')
    assert default_summary(CompactionState([], results, max_chars=10)) == (
        "Your context was reset. Saved in memory: nothing.")


def test_score():
    vaults, codes = ["kite", "jade"], ["falcon", "tiger"]
    assert score({"kite": "falcon", "jade": "tiger"}, vaults, codes) == 1.0
    assert score({"jade": "tiger", "kite": "otter"}, vaults, codes) == 0.5
    assert score({"kite": "none"}, vaults, codes) == 0.0
    assert score({}, vaults, codes) == 0.0 and score({}, [], []) == 0.0


def test_submit_code_needs_every_vault_opened_and_takes_one_code_per_vault(env):
    task = next(t for t in env.tasks("train") if not t.data["world"].jammed)
    world = task.data["world"]
    with MemoryStore() as store:
        episode = env.start(task, store.namespace("submit"), seed=0)
        tools = {t.name: t for t in episode.tools}
        first, *rest = world.vaults
        tools["open_vault"].fn(name=first)
        with pytest.raises(RuntimeError, match=f"open every vault first: {rest[0]} is not "
                                               "opened yet"):
            tools["submit_code"].fn(vault=first, code=world.codes[0])
        for vault in rest:
            tools["open_vault"].fn(name=vault)
        with pytest.raises(ValueError, match='no vault named "nowhere"'):
            tools["submit_code"].fn(vault="nowhere", code="yak")
        assert tools["submit_code"].fn(vault=first, code=world.codes[0]) == (
            f"submitted; left: {', '.join(rest)}")
        with pytest.raises(RuntimeError, match=f"vault {first}: a code was already submitted"):
            tools["submit_code"].fn(vault=first, code="yak")
        assert episode.finish("Done.") == 1 / len(world.vaults)  # only the first was handed in
        assert not episode.success


@pytest.mark.parametrize("field, value, fragment", [
    ("samples_per_task", 0, "samples_per_task must be an int >= 1"),
    ("context_budget", 16, "context_budget (16) must exceed sampling.max_new_tokens"),
    ("schedule", "async", "schedule must be one of lockstep, overlap"),
    ("memory_scope", "global", "memory_scope must be one of rollout, agent"),
    ("summary_chars", -1, "summary_chars must be an int >= 0"),
    ("sampling", {"max_new_tokens": 3}, "sampling must be a SamplingParams"),
])
def test_bad_config(field, value, fragment):
    with pytest.raises((TypeError, ValueError)) as info:
        config(**{field: value})
    assert fragment in str(info.value)


def test_agent_memory_scope_shares_one_namespace(env, chat):
    store = MemoryStore()
    engine = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, env,
                           config(samples_per_task=1, context_budget=200, max_turns=30,
                                  summary_chars=200, memory_scope="agent"), memory=store)
    tasks = env.tasks("train")[:3]
    trajectories = engine.run(tasks, seed=0)
    assert store.namespaces() == ["agent"]
    vaults = {v for task in tasks for v in task.data["world"].vaults}
    assert set(store.namespace("agent").list()) == vaults
    assert len(trajectories) == 3


def test_error_penalty_charges_the_agents_mistakes_on_their_turn_and_not_a_jam(chat):
    penalty = 0.125
    env = VaultEnvironment(error_penalty=penalty)
    tasks = [t for t in env.tasks("train")[:40] if t.data["world"].jammed][:4]
    assert tasks

    def clumsy(context: str) -> str:  # one call of an unknown vault, then the expert
        if context.count("<|im_start|>assistant\n") == 1 and "context was reset" not in context:
            return ('<tool_call>\n{"name": "open_vault", "arguments": {"name": "nowhere"}}\n'
                    '</tool_call>')
        return expert_action(context)

    settings = config(samples_per_task=1, context_budget=200, max_turns=30, summary_chars=200)
    careful = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, env, settings)
    for t in careful.run(tasks, seed=0):  # jammed vaults are the world's doing: no charge
        assert t.metrics["tool_exception"] > 0 and t.metrics["success"] == 1
        assert t.reward == 1.0 and sum(sum(s.rewards) for s in t.sub_traces) == 1.0
    engine = RolloutEngine(ScriptedGenerator(clumsy, chat), chat, env, settings)
    for t in engine.run(tasks, seed=0):
        assert t.metrics["success"] == 1
        assert t.reward == pytest.approx(1.0 - penalty)
        first = t.sub_traces[0]
        charged = [r for s in t.sub_traces for r in s.rewards if r]
        assert charged[0] == -penalty and charged[-1] == 1.0 and len(charged) == 2
        # The charge sits on the mistaken turn's last action token: the first turn's `</tool_call>`.
        position = first.rewards.index(-penalty)
        assert first.action_mask[position] and not first.action_mask[position + 1]
        assert '"nowhere"' in chat.decode(first.ids[:position + 1]).split("assistant\n")[-1]
    with pytest.raises(ValueError, match=r"error_penalty must be in \[0, 1\], got -0.1"):
        VaultEnvironment(error_penalty=-0.1)


def test_a_prompt_without_room_for_a_turn_is_an_error_naming_the_budget_it_needs(env, chat):
    """A first prompt over the context budget would end every rollout before it generated
    anything (a step trained on no tokens); the engine says how large the budget must be."""
    settings = config(samples_per_task=1, context_budget=40)
    engine = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, env, settings)
    task = env.tasks("train")[0]
    with pytest.raises(ValueError, match=r"task .*: the first prompt .* is \d+ tokens; .* needs "
                                         r"context_budget >= (\d+), but .* is 40"):
        engine.run([task])
    need = int(re.search(r">= (\d+)", str(_error(engine, task))).group(1))
    fits = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, env,
                         config(samples_per_task=1, context_budget=need))
    assert fits.run([task])[0].sub_traces[0].num_action_tokens > 0


def _error(engine, task) -> Exception:
    try:
        engine.run([task])
    except ValueError as error:
        return error
    raise AssertionError("no error")


class _Bare:
    """An environment written from the protocol, with members left out by the test."""

    name = "bare"

    def tasks(self, split):
        from agentrl_fast.harness import Task
        return [Task("t0", "Say done.")]

    def start(self, task, memory, seed):
        return _BareEpisode()


class _BareEpisode:
    system_prompt, prompt, tools = "You answer.", "Say done.", []

    def after_tools(self, calls, results):
        return 0.0

    def finish(self, answer):
        return 1.0


@pytest.mark.parametrize("remove, message", [
    ("Environment.start", r"environment .* lacks start\(\) of the Environment protocol"),
    ("Episode.finish", r"Environment.start returned a Episode that lacks finish\(\) of the"),
    ("Episode.success", r"has no 'success' after finish\(\): the Episode protocol needs it"),
])
def test_an_environment_missing_a_protocol_member_is_named(chat, remove, message):
    environment_class = type("Environment", (_Bare,), {})
    episode_class = type("Episode", (_BareEpisode,), {})
    environment_class.start = lambda self, task, memory, seed: episode_class()
    if remove == "Environment.start":
        environment_class.start = None
    elif remove == "Episode.finish":
        episode_class.finish = None
    else:  # success is the only member left: with it the rollout finishes
        episode_class.success = property(lambda self: True)
        engine = RolloutEngine(ScriptedGenerator(lambda text: "done", chat), chat,
                               environment_class(), config(samples_per_task=1))
        assert engine.run(environment_class().tasks("train"))[0].metrics["success"] == 1
        del episode_class.success
    with pytest.raises(TypeError, match=message):
        engine = RolloutEngine(ScriptedGenerator(lambda text: "done", chat), chat,
                               environment_class(), config(samples_per_task=1))
        engine.run(environment_class().tasks("train"))
