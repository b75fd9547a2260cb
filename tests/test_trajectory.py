"""Token-in/token-out sub-traces: sampled ids kept verbatim with their log-probs, template and
tool-response ids appended, the action mask exactly on sampled ids, both stop modes."""

import asyncio
import random
from collections import Counter

import pytest
import torch

from agentrl_fast.harness import (ChatFormat, SubTrace, ToolRegistry, Trajectory, apply_turn,
                                  render_messages, tool)
from agentrl_fast.envs import build_tokenizer


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@tool
def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


SYSTEM = {"role": "system", "content": "You are a calculator agent."}
TASK = {"role": "user", "content": "Compute (1+2)+4, then answer."}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["Compute the sum", '{"name": "add", "arguments": {"a": 1, "b": 2}}'] * 4)


def sample(chat: ChatFormat, text: str, stop: int | None, rng: random.Random):
    """What a policy would have sampled for ``text`` (+ a stop id), with made-up log-probs."""
    ids = chat.encode(text) + ([stop] if stop is not None else [])
    return ids, [-rng.random() * 3 for _ in ids]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("stop_mode", ["tool_call", "im_end"])
def test_rollout_is_built_from_ids_and_decodes_to_the_conversation(tokenizer, stop_mode):
    chat = ChatFormat(tokenizer, stop_mode=stop_mode)
    registry = ToolRegistry([add, fail])
    rng = random.Random(0)
    trajectory = Trajectory("r0", task_id="t0")
    sub = trajectory.new_sub_trace()
    sub.append_context(chat.render_ids([SYSTEM, TASK], registry.schemas, add_generation_prompt=True))
    messages = [SYSTEM, TASK]
    if stop_mode == "tool_call":
        # One call per turn; the model stops at </tool_call>, the harness writes <|im_end|>.
        turns = [('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None),
                 ('Next.\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
                  None),
                 ("The answer is 7.", chat.im_end_id)]
    else:
        # Several calls in one turn, executed concurrently; the model stops at <|im_end|>.
        turns = [('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "fail", "arguments": {"reason": "no"}}\n</tool_call>',
                  chat.im_end_id),
                 ("The answer is 7.", chat.im_end_id)]
    expected_mask, expected_logprobs = [0] * len(sub), [0.0] * len(sub)
    metrics = Counter()
    for text, stop in turns:
        seen = list(sub.ids)  # what the model saw before this turn
        ids, logprobs = sample(chat, text, stop, rng)
        outcome = run(apply_turn(sub, chat, registry, ids, logprobs, metrics))
        # Never re-tokenized: the trajectory extends what the model saw, then its own ids.
        assert sub.ids[:len(seen)] == seen
        assert sub.ids[len(seen):len(seen) + len(ids)] == ids
        expected_mask += [1] * len(ids) + [0] * (len(sub) - len(seen) - len(ids))
        expected_logprobs += logprobs + [0.0] * (len(sub) - len(seen) - len(ids))
        if outcome.final:
            messages.append({"role": "assistant", "content": text})
            break
        calls = [{"name": c.name, "arguments": c.arguments} for c in outcome.calls]
        content = text.split("<tool_call>")[0].rstrip("\n")
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        messages += [{"role": "tool", "content": r.content} for r in outcome.results]
        # After a tool turn the trajectory is exactly the rendered conversation + prompt.
        assert chat.decode(sub.ids) == render_messages(messages, registry.schemas,
                                                       add_generation_prompt=True)
    assert outcome.final and outcome.stop == "im_end"
    assert sub.action_mask == expected_mask
    assert sub.logprobs == expected_logprobs
    # The final answer ended the turn with the model's own <|im_end|>; "\n" closes it.
    assert chat.decode(sub.ids).endswith("The answer is 7.<|im_end|>\n")
    if stop_mode == "tool_call":
        assert metrics == Counter(turns=3, calls=2, ok=2)
    else:
        assert metrics == Counter(turns=2, calls=2, ok=1, tool_exception=1)
        assert "RuntimeError: no" in chat.decode(sub.ids)
    sub.add_reward(1.0)
    sub.close("terminal")
    assert trajectory.done
    tensors = sub.to_tensors()
    assert tensors["ids"].dtype == torch.int64 and tensors["action_mask"].dtype == torch.bool
    assert tensors["logprobs"].dtype == torch.float32 and tensors["rewards"].dtype == torch.float32
    assert tensors["rewards"].sum().item() == 1.0
    assert tensors["rewards"][sub.last_action_index].item() == 1.0
    assert tensors["action_mask"].sum().item() == sub.num_action_tokens
    assert not tensors["action_mask"][0]


def test_model_mistakes_become_error_responses_and_the_loop_goes_on(tokenizer):
    chat = ChatFormat(tokenizer)
    registry = ToolRegistry([add])
    rng = random.Random(1)
    sub = SubTrace("r1")
    sub.append_context(chat.render_ids([TASK], registry.schemas, add_generation_prompt=True))
    mistakes = ['<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # bad JSON
                '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',  # unknown tool
                '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 2}}</tool_call>',
                "no call at all</tool_call>"]  # stopped at </tool_call> without a block
    kinds = []
    for text in mistakes:
        ids, logprobs = sample(chat, text, None, rng)
        if ids[-1] != chat.tool_call_close_id:
            ids, logprobs = ids + [chat.tool_call_close_id], logprobs + [-0.5]
        outcome = run(apply_turn(sub, chat, registry, ids, logprobs))
        assert not outcome.final and len(outcome.results) == 1
        assert outcome.results[0].content.startswith("Error:")
        kinds.append(outcome.results[0].error)
        assert chat.decode(sub.ids).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert kinds == ["parse_error", "unknown_tool", "wrong_type", "parse_error"]
    ids, logprobs = sample(chat, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}'
                                 "</tool_call>", None, rng)
    outcome = run(apply_turn(sub, chat, registry, ids, logprobs))
    assert outcome.results[0].ok and outcome.results[0].content == "4"
    assert registry.metrics["calls"] == 5 and registry.metrics["ok"] == 1


