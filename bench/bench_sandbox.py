"""Benchmark: the cost per call of running model-written code under bubblewrap
(``isolation="bwrap"``) against the plain child process (``isolation="none"``), and of the
seccomp system-call filter (``bwrap-no-filter``: bubblewrap with ``syscall_filter=False``) and
of the call's control group (``bwrap-no-cgroup``: ``cgroup="off"``); the others run with both,
the defaults (the group where this host lets us make one).

Each call is one ``run_sandboxed`` (``agentrl_fast/harness/sandbox/execute.py``), awaited alone (no other
call running), wall time from the call to its result. Programs:

* ``python``: what ``python_tool`` runs, the base interpreter's ``python -I -S -u -`` reading
  ``print(1)`` from stdin (interpreter start-up included, as the model pays it);
* ``/bin/true``: nothing but the sandbox (the launcher and, under bubblewrap, its namespaces and
  mounts).

The configurations (``--configs``, default all) alternate call by call (``--calls`` each,
after ``--warmup``), so a change in the machine's load hits all alike. Printed: median, p95 and
mean per call, the median overhead over ``none`` and the filter's cost (``bwrap`` minus
``bwrap-no-filter``); ``--markdown PATH`` also writes them as a table with the command; rows
(``op="sandbox"``, ``provider`` the configuration, ``time_ms`` the median, ``ratio`` against
``none`` when measured) are appended to ``bench/results/sandbox.jsonl`` unless ``--no-rows``.

    python bench/bench_sandbox.py --calls 200 --markdown bench/results/sandbox.md
    python bench/bench_sandbox.py --calls 50 --programs python --configs bwrap bwrap-no-filter
"""

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agentrl_fast.harness.sandbox.bwrap import base_python
from agentrl_fast.harness.sandbox.execute import bwrap_problem
from agentrl_fast.harness.sandbox import run_sandboxed

CONFIGS = {"none": {"isolation": "none"}, "bwrap": {"isolation": "bwrap"},
           "bwrap-no-filter": {"isolation": "bwrap", "syscall_filter": False},
           "bwrap-no-cgroup": {"isolation": "bwrap", "cgroup": "off"}}


def programs() -> dict[str, tuple[list[str], str]]:
    return {"python": ([base_python(), "-I", "-S", "-u", "-"], "print(1)"),
            "/bin/true": (["/bin/true"], "")}


async def one_call(argv: list[str], stdin: str, config: str) -> float:
    options = CONFIGS[config]
    start = time.perf_counter()
    result = await run_sandboxed(argv, stdin=stdin, timeout=30, **options)
    elapsed = time.perf_counter() - start
    if not result.ok or result.isolation != options["isolation"] or (
            result.syscall_filter != options.get("syscall_filter", True)) or (
            options.get("cgroup") == "off" and result.cgroup):
        raise RuntimeError(f"bench_sandbox: a call failed under {config}: {result}")
    return elapsed * 1000


async def measure(names: list[str], configs: list[str], calls: int,
                  warmup: int) -> dict[tuple[str, str], list[float]]:
    times = {(name, config): [] for name in names for config in configs}
    for name in names:
        argv, stdin = programs()[name]
        for i in range(warmup + calls):
            for config in (configs if i % 2 == 0 else configs[::-1]):
                ms = await one_call(argv, stdin, config)
                if i >= warmup:
                    times[name, config].append(ms)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _medians(times: dict[tuple[str, str], list[float]]) -> dict[tuple[str, str], float]:
    return {key: statistics.median(values) for key, values in times.items()}


