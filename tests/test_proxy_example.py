"""examples/train_openai_agent.py runs as shipped (a child process, a scratch directory, a tiny
step count): an OpenAI-SDK agent, and an OpenAI Agents SDK agent on the Responses API, trained
through the proxy, the trainer's recomputed log-probs equal to the recorded ones."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("harness", ["openai", "agents-sdk"])
def test_train_openai_agent_example(tmp_path, harness):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_openai_agent.py"),
                             "--steps", "2", "--demos", "8", "--warmstart-steps", "30",
                             "--tasks-per-step", "2", "--samples", "2", "--harness", harness],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm-start:" in result.stdout and "proxy on http://127.0.0.1:" in result.stdout
    steps = re.findall(r"ppo step (\d+): .* mismatch (\S+)", result.stdout)
    assert [int(s) for s, _ in steps] == [1, 2], result.stdout
    assert all(float(m) < 1e-4 for _, m in steps), result.stdout  # token in, token out
