"""Write, or check, ``bench/results/README.md``: the index of the recorded results, made from them.

    python bench/results_index.py            # rewrite bench/results/README.md
    python bench/results_index.py --check    # exit 1 and say what differs when it is stale

Every file under ``bench/results/`` is listed, under the record that describes it. A record is a
``*.md`` file; its header (the lines before its first ``## `` heading or table) carries its own
headline::

    # Title: what it is

    Summary: a short paragraph, the headline the index repeats.

    Command: `the command that produced it`
    Date 2026-12-02, commit abc1234. ...

A ``Command ...:`` line (or one ending ``Regenerate with:``) with nothing after the colon takes
the next code line (indented or fenced). The date and the commit are the first of each in the
header outside the summary. A record owns the ``.jsonl`` of the same name beside it and the
files ``GROUPS`` assigns to it; a ``.jsonl`` of rows adds a line computed from its rows (the
newest rows' date, commit and largest ratio per op; per algorithm, the runs' mean success).
A file no record owns, a record without title, summary, command, date or commit, or a summary
that does not state the mean its runs give, is an error. Standard library only (no torch).
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
INDEX_NAME = "README.md"
FIRST = "main_job.md"  # the record listed first


class Group(NamedTuple):
    """Files without a header of their own, and the record that owns them."""
    pattern: str  # a glob relative to bench/results
    record: str
    what: str
    command: str  # Markdown


GROUPS = [
    Group("main_job.png", "main_job.md",
          "the figure: held-out success against RL step, PPO and GRPO, every seed",
          "`python bench/plot_main_job.py`"),
    Group("main_job/ppo-seed*.jsonl", "main_job.md",
          ("each PPO run's `metrics.jsonl` (warm-start, train and eval rows): what the figure "
           "draws"),
          "`python bench/main_job_seeds.py --seeds 0 1 2 3 4`"),
    Group("main_job/grpo-seed*.jsonl", "main_job.md",
          "each GRPO run's `metrics.jsonl`, from the PPO run's saved warm-start",
          "`python bench/main_job_seeds.py --seeds 0 1 2 3 4 --algos grpo`"),
    Group("main_job/*-seed*.log", "main_job.md", "each of those runs' console output",
          "`python bench/main_job_seeds.py` (beside each run's metrics)"),
    Group("main_job/runs.jsonl", "main_job.md",
          ("one row per run: SFT steps, warm-start and final success, wall seconds, matmul "
           "GFLOP/s before and after, commit, command"),
          "`python bench/main_job_seeds.py` (a row per run)"),
    Group("main_job/ppo-sync-seed0-f41142f.jsonl", "main_job.md",
          "seed 0, synchronous, the previous default: metrics of the asynchronous comparison",
          "`agentrl-fast train --run-dir runs/sync-seed0`"),
    Group("main_job/ppo-async1-seed0.jsonl", "main_job.md",
          "seed 0 with `train.max_staleness=1`: metrics of the asynchronous comparison",
          "`agentrl-fast train --set train.max_staleness=1 --run-dir runs/async-seed0`"),
    Group("critic_study.png", "critic_study.md",
          "the figure: held-out success against RL step per cell and task, mean and min-max "
          "over seeds", "`python bench/critic_study.py` (redrawn after each run)"),
    Group("main_job/tuning.jsonl", "main_job.md",
          ("issue 34's tuning runs, one summary row each (settings, SFT steps, validation "
           "checks, warm-start and final success, wall time, commit, command); the raw logs are "
           "in git's history (each row's `raw_log`; `docs/experiments.md`, \"Issue 34's tuning "
           "runs, summarised\")"),
          "each row's `command` (`bench/probe_warmstart.py`, `bench/main_job_seeds.py`)"),
    Group("gpu_2026-12-04/summary.txt", "gpu_2026-12-04/README.md",
          "run 1's verdict and time per stage", "`bash bench/gpu_suite.sh /tmp/suite`"),
    Group("gpu_2026-12-04/gpu.txt", "gpu_2026-12-04/README.md",
          "nvidia-smi's name, driver and SM clock of the machine",
          "`bash bench/gpu_suite.sh /tmp/suite`"),
    Group("gpu_2026-12-04/preflight.txt", "gpu_2026-12-04/README.md",
          "run 1's preflight: tools, GPU, wheels, the stages whose modules import, versions",
          "`bash bench/gpu_suite.sh /tmp/suite`"),
    Group("gpu_2026-12-04/build.log", "gpu_2026-12-04/README.md",
          "run 1's build of the CUDA extension", "`bash bench/gpu_suite.sh /tmp/suite`"),
    Group("gpu_2026-12-04/warm.log", "gpu_2026-12-04/README.md",
          "run 1's background Triton compiles (`bench/warm_triton_cache.py`)",
          "`bash bench/gpu_suite.sh /tmp/suite`"),
    Group("gpu_2026-12-04/bench.log", "gpu_2026-12-04/README.md",
          "run 1's tune sweep and benchmarks, their whole output",
          "`bash bench/gpu_suite.sh /tmp/suite`"),
    Group("gpu_2026-12-04/rows.jsonl", "gpu_2026-12-04/README.md",
          ("run 1's benchmark rows (stamped commit db48f1b, the device copy's stale git HEAD; "
           "the tree was e7ee7df's; the attention fwd+bwd rows are not valid)"),
          "`bash bench/gpu_suite.sh /tmp/suite`"),
    Group("gpu_2026-12-04/tests_run*.log", "gpu_2026-12-04/README.md",
          ("the GPU tests' output: run 1 (cut off at the 75 s cap), run 2 (caps x 4), run 4 "
           "(a fresh machine, after the test fixes)"),
          ("`bash bench/gpu_suite.sh /tmp/suite`, `CAP_SCALE=4 bash bench/gpu_suite.sh "
           "/tmp/suite2 --only tests`, `python -m pytest -m gpu -rA` (run 4's four files)")),
    Group("gpu_2026-12-04/sanitize*.log", "gpu_2026-12-04/README.md",
          ("compute-sanitizer's memcheck, racecheck and synccheck: run 1 (cut off at the 40 s "
           "cap), run 3 (caps x 5)"),
          ("`bash bench/gpu_suite.sh /tmp/suite`, `CAP_SCALE=5 bash bench/gpu_suite.sh OUT "
           "--only sanitize`")),
    Group("gpu_2026-12-04/probe_run4.log", "gpu_2026-12-04/README.md",
          "run 4's backward probe: every job crashed on the probe's own bug (fixed since)",
          "`python bench/attention_backward_probe.py`"),
]

INTRO = """\
Each `<op>.jsonl` holds rows in the one format of `bench/common.py` (op, provider, shape, dtype,
device, time_ms, tokens_per_s, gbps, tflops, ratio, commit, date); ratio = provider time / ours.
Every record below was measured on the same dev box unless it says otherwise: 2 cores of an AMD
EPYC VM (AVX2 + FMA), torch 2.14.1, CPU only, nothing else running. The GPU records,
`gpu_2026-12-04/`, come from one H200 (`bench/gpu_suite.sh OUT`, the GPU suite). How the numbers
behind the defaults were reached, and what was tried and dropped: `docs/experiments.md`."""

GENERATED = ("<!-- Generated by `python bench/results_index.py` from the files it lists: edit a "
             "record's header (title, `Summary:`, `Command:`, date and commit) or the script's "
             "GROUPS, not this file. `python bench/results_index.py --check` "
             "(tests/test_results_index.py) fails when it is stale. -->")

LISTED = ("Every file under `bench/results/` is listed below under the record that describes it: "
          "the record's title, date and commit, its summary, the command that produced it, and "
          "for a `.jsonl` of rows a line computed from its rows.")

DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
COMMIT = re.compile(r"\bcommit:?\s+`?([0-9a-f]{7,40})\b", re.IGNORECASE)
COMMAND = re.compile(r"^(?:Command[^:]*:|.*Regenerate with:)\s*(.*)$")


@dataclass
class Header:
    """A record's headline: what its header says."""
    title: str = ""
    summary: list[str] = field(default_factory=list)
    command: str = ""
    date: str = ""
    commit: str = ""


