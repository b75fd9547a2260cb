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


@pytest.mark.slow
def test_bench_learning_runs(tmp_path):
    """The learning study (bench/bench_learning.py) at toy size: warm-start, pass@k, two
    variants with an evaluation each, one JSON line per record."""
    out = tmp_path / "learning.jsonl"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_learning.py"),
                             "--steps", "1", "--eval-every", "1", "--eval-tasks", "4",
                             "--demos", "10", "--warmstart-steps", "3", "--pass-k", "2",
                             "--variant", "", "--variant", "train.algo=grpo",
                             "--out", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm-start (10 demos, 3 steps" in result.stdout and "pass@2" in result.stdout
    import json
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["warmstart", "train", "eval", "train", "eval"]
    assert {r["variant"] for r in rows[1:]} == {"", "train.algo=grpo"}
