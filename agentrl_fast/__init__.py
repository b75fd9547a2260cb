"""agentrl_fast: native kernels and a thin Python API for agentic reinforcement learning of LLMs.

``agentrl_fast.ops`` holds the ops (GAE over packed trajectories, ...); the native extension
``agentrl_fast._C`` registers the C++/CUDA kernels under ``torch.ops.agentrl_fast``.
"""

__version__ = "0.1.0"

from agentrl_fast import ops  # noqa: E402,F401  (registers the native ops)
