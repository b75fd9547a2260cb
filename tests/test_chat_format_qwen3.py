"""ChatFormat token-exact with the real Qwen3 vocabulary: every id sequence the harness builds
equals the tokenizer's ids of the text ``render_messages`` gives for the same conversation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_fast.harness import ChatFormat
from agentrl_fast.harness.chat_format import render_messages

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                         "arguments": '{"expression": "2+3"}'}}]}
SEAMS = ["5\n", "", "\n", "ünïcödé ✓ 中文\n\n", "  spaced  ", "a.\n\n\n", "{\"x\": [1, 2]}\n"]


def reference(tokenizer, messages, tools=None, generation=True) -> list[int]:
    return list(tokenizer.encode(render_messages(messages, tools, generation),
                                 add_special_tokens=False))


@pytest.fixture(scope="module")
def chat(qwen3_tokenizer):
    return ChatFormat(qwen3_tokenizer)


@pytest.mark.parametrize("system", [None, "You are a careful assistant.", "Use tools.\n"])
@pytest.mark.parametrize("tools", [None, [CALCULATOR]])
def test_prompts_equal_the_tokenizers_ids(chat, qwen3_tokenizer, system, tools):
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": "What is 2+3?\n"})
    assert chat.render_ids(messages, tools, True) == reference(qwen3_tokenizer, messages, tools)


def test_the_issues_seams_merge(chat, qwen3_tokenizer):
    """The two seams the issue found: a system prompt ending in '.' before the tools header,
    and a tool result ending in a newline."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = chat.render_ids(messages, [CALCULATOR], True)
    assert ".ĊĊ" in qwen3_tokenizer.convert_ids_to_tokens(ids)
    turn = chat.tool_results_ids(["5\n"])
    assert "ĊĊ" in qwen3_tokenizer.convert_ids_to_tokens(turn)
    assert turn == list(qwen3_tokenizer.encode(render_messages([{"role": "tool", "content": "5\n"}]),
                                               add_special_tokens=False))


@pytest.mark.parametrize("results", [[s] for s in SEAMS] + [SEAMS[:3], SEAMS[3:]])
def test_a_trajectory_built_turn_by_turn_is_the_rendered_conversation(chat, qwen3_tokenizer,
                                                                      results):
    """Prompt, the model's sampled ids verbatim, then the harness's turn end, tool results and
    generation prompt: the ids of the whole rendered conversation."""
    messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2+3?"}]
    ids = chat.render_ids(messages, [CALCULATOR], True)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    sampled = chat.encode(call)
    ids += sampled + chat.turn_end_ids(sampled) + chat.tool_results_ids(results)
    ids += chat.generation_prompt_ids()
    history = messages + [{**CALL, "tool_calls": [{"name": "calculator",
                                                  "arguments": {"expression": "2+3"}}]}]
    history += [{"role": "tool", "content": r} for r in results]
    assert ids == reference(qwen3_tokenizer, history, [CALCULATOR])


@pytest.mark.parametrize("content", SEAMS)
def test_user_turns_and_compaction_restarts(chat, qwen3_tokenizer, content):
    assert chat.user_ids(content) == list(qwen3_tokenizer.encode(
        render_messages([{"role": "user", "content": content}]), add_special_tokens=False))
    summary = f"Task: open the vaults.\n\nProgress so far:\n- saved: {content}"
    messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": summary}]
    assert chat.render_ids(messages, [CALCULATOR], True) == reference(qwen3_tokenizer, messages,
                                                                    [CALCULATOR])


def test_demonstrations_are_the_conversation_as_a_rollout_builds_it(chat, qwen3_tokenizer):
    """Whole conversations with assistant turns (tool calls and a final answer): the ids a
    rollout builds turn by turn (the final answer after the plain generation prompt, not the
    template's think block), the mask on the outputs and their stop tokens."""
    messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2+3?"},
                CALL, {"role": "tool", "content": "5\n"}]
    ids, mask = chat.encode_messages(messages + [{"role": "assistant",
                                                  "content": "The answer is 5."}], [CALCULATOR])
    prompt = reference(qwen3_tokenizer, messages[:2], [CALCULATOR])
    call = chat.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}'
                       '\n</tool_call>')
    answer = chat.encode("The answer is 5.") + [chat.im_end_id]
    built = (prompt + call + chat.turn_end_ids(call) + chat.tool_results_ids(["5\n"])
             + chat.generation_prompt_ids() + answer + chat.turn_end_ids(answer))
    assert ids == built
    assert [i for i, m in zip(ids, mask) if m] == call + answer


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=30), min_size=1, max_size=3),
       st.text(max_size=30), st.booleans())
