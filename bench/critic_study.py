"""Issue 46's critic study: where PPO with a critic pays against GRPO, on the main job's vault
task and on the long-horizon variant, at 32 sampled rollouts per RL step in every cell.

    python bench/critic_study.py --seeds 0 1 2                  # the study (report seeds)
    python bench/critic_study.py --seeds 5 6 7 8 9 --work runs/critic_tune \
        --out tmp/critic_tune                                  # tuning seeds, not committed
    python bench/critic_study.py --seeds 0 --cells grpo --tasks long   # a part of it
    python bench/critic_study.py --quick --seeds 0 --cells ppo  # smoke run (tiny settings)
    python bench/critic_study.py --report-only                  # redraw the table and figure
    python bench/critic_study.py --tasks long & python bench/critic_study.py --tasks default
                                                               # two parts side by side

Cells (``CELLS``): GRPO 8 tasks x 4 samples; PPO 8 x 4 with lambda 1; PPO 8 x 4 with the
length-adaptive lambda at alpha 0.05 (VAPO) and 1.5 (CompactionRL); PPO 32 x 1 with the
adaptive lambda (``--alpha``) and ``--critic-warmup`` critic pre-training steps. The adaptive
cells keep the critic's lambda at 1 (``train.critic_lam``). Tasks: ``default``
(``configs/default.yaml``) and ``long`` (``configs/long_horizon.yaml``).

Per task and seed one supervised warm-start (``WORK/<task>/warmstart/seed-<s>/warmstart.pt``,
the library's own ``expert_demonstrations`` and ``warm_start``, as ``train_run`` does it)
that every cell of that seed loads (``warmstart.load``): the cells differ only in RL. Each
cell is one ``train_run`` in ``WORK/<task>/<cell>/seed-<s>/`` with periodic greedy evaluation
(``eval.every``). Resumable: a run whose row is in ``bench/results/critic_study.jsonl`` is
skipped; a run folder with checkpoints is resumed (``train_run(resume=True)``); one without is
started over; a finished run folder whose row is missing gives its row. Each row (the
warm-start and final held-out success, the eval curve, sampled tokens per step, wall time) is
appended as its run finishes, and the record ``bench/results/critic_study.md`` and the figure
``bench/results/critic_study.png`` (``--out``) are redrawn from all rows of the current setting.

Wall time of a resumed run: the time its earlier attempts spent up to their last checkpoint
plus its last attempt's (``summary.txt`` ``seconds``). ``--quick`` rows are marked and dropped
from the rows file by the first full-setting row. A work folder holds one setting (steps,
``--set`` overrides, ...: ``WORK/setting.json``); another setting needs another ``--work``.
``--seeds 0 1 2`` takes about 4 h on 2 CPU cores (estimated in ``critic_study.md``).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's agentrl_fast; bench/ is first already

import torch  # noqa: E402
import yaml  # noqa: E402

from common import RESULTS, git_commit, write_record  # noqa: E402
from main_job_seeds import summary as read_summary  # noqa: E402
from plot_main_job import seed_list  # noqa: E402

from agentrl_fast.config import apply_overrides, load_config  # noqa: E402
from agentrl_fast.train.metrics_log import MetricsLogger  # noqa: E402
from agentrl_fast.train.run import (build, expert_demonstrations, train_run,  # noqa: E402
                                    warm_start)

TASKS = {"default": "configs/default.yaml", "long": "configs/long_horizon.yaml"}
ROLLOUTS_PER_STEP = 32  # every cell: tasks per step x samples per task
CELLS = {  # name: (label, overrides); "{alpha}" and "{warmup}" come from the arguments
    "grpo": ("GRPO 8x4", ["train.algo=grpo"]),
    "ppo": ("PPO 8x4, lam 1", ["train.algo=ppo", "train.lam=1.0", "train.lam_alpha=null",
                               "train.critic_lam=null"]),
    "ppo-a0.05": ("PPO 8x4, alpha 0.05", ["train.algo=ppo", "train.lam_alpha=0.05",
                                          "train.critic_lam=1.0"]),
    "ppo-a1.5": ("PPO 8x4, alpha 1.5", ["train.algo=ppo", "train.lam_alpha=1.5",
                                        "train.critic_lam=1.0"]),
    "ppo-32x1": ("PPO 32x1, alpha {alpha}, {warmup} critic pre-training steps",
                 ["train.algo=ppo", "train.tasks_per_step=32",
                  "train.rollout.samples_per_task=1", "train.lam_alpha={alpha}",
                  "train.critic_lam=1.0", "train.critic_warmup_steps={warmup}"]),
}
QUICK = dict(steps=2, eval_every=1, critic_warmup=2,  # a smoke run: minutes, not the study
             sets=["warmstart.demos=256", "warmstart.steps=120", "warmstart.target_success=null",
                   "eval.tasks=16", "eval.every_tasks=8"])
SMOKE = "Summary: a smoke run of the harness"
AUTO = "written by the script until a person reads the runs and rewrites it"


def setting_of(args) -> dict:
    """What makes runs comparable: rows and run folders of another setting are not reused."""
    return {"steps": args.steps, "eval_every": args.eval_every, "alpha": args.alpha,
            "critic_warmup": args.critic_warmup, "sets": args.set, "quick": args.quick}


def cell_overrides(cell: str, setting: dict) -> list[str]:
    return [item.format(alpha=setting["alpha"], warmup=setting["critic_warmup"])
            for item in CELLS[cell][1]]


def run_config(task: str, seed: int, run_dir: Path, overrides: list[str]):
    """The task's YAML with the setting's and the cell's overrides (later ones win)."""
    config = load_config(ROOT / TASKS[task])
    return apply_overrides(config, [f"seed={seed}", f"run_dir={run_dir}", *overrides])