def header_lines(text: str) -> list[str]:
    """The lines of a record before its first ``## `` heading or table row."""
    lines = []
    for line in text.splitlines():
        if line.startswith(("## ", "|")):
            break
        lines.append(line)
    return lines


def split_summary(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the ``Summary:`` paragraph without its prefix, the other lines)."""
    for start, line in enumerate(lines):
        if line.startswith("Summary:"):
            end = start
            while end < len(lines) and lines[end].strip():
                end += 1
            summary = [line[len("Summary:"):].strip(), *lines[start + 1:end]]
            return summary, lines[:start] + lines[end:]
    return [], lines


def find_command(lines: list[str]) -> str:
    """The command a header names: after ``Command...:``, or the next code line."""
    for i, line in enumerate(lines):
        match = COMMAND.match(line)
        if not match:
            continue
        if match.group(1):
            return match.group(1)
        for code in lines[i + 1:]:
            if code.strip() and not code.startswith("```"):
                return f"`{code.strip()}`"
    return ""


def parse_header(text: str) -> Header:
    """Title, summary, command, date and commit of a record's text."""
    lines = header_lines(text)
    summary, rest = split_summary(lines)
    title = next((l[2:].strip() for l in lines if l.startswith("# ")), "")
    body = "\n".join(rest)
    date, commit = DATE.search(body), COMMIT.search(body)
    return Header(title, summary, find_command(rest), date.group(1) if date else "",
                  commit.group(1) if commit else "")


