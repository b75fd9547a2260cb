"""The rollout engine's limits and options (a leaf: standard library and the sampling
parameters only)."""

from __future__ import annotations

from dataclasses import dataclass

from agentrl_fast.config.sampling import SamplingParams

SCHEDULES = ("lockstep", "overlap")
MEMORY_SCOPES = ("rollout", "agent")


@dataclass(frozen=True)
class RolloutConfig:
    """Limits and options of :class:`RolloutEngine` (see the module doc). Token counts are in
    tokens of the chat format's tokenizer."""

    samples_per_task: int = 1
    sampling: SamplingParams = SamplingParams(max_new_tokens=128)
    context_budget: int = 2048
    max_turns: int = 32
    max_sub_traces: int = 8
    max_total_tokens: int = 32768
    max_tool_response_chars: int = 2000
    summary_chars: int = 600
    memory_scope: str = "rollout"
    schedule: str = "lockstep"
    tool_timeout: float = 30.0

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
