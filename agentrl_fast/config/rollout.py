"""The rollout engine's limits and options (a leaf: standard library and the sampling
parameters only)."""

from __future__ import annotations

from dataclasses import dataclass

from agentrl_fast.config.sampling import SamplingParams

SCHEDULES = ("lockstep", "overlap")
MEMORY_SCOPES = ("rollout", "agent")


@dataclass(frozen=True)
class RolloutConfig:
    """Limits and options of :class:`RolloutEngine` (the module doc of
    ``agentrl_fast.harness.rollout`` says how the limits act). Token counts are in tokens of the
    chat format's tokenizer."""

    samples_per_task: int = 1
    """Rollouts of each task (a task group: GRPO's advantages compare them, and
    ``filter_groups`` needs 2 or more). A step trains on ``tasks_per_step`` times this many
    rollouts."""
    sampling: SamplingParams = SamplingParams(max_new_tokens=128)
    """What every turn samples with (``SamplingParams``); ``max_new_tokens`` is per turn. This
    default caps a turn at 128 new tokens (``SamplingParams()`` alone has 256)."""
    context_budget: int = 2048
    """Most tokens of one sub-trace (prompt, turns and tool responses). Before each turn, if
    the sub-trace plus ``sampling.max_new_tokens`` would pass it, the sub-trace is compacted:
    the next starts from the system prompt, the task and a summary. Must exceed
    ``sampling.max_new_tokens`` plus the prompt, and be at most ``micro_batch_tokens``. Set it
    to the context length to train at; a smaller budget compacts more often."""
    max_turns: int = 32
    """Most assistant turns of a rollout, over all its sub-traces; reaching it truncates the
    rollout. Set it a little above what a good episode takes, so looping failures end."""
    max_sub_traces: int = 8
    """Most sub-traces of a rollout (one more than its compactions); a compaction past it
    truncates the rollout instead."""
    max_total_tokens: int = 32768
    """Most tokens of a rollout over all its sub-traces; a turn that would pass it truncates
    the rollout."""
    max_tool_response_chars: int = 2000
    """Tool responses longer than this (characters) are cut, with a visible marker."""
    summary_chars: int = 600
    """Characters of the default compaction summary (memory keys, then the latest tool results
    that fit; 0: the memory keys only). Its tokens count against ``context_budget``: keep it
    well under the budget."""
    memory_scope: str = "rollout"
    """``"rollout"``: each rollout has its own memory namespace, emptied when it starts;
    ``"agent"``: one namespace shared by every rollout (memory that persists across
    episodes)."""
    schedule: str = "lockstep"
    """``"lockstep"``: generate for all waiting rollouts, then run all their tools (batches are
    a function of the inputs: a seed reproduces rollouts bit for bit); ``"overlap"``: the next
    generation starts while other rollouts' tools run, which hides slow tools (network,
    sandboxes) but makes batches depend on timing."""
    tool_timeout: float = 30.0
    """Seconds a tool call may run before it fails with a ``timeout`` result the model sees (a
    tool's own ``timeout`` overrides it)."""

    def __post_init__(self):
        positive = ("samples_per_task", "context_budget", "max_turns", "max_sub_traces",
                    "max_total_tokens", "max_tool_response_chars")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RolloutConfig: {name} must be an int >= 1, got {value!r}")
        if not isinstance(self.summary_chars, int) or self.summary_chars < 0:
            raise ValueError(f"RolloutConfig: summary_chars must be an int >= 0, "
                             f"got {self.summary_chars!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"RolloutConfig: sampling must be a SamplingParams, "
                            f"got {type(self.sampling).__name__}")
        if self.sampling.max_new_tokens >= self.context_budget:
            raise ValueError(f"RolloutConfig: context_budget ({self.context_budget}) must exceed "
                             f"sampling.max_new_tokens ({self.sampling.max_new_tokens}) plus the "
                             "prompt")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"RolloutConfig: schedule must be one of {', '.join(SCHEDULES)}, "
                             f"got {self.schedule!r}")
        if self.memory_scope not in MEMORY_SCOPES:
            raise ValueError(f"RolloutConfig: memory_scope must be one of "
                             f"{', '.join(MEMORY_SCOPES)}, got {self.memory_scope!r}")
        if not self.tool_timeout > 0:
            raise ValueError(f"RolloutConfig: tool_timeout must be > 0 seconds, "
                             f"got {self.tool_timeout!r}")