def header_problems(name: str, header: Header) -> list[str]:
    """What a record's header lacks."""
    wanted = {"a title line (# ...)": header.title, "a 'Summary:' paragraph": header.summary,
              "a 'Command:' line": header.command, "a date (YYYY-MM-DD)": header.date,
              "a commit ('commit abc1234')": header.commit}
    return [f"bench/results/{name}: its header lacks {what}"
            for what, value in wanted.items() if not value]


def read_rows(path: Path) -> list[dict]:
    """The JSON rows of a ``.jsonl`` file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def span(numbers) -> str:
    """``0-4`` / ``0, 5-9``: sorted integers with runs collapsed."""
    numbers, parts = sorted(set(numbers)), []
    for n in numbers:
        if parts and n == parts[-1][1] + 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def bench_headline(rows: list[dict]) -> str:
    """Rows of ``bench/common.py``: count, newest date and commit, and there the largest ratio
    per op (the reference rows, ratio 1, left out)."""
    date, commit = rows[-1].get("date"), rows[-1].get("commit")
    newest = [r for r in rows if r.get("date") == date and r.get("commit") == commit]
    best: dict[str, dict] = {}
    for row in (r for r in newest if r.get("ratio") not in (None, 1.0)):
        if row["ratio"] > best.get(row["op"], {}).get("ratio", -1):
            best[row["op"]] = row
    ratios = "; ".join(f"{op} {r['ratio']:.2f}x ({r['provider']}, {r['shape']})"
                       for op, r in best.items())
    text = f"{len(rows)} rows; newest {date}, commit {commit}"
    return text + (f"; largest `ratio` (provider time / ours) per op there: {ratios}"
                   if ratios else "")


def latest_runs(rows: list[dict]) -> dict[str, list[dict]]:
    """``{algo: [row]}``: the newest row per algorithm and seed (file order)."""
    latest: dict[tuple[str, int], dict] = {}
    for row in rows:
        latest[(row["algo"], row["seed"])] = row
    out: dict[str, list[dict]] = {}
    for (algo, _), row in sorted(latest.items(), key=lambda kv: (kv[0][0] != "ppo", kv[0])):
        out.setdefault(algo, []).append(row)
    return out


def run_means(rows: list[dict]) -> dict[str, float]:
    """``{algo: mean final held-out success}`` over the newest run per seed."""
    return {algo: sum(r["final_success"] for r in runs) / len(runs)
            for algo, runs in latest_runs(rows).items()}


def runs_headline(rows: list[dict]) -> str:
    """Rows of ``main_job_seeds.py``: per algorithm, seeds, mean warm-start and final success."""
    parts = []
    for algo, runs in latest_runs(rows).items():
        warm = sum(r["warmstart_success"] for r in runs) / len(runs)
        final = sum(r["final_success"] for r in runs) / len(runs)
        commits = ", ".join(sorted({r["commit"] for r in runs}))
        parts.append(f"{algo.upper()} seeds {span(r['seed'] for r in runs)}: warm-start mean "
                     f"{warm:.3f} → held-out mean {final:.3f} (commit {commits})")
    return "; ".join(parts)


def tuning_headline(rows: list[dict]) -> str:
    """Rows of ``tuning.jsonl``: runs by kind, seeds, dates, commits, the best final success."""
    kinds: dict[str, int] = {}
    for row in rows:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
    finals = [r for r in rows if r.get("final_success") is not None]
    best = max(finals, key=lambda r: r["final_success"]) if finals else None
    commits = ", ".join(sorted({r["commit"] for r in rows if r.get("commit")}))
    dates = ", ".join(sorted({r["date"] for r in rows if r.get("date")}))
    text = (f"{len(rows)} runs ({', '.join(f'{n} {k}' for k, n in kinds.items())}) on seeds "
            f"{span(r['seed'] for r in rows)}; {dates}; commits {commits}")
    return text + (f"; best held-out final {best['final_success']:.3f} (`{best['run']}`)"
                   if best else "")


def study_headline(rows: list[dict]) -> str:
    """Rows of ``critic_study.py``: runs (smoke runs among them), tasks, cells, seeds, commits."""
    smoke = sum(1 for r in rows if r["setting"].get("quick"))
    tasks = ", ".join(sorted({r["task"] for r in rows}))
    commits = ", ".join(sorted({r["commit"] for r in rows}))
    return (f"{len(rows)} runs ({smoke} of them --quick smoke runs) on tasks {tasks}, "
            f"{len({r['cell'] for r in rows})} cells, seeds {span(r['seed'] for r in rows)}; "
            f"commits {commits}")


def rows_headline(path: Path) -> str:
    """A line computed from a ``.jsonl`` file's rows, or "" for rows of no known shape."""
    rows = read_rows(path)
    if not rows:
        return "no rows"
    if {"op", "ratio"} <= rows[0].keys():
        return bench_headline(rows)
    if {"algo", "seed", "final_success"} <= rows[0].keys():
        return runs_headline(rows)
    if {"task", "cell", "seed", "setting"} <= rows[0].keys():
        return study_headline(rows)
    if {"run", "kind", "seed"} <= rows[0].keys():
        return tuning_headline(rows)
    return ""