def test_random_contents(chat, qwen3_tokenizer, results, system, tools):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "go"},
                CALL] + [{"role": "tool", "content": r} for r in results]
    schemas = [CALCULATOR] if tools else None
    assert chat.render_ids(messages, schemas, True) == reference(qwen3_tokenizer, messages, schemas)
    assert chat.tool_results_ids(results) == list(qwen3_tokenizer.encode(
        render_messages([{"role": "tool", "content": r} for r in results]),
        add_special_tokens=False))


def test_the_engines_sub_traces_are_the_rendered_conversation(chat, qwen3_tokenizer):
    """Real rollouts of the vault expert on the Qwen3 vocabulary, compacted into several
    sub-traces: each sub-trace's ids are the tokenizer's ids of its conversation's text."""
    import dataclasses

    from agentrl_fast.config import RolloutConfig, SamplingParams
    from agentrl_fast.envs import VaultEnvironment, expert_action
    from agentrl_fast.generators import ScriptedGenerator
    from agentrl_fast.harness import RolloutEngine

    env = VaultEnvironment(min_vaults=3)
    config = RolloutConfig(samples_per_task=1, context_budget=700, max_turns=24,
                           summary_chars=200, sampling=SamplingParams(max_new_tokens=48))
    engine = RolloutEngine(ScriptedGenerator(expert_action, chat), chat, env, config)
    tasks = env.tasks("train")[:4]
    trajectories = engine.run(tasks)
    assert all(t.metrics["success"] for t in trajectories)
    assert max(len(t.sub_traces) for t in trajectories) >= 2
    for task, trajectory in zip(tasks, trajectories):
        assert engine.prompt_ids(task) == trajectory.sub_traces[0].ids[:len(engine.prompt_ids(task))]
        for sub_trace in trajectory.sub_traces:
            text = chat.decode(sub_trace.ids)
            assert sub_trace.ids == list(qwen3_tokenizer.encode(text, add_special_tokens=False))
    assert dataclasses.is_dataclass(config)


def test_the_proxys_prompt_ids(chat, qwen3_tokenizer):
    """A proxy session's ids after two requests (a tool call, a result ending in newlines)
    are the tokenizer's ids of the conversation the client holds."""
    import asyncio

    from agentrl_fast.config import SamplingParams
    from agentrl_fast.generators import ScriptedGenerator
    from agentrl_fast.proxy.service import Proxy

    outputs = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n'
               '</tool_call>', "It is 5."]
    proxy = Proxy(ScriptedGenerator(lambda context: outputs.pop(0), chat), chat,
                  SamplingParams(temperature=1.0, max_new_tokens=48), batch_window=0.0)
    session = proxy.create_session(task_id="t")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    body = {"model": "m", "tools": [CALCULATOR]}
    _, first, _ = asyncio.run(proxy.complete(session, {**body, "messages": messages}))
    messages += [{"role": "assistant", "content": None, "tool_calls": list(first.tool_calls)},
                 {"role": "tool", "tool_call_id": first.tool_calls[0]["id"], "content": "5\n\n"}]
    _, second, _ = asyncio.run(proxy.complete(session, {**body, "messages": messages}))
    trajectory = proxy.finish(session, reward=1.0)
    sub_trace, = trajectory.sub_traces
    prompt = reference(qwen3_tokenizer, messages, [CALCULATOR])  # up to the generation prompt
    assert sub_trace.ids[:len(prompt)] == prompt
    assert qwen3_tokenizer.decode(sub_trace.ids[len(prompt):]) == "It is 5.<|im_end|>\n"
