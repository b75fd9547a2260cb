"""Token-in/token-out trajectories: a rollout (:class:`Trajectory`) is a list of sub-traces
(:class:`SubTrace`), each one training sample built from ids, never from re-tokenized text.

A sub-trace grows by two operations only: :meth:`SubTrace.append_context` (prompt, template and
tool-response ids, ``action_mask`` 0) and :meth:`SubTrace.append_action` (the ids the policy
sampled, kept verbatim with their sampling log-probs, ``action_mask`` 1, stop token included).
:func:`apply_turn` is one turn of the loop: record the sampled ids, parse and run the tool
calls, append the turn's end, the tool results and the next generation prompt as template ids.

How a sub-trace ended (``end``): ``"terminal"`` (the episode is over; GAE bootstraps 0),
``"truncated"`` (cut by a limit; bootstrap with the critic's value after the last token),
``"continued"`` (compacted; bootstrap with the value at the first action token of the rollout's
next sub-trace). See docs/design.md ("Training").
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.tool_calls import ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import ToolRegistry, ToolResult, count_failures

END_KINDS = ("terminal", "truncated", "continued")


def _check_ids(ids: Sequence[int], name: str) -> list[int]:
    if type(ids) is list and all(type(token) is int for token in ids) and (not ids or min(ids) >= 0):
        return list(ids)  # the common case, without a Python step per token
    out = []
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) and not hasattr(token, "__index__"):
            raise TypeError(f"{name}[{i}] must be an int token id, got {type(token).__name__}")
        token = int(token)
        if token < 0:
            raise ValueError(f"{name}[{i}] = {token}: token ids must be >= 0")
        out.append(token)
    return out


@dataclass
class SubTrace:
    """One training sample of a rollout. Per-token lists, all of length ``len(ids)``:

    - ``ids``: token ids as the model saw them;
    - ``action_mask``: 1 exactly on sampled ids (stop tokens included), 0 on context;
    - ``logprobs``: the sampling log-prob of each action token (docs/design.md: ``log_softmax`` of
      ``logits / temperature`` before top-p/top-k), 0.0 on context;
    - ``rewards``: per-token rewards, nonzero only on action tokens (a turn's reward sits on
      its last action token);
    - ``versions``: the policy version that sampled each action token (the learner's step
      count when its weights were published; asynchronous training bounds how far behind they
      may be), -1 on context. Empty on a sub-trace built by hand: version 0 throughout.
    """

    rollout_id: str
    index: int = 0
    ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    end: str | None = None
    versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    def action_versions(self) -> list[int]:
        """The version of each action token, in order."""
        if len(self.versions) != len(self.ids):  # built by hand
            return [0] * self.num_action_tokens
        return [v for v, m in zip(self.versions, self.action_mask) if m]

    @property
    def last_action_index(self) -> int | None:
        for i in range(len(self.action_mask) - 1, -1, -1):
            if self.action_mask[i]:
                return i
        return None

    def _check_open(self):
        if self.end is not None:
            raise ValueError(f"sub-trace {self.rollout_id}#{self.index} is closed ({self.end}); "
                             "start the rollout's next sub-trace instead")

    def append_context(self, ids: Sequence[int]) -> None:
        """Append prompt, template or tool-response ids (not sampled by the policy)."""
        self._check_open()
        ids = _check_ids(ids, "ids")
        self.ids += ids
        self.action_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.rewards += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def append_action(self, ids: Sequence[int], logprobs: Sequence[float],
                      version: int = 0) -> None:
        """Append the ids the policy sampled, verbatim, with their sampling log-probs and the
        policy version that sampled them."""
        self._check_open()
        ids = _check_ids(ids, "ids")
        logprobs = [float(lp) for lp in logprobs]
        if len(logprobs) != len(ids):
            raise ValueError(f"logprobs has {len(logprobs)} entries but ids has {len(ids)}; "
                             "pass one sampling log-prob per sampled id")
        for i, lp in enumerate(logprobs):
            if not (lp <= 0.0 and math.isfinite(lp)):
                raise ValueError(f"logprobs[{i}] = {lp}: a sampling log-prob must be finite "
                                 "and <= 0")
        if ids and not self.ids:
            raise ValueError("append_action on an empty sub-trace: a sequence starts with a "
                             "prompt (append_context first); its first token is never an action")
        self.ids += ids
        self.action_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.rewards += [0.0] * len(ids)
        self.versions += [int(version)] * len(ids)

    def rewind(self, length: int) -> None:
        """Drop the tokens from ``length`` on; they must all be context (a compaction moves tool
        results that would overflow the budget into the next sub-trace's summary)."""
        self._check_open()
        if not 0 <= length <= len(self.ids):
            raise ValueError(f"rewind: length must be in [0, {len(self.ids)}], got {length}")
        if any(self.action_mask[length:]):
            raise ValueError("rewind would drop action tokens; only context can be dropped")
        for values in (self.ids, self.action_mask, self.logprobs, self.rewards, self.versions):
            del values[length:]

    def add_reward(self, reward: float) -> None:
        """Add ``reward`` on the last action token (the end of the latest turn)."""
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        last = self.last_action_index
        if last is None:
            raise ValueError(f"sub-trace {self.rollout_id}#{self.index} has no action token "
                             "to carry a reward")
        self.rewards[last] += reward

    def close(self, end: str) -> None:
        """Mark how the sub-trace ended: one of ``END_KINDS``."""
        self._check_open()
        if end not in END_KINDS:
            raise ValueError(f"end must be one of {', '.join(END_KINDS)}, got {end!r}")
        self.end = end

    def to_tensors(self) -> dict:
        """``{"ids": int64 [T], "action_mask": bool [T], "logprobs": float32 [T],
        "rewards": float32 [T]}`` (torch tensors, CPU)."""
        import torch
        return {"ids": torch.tensor(self.ids, dtype=torch.int64),
                "action_mask": torch.tensor(self.action_mask, dtype=torch.bool),
                "logprobs": torch.tensor(self.logprobs, dtype=torch.float32),
                "rewards": torch.tensor(self.rewards, dtype=torch.float32)}


@dataclass
class Trajectory:
    """A rollout: its sub-traces (in order, sharing ``rollout_id``), task and sample index, the
    episode's total reward (its per-turn rewards and the final one), and counters
    (``metrics``: turns, tool calls and each failure kind). ``error``: why the rollout failed
    for a reason outside the model (an inference server failed its request); a failed rollout
    is not trained on."""

    rollout_id: str
    task_id: str | None = None
    sample_index: int = 0
    sub_traces: list[SubTrace] = field(default_factory=list)
    reward: float = 0.0
    metrics: Counter = field(default_factory=Counter)
    error: str | None = None

    def new_sub_trace(self) -> SubTrace:
        """Start the next sub-trace; the current one, if open, is closed as ``"continued"``."""
        if self.sub_traces and self.sub_traces[-1].end is None:
            self.sub_traces[-1].close("continued")
        sub_trace = SubTrace(self.rollout_id, index=len(self.sub_traces))
        self.sub_traces.append(sub_trace)
        return sub_trace

    @property
    def current(self) -> SubTrace:
        if not self.sub_traces:
            raise ValueError(f"rollout {self.rollout_id} has no sub-trace; call new_sub_trace()")
        return self.sub_traces[-1]

    @property
    def done(self) -> bool:
        return bool(self.sub_traces) and self.sub_traces[-1].end in ("terminal", "truncated")

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sub_traces)