@dataclass
class Record:
    """One ``*.md`` record, its header and the files it owns (besides itself)."""
    name: str
    header: Header
    files: list[str] = field(default_factory=list)


def result_files(results: Path) -> list[str]:
    """Every file under ``results`` (relative, POSIX), the index itself left out."""
    return sorted(p.relative_to(results).as_posix() for p in results.rglob("*")
                  if p.is_file() and p.relative_to(results).as_posix() != INDEX_NAME)


def owner(name: str, records: dict[str, Record]) -> str | None:
    """The record owning a file that is not a record: its ``.md`` twin, or a GROUPS entry."""
    twin = name[:-len(".jsonl")] + ".md" if name.endswith(".jsonl") else None
    if twin in records:
        return twin
    return next((g.record for g in GROUPS
                 if fnmatch.fnmatchcase(name, g.pattern) and g.record in records), None)


def collect(results: Path) -> tuple[list[Record], list[str]]:
    """The records, each with its files, and the problems found (unowned files, bad headers)."""
    names = result_files(results)
    records = {n: Record(n, parse_header((results / n).read_text()))
               for n in names if n.endswith(".md")}
    problems = [p for r in records.values() for p in header_problems(r.name, r.header)]
    for name in names:
        if name in records:
            continue
        home = owner(name, records)
        if home is None:
            problems.append(f"bench/results/{name}: no record owns it (give it a `.md` record "
                            f"beside it or a GROUPS entry in bench/results_index.py)")
        else:
            records[home].files.append(name)
    order = sorted(records, key=lambda n: (n != FIRST, n))
    return [records[n] for n in order], problems


