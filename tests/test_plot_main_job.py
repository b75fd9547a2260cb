"""bench/plot_main_job.py draws the README's figure from the recorded main-job runs."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "plot_main_job.py"
RUNS = ROOT / "bench" / "results" / "main_job"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_draws_the_recorded_runs(tmp_path):
    assert sorted(RUNS.glob("ppo-seed*.jsonl")) and sorted(RUNS.glob("grpo-seed*.jsonl"))
    out = tmp_path / "fig" / "main_job.png"
    result = run("--runs", RUNS, "--out", out)
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a drawn figure, not an empty canvas
    assert "ppo" in result.stdout and "grpo" in result.stdout


def test_same_files_give_the_same_bytes_and_new_seeds_are_found(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(RUNS / "ppo-seed0.jsonl", runs / "ppo-seed0.jsonl")
    shutil.copy(RUNS / "ppo-seed0.jsonl", runs / "ppo-seed7.jsonl")
    (runs / "notes.txt").write_text("not a run file")
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    for out in (first, second):
        result = run("--runs", runs, "--out", out)
        assert result.returncode == 0, result.stderr
    assert "seeds 0, 7" in result.stdout
    assert first.read_bytes() == second.read_bytes()


def test_a_folder_without_run_files_fails_naming_it(tmp_path):
    empty = tmp_path / "no_runs_here"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("{}\n")
    result = run("--runs", empty, "--out", tmp_path / "x.png")
    assert result.returncode != 0
    assert str(empty) in result.stderr and "no run files" in result.stderr
    assert not (tmp_path / "x.png").exists()
    missing = tmp_path / "missing"
    result = run("--runs", missing, "--out", tmp_path / "x.png")
    assert result.returncode != 0 and str(missing) in result.stderr
