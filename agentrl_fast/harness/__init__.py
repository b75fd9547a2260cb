"""The agent harness: the Qwen3 tool-call format (text and token ids), tools that survive the
model's mistakes, memory as a tool, and token-in/token-out trajectories. Semantics: DESIGN.md
("The harness")."""

from agentrl_fast.harness.chat_format import (SPECIAL_TOKENS, STOP_MODES, ChatFormat,
                                              render_messages)
from agentrl_fast.harness.memory import MemoryNamespace, MemoryStore
from agentrl_fast.harness.sandbox import SandboxResult, python_tool, run_sandboxed
from agentrl_fast.harness.tokenizer import build_tokenizer
from agentrl_fast.harness.tool_calls import ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import (FAILURE_KINDS, Tool, ToolRegistry, ToolResult,
                                        count_failures, tool)
from agentrl_fast.harness.trajectory import (END_KINDS, SubTrace, Trajectory, TurnOutcome,
                                             apply_turn)

__all__ = [
    "END_KINDS", "FAILURE_KINDS", "SPECIAL_TOKENS", "STOP_MODES", "ChatFormat", "MemoryNamespace",
    "MemoryStore", "SandboxResult", "SubTrace", "Tool", "ToolCall", "ToolRegistry", "ToolResult",
    "Trajectory", "TurnOutcome", "apply_turn", "build_tokenizer", "count_failures",
    "parse_tool_calls", "python_tool", "render_messages", "run_sandboxed", "tool",
]
