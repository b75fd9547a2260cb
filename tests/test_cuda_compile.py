"""The CUDA kernels compile for sm_90 (H100/H200) without a GPU, with no register spills.

A kernel that only ever compiled inside the extension build could spill silently; this reads
ptxas's resource report for every kernel instantiation."""

import os
import re
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from background import Command

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _nvcc_command(source: str) -> Command:
    torch_include = Path(torch.__file__).parent / "include"
    return Command([
        NVCC, "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90", "--resource-usage",
        "-DAGENTRL_FAST_WITH_CUDA", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{ROOT / 'csrc'}", f"-I{torch_include}", f"-I{torch_include / 'torch/csrc/api/include'}",
        f"-I{sysconfig.get_paths()['include']}", "-c", str(ROOT / "csrc" / source),
        "-o", os.devnull,  # only the resource report is read
    ], cwd=str(ROOT), timeout=300)


def background_command(params: dict) -> Command | None:
    """nvcc runs in the background from the session's start (tests/background.py)."""
    return None if NVCC is None else _nvcc_command(params["source"])


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("source", sorted(p.name for p in (ROOT / "csrc").glob("*.cu")))
def test_cuda_source_compiles_for_sm90_without_spills(source, background_result):
    result = background_result(_nvcc_command(source))
    assert result.returncode == 0, result.stderr[-4000:]
    report = result.stdout + result.stderr
    kernels = re.findall(r"Function properties for (\S+)", report)
    assert kernels, "ptxas printed no resource report"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report[-4000:]
