"""The main job over seeds: ``agentrl-fast train --seed S`` run alone, one after another, each
timed beside the machine's float32 matmul rate measured just before and after it (this VM's
speed varies by 10-15 % between runs); optionally the same seeds with GRPO from each PPO run's
saved warm-start (``warmstart.load``: the same policy, no second supervised phase).

Usage (from the repository root; about 5-10 minutes per seed on 2 cores)::

    python bench/main_job_seeds.py --seeds 0 1 2 3 4 [--algos ppo grpo] [--runs runs]
        [--results bench/results/main_job] [--set FIELD=VALUE ...]

For each run: the run folder ``RUNS/<algo>-seed<S>``; its ``metrics.jsonl`` copied to
``RESULTS/<algo>-seed<S>.jsonl`` (what ``bench/plot_main_job.py`` draws); one JSON line in
``RESULTS/runs.jsonl`` (seed, algo, SFT steps, warm-start and final held-out success, wall
seconds, matmul GFLOP/s before and after, commit, command). GRPO runs need the seed's PPO run
folder (its ``warmstart.pt``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)


def matmul_gflops(size: int = 1024) -> float:
    """float32 ``size``² matmul rate on this process's threads (median of 50 timings)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    ms = common.benchmark(lambda: a @ b, torch.device("cpu"), warmup=3, repeats=50)
    return 2 * size ** 3 / (ms * 1e-3) / 1e9


def summary(run_dir: Path) -> dict:
    """``summary.txt`` of a finished run folder, values parsed."""
    out = {}
    for line in (run_dir / "summary.txt").read_text().splitlines():
        key, _, value = line.partition(": ")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def sft_steps(metrics: Path) -> int:
    steps = [json.loads(line).get("sft_step", 0) for line in metrics.read_text().splitlines()
             if '"warmstart"' in line]
    return max(steps, default=0)


def run_one(seed: int, algo: str, runs: Path, results: Path, overrides: list[str]) -> dict:
    run_dir = runs / f"{algo}-seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = ["agentrl-fast", "train", "--seed", str(seed), "--run-dir", str(run_dir),
               "--no-progress"]
    if algo != "ppo":
        warm = runs / f"ppo-seed{seed}" / "warmstart.pt"
        command += ["--algo", algo, "--set", f"warmstart.load={warm}"]
    for item in overrides:
        command += ["--set", item]
    before = matmul_gflops()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "agentrl_fast.cli", *command[1:]], cwd=ROOT,
                   check=True, stdout=open(results / f"{algo}-seed{seed}.log", "w"),
                   stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    after = matmul_gflops()
    s = summary(run_dir)
    shutil.copy(run_dir / "metrics.jsonl", results / f"{algo}-seed{seed}.jsonl")
    row = {"seed": seed, "algo": algo, "sft_steps": sft_steps(run_dir / "metrics.jsonl"),
           "warmstart_success": s["warmstart_success"], "final_success": s["final_success"],
           "final_reward": s["final_reward"], "wall_seconds": round(wall, 1),
           "run_seconds": round(s["seconds"], 1), "matmul_gflops_before": round(before, 1),
           "matmul_gflops_after": round(after, 1), "threads": torch.get_num_threads(),
           "commit": common.git_commit(), "command": " ".join(command)}
    with open(results / "runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--algos", nargs="+", default=["ppo"], choices=["ppo", "grpo"])
    parser.add_argument("--runs", default="runs")
    parser.add_argument("--results", default="bench/results/main_job")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    args = parser.parse_args(argv)
    runs, results = ROOT / args.runs, ROOT / args.results
    runs.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    for algo in args.algos:  # every PPO run first: GRPO starts from their warm-starts
        for seed in args.seeds:
            run_one(seed, algo, runs, results, args.set)
    return 0


if __name__ == "__main__":
    sys.exit(main())
