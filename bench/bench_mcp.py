"""MCP tool-call latency over stdio (issue 45): what a tool served by an MCP server costs a
rollout, against the same function as an in-process ``@tool``, every call through the same
``ToolRegistry.execute`` path the rollout engine awaits.

Two servers: the toy server of ``tests/mcp_servers/toy.py`` (the SDK's low-level ``Server``;
its ``add(a, b)``), and ``mcp-server-git`` (PyPI; ``git_status`` on a temporary repository,
the baseline being its own ``git_status`` function called in-process). Scope ``shared``: one
server, its per-call latency with 1 and ``--concurrency`` rollouts calling at once. Scope
``rollout``: a server per rollout, its per-call latency once started, and its start cost: from
the rollout's ``tools()`` to its first call's result (what a rollout pays), for rollouts
started one after another and ``--concurrency`` of them at once. ``pool start`` rows:
``MCPServers.start()``, paid once per run (the shared server's start, a rollout server's probe).

    python bench/bench_mcp.py --out bench/results/mcp.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import common  # bench/ is the script's folder: first on sys.path
import git
import torch
from mcp_server_git.server import git_status as server_git_status

from agentrl_fast.harness import ToolCall, ToolRegistry, tool
from agentrl_fast.harness.mcp import MCPServers

TOY = common.ROOT / "tests" / "mcp_servers" / "toy.py"


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def git_status_tool(repo: Path):
    """mcp-server-git's ``git_status`` as an in-process ``@tool``, ``repo_path`` read from
    ``repo`` (as the server reads it from its working directory)."""
    @tool
    def git_status(repo_path: str) -> str:
        """Shows the working tree status.

        Args:
            repo_path: The repository.
        """
        return f"Repository status:\n{server_git_status(git.Repo(repo / repo_path))}"

    return git_status


@dataclass(frozen=True)
class Case:
    """One tool on one server: the spec (less its scope), the call, a text its result holds,
    and the in-process tool that is its baseline."""

    server: str
    spec: dict
    call: ToolCall
    expect: str
    baseline: object


def git_command() -> str:
    """The real console script, not a pyenv shim (whose bash start would count as the
    server's)."""
    beside = Path(sys.executable).with_name("mcp-server-git")
    return str(beside) if beside.exists() else shutil.which("mcp-server-git") or "mcp-server-git"


def make_repo(folder: Path) -> Path:
    """A git repository with one commit."""
    repo = folder / "repo"
    repo.mkdir()
    run = ["git", "-c", "user.email=b@example.com", "-c", "user.name=b", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README.md").write_text("hello\n")
    subprocess.run(run + ["add", "README.md"], check=True)
    subprocess.run(run + ["commit", "-q", "-m", "first"], check=True)
    return repo


def cases(repo: Path) -> list[Case]:
    toy = {"name": "toy", "command": sys.executable, "args": [str(TOY)], "include": ["add"]}
    server_git = {"name": "git", "command": git_command(), "include": ["git_status"],
                  "args": ["--repository", "{rollout_dir}"],
                  "rollout_dir_template": str(repo)}
    return [Case("toy", toy, ToolCall("add", {"a": 2, "b": 3}), "5", add),
            Case("mcp-server-git", server_git, ToolCall("git_status", {"repo_path": "."}),
                 "On branch", git_status_tool(repo))]


def shared_spec(case: Case, repo: Path) -> dict:
    """``case``'s spec as one shared server working in ``repo`` (where git_status's "." is)."""
    spec = {k: v for k, v in case.spec.items() if k != "rollout_dir_template"}
    spec["args"] = [str(repo) if a == "{rollout_dir}" else a for a in spec["args"]]
    return {**spec, "scope": "shared", "cwd": str(repo)}


# ---------------------------------------------------------------------------------------------
# Timing.

async def call_once(registry: ToolRegistry, case: Case) -> float:
    """Seconds of one call; its result checked."""
    start = time.perf_counter()
    (result,) = await registry.execute([case.call])
    seconds = time.perf_counter() - start
    if not result.ok or case.expect not in result.content:
        raise RuntimeError(f"{case.server}: {case.call.name} answered {result!r}")
    return seconds


async def sequential(registry: ToolRegistry, case: Case, calls: int) -> list[float]:
    return [await call_once(registry, case) for _ in range(calls)]


async def at_once(registries: list[ToolRegistry], case: Case, calls: int
                  ) -> tuple[list[float], float]:
    """Each registry a rollout calling ``calls`` times, all at once: (every call's seconds,
    wall seconds)."""
    start = time.perf_counter()
    per = await asyncio.gather(*(sequential(r, case, calls) for r in registries))
    return [t for times in per for t in times], time.perf_counter() - start


async def rollout(pool: MCPServers, key: int, case: Case, calls: int) -> tuple[float, list[float]]:
    """One rollout on its own server: (start cost: ``tools()`` to the first result, the later
    calls' seconds); its server stopped after (untimed: a release runs in the background)."""
    start = time.perf_counter()
    registry = ToolRegistry(pool.tools(key))
    await call_once(registry, case)
    first = time.perf_counter() - start
    later = await sequential(registry, case, calls)
    await asyncio.wrap_future(pool.release(key))
    return first, later


def row(case: Case, scope: str, rollouts: int, measure: str, seconds: list[float],
        wall: float | None = None) -> dict:
    out = {"server": case.server, "scope": scope, "rollouts": rollouts, "measure": measure,
           **common.latency_ms(seconds)}
    if wall:
        out["calls_per_s"] = len(seconds) / wall
    print(json.dumps(out), flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# The measurements.

async def in_process(case: Case, args) -> list[dict]:
    registry = ToolRegistry([case.baseline])
    await sequential(registry, case, args.warmup)
    rows = []
    for n in (1, args.concurrency):
        times, wall = await at_once([registry] * n, case, args.calls // n)
        rows.append(row(case, "in-process", n, "call", times, wall))
    return rows


async def shared(case: Case, repo: Path, args) -> list[dict]:
    with MCPServers([shared_spec(case, repo)]) as pool:
        rows = [row(case, "shared", 1, "pool start", [timed(pool.start)])]
        registries = [ToolRegistry(pool.tools(k)) for k in range(args.concurrency)]
        await sequential(registries[0], case, args.warmup)
        for n in (1, args.concurrency):
            times, wall = await at_once(registries[:n], case, args.calls // n)
            rows.append(row(case, "shared", n, "call", times, wall))
    return rows


async def per_rollout(case: Case, args) -> list[dict]:
    with MCPServers([{**case.spec, "scope": "rollout"}]) as pool:
        rows = [row(case, "rollout", 1, "pool start", [timed(pool.start)])]
        alone = [await rollout(pool, k, case, args.calls // args.rollouts)
                 for k in range(args.rollouts)]
        rows.append(row(case, "rollout", 1, "start", [first for first, _ in alone]))
        together = await asyncio.gather(*(rollout(pool, args.rollouts + k, case, 0)
                                          for k in range(args.concurrency)))
        rows.append(row(case, "rollout", args.concurrency, "start", [f for f, _ in together]))
        later = [t for _, times in alone for t in times]
        rows.append(row(case, "rollout", 1, "call", later))
    return rows


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def measure(case: Case, repo: Path, args) -> list[dict]:
    rows = await in_process(case, args)
    rows += await shared(case, repo, args)
    rows += await per_rollout(case, args)
    return with_ratios(rows)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each call row's p50 over the in-process p50 at as many rollouts (> 1: slower than
    in-process); start rows in in-process calls (p50 / one in-process call's p50)."""
    base = {r["rollouts"]: r["p50_ms"] for r in rows if r["scope"] == "in-process"}
    for r in rows:
        r["x_in_process"] = r["p50_ms"] / base.get(r["rollouts"] if r["measure"] == "call"
                                                   else 1)
    return rows


# ---------------------------------------------------------------------------------------------
# The record.

def table(rows: list[dict]) -> str:
    head = ("| server | scope | rollouts at once | measure | n | p50 ms | p95 ms | mean ms | "
            "calls/s | p50 / in-process p50 |")
    lines = [head, "| --- " * 10 + "|"]
    for r in rows:
        rate = f"{r['calls_per_s']:.0f}" if "calls_per_s" in r else ""
        lines.append(f"| {r['server']} | {r['scope']} | {r['rollouts']} | {r['measure']} | "
                     f"{r['n']} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | {r['mean_ms']:.2f} | "
                     f"{rate} | {r['x_in_process']:.1f}x |")
    return "\n".join(lines)


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def wait_quiet(seconds: float) -> None:
    """Wait up to ``seconds`` for other processes to go quiet (``bench_rollout``'s reading)."""
    if seconds > 0:
        # Imported here: bench_rollout imports the engine and torch.
        from bench_rollout import OtherLoad
        print(f"waited {OtherLoad.wait(seconds):.0f} s for a quiet machine", flush=True)


def run(args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench_mcp-") as folder:
        repo = make_repo(Path(folder))
        rows = []
        for case in (c for c in cases(repo) if args.only in (None, c.server)):
            wait_quiet(args.wait_quiet)
            rows += asyncio.run(measure(case, repo, args))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300,
                        help="timed calls per row (split over the rollouts calling at once)")
    parser.add_argument("--rollouts", type=int, default=6,
                        help="rollout-scoped rollouts started one after another")
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts at once")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before a row")
    parser.add_argument("--only", choices=("toy", "mcp-server-git"), default=None)
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each server, wait up to this long for an idle machine")
    parser.add_argument("--out", default=None, help="write the record (markdown) here")
    args = parser.parse_args()
    before, start = load_average(), time.perf_counter()
    rows = run(args)
    header = (f"Machine: {common.device_name(torch.device('cpu'))}, shared with other jobs; "
              f"load average {before} at the start, {load_average()} at the end; "
              f"{time.perf_counter() - start:.0f} s in all.")
    text = table(rows)
    print(text, f"\n{header}")
    if args.out:
        common.write_record(args.out, f"# MCP tool-call latency over stdio\n\nCommand: `python "
                            f"bench/bench_mcp.py {' '.join(sys.argv[1:])}` (calls {args.calls}, "
                            f"rollouts {args.rollouts}, concurrency {args.concurrency}, warmup "
                            f"{args.warmup})\n\n{header}\n\n{text}\n")


if __name__ == "__main__":
    main()
