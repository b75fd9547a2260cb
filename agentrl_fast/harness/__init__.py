"""The agent loop: the Qwen3 tool-call format (text and token ids), tools that survive the
model's mistakes, memory as a tool, the environment protocol, token-in/token-out trajectories
and batched multi-turn rollouts with context compaction; code the model wrote runs in
:mod:`.sandbox`. It samples from any :mod:`agentrl_fast.generators` generator; the built-in
environments are :mod:`agentrl_fast.envs`. Semantics: ``docs/design.md`` ("The harness")."""

from agentrl_fast.harness.chat_format import (SPECIAL_TOKENS, STOP_MODES, ChatFormat,
                                              render_messages)
from agentrl_fast.harness.environment import Environment, Episode, Task
from agentrl_fast.harness.memory import MemoryNamespace, MemoryStore
from agentrl_fast.harness.rollout import (CompactionState, RolloutEngine, RolloutStats,
                                          default_summary, rollout_metrics)
from agentrl_fast.harness.sandbox import SandboxResult, python_tool, run_sandboxed
from agentrl_fast.harness.tool_calls import ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import (FAILURE_KINDS, Tool, ToolRegistry, ToolResult,
                                        ToolTimeout, count_failures, tool)
from agentrl_fast.harness.trajectory import (END_KINDS, SubTrace, Trajectory, TurnOutcome,
                                             apply_turn)

__all__ = [
    "END_KINDS", "FAILURE_KINDS", "SPECIAL_TOKENS", "STOP_MODES", "ChatFormat", "CompactionState",
    "Environment", "Episode", "MemoryNamespace", "MemoryStore", "RolloutEngine", "RolloutStats",
    "SandboxResult", "SubTrace", "Task", "Tool", "ToolCall", "ToolRegistry", "ToolResult",
    "ToolTimeout", "Trajectory", "TurnOutcome", "apply_turn", "count_failures", "default_summary",
    "parse_tool_calls", "python_tool", "render_messages", "rollout_metrics", "run_sandboxed",
    "tool",
]
