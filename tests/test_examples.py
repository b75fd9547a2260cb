"""The examples run as shipped (a child process, a scratch directory)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_train_tiny_example(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tiny.py"),
                             "--steps", "1", "--out", str(tmp_path / "out")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm-start:" in result.stdout
    for algo in ("ppo", "grpo"):
        assert f"{algo} step 1:" in result.stdout
        assert (tmp_path / "out" / algo / "policy" / "config.json").exists()
    assert (tmp_path / "out" / "ppo" / "critic" / "config.json").exists()
    # The exports load with plain transformers.
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "ppo" / "policy")
    AutoTokenizer.from_pretrained(tmp_path / "out" / "ppo" / "policy")
    AutoModelForTokenClassification.from_pretrained(tmp_path / "out" / "ppo" / "critic")
