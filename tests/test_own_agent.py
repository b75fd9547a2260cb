"""docs/own-agent.md as a user runs it: its files written into a temporary folder beside a Qwen3
checkpoint with the real vocabulary, then ``agentrl-fast train --config ...``, ``eval`` and the
export, from that folder — an environment given by ``env.factory`` from a module there, and the
built-in dataset tool environment warm-started from demonstrations its scripted policy wrote."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_vocab import EOS_TOKEN_ID, PAD_TOKEN_ID, tiny_qwen3_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "own-agent.md"


def doc_files() -> dict[str, str]:
    """The page's code blocks whose first line is ``# <file name>``."""
    files = {}
    for block in re.findall(r"```(?:python|yaml)\n(.*?)```", DOC.read_text(), re.S):
        first, _, rest = block.partition("\n")
        name = re.fullmatch(r"# (\S+\.(?:py|yaml))", first.strip())
        if name:
            files[name.group(1)] = block
    return files


@pytest.fixture(scope="module")
def folder(tmp_path_factory, qwen3_tokenizer):
    folder = tmp_path_factory.mktemp("user")
    for name, text in doc_files().items():
        (folder / name).write_text(text)
    for name in ("train.jsonl", "eval.jsonl"):
        shutil.copy(ROOT / "examples" / "calculator" / name, folder / name)
    tiny_qwen3_checkpoint(folder / "qwen3-tiny", tokenizer=qwen3_tokenizer)
    return folder


def agentrl_fast(folder: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The console script, run in the user's folder (no repository on its path)."""
    script = Path(sys.executable).parent / "agentrl-fast"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "agentrl_fast.cli"]
    return subprocess.run(command + list(args), cwd=folder, capture_output=True, text=True,
                          timeout=timeout)


def rows(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_the_page_has_the_files_a_user_writes():
    assert set(doc_files()) == {"tools.py", "reward.py", "make_demos.py", "calculator.yaml",
                                "my_env.py", "capitals.yaml"}


def test_your_environment_from_a_factory(folder):
    result = agentrl_fast(folder, "train", "--config", "capitals.yaml", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    run = folder / "runs" / "capitals"
    assert [r["step"] for r in rows(run, "train")] == [1]
    assert rows(run, "train")[0]["generated_tokens"] > 0
    # From another directory: the saved config's paths are absolute, its modules found in the
    # config's folder.
    evaluated = agentrl_fast(folder.parent, "eval", "--run-dir", str(run))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "| step-000000001 | 2 |" in evaluated.stdout
    from transformers import AutoConfig, AutoTokenizer
    exported = AutoConfig.from_pretrained(run / "export" / "policy")
    assert (exported.eos_token_id, exported.pad_token_id) == (EOS_TOKEN_ID, PAD_TOKEN_ID)
    assert exported.vocab_size == len(AutoTokenizer.from_pretrained(run / "export" / "policy"))


def test_the_dataset_environment_after_a_warm_start_from_demonstrations(folder):
    demos = subprocess.run([sys.executable, "make_demos.py"], cwd=folder, capture_output=True,
                           text=True, timeout=120)
    assert demos.returncode == 0, demos.stderr[-3000:]
    assert demos.stdout.strip() == "8 demos"
    result = agentrl_fast(folder, "train", "--config", "calculator.yaml", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    run = folder / "runs" / "calculator"
    losses = [r["sft_loss"] for r in rows(run, "warmstart") if "sft_loss" in r]
    assert losses[-1] < losses[0] / 3
    # Greedy after the warm-start, the model's own tokens parse as calls the tools answer.
    warm, *_ = rows(run, "eval")
    assert warm["tool_calls"] > 0 and warm["tool_error_rate"] < 1.0
    assert [r["step"] for r in rows(run, "train")] == [1]
