"""Draw the main job's figure: held-out success against RL step, PPO and GRPO, every seed.

    python bench/plot_main_job.py [--runs bench/results/main_job] [--out bench/results/main_job.png]

Reads every ``<algo>-seed<S>.jsonl`` in ``--runs`` (a run folder's ``metrics.jsonl`` of
``agentrl-fast train --seed S [--algo grpo]``, copied under that name) and draws one figure:

* large markers joined by dashed lines: greedy success on the held-out tasks (the
  ``kind: "eval"`` rows; step 0 is the warm-start, the last step the trained policy; nothing is
  measured in between), one colour per algorithm; each seed's warm-start is marked at step 0 and
  labelled on the left, each final value on the right;
* thin faint lines: the success of each RL step's rollouts on training tasks (the
  ``kind: "train"`` rows' ``success``, sampled at the rollout temperature), as a moving average
  over ``--smooth`` steps (1: the raw per-step values).

Seeds are found by glob, so adding ``ppo-seed3.jsonl`` and running the same command re-draws
the figure over the new seeds. The PNG carries no timestamp: the same files give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_FILE = re.compile(r"^(?P<algo>[A-Za-z0-9_]+)-seed(?P<seed>\d+)\.jsonl$")
ALGO_ORDER = ("ppo", "grpo")
COLOURS = {"ppo": "#1f5fa8", "grpo": "#d9730d"}
OTHER_COLOURS = ("#2a9d4b", "#8e44ad", "#b03a2e", "#555555")
LABEL_GAP = 0.04  # least vertical distance between two end labels, in success units


class RunsError(Exception):
    """Nothing to draw (no run files, or a file without the rows the figure needs)."""


def read_run(path: Path) -> dict:
    """The rows of one ``metrics.jsonl`` the figure needs."""
    evals, train, sft_steps = [], [], 0
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise RunsError(f"{path}:{number}: not a JSON line ({error})") from None
            kind = row.get("kind")
            if kind == "eval":
                evals.append((row["step"], row["success"]))
            elif kind == "train":
                train.append((row["step"], row["success"]))
            elif kind == "warmstart":
                sft_steps = max(sft_steps, row.get("sft_step", 0))
    if not evals:
        raise RunsError(f"{path}: no held-out evaluation rows (kind \"eval\")")
    evals.sort()
    if evals[0][0] != 0:
        raise RunsError(f"{path}: no evaluation at step 0 (the warm-start)")
    return {"eval": evals, "train": sorted(train), "sft_steps": sft_steps}


def find_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """``{algo: {seed: run}}`` of every ``<algo>-seed<S>.jsonl`` in ``folder``."""
    if not folder.is_dir():
        raise RunsError(f"{folder} is not a folder")
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(folder.iterdir()):
        match = RUN_FILE.match(path.name)
        if match and path.is_file():
            runs.setdefault(match["algo"].lower(), {})[int(match["seed"])] = read_run(path)
    if not runs:
        raise RunsError(f"no run files (<algo>-seed<S>.jsonl, e.g. ppo-seed0.jsonl) in {folder}")
    order = [a for a in ALGO_ORDER if a in runs] + sorted(a for a in runs if a not in ALGO_ORDER)
    return {algo: dict(sorted(runs[algo].items())) for algo in order}


def spread(positions: list[float], gap: float, low: float, high: float) -> list[float]:
    """``positions`` moved apart to at least ``gap`` (order kept), kept within [low, high]."""
    order = sorted(range(len(positions)), key=lambda i: positions[i])
    placed = [positions[i] for i in order]
    for k in range(1, len(placed)):
        placed[k] = max(placed[k], placed[k - 1] + gap)
    overflow = placed[-1] - high if placed else 0.0
    if overflow > 0:
        placed = [p - overflow for p in placed]
        for k in range(len(placed) - 2, -1, -1):
            placed[k] = min(placed[k], placed[k + 1] - gap)
    placed = [max(p, low) for p in placed]
    out = [0.0] * len(positions)
    for k, i in enumerate(order):
        out[i] = placed[k]
    return out


def seed_list(seeds) -> str:
    seeds = sorted(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}–{seeds[-1]}"
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(runs: dict[str, dict[int, dict]], out: Path, smooth: int = 10) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colours = dict(COLOURS)
    extra = iter(OTHER_COLOURS)
    for algo in runs:
        colours.setdefault(algo, next(extra, "#333333"))
    last_step = max(run["eval"][-1][0] for seeds in runs.values() for run in seeds.values())
    all_seeds = sorted({s for seeds in runs.values() for s in seeds})
    held_out = dict(linewidth=1.6, linestyle=(0, (5, 3)), marker="o", markersize=7)

    fig, ax = plt.subplots(figsize=(10, 5.9), dpi=120)
    handles = []
    for algo, seeds in runs.items():
        colour = colours[algo]
        for run in seeds.values():
            if run["train"]:
                steps, success = zip(*run["train"])
                ax.plot(steps, moving_average(list(success), smooth), color=colour,
                        linewidth=1.0, alpha=0.45, zorder=1)
            steps, success = zip(*run["eval"])
            ax.plot(steps, success, color=colour, zorder=3, **held_out)
        finals = [run["eval"][-1][1] for run in seeds.values()]
        starts = [run["eval"][0][1] for run in seeds.values()]
        mean_final, mean_start = sum(finals) / len(finals), sum(starts) / len(starts)
        handles.append(Line2D([], [], color=colour, **held_out,
                              label=f"{algo.upper()}, held out: greedy success on the held-out "
                                    f"tasks, warm-start → step {last_step} "
                                    f"(mean {mean_start:.3f} → {mean_final:.3f})"))
        average = f", {smooth}-step moving average" if smooth > 1 else ""
        handles.append(Line2D([], [], color=colour, linewidth=1.0, alpha=0.6,
                              label=f"{algo.upper()}, training: success of each step's rollouts "
                                    f"on training tasks (sampled{average})"))

    # Warm-starts: one per seed (every algorithm of a seed starts from the same policy).
    # A run started from another's saved warm-start (warmstart.load) logs no SFT steps.
    starts: dict[int, tuple[float, int]] = {}
    for seeds in runs.values():
        for seed, run in seeds.items():
            success, sft_steps = starts.get(seed, (run["eval"][0][1], 0))
            starts[seed] = (success, max(sft_steps, run["sft_steps"]))
    warm = dict(marker="D", markersize=9, markerfacecolor="white", markeredgecolor="black",
                markeredgewidth=1.6, linestyle="none")
    for seed, (success, _) in starts.items():
        ax.plot([0], [success], zorder=4, **warm)
    handles.append(Line2D([], [], **warm, label="warm-start of a seed (step 0, shared by its "
                                                 "PPO and GRPO runs; SFT steps it took)"))
    seeds_sorted = sorted(starts)
    left = spread([starts[s][0] for s in seeds_sorted], LABEL_GAP, 0.02, 0.98)
    label_x = -0.04 * last_step
    for seed, y in zip(seeds_sorted, left):
        success, sft_steps = starts[seed]
        ax.annotate(f"seed {seed}: {success:.3f}, {sft_steps} SFT steps", xy=(0, success),
                    xytext=(label_x, y), ha="right", va="center", fontsize=8,
                    arrowprops=dict(arrowstyle="-", color="0.5", linewidth=0.6,
                                    shrinkA=1, shrinkB=5))

    # Final held-out values, labelled on the right.
    ends = [(algo, seed, run["eval"][-1]) for algo, seeds in runs.items()
            for seed, run in seeds.items()]
    right = spread([e[2][1] for e in ends], LABEL_GAP, 0.02, 1.0)
    label_x = last_step * 1.04
    for (algo, seed, (step, success)), y in zip(ends, right):
        ax.annotate(f"{algo.upper()} seed {seed}: {success:.3f}", xy=(step, success),
                    xytext=(label_x, y), ha="left", va="center", fontsize=8,
                    color=colours[algo],
                    arrowprops=dict(arrowstyle="-", color="0.5", linewidth=0.6,
                                    shrinkA=1, shrinkB=5))

    ax.set_xlim(-0.36 * last_step, last_step * 1.27)
    ax.set_ylim(0.0, 1.02)
    ticks = list(range(0, last_step + 1, 10 if last_step <= 120 else 50))
    if ticks[-1] != last_step:
        ticks.append(last_step)
    ax.set_xticks(ticks)
    ax.set_yticks([i / 10 for i in range(11)])
    ax.grid(True, color="0.92", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.spines["bottom"].set_bounds(0, last_step)
    ax.set_xlabel("RL step")
    ax.set_ylabel("success (fraction of episodes that hand in every code)")
    ax.set_title(f"agentrl-fast train: success against RL step, "
                 f"{' and '.join(a.upper() for a in runs)}, {seed_list(all_seeds)}",
                 fontsize=11)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1,
              fontsize=8.5, frameon=False)
    fig.subplots_adjust(left=0.07, right=0.99, top=0.94, bottom=0.31)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None}, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Draw held-out success against RL step for PPO and GRPO over every seed "
                    "recorded in --runs (files <algo>-seed<S>.jsonl), with each step's training "
                    "success as faint lines and the warm-starts marked at step 0.")
    parser.add_argument("--runs", type=Path, default=ROOT / "bench" / "results" / "main_job",
                        help="folder of <algo>-seed<S>.jsonl run metrics "
                             "(default bench/results/main_job)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "main_job.png",
                        help="PNG to write (default bench/results/main_job.png)")
    parser.add_argument("--smooth", type=int, default=10,
                        help="moving-average window of the training success, in RL steps "
                             "(default 10; 1: the raw per-step values)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    try:
        runs = find_runs(args.runs)
    except RunsError as error:
        print(f"plot_main_job: {error}", file=sys.stderr)
        return 2
    plot(runs, args.out, smooth=args.smooth)
    found = ", ".join(f"{algo} {seed_list(seeds)}" for algo, seeds in runs.items())
    print(f"wrote {args.out} ({found})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