@dataclass(frozen=True)
class TurnOutcome:
    """What :func:`apply_turn` did: the parsed ``calls``, their ``results``, and whether the
    turn was the final answer (``final``: the model stopped at ``<|im_end|>`` without calls) or
    ran out of tokens (``stop == "length"``)."""

    calls: list[ToolCall]
    results: list[ToolResult]
    stop: str  # "tool_call", "im_end" or "length"
    final: bool


def cap_response(result: ToolResult, max_chars: int) -> ToolResult:
    """``result`` with its content cut to ``max_chars`` and a visible marker."""
    if len(result.content) <= max_chars:
        return result
    cut = len(result.content) - max_chars
    return dataclasses.replace(result, content=result.content[:max_chars]
                               + f"\n[truncated: {cut} more characters]")


async def apply_turn(sub_trace: SubTrace, chat_format: ChatFormat, registry: ToolRegistry,
                     sampled_ids: Sequence[int], logprobs: Sequence[float],
                     metrics: Counter | None = None,
                     max_response_chars: int | None = None, version: int = 0) -> TurnOutcome:
    """One turn: append the sampled ids as actions, run the calls they contain, append the
    turn's end, the tool results and the next generation prompt as context ids.

    Stop handling: at ``</tool_call>`` (``"tool_call"`` mode) the harness writes ``<|im_end|>``;
    at ``<|im_end|>`` with calls (either mode), their results follow; at ``<|im_end|>`` without
    calls the turn is the final answer and nothing is appended after ``\\n``. A turn that ended
    at ``</tool_call>`` with no ``<tool_call>`` block gets an error result. A turn without a
    stop token (``"length"``) is closed with ``<|im_end|>``, gets no results, and the caller
    decides (usually: truncate the rollout). A tool response longer than
    ``max_response_chars`` is cut there, with a visible ``[truncated: N more characters]``.
    """
    sub_trace.append_action(sampled_ids, logprobs, version)
    last = sampled_ids[-1] if len(sampled_ids) else None
    if last == chat_format.im_end_id:
        stop = "im_end"
    elif last == chat_format.tool_call_close_id and chat_format.stop_mode == "tool_call":
        stop = "tool_call"
    else:
        stop = "length"
    calls: list[ToolCall] = []
    if stop != "length":
        calls = parse_tool_calls(chat_format.decode(sampled_ids))
        if stop == "tool_call" and not calls:
            calls = [ToolCall(None, error="the turn ended with </tool_call> but has no "
                              "<tool_call> block; write <tool_call>{...}</tool_call>")]
    results = await registry.execute(calls) if calls else []
    if max_response_chars is not None:
        results = [cap_response(r, max_response_chars) for r in results]
    sub_trace.append_context(chat_format.turn_end_ids(sampled_ids))
    if results:
        sub_trace.append_context(chat_format.tool_results_ids([r.content for r in results]))
        sub_trace.append_context(chat_format.generation_prompt_ids())
    if metrics is not None:
        metrics["turns"] += 1
        metrics.update(count_failures(results))
    return TurnOutcome(calls, results, stop, final=stop == "im_end" and not calls)