def test_turn_without_a_stop_token_is_closed_and_reported(tokenizer):
    chat = ChatFormat(tokenizer, stop_mode="im_end")
    sub = SubTrace("r2")
    sub.append_context(chat.render_ids([TASK], add_generation_prompt=True))
    # In im_end mode </tool_call> is not a stop: a turn ending there ran out of tokens.
    ids = chat.encode('<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    outcome = run(apply_turn(sub, chat, ToolRegistry([add]), ids, [-1.0] * len(ids)))
    assert outcome.stop == "length" and not outcome.final and outcome.results == []
    assert chat.decode(sub.ids).endswith("</tool_call><|im_end|>\n")


def test_sub_trace_checks():
    sub = SubTrace("r3")
    with pytest.raises(ValueError, match="append_action on an empty sub-trace"):
        sub.append_action([5], [-0.1])
    sub.append_context([1, 2])
    with pytest.raises(ValueError, match="logprobs has 1 entries but ids has 2"):
        sub.append_action([3, 4], [-0.1])
    with pytest.raises(ValueError, match=r"logprobs\[0\] = 0.5"):
        sub.append_action([3], [0.5])
    with pytest.raises(ValueError, match=r"logprobs\[0\] = nan"):
        sub.append_action([3], [float("nan")])
    with pytest.raises(ValueError, match=r"ids\[1\] = -1"):
        sub.append_context([0, -1])
    with pytest.raises(TypeError, match=r"ids\[0\] must be an int"):
        sub.append_context([1.5])
    with pytest.raises(ValueError, match="no action token"):
        sub.add_reward(1.0)
    sub.append_action(torch.tensor([7, 8]).tolist(), torch.tensor([-0.25, -0.5]).tolist())
    sub.add_reward(0.5)
    sub.add_reward(0.25)
    assert sub.rewards == [0.0, 0.0, 0.0, 0.75]
    with pytest.raises(ValueError, match="reward must be finite"):
        sub.add_reward(float("inf"))
    with pytest.raises(ValueError, match="end must be one of terminal, truncated, continued"):
        sub.close("done")
    sub.close("truncated")
    with pytest.raises(ValueError, match="is closed"):
        sub.append_context([1])
    assert sub.action_mask == [0, 0, 1, 1] and sub.logprobs == [0.0, 0.0, -0.25, -0.5]


def test_trajectory_sub_traces_chain():
    trajectory = Trajectory("r4", task_id="t", sample_index=2)
    with pytest.raises(ValueError, match="has no sub-trace"):
        trajectory.current
    first = trajectory.new_sub_trace()
    first.append_context([1, 2, 3])
    second = trajectory.new_sub_trace()
    assert first.end == "continued" and second.index == 1 and second.rollout_id == "r4"
    assert trajectory.current is second and not trajectory.done
    second.append_context([4])
    second.close("truncated")
    assert trajectory.done and trajectory.num_tokens == 4


def test_token_ids_are_checked_and_stored_as_ints():
    import numpy as np
    import torch

    s = SubTrace("r", index=0)
    s.append_context([1, 2, 3])
    s.append_context((np.int64(4), torch.tensor(5)))  # any integer with __index__
    s.append_action([6], [-0.5])
    assert s.ids == [1, 2, 3, 4, 5, 6] and all(type(t) is int for t in s.ids)
    with pytest.raises(TypeError, match=r"ids\[1\] must be an int token id, got bool"):
        s.append_context([7, True])
    with pytest.raises(TypeError, match=r"must be an int token id, got float"):
        s.append_context([7.0])
    with pytest.raises(ValueError, match=r"\[2\] = -1: token ids must be >= 0"):
        s.append_context([7, 8, -1])
    assert s.ids == [1, 2, 3, 4, 5, 6]  # nothing appended by a refused call
