"""Triton kernels: compiled ahead of time for sm_90 under every triton at hand, and run on the
CPU by the interpreter in child processes.

- AOT: ``tests/triton_aot.py --sample`` compiles every configuration of
  ``agentrl_fast/kernels/*.py`` (``aot_specs()``; of the prefix-shared kernels, their sample)
  for sm_90 with no GPU, with the launch hints a GPU launch gets, and fails on compile errors,
  spills its spec does not allow, or shared memory over the sm_90 limit; the hot attention
  forwards must not spill and, in bf16, must use wgmma. It runs under this process's triton and
  under triton 3.6, the GPU machine's version, in the side environment ``triton36`` without
  torch (``tools/setup_test_env.sh``). Its parsing and rules: ``tests/test_triton_aot.py``.
- Interpreter: the tests in ``tests/interpret/`` run kernels with ``TRITON_INTERPRET=1``, which
  triton reads when a kernel is defined, so they run in their own pytest process, one per file.

Each test is one child process, started when the session starts at low priority and collected at
the end of the run (``tests/background.py``).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from background import Command
from side_envs import find_side_env, side_env_python

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TRITONS = ["installed", "triton36"]  # this process's triton; the side environment's
HOT = [f"varlen_attention{mode}_forward_{dtype}_d{head_dim}" for mode in ("", "_prefix")
       for dtype in ("bf16", "fp16") for head_dim in (64, 128)]  # plain and prefix-shared
INTERPRET_FILES = sorted(p.name for p in (TESTS / "interpret").glob("test_*.py"))


def _shipped_kernel_modules():
    return [p for p in (ROOT / "agentrl_fast" / "kernels").glob("*.py") if "def aot_specs" in p.read_text()]


def _aot_command(python) -> Command:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return Command([str(python), str(TESTS / "triton_aot.py"), "--sample"], cwd=str(ROOT),
                   env=env, timeout=600)


def _interpreter_command(test_file: str) -> Command:
    return Command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(TESTS / "interpret" / test_file)], cwd=str(ROOT),
                   env=dict(os.environ, TRITON_INTERPRET="1"), timeout=900)


def background_command(params: dict) -> Command | None:
    """Each test here is one child process, started in the background (tests/background.py)."""
    if "test_file" in params:
        return _interpreter_command(params["test_file"])
    if params["triton"] == "installed":
        return _aot_command(sys.executable)
    python, _ = find_side_env(params["triton"])  # missing: the test skips or fails itself
    return None if python is None else _aot_command(python)


@pytest.mark.slow  # minutes on a 2-core machine: every configuration (sampled), twice
@pytest.mark.parametrize("triton", TRITONS)
def test_every_kernel_configuration_compiles_for_sm90_without_spills(triton, background_result):
    python = sys.executable if triton == "installed" else side_env_python(triton)
    result = background_result(_aot_command(python))
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1].get("summary"), result.stderr[-4000:]
    summary = lines[-1]
    failed = [row for row in lines[:-1] if not row["ok"]]
    assert result.returncode == 0 and not failed, json.dumps(failed, indent=1)[-6000:]
    # Every module that ships kernels contributes configurations.
    if _shipped_kernel_modules():
        assert summary["configurations"] > 0
    # The hot attention forwards (bf16/fp16 at D = 64 and 128) do not spill, load K/V
    # asynchronously (the software pipeline the launch hints allow), and the bf16 ones use wgmma,
    # Hopper's matrix path.
    rows = {row["name"]: row for row in lines[:-1]}
    assert set(HOT) <= set(rows), sorted(set(HOT) - set(rows))
    for name in HOT:
        row = rows[name]
        assert row["ok"] and row["ptxas_ok"], json.dumps(row)[-3000:]
        assert row["spill_bytes"] == 0, f"{name} spills {row['spill_bytes']} bytes ({row['triton']})"
        assert row["cp_async"] + row["tma"] > 0, f"{name}: no cp.async/TMA ({row['triton']})"
        if "_bf16_" in name:
            assert row["wgmma"], f"{name}: no wgmma in the PTX under triton {row['triton']}"


@pytest.mark.parametrize("test_file", INTERPRET_FILES)
def test_interpreter_suite(test_file, background_result):
    result = background_result(_interpreter_command(test_file))
    assert result.returncode == 0, (result.stdout[-6000:] + result.stderr[-2000:])