def table(times: dict[tuple[str, str], list[float]]) -> list[str]:
    medians = _medians(times)
    lines = ["| program | configuration | calls | median ms | p95 ms | mean ms | overhead over "
             "none (median) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for (name, config), values in times.items():
        median, plain = medians[name, config], medians.get((name, "none"))
        overhead = (f"{median - plain:+.1f} ms ({median / plain:.2f}x)"
                    if plain is not None and config != "none" else "-")
        lines.append(f"| {name} | {config} | {len(values)} | {median:.1f} | "
                     f"{percentile(values, 0.95):.1f} | {statistics.fmean(values):.1f} | "
                     f"{overhead} |")
    for name in dict.fromkeys(name for name, _ in times):
        if (name, "bwrap") in medians and (name, "bwrap-no-filter") in medians:
            cost = medians[name, "bwrap"] - medians[name, "bwrap-no-filter"]
            lines.append(f"\nThe seccomp filter under bubblewrap, {name}: {cost:+.1f} ms per call "
                         f"(median bwrap minus median bwrap-no-filter).")
        if (name, "bwrap") in medians and (name, "bwrap-no-cgroup") in medians:
            cost = medians[name, "bwrap"] - medians[name, "bwrap-no-cgroup"]
            lines.append(f"\nThe call's control group under bubblewrap, {name}: {cost:+.1f} ms "
                         f"per call (median bwrap minus median bwrap-no-cgroup).")
    return lines


def write_rows(times: dict[tuple[str, str], list[float]]) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import Row, write_rows as append  # torch, only when rows are written
    medians = _medians(times)
    rows = []
    for (name, config), values in times.items():
        plain = medians.get((name, "none"))
        rows.append(Row(op="sandbox", provider=config,
                        shape=f"{name}, {len(values)} calls, "
                              f"p95 {percentile(values, 0.95):.1f} ms",
                        dtype="-", device=f"cpu ({os.cpu_count()} cores)",
                        time_ms=medians[name, config],
                        ratio=None if plain is None else medians[name, config] / plain))
    return append(rows, "sandbox")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per program and isolation")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--programs", nargs="+", choices=list(programs()),
                        default=list(programs()))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--markdown", help="also write the table (and the command) here")
    parser.add_argument("--no-rows", action="store_true", help="append no rows to the jsonl")
    args = parser.parse_args()
    problem = bwrap_problem()
    if problem is not None:
        sys.exit(f"bench_sandbox: bubblewrap cannot run here: {problem}")
    times = asyncio.run(measure(args.programs, args.configs, args.calls, args.warmup))
    lines = table(times)
    print("\n".join(lines))
    if not args.no_rows:
        print(f"rows appended to {write_rows(times)}")
    if args.markdown:
        command = "python bench/bench_sandbox.py " + shlex.join(sys.argv[1:])
        load = os.getloadavg()[0]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        head = [f"Command: `{command}`", "",
                f"Date {datetime.date.today().isoformat()}, commit {commit or 'unknown'}. "
                f"Machine: {os.cpu_count()} cores, Linux {platform.release()}, Python "
                f"{platform.python_version()}, {bwrap_version()}; load average at the end "
                f"{load:.2f} (other engineers' jobs share this machine). Each call awaited "
                "alone; configurations alternate call by call. What is measured: the module doc "
                "of `bench/bench_sandbox.py`.", "",
                "Where bubblewrap's time goes: bwrap itself (its namespaces and mounts, "
                "~10-20 ms for a bare `bwrap ... /bin/true` here) and, as root, the launcher's "
                "uid drop and new user namespace (importing ctypes, a few ms); the seccomp filter "
                "(libseccomp building and loading it) is the difference of bwrap and "
                "bwrap-no-filter, the call's control group that of bwrap and bwrap-no-cgroup "
                "(`none` has one too): moving the child into it waits for an RCU grace period "
                "(cgroup migration takes a lock whose writer waits for one), 10-14 ms of latency "
                "on this VM and no CPU, so concurrent calls overlap it; with "
                "`/sys/kernel/rcu_expedited` set to 1 (a host setting, not changed by us) it was "
                "gone: a bare bwrap `/bin/true` took 11.7 ms in a group against 12.2 ms without, "
                "and 23-24 ms against 11.2-11.4 with it 0. The python rows are what a "
                "`python_tool` call costs.", ""]
        from common import write_record  # torch, only when the record is written
        write_record(args.markdown, "# Cost per call of the bubblewrap sandbox\n\n"
                     + "\n".join(head + lines) + "\n")


def bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except OSError:
        return "bwrap (version unknown)"


if __name__ == "__main__":
    main()
