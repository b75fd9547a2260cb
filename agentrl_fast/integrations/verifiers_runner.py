"""Runs a verifiers (0.4, ``verifiers.v1``) environment's own rollouts against the agentrl_fast
proxy, one proxy session per rollout. A standalone script for the verifiers side environment:
it imports only the standard library and verifiers (which pins ``openai<3`` and ``mcp==2.0.0``,
so it cannot share the trainer's environment), never agentrl_fast; it reaches the trainer over
HTTP alone.

For each task x sample it ``POST``s ``/sessions``, gives verifiers a model context of its own
whose endpoint is that session (``{proxy}/s/{id}/v1``: verifiers' ``ModelContext`` is per
rollout, so concurrent rollouts never share a session), lets the environment run the episode
(its harness, tools and rubric), then ``POST``s ``/sessions/{id}/finish`` with the episode's
reward and whether verifiers judged it truncated. One JSON line per rollout goes to stdout,
as it finishes::

    {"session": id, "task_id": ..., "task_index": i, "sample": s, "reward": r,
     "truncated": false, "error": null}

(``error`` a message when verifiers failed the episode), and a line with ``"started": true``
instead of the outcome when its session is made, so the caller can close what a crash left
open. ``task_index`` is the task's position in this run; ``--skip`` wraps around the taskset.
verifiers' own logs go to stderr.

    python verifiers_runner.py --proxy http://127.0.0.1:8000 --env-id vf-lookup \\
        --env-path examples/verifiers_env --tasks 2 --samples 2 --max-turns 4

Nothing is downloaded: hub look-ups are switched off (``HF_HUB_OFFLINE`` and friends), the
environment is an importable package (``--env-path`` puts a local one on the path), and
verifiers' bundled chat program runs on this interpreter instead of a ``uv``-made one.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

# Run by path, this file's folder is sys.path[0], where the trainer-side driver verifiers.py
# would shadow the verifiers package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
# The API-key variable verifiers reads for the proxy (unset: "EMPTY"); not PRIME_API_KEY,
# which would make verifiers read the Prime CLI's config.
API_KEY_VAR = "AGENTRL_PROXY_API_KEY"
# The packages verifiers' bundled chat program declares (its PEP 723 header).
CHAT_PROGRAM_PACKAGES = ("openai", "mcp", "httpx", "httpx2", "tenacity", "certifi")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", required=True,
                        help="the proxy's root URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--env-id", required=True,
                        help="the verifiers taskset id (an importable package, e.g. vf-lookup)")
    parser.add_argument("--env-args", default="{}",
                        help="JSON object of taskset config fields (e.g. a local data path)")
    parser.add_argument("--env-path", action="append", default=[],
                        help="a folder holding the environment's package (repeatable)")
    parser.add_argument("--harness", default="null",
                        help="verifiers harness id (default null: its tool-calling chat loop)")
    parser.add_argument("--model", default="policy")
    parser.add_argument("--skip", type=int, default=0,
                        help="tasks to skip first (wraps around the taskset)")
    parser.add_argument("--tasks", type=int, required=True, help="tasks to run")
    parser.add_argument("--samples", type=int, default=1, help="rollouts per task")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts at once")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one rollout may take")
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad arguments fail here, naming the flag, before any session is made."""
    for flag, value, least in (("--tasks", args.tasks, 1), ("--samples", args.samples, 1),
                               ("--max-turns", args.max_turns, 1), ("--skip", args.skip, 0),
                               ("--concurrency", args.concurrency, 1)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if not args.proxy.startswith(("http://", "https://")):
        parser.error(f"--proxy must be an http(s) URL, got {args.proxy!r}")
    try:
        args.env_args = json.loads(args.env_args)
    except json.JSONDecodeError as error:
        parser.error(f"--env-args must be a JSON object: {error}")
    if not isinstance(args.env_args, dict):
        parser.error(f"--env-args must be a JSON object, got {type(args.env_args).__name__}")
    for folder in args.env_path:
        if not Path(folder).is_dir():
            parser.error(f"--env-path {folder!r} is not a folder")


def prepare_process(env_paths: list[str]) -> None:
    """Offline switches, and the environment's folders on this process's path and on
    ``PYTHONPATH`` (verifiers starts tool servers as ``python -m <module>`` subprocesses)."""
    os.environ.update(OFFLINE)
    folders = [str(Path(p).resolve()) for p in env_paths]
    sys.path[:0] = folders
    inherited = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(folders + ([inherited] if inherited else []))


def use_this_interpreter_for_chat_program() -> None:
    """verifiers runs its bundled chat program (the ``null``/``bash`` harnesses) under an
    environment ``uv`` builds from the package index on first use; that needs uv and the
    network. This interpreter already has every package the program declares (verifiers
    depends on them), so record it as that program's prepared interpreter: the subprocess
    runtime keeps prepared interpreters in a class-level cache keyed by the script's path."""
    from importlib.metadata import PackageNotFoundError, version

    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    missing = []
    for package in CHAT_PROGRAM_PACKAGES:
        try:
            version(package)
        except PackageNotFoundError:
            missing.append(package)
    if missing:
        raise RuntimeError(f"the chat program needs {missing} in this environment")
    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


def post(url: str, body: dict) -> dict:
    """POST JSON to the proxy; an HTTP error raises with the proxy's message."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"POST {url}: {error.code} {error.read().decode()[:500]}") from None
    except urllib.error.URLError as error:
        raise RuntimeError(f"POST {url}: cannot reach the proxy ({error.reason})") from None


def load_env(args: argparse.Namespace):
    """The environment: the taskset ``--env-id`` with ``--env-args``, one agent seat
    running ``--harness`` as a local subprocess, at most ``--max-turns`` model turns."""
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    config = resolve_env_config({
        "taskset": {**args.env_args, "id": args.env_id},
        "agent": {"harness": {"id": args.harness}, "runtime": {"type": "subprocess"},
                  "max_turns": args.max_turns, "timeout": {"rollout": args.timeout}},
    })
    return load_environment(config)


def episode_outcome(episode) -> dict:
    """``reward`` (its traces' rewards summed), ``truncated`` (verifiers' verdict: a turn or
    token limit, or a final reply cut at its length, so the trainer bootstraps the value) and
    ``error`` (an episode verifiers marks failed: a harness crash, a tool server that never
    came up) of a finished episode."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    detail = "; ".join(f"{e.type}: {e.message}"[:400] for e in errors) or "not ok"
    return {"reward": float(sum(trace.reward for trace in episode.traces)),
            "truncated": any(trace.is_truncated for trace in episode.traces),
            "error": None if episode.ok else f"verifiers episode failed: {detail}"}


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


async def run_rollout(env, task, index: int, sample: int, args: argparse.Namespace,
                      gate: asyncio.Semaphore) -> None:
    from verifiers.v1 import EvalClientConfig, ModelContext
    from verifiers.v1.env import RunSlot

    task_id = str(task.data.id if task.data.id is not None else task.data.idx)
    async with gate:
        session = (await asyncio.to_thread(post, f"{args.proxy}/sessions",
                                           {"task_id": task_id, "sample_index": sample}))["id"]
        line = {"session": session, "task_id": task_id, "task_index": index, "sample": sample}
        emit({**line, "started": True})
        client = EvalClientConfig(base_url=f"{args.proxy}/s/{session}/v1",
                                  api_key_var=API_KEY_VAR)
        ctx = ModelContext(model=args.model, client=client)
        try:
            outcome = episode_outcome(await env.run_slot(RunSlot(task), ctx))
        except Exception as exception:  # noqa: BLE001 - reported on the rollout, not fatal
            outcome = {"reward": 0.0, "truncated": False,
                       "error": f"verifiers raised {type(exception).__name__}: {exception}"}
        await asyncio.to_thread(post, f"{args.proxy}/sessions/{session}/finish",
                                {"reward": outcome["reward"], "truncated": outcome["truncated"]})
        emit({**line, **outcome})


async def run(args: argparse.Namespace) -> None:
    env = load_env(args)
    every = list(env.taskset.take(args.skip + args.tasks))
    if not every:
        raise SystemExit(f"taskset {args.env_id!r} has no tasks")
    tasks = [every[(args.skip + i) % len(every)] for i in range(args.tasks)]
    gate = asyncio.Semaphore(args.concurrency)
    async with env.serving():
        await asyncio.gather(*(run_rollout(env, task, index, sample, args, gate)
                               for index, task in enumerate(tasks)
                               for sample in range(args.samples)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.proxy = args.proxy.rstrip("/")
    prepare_process(args.env_path)
    use_this_interpreter_for_chat_program()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