def ensure_warmstart(task: str, seed: int, work: Path, setting: dict) -> dict:
    """The seed's shared warm-start (made once, as ``train_run`` makes it); its facts."""
    folder = work / task / "warmstart" / f"seed-{seed}"
    weights, facts = folder / "warmstart.pt", folder / "warmstart.json"
    if weights.exists():
        return json.loads(facts.read_text())
    shutil.rmtree(folder, ignore_errors=True)  # an interrupted warm-start is redone whole
    config = run_config(task, seed, folder, setting["sets"])
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    environment, chat, policy = build(config)
    demos = expert_demonstrations(config, chat, environment)
    with MetricsLogger(folder) as log:
        losses, checks = warm_start(config, policy, chat, environment, demos,
                                    log=lambda m: log.write("warmstart", m["sft_step"], m))
    done = {"sft_steps": len(losses), "demos": len(demos),
            "last_check": checks[-1]["check_success"] if checks else None,
            "seconds": round(time.perf_counter() - start, 1)}
    facts.write_text(json.dumps(done))
    torch.save(policy.state_dict(), folder / "warmstart.tmp")
    (folder / "warmstart.tmp").rename(weights)  # last: its presence means the rest is there
    print(f"[{task} seed {seed}] warm-start: {done}", flush=True)
    return done


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*"))


def kept_seconds(run_dir: Path, started: float) -> float:
    """An interrupted attempt's time up to its last checkpoint (what the resume keeps)."""
    last = checkpoints(run_dir)[-1]
    return max(0.0, max(p.stat().st_mtime for p in last.rglob("*")) - started)


