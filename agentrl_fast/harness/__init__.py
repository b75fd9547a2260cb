"""The agent harness: the Qwen3 tool-call format (text and token ids), tools that survive the
model's mistakes, memory as a tool, token-in/token-out trajectories, generation, batched
multi-turn rollouts with context compaction, and the built-in vault environment. Semantics:
DESIGN.md ("The harness")."""

from agentrl_fast.harness.chat_format import (SPECIAL_TOKENS, STOP_MODES, ChatFormat,
                                              render_messages)
from agentrl_fast.harness.environment import Environment, Episode, Task
from agentrl_fast.harness.generation import (Generation, Generator, SamplingParams,
                                             ScriptedGenerator, TorchGenerator)
from agentrl_fast.harness.memory import MemoryNamespace, MemoryStore
from agentrl_fast.harness.rollout import (CompactionState, RolloutConfig, RolloutEngine,
                                          RolloutStats, default_summary, derive_seed,
                                          rollout_metrics)
from agentrl_fast.harness.sandbox import SandboxResult, python_tool, run_sandboxed
from agentrl_fast.harness.tokenizer import build_tokenizer
from agentrl_fast.harness.tool_calls import ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import (FAILURE_KINDS, Tool, ToolRegistry, ToolResult,
                                        count_failures, tool)
from agentrl_fast.harness.trajectory import (END_KINDS, SubTrace, Trajectory, TurnOutcome,
                                             apply_turn)
from agentrl_fast.harness.vault import VaultEnvironment, expert_action
from agentrl_fast.harness.vllm_generator import VLLMGenerator
from agentrl_fast.harness.vllm_server import ServerError, VLLMServer

__all__ = [
    "CompactionState", "Environment", "Episode", "Generation", "Generator", "RolloutConfig",
    "RolloutEngine", "RolloutStats", "SamplingParams", "ScriptedGenerator", "Task",
    "TorchGenerator", "VLLMGenerator", "VLLMServer", "ServerError", "VaultEnvironment",
    "default_summary", "derive_seed", "expert_action",
    "rollout_metrics",
    "END_KINDS", "FAILURE_KINDS", "SPECIAL_TOKENS", "STOP_MODES", "ChatFormat", "MemoryNamespace",
    "MemoryStore", "SandboxResult", "SubTrace", "Tool", "ToolCall", "ToolRegistry", "ToolResult",
    "Trajectory", "TurnOutcome", "apply_turn", "build_tokenizer", "count_failures",
    "parse_tool_calls", "python_tool", "render_messages", "run_sandboxed", "tool",
]
