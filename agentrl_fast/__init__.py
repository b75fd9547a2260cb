"""agentrl_fast: native kernels and a thin Python API for agentic reinforcement learning of LLMs.

``agentrl_fast.ops`` holds the ops (GAE over packed trajectories, ...); importing it loads the
native extension ``agentrl_fast._C``, which registers the C++/CUDA kernels under
``torch.ops.agentrl_fast``. Subpackages load on first use, so ``agentrl_fast.config`` stays
light (no torch).
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("config", "harness", "models", "ops", "train", "seeds")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"agentrl_fast.{name}")
    raise AttributeError(f"module 'agentrl_fast' has no attribute {name!r}")
