"""Loads the native extension, which registers ``torch.ops.agentrl_fast.*`` as a side effect."""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

try:
    from agentrl_fast import _C
except ImportError as error:  # pragma: no cover - only on a broken install
    raise ImportError(
        "agentrl_fast._C (the native extension) is missing or failed to load: "
        f"{error}. Build it against the installed torch with "
        "`pip install --no-build-isolation -e .` (see README.md)."
    ) from error

cuda_built: bool = bool(_C.cuda_built)
"""Whether the CUDA kernels were compiled into this build."""

cuda_arch_list: str = str(_C.cuda_arch_list)
"""The CUDA architectures compiled for (CMake's notation), empty without CUDA."""


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether ``torch.ops.agentrl_fast.<op>`` has a kernel for ``dispatch_key`` ("CPU", "CUDA")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"agentrl_fast::{op}", dispatch_key)
