"""bench/tune_kernels.py's sweep is safe to run on a GPU that faults or computes wrong results:
every candidate is checked (outputs and gradients against a trusted result) in a child process
before it is timed; a candidate whose child crashes or hangs is reported and skipped, and the
sweep goes on in a new child; a wrong candidate is never timed nor chosen; a wrong default writes
no choice for its launch and says so (output, tune.md, exit status); the budget bounds the wall
time. On the CPU (``TRITON_INTERPRET=1``, the children and checks of the GPU run), the faults
injected through ``AGENTRL_FAST_TUNE_FAULTS`` (the script's docstring)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "tune_kernels.py"
sys.path.insert(0, str(ROOT / "bench"))

import tune_kernels  # (imports no torch at module level)


def sweep(out: Path, faults: str, *argv: str, timeout: float = 120):
    """``(process, rows, tuned configurations written)`` of a CPU sweep with ``faults``."""
    env = dict(os.environ, AGENTRL_FAST_TUNE_FAULTS=faults)
    env.pop("TRITON_INTERPRET", None)  # --device cpu sets it for itself and its children
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny",
                           "--out-dir", str(out), *argv], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    rows_path, tuned_path = out / "tune.jsonl", out / "tuned_configs.json"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] \
        if rows_path.exists() else []
    written = json.loads(tuned_path.read_text()).get("cpu (dry run)", {}) \
        if tuned_path.exists() else {}
    return proc, rows, written


def by_launch(rows: list[dict], launch: str) -> list[dict]:
    return [row for row in rows if row["provider"] == launch]


def test_crashing_hanging_and_wrong_candidates_are_skipped_and_the_sweep_goes_on(tmp_path):
    faults = ("crash:token_logprobs:block1024:1,wrong:token_logprobs:block1024:2,"
              "hang:token_logprobs:block1024:3,time-crash:token_logprobs:block4096:1")
    proc, rows, written = sweep(tmp_path, faults, "--only", "token_logprobs",
                                "--max-candidates", "5", "--candidate-timeout", "10",
                                "--workers", "2", "--budget", "100")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    first = by_launch(rows, "token_logprobs block1024")
    assert [r["verdict"] for r in first] == ["ok", "CRASH", "WRONG", "HANG", "ok"], log
    assert "dlogits" in first[2]["detail"] and first[2]["errors"]["dlogits"] > 0.5
    assert "exit 86" in first[1]["detail"] and "within 10 s" in first[3]["detail"]
    # after a crash, a wrong result and a hang, the next candidate was still checked and timed
    assert first[4]["time_ms"] > 0 and first[0]["time_ms"] > 0
    assert all(r["time_ms"] is None and r["ratio"] is None for r in first[1:4])
    second = by_launch(rows, "token_logprobs block4096")
    assert [r["verdict"] for r in second] == ["ok", "CRASH", "ok", "ok", "ok"], log
    assert second[1]["detail"].startswith("timing: exit 86")  # the timing child died on it
    assert all(r["time_ms"] > 0 for r in second if r["verdict"] == "ok")
    # choices: only among the candidates that passed
    assert written["token_logprobs"]["block1024"] in [json.loads(first[i]["shape"])
                                                      for i in (0, 4)]
    assert written["token_logprobs"]["block4096"] != json.loads(second[1]["shape"])
    lines = proc.stdout.splitlines()
    for index, verdict in ((1, "CRASH"), (2, "WRONG"), (3, "HANG")):
        assert any(line.startswith(f"check token_logprobs block1024 #{index} ")
                   and f": {verdict}" in line for line in lines), log
    table = (tmp_path / "tune.md").read_text()
    assert "| CRASH |" in table and "| WRONG |" in table and "| HANG |" in table


def test_a_wrong_default_writes_no_choice_and_says_so(tmp_path):
    """The H200's case: the backward's default computes a wrong gradient (here dv, doubled)."""
    launch = "varlen_attention_backward bf16_d64"
    proc, rows, written = sweep(tmp_path, "wrong:varlen_attention_backward:bf16_d64:0",
                                "--only", "varlen_attention_backward:bf16_d64",
                                "--max-candidates", "2", "--budget", "100")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    assert f"!!! {launch}: DEFAULT WRONG" in proc.stdout, log
    assert "dv " in proc.stdout.split("DEFAULT WRONG", 1)[1].splitlines()[0]
    assert "varlen_attention_backward" not in written
    table = (tmp_path / "tune.md").read_text()
    assert f"**{launch}: DEFAULT WRONG" in table
    mine = by_launch(rows, launch)
    assert [r["verdict"] for r in mine] == ["WRONG", "ok"], log
    # the right candidate is timed (for the record) but not chosen: nothing to compare with
    assert mine[1]["time_ms"] > 0 and mine[1]["ratio"] is None
    assert mine[0]["errors"]["dv"] > 0.5 and mine[0]["errors"]["dq"] < 0.05


def test_the_budget_bounds_the_wall_time_even_when_a_candidate_hangs(tmp_path):
    start = time.monotonic()
    proc, rows, written = sweep(tmp_path, "hang:token_logprobs:block1024:0",
                                "--only", "token_logprobs:block1024", "--max-candidates", "3",
                                "--candidate-timeout", "300", "--budget", "8")
    seconds = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert seconds < 8 + 20, log  # + the parent's imports; the hang alone would take 300 s
    assert proc.returncode == 1 and not written, log  # the default never finished: no choice
    assert [r["verdict"] for r in rows] == ["SKIPPED"] * 3, log
    assert "no choice for token_logprobs block1024: the default was not timed" in proc.stdout


def result(index, verdict, ms):
    return {"config": {"BLOCK": index}, "verdict": verdict, "ms": ms, "detail": ""}


def test_choose_takes_the_fastest_right_candidate_only():
    ok = [result(0, "ok", 10.0), result(1, "ok", 9.0)]
    # wrong, crashed or hung candidates are never chosen, however fast their time
    for verdict in ("WRONG", "CRASH", "HANG", "SKIPPED"):
        choice, _ = tune_kernels.choose(ok + [result(2, verdict, 1.0)])
        assert choice == {"BLOCK": 1}, verdict
    assert tune_kernels.choose([result(0, "ok", 10.0), result(1, "ok", 9.8)])[0] == {"BLOCK": 0}
    for verdict in ("WRONG", "CRASH", "HANG"):  # a failed default: no choice at all
        choice, why = tune_kernels.choose([result(0, verdict, None), result(1, "ok", 1.0)])
        assert choice is None and why.startswith(f"DEFAULT {verdict}")
    choice, why = tune_kernels.choose([result(0, "SKIPPED", None), result(1, "ok", 1.0)])
    assert choice is None and "not timed" in why


def test_checks_count_nan_and_large_errors_as_wrong():
    assert tune_kernels.failures({"dq": 0.049, "logp": 1e-5}) == []
    assert tune_kernels.failures({"dq": 0.051}) == ["dq 0.051 > 0.05"]
    assert tune_kernels.failures({"dlogits": float("nan")})
    assert tune_kernels.parse_faults("crash:token_logprobs:block1024:1, wrong:a:b:0") == {
        ("token_logprobs", "block1024", 1): "crash", ("a", "b", 0): "wrong"}
    with pytest.raises(ValueError):
        tune_kernels.parse_faults("explode:a:b:0")