def train_cell(task: str, cell: str, seed: int, run_dir: Path, overrides: list[str]) -> None:
    """One cell's run: resumed from its checkpoints, or started over; attempts timed."""
    attempts = run_dir / "attempts.jsonl"
    resume = bool(checkpoints(run_dir))
    if resume:
        last = json.loads(attempts.read_text().splitlines()[-1])
        with attempts.open("a") as f:
            f.write(json.dumps({**last, "kept": kept_seconds(run_dir, last["start"])}) + "\n")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
    with attempts.open("a") as f:
        f.write(json.dumps({"start": time.time()}) + "\n")
    print(f"[{task} {cell} seed {seed}] {'resuming' if resume else 'starting'} in {run_dir}",
          flush=True)
    train_run(run_config(task, seed, run_dir, overrides), progress=False, resume=resume,
              print_fn=lambda text: print(f"[{task} {cell} seed {seed}] {text}", flush=True))


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def make_row(task: str, cell: str, seed: int, run_dir: Path, setting: dict,
             warm: dict) -> dict:
    """A finished run's summary row: success, curve, tokens, wall time."""
    s, rows = read_summary(run_dir), metrics_rows(run_dir)
    train_config = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    rollouts = train_config["tasks_per_step"] * train_config["rollout"]["samples_per_task"]
    train = [r for r in rows if r["kind"] == "train"]
    warmup = [r for r in rows if r["kind"] == "critic_warmup"]
    curve = sorted((r["step"], r["success"], r.get("eval_tasks", s["eval_tasks"]))
                   for r in rows if r["kind"] == "eval")
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text()
                .splitlines()]
    earlier = sum(a.get("kept", 0.0) for a in attempts if "kept" in a)
    return {"task": task, "cell": cell, "seed": seed, "setting": setting,
            "warmstart_success": s["warmstart_success"], "final_success": s["final_success"],
            "final_reward": s["final_reward"], "curve": curve, "steps": s["steps"],
            "rollouts_per_step": rollouts,
            "sampled_tokens_per_step": mean(r["generated_tokens"] * rollouts for r in train),
            "context_tokens_per_step": mean(r["tokens"] * rollouts for r in train),
            "sub_traces_per_rollout": mean(r["sub_traces"] for r in train),
            "critic_warmup_steps": len(warmup),
            "critic_warmup_sampled_tokens": sum(r["generated_tokens"] * rollouts
                                                for r in warmup),
            "wall_seconds": round(earlier + s["seconds"], 1),
            "periodic_eval_seconds": round(s.get("periodic_eval_seconds", 0.0), 1),
            "attempts": sum(1 for a in attempts if "kept" not in a),
            "warmstart_sft_steps": warm["sft_steps"], "warmstart_seconds": warm["seconds"],
            "threads": torch.get_num_threads(), "commit": git_commit(),
            "date": datetime.date.today().isoformat()}


def load_rows(out: Path) -> list[dict]:
    path = out.with_suffix(".jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def append_row(row: dict, out: Path) -> None:
    """Append ``row``; a full-setting row drops the smoke rows first."""
    rows = load_rows(out)
    if not row["setting"]["quick"] and any(r["setting"]["quick"] for r in rows):
        rows = [r for r in rows if not r["setting"]["quick"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [row]))


def run_all(args, setting: dict) -> None:
    work = ROOT / args.work
    guard = work / "setting.json"
    if guard.exists() and json.loads(guard.read_text()) != setting:
        sys.exit(f"critic_study: {work} holds runs of another setting "
                 f"({guard.read_text().strip()}); give another --work")
    work.mkdir(parents=True, exist_ok=True)
    guard.write_text(json.dumps(setting))
    done = {(r["task"], r["cell"], r["seed"]) for r in load_rows(args.out)
            if r["setting"] == setting}
    common = setting["sets"] + [f"train.steps={args.steps}", f"eval.every={args.eval_every}"]
    for task in args.tasks:
        for seed in args.seeds:
            for cell in args.cells:
                if (task, cell, seed) in done:
                    continue
                warm = ensure_warmstart(task, seed, work, setting)
                run_dir = work / task / cell / f"seed-{seed}"
                weights = work / task / "warmstart" / f"seed-{seed}" / "warmstart.pt"
                overrides = common + [f"warmstart.load={weights}",
                                      *cell_overrides(cell, setting)]
                if not (run_dir / "summary.txt").exists():
                    train_cell(task, cell, seed, run_dir, overrides)
                row = make_row(task, cell, seed, run_dir, setting, warm)
                lock_path = ROOT / "runs" / f".{args.out.name}.lock"  # (git ignores runs/)
                with open(lock_path, "w") as lock:  # parts may run side by side
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    append_row(row, args.out)
                    report(setting, args.out, args.command)


def spread(values: list[float]) -> str:
    """Mean ± sample standard deviation (min-max), or the value alone."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return (f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} "
            f"({min(values):.3f}-{max(values):.3f})")


def grouped(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """``{(task, cell): rows}`` in TASKS and CELLS order."""
    out = {}
    for task in TASKS:
        for cell in CELLS:
            mine = sorted((r for r in rows if (r["task"], r["cell"]) == (task, cell)),
                          key=lambda r: r["seed"])
            if mine:
                out[(task, cell)] = mine
    return out


def label(cell: str, setting: dict) -> str:
    return CELLS[cell][0].format(alpha=setting["alpha"], warmup=setting["critic_warmup"])


def table(groups, setting: dict) -> list[str]:
    lines = ["| task | cell | seeds | warm-start | final held out: mean ± sd (min-max) | gain | "
             "curve mean (steps > 0) | first step >= 0.9 | "
             "sampled tokens / step | context tokens / step | sub-traces / rollout | "
             "critic pre-training sampled tokens | run wall s (mean) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (task, cell), rows in groups.items():
        final = [r["final_success"] for r in rows]
        warm = [r["warmstart_success"] for r in rows]
        lines.append(
            f"| {task} | {label(cell, setting)} | {seed_list(r['seed'] for r in rows)} | "
            f"{statistics.fmean(warm):.3f} | {spread(final)} | "
            f"{statistics.fmean(final) - statistics.fmean(warm):+.3f} | "
            f"{statistics.fmean(curve_mean(r) for r in rows):.3f} | "
            f"{first_reaching(rows, 0.9)} | "
            f"{statistics.fmean(r['sampled_tokens_per_step'] for r in rows):.0f} | "
            f"{statistics.fmean(r['context_tokens_per_step'] for r in rows):.0f} | "
            f"{statistics.fmean(r['sub_traces_per_rollout'] for r in rows):.1f} | "
            f"{statistics.fmean(r['critic_warmup_sampled_tokens'] for r in rows):.0f} | "
            f"{statistics.fmean(r['wall_seconds'] for r in rows):.0f} |")
    return lines


def curve_mean(row: dict) -> float:
    """The mean held-out success over a run's periodic evaluations after step 0 (how fast it
    learns, not only where it ends)."""
    return statistics.fmean(p[1] for p in row["curve"] if p[0] > 0)


def first_reaching(rows: list[dict], level: float) -> str:
    """Per seed, the first evaluated step whose held-out success is at least ``level`` (``-``:
    never)."""
    firsts = [next((str(p[0]) for p in sorted(r["curve"]) if p[1] >= level), "-") for r in rows]
    return " / ".join(firsts)


def seed_table(groups, setting: dict) -> list[str]:
    """Each seed's final held-out success (and curve mean) per cell: the cells of one task
    share each seed's warm-start, so a column compares them paired."""
    seeds = sorted({r["seed"] for rows in groups.values() for r in rows})
    lines = ["| task | cell | " + " | ".join(f"seed {s}: final (curve mean)" for s in seeds)
             + " |", "| --- | --- | " + " | ".join("---" for _ in seeds) + " |"]
    for (task, cell), rows in groups.items():
        by_seed = {r["seed"]: r for r in rows}
        cells = [f"{by_seed[s]['final_success']:.3f} ({curve_mean(by_seed[s]):.3f})"
                 if s in by_seed else "" for s in seeds]
        lines.append(f"| {task} | {label(cell, setting)} | " + " | ".join(cells) + " |")
    return lines


