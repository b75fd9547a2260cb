"""Benchmark: the cost per call of running model-written code under bubblewrap
(``isolation="bwrap"``) against the plain child process (``isolation="none"``).

Each call is one ``run_sandboxed`` (``agentrl_fast/harness/sandbox.py``), awaited alone (no other
call running), wall time from the call to its result. Programs:

* ``python``: what ``python_tool`` runs, the base interpreter's ``python -I -S -u -`` reading
  ``print(1)`` from stdin (interpreter start-up included, as the model pays it);
* ``/bin/true``: nothing but the sandbox (the launcher and, under bubblewrap, its namespaces and
  mounts).

The two isolations alternate call by call (``--calls`` each, after ``--warmup``), so a change in
the machine's load hits both alike. Printed: median, p95 and mean per call and the median
overhead of bubblewrap; ``--markdown PATH`` also writes them as a table with the command; rows
(``op="sandbox"``, ``time_ms`` the median, ``ratio`` bwrap / none) are appended to
``bench/results/sandbox.jsonl`` unless ``--no-rows``.

    python bench/bench_sandbox.py --calls 200 --markdown bench/results/sandbox.md
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

from agentrl_fast.harness.bwrap import base_python
from agentrl_fast.harness.sandbox import bwrap_problem, run_sandboxed

ISOLATIONS = ("none", "bwrap")


def programs() -> dict[str, tuple[list[str], str]]:
    return {"python": ([base_python(), "-I", "-S", "-u", "-"], "print(1)"),
            "/bin/true": (["/bin/true"], "")}


async def one_call(argv: list[str], stdin: str, isolation: str) -> float:
    start = time.perf_counter()
    result = await run_sandboxed(argv, stdin=stdin, isolation=isolation, timeout=30)
    elapsed = time.perf_counter() - start
    if not result.ok or result.isolation != isolation:
        raise RuntimeError(f"bench_sandbox: a call failed under {isolation}: {result}")
    return elapsed * 1000


async def measure(calls: int, warmup: int) -> dict[tuple[str, str], list[float]]:
    times = {(name, iso): [] for name in programs() for iso in ISOLATIONS}
    for name, (argv, stdin) in programs().items():
        for i in range(warmup + calls):
            for isolation in (ISOLATIONS if i % 2 == 0 else ISOLATIONS[::-1]):
                ms = await one_call(argv, stdin, isolation)
                if i >= warmup:
                    times[name, isolation].append(ms)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(times: dict[tuple[str, str], list[float]]) -> list[str]:
    lines = ["| program | isolation | calls | median ms | p95 ms | mean ms | bwrap overhead "
             "(median) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in programs():
        plain = statistics.median(times[name, "none"])
        for isolation in ISOLATIONS:
            values = times[name, isolation]
            median = statistics.median(values)
            overhead = (f"+{median - plain:.1f} ms ({median / plain:.2f}x)"
                        if isolation == "bwrap" else "-")
            lines.append(f"| {name} | {isolation} | {len(values)} | {median:.1f} | "
                         f"{percentile(values, 0.95):.1f} | {statistics.fmean(values):.1f} | "
                         f"{overhead} |")
    return lines


def write_rows(times: dict[tuple[str, str], list[float]]) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import Row, write_rows as append  # torch, only when rows are written
    rows = []
    for name in programs():
        plain = statistics.median(times[name, "none"])
        for isolation in ISOLATIONS:
            values = times[name, isolation]
            rows.append(Row(op="sandbox", provider=isolation,
                            shape=f"{name}, {len(values)} calls, "
                                  f"p95 {percentile(values, 0.95):.1f} ms",
                            dtype="-", device=f"cpu ({os.cpu_count()} cores)",
                            time_ms=statistics.median(values),
                            ratio=statistics.median(values) / plain))
    return append(rows, "sandbox")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per program and isolation")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--markdown", help="also write the table (and the command) here")
    parser.add_argument("--no-rows", action="store_true", help="append no rows to the jsonl")
    args = parser.parse_args()
    problem = bwrap_problem()
    if problem is not None:
        sys.exit(f"bench_sandbox: bubblewrap cannot run here: {problem}")
    times = asyncio.run(measure(args.calls, args.warmup))
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
                "alone; isolations alternate call by call. What is measured: the module doc of "
                "`bench/bench_sandbox.py`.", "",
                "Where bubblewrap's time goes: bwrap itself (its namespaces and mounts, "
                "~10-20 ms for a bare `bwrap ... /bin/true` here) and, as root, the launcher's "
                "uid drop and new user namespace (importing ctypes, a few ms). The python row is "
                "what a `python_tool` call costs.", ""]
        Path(args.markdown).write_text("# Cost per call of the bubblewrap sandbox\n\n"
                                       + "\n".join(head + lines) + "\n")


def bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except OSError:
        return "bwrap (version unknown)"


if __name__ == "__main__":
    main()