def stated_means(record: Record, results: Path) -> list[str]:
    """Problems: a runs file's mean final success per algorithm missing from the summary."""
    summary, problems = " ".join(record.header.summary), []
    for name in (n for n in record.files if n.endswith(".jsonl")):
        rows = read_rows(results / name)
        if not rows or "algo" not in rows[0]:
            continue
        for algo, mean in run_means(rows).items():
            if f"{mean:.3f}" not in summary:
                problems.append(f"bench/results/{record.name}: its summary does not state "
                                f"{algo.upper()}'s mean {mean:.3f} from {name}")
    return problems


def group_of(name: str) -> Group | None:
    """The GROUPS entry a file matches, if any."""
    return next((g for g in GROUPS if fnmatch.fnmatchcase(name, g.pattern)), None)


def twin_line(name: str, results: Path) -> str:
    """The bullet of a record's own rows (the ``.jsonl`` beside it)."""
    headline = rows_headline(results / name)
    return f"- [`{name}`]({name}): the record's rows" + (f"; {headline}." if headline else ".")


def group_line(group: Group, members: list[str], results: Path) -> str:
    """The bullet of a GROUPS entry's files: what, command, and the rows of a lone ``.jsonl``."""
    links = ", ".join(f"[`{n}`]({n})" for n in members)
    lone = members[0] if len(members) == 1 and members[0].endswith(".jsonl") else None
    headline = rows_headline(results / lone) if lone else ""
    return (f"- {links}: {group.what}. Command: {group.command}."
            + (f" Rows: {headline}." if headline else ""))


def file_lines(record: Record, results: Path) -> list[str]:
    """The bullet list of a record's files: itself, its rows, then each group in GROUPS order."""
    lines = [f"- [`{record.name}`]({record.name}): this record."]
    lines += [twin_line(n, results) for n in record.files if group_of(n) is None]
    for group in GROUPS:
        members = [n for n in record.files if group_of(n) == group]
        if members:
            lines.append(group_line(group, members, results))
    return lines


def capitalised(lines: list[str]) -> list[str]:
    """The summary's lines, its first letter in upper case (it followed ``Summary:``)."""
    return [lines[0][:1].upper() + lines[0][1:], *lines[1:]] if lines else lines


def render_record(record: Record, results: Path) -> list[str]:
    """A record's section of the index."""
    h = record.header
    return [f"## `{record.name}`: {h.title}", "", f"{h.date}, commit {h.commit}.", "",
            *capitalised(h.summary), "", f"Command: {h.command}", "", "Files:", "",
            *file_lines(record, results), ""]


def render(results: Path) -> tuple[str, list[str]]:
    """The index's text and the problems found on the way."""
    records, problems = collect(results)
    for record in records:
        problems += stated_means(record, results)
    lines = ["# Recorded results: the current record", "", GENERATED, "", INTRO, "", LISTED, ""]
    for record in records:
        lines += render_record(record, results)
    return "\n".join(lines).rstrip("\n") + "\n", problems


def check(results: Path = RESULTS) -> list[str]:
    """What is wrong with the index of ``results``: problems, then a diff if it is stale."""
    text, problems = render(results)
    index = results / INDEX_NAME
    old = index.read_text() if index.is_file() else ""
    if old != text:
        diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(),
                                         f"{index} (on disk)", f"{index} (from the files)",
                                         lineterm=""))
        shown = diff[:60] + ([f"... {len(diff) - 60} more diff lines"] if len(diff) > 60 else [])
        problems.append(f"{index} is stale; `python bench/results_index.py` rewrites it:\n"
                        + "\n".join(shown))
    return problems


def main(argv: list[str] | None = None) -> int:
    """Rewrite the index (or, with --check, report what differs); 1 on any problem."""
    parser = argparse.ArgumentParser(description="Write bench/results/README.md, the index of "
                                     "the recorded results, from the result files' headers.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and say what differs when the index is stale")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the results folder (default bench/results)")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        print(f"results_index: {args.results} is not a folder", file=sys.stderr)
        return 2
    if args.check:
        problems = check(args.results)
    else:
        text, problems = render(args.results)
        if not problems:
            (args.results / INDEX_NAME).write_text(text)
    for problem in problems:
        print(f"results_index: {problem}", file=sys.stderr)
    if not problems:
        print(f"{args.results / INDEX_NAME} is current" if args.check
              else f"wrote {args.results / INDEX_NAME}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