def curve_stats(rows: list[dict]) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) of held-out success over seeds at the steps every seed has."""
    steps = sorted(set.intersection(*({p[0] for p in r["curve"]} for r in rows)))
    out = []
    for step in steps:
        values = [next(p[1] for p in r["curve"] if p[0] == step) for r in rows]
        out.append((step, statistics.fmean(values), min(values), max(values)))
    return out


def curve_table(groups, setting: dict) -> list[str]:
    lines = ["| task | cell | held-out success at RL step: mean over seeds |",
             "| --- | --- | --- |"]
    for (task, cell), rows in groups.items():
        points = " · ".join(f"{step}: {m:.2f}" for step, m, _, _ in curve_stats(rows))
        lines.append(f"| {task} | {label(cell, setting)} | {points} |")
    return lines


def plot(groups, setting: dict, path: Path) -> None:
    """One panel per task: each cell's mean held-out success against RL step, min-max band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    tasks = [t for t in TASKS if any(k[0] == t for k in groups)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.2 * len(tasks), 4.8), dpi=110,
                             squeeze=False)
    colours = dict(zip(CELLS, ("#d9730d", "#1f5fa8", "#2a9d4b", "#8e44ad", "#b03a2e")))
    handles = {}
    for ax, task in zip(axes[0], tasks):
        for (t, cell), rows in groups.items():
            if t != task:
                continue
            steps, means, lows, highs = zip(*curve_stats(rows))
            handles[cell], = ax.plot(steps, means, "o-", color=colours[cell], markersize=4,
                                     label=label(cell, setting))
            ax.fill_between(steps, lows, highs, color=colours[cell], alpha=0.15, linewidth=0)
        seeds = seed_list({r["seed"] for (t, _), rows in groups.items() if t == task
                           for r in rows})
        ax.set_title(f"{task} task ({TASKS[task]}), {seeds}", fontsize=10)
        ax.set_xlabel("RL step (0: the shared warm-start)")
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, color="0.92")
    axes[0][0].set_ylabel("held-out greedy success (mean, min-max band)")
    fig.legend(handles=list(handles.values()), loc="lower center", ncol=3, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def report(setting: dict, out: Path, command: str | None = None) -> None:
    """Rewrite the record and the figure (``out`` .md, .png) from the rows of ``setting``."""
    rows = [r for r in load_rows(out) if r["setting"] == setting]
    groups = grouped(rows)
    if groups:
        plot(groups, setting, out.with_suffix(".png"))
    quick, record = setting["quick"], out.with_suffix(".md")
    kept = record.read_text() if record.exists() else ""
    summary = []  # a person's summary of the same kind (smoke or study) is kept
    if "Summary:" not in kept or AUTO in kept or (SMOKE in kept) != quick:
        summary = [f"{SMOKE} (runs: {len(rows)}, with the --quick settings below), not the "
                   f"study: its numbers say nothing about PPO against GRPO; {AUTO}."
                   if quick else
                   f"Summary: the study in progress, runs: {len(rows)}; the tables below are "
                   f"computed from them; {AUTO}."]
    warm_s = [r["warmstart_seconds"] for r in rows]
    lines = ["# The critic study: PPO with a critic against GRPO, default and long-horizon "
             "vault tasks (issue 46)", *(["", *summary] if summary else []), "",
             f"Setting: {json.dumps(setting)}; {ROLLOUTS_PER_STEP} sampled rollouts per RL "
             "step in every cell; held-out greedy success on `eval.tasks` tasks at step 0 "
             "(the shared warm-start) and at the end, on the first `eval.every_tasks` of them "
             "every `eval.every` steps. The study: `python bench/critic_study.py --seeds 0 1 "
             "2` (tuning: seeds 5-9 with `--work runs/critic_tune --out tmp/critic_tune`).",
             "", f"![held-out success against RL step]({out.name}.png)" if groups else
             "No runs recorded: no figure yet.", "", "## Results", ""]
    if groups:
        lines += [*table(groups, setting), "", *seed_table(groups, setting), "",
                  *curve_table(groups, setting), "",
                  f"Warm-starts (one per task and seed, shared by its cells): "
                  f"{statistics.fmean(warm_s):.0f} s mean. Run wall time: the RL phase, the "
                  "critic pre-training, the step-0, periodic and final evaluations. Sampled "
                  "tokens: the policy's generated tokens; context tokens: every sub-trace's "
                  "tokens (prompts and tool results included)."]
    write_record(record, "\n".join(lines), command)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default 100)")
    parser.add_argument("--eval-every", type=int, default=None, help="default 10")
    parser.add_argument("--alpha", type=float, default=1.5,
                        help="the 32x1 cell's lam_alpha (default 1.5, CompactionRL's)")
    parser.add_argument("--critic-warmup", type=int, default=None,
                        help="the 32x1 cell's critic pre-training steps (default 20)")
    parser.add_argument("--work", default=None,
                        help="run folders (default runs/critic_study, --quick runs/critic_quick)")
    parser.add_argument("--out", default="critic_study",
                        help="rows, record and figure: bench/results/OUT.jsonl, .md, .png "
                             "(tuning: tmp/critic_tune, a folder git ignores)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="an override for every run, after the setting's")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny settings")
    parser.add_argument("--report-only", action="store_true",
                        help="redraw the record and figure from the rows; run nothing")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else dict(steps=100, eval_every=10, critic_warmup=20, sets=[])
    args.steps = args.steps or base["steps"]
    args.eval_every = args.eval_every or base["eval_every"]
    args.critic_warmup = base["critic_warmup"] if args.critic_warmup is None \
        else args.critic_warmup
    args.set = base["sets"] + args.set
    args.work = args.work or ("runs/critic_quick" if args.quick else "runs/critic_study")
    args.out = RESULTS / args.out
    args.command = " ".join(["python", "bench/critic_study.py",  # what the runs were made by
                             *(a for a in (argv or sys.argv[1:]) if a != "--report-only")])
    setting = setting_of(args)
    if not args.report_only:
        run_all(args, setting)
    report(setting, args.out, args.command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
