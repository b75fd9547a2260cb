"""Triton kernels: compiled ahead of time for sm_90 under every triton at hand, and run on the
CPU by the interpreter in child processes.

- AOT: ``tests/triton_aot.py`` compiles every configuration of ``kernels/*.py`` (``aot_specs()``)
  for sm_90 with no GPU and fails on compile errors or register spills. It runs under this
  process's triton and under each Python listed in ``AGENTRL_FAST_TRITON_PYTHONS`` (CI sets one
  with triton 3.6, the GPU machine's version, in a side environment without torch).
- Interpreter: the tests in ``tests/interpret/`` run kernels with ``TRITON_INTERPRET=1``, which
  triton reads when a kernel is defined, so they run in their own pytest process, one per file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PYTHONS = [sys.executable] + [p for p in os.environ.get("AGENTRL_FAST_TRITON_PYTHONS", "").split(os.pathsep) if p]
INTERPRET_FILES = sorted(p.name for p in (TESTS / "interpret").glob("test_*.py"))


def _shipped_kernel_modules():
    return [p for p in (ROOT / "kernels").glob("*.py") if "def aot_specs" in p.read_text()]


@pytest.mark.slow  # minutes on a 2-core machine: every configuration of every kernel, twice
@pytest.mark.parametrize("python", PYTHONS)
def test_every_kernel_configuration_compiles_for_sm90_without_spills(python):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([python, str(TESTS / "triton_aot.py")], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env=env)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1].get("summary"), result.stderr[-4000:]
    summary = lines[-1]
    failed = [row for row in lines[:-1] if not row["ok"]]
    assert result.returncode == 0 and not failed, json.dumps(failed, indent=1)[-6000:]
    # Every module that ships kernels contributes configurations.
    if _shipped_kernel_modules():
        assert summary["configurations"] > 0


@pytest.mark.parametrize("test_file", INTERPRET_FILES)
def test_interpreter_suite(test_file):
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(TESTS / "interpret" / test_file)],
                            capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, (result.stdout[-6000:] + result.stderr[-2000:])
