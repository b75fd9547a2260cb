"""Training verifiers (prime-rl's environment hub library, 0.4: ``verifiers.v1``) environments
through the proxy. verifiers pins ``openai<3`` and ``mcp==2.0.0``, so it runs in an environment
of its own (``tools/side-envs/verifiers.txt``): this module launches the standalone runner
(:mod:`agentrl_fast.integrations.verifiers_runner`, by file path) with that environment's
Python. The runner runs the verifiers environment's own rollouts (its harness, tools and
rubric), each in a proxy session of its own, and finishes each session with verifiers' reward;
here the finished sessions become trajectories for ``Trainer.train_on``.

    proxy = proxy_for(trainer)
    with ProxyServer(proxy) as server:
        trajectories = collect(server, side_python, "vf-lookup", tasks=2, samples=2,
                               env_paths=["examples/verifiers_env"])
        metrics = train_step(trainer, proxy, trajectories)     # proxy_driver's

Nothing here imports verifiers. A rollout verifiers failed, or that the runner left unfinished
(it crashed or ran past ``timeout``), comes back with ``error`` set (counted, not trained on).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.proxy import Proxy, ProxyError, ProxyServer
from agentrl_fast.train.proxy_driver import train_step

RUNNER = Path(__file__).resolve().parent.parent / "integrations" / "verifiers_runner.py"
# The main environment's settings the side environment must not inherit (it would import
# the main environment's packages).
_PRIVATE = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def runner_command(python: str | Path, proxy_url: str, env_id: str, *, tasks: int,
                   samples: int = 1, skip: int = 0, env_args: dict | None = None,
                   env_paths: Sequence[str | Path] = (), max_turns: int = 8,
                   concurrency: int = 8, harness: str = "null", model: str = "policy"
                   ) -> list[str]:
    """The command line that runs the runner in the side environment ``python``."""
    python = Path(python).expanduser()
    if not python.is_file():
        raise ValueError(f"python must be the verifiers side environment's interpreter; "
                         f"{python} does not exist (bash tools/setup_test_env.sh verifiers)")
    for name, value, least in (("tasks", tasks, 1), ("samples", samples, 1), ("skip", skip, 0),
                               ("max_turns", max_turns, 1), ("concurrency", concurrency, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    command = [str(python), str(RUNNER), "--proxy", proxy_url, "--env-id", env_id,
               "--env-args", json.dumps(env_args or {}), "--tasks", str(tasks),
               "--samples", str(samples), "--skip", str(skip), "--max-turns", str(max_turns),
               "--concurrency", str(concurrency), "--harness", harness, "--model", model]
    for folder in env_paths:
        command += ["--env-path", str(Path(folder).resolve())]
    return command


def collect(server: ProxyServer, python: str | Path, env_id: str, *, tasks: int,
            samples: int = 1, timeout: float = 600.0, **options) -> list[Trajectory]:
    """Run ``tasks`` x ``samples`` rollouts of verifiers environment ``env_id`` through
    ``server`` (options: :func:`runner_command`'s); their trajectories in (task, sample)
    order, each with verifiers' reward. A runner that fails before any rollout raises
    ``RuntimeError`` with its stderr (e.g. an unknown ``env_id``)."""
    command = runner_command(python, server.url, env_id, tasks=tasks, samples=samples,
                             **options)
    environment = {k: v for k, v in os.environ.items() if k not in _PRIVATE}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=environment)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        failure = f"exited {process.returncode}" if process.returncode else None
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        failure = f"ran past its {timeout:g} s timeout and was killed"
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    started = {line["session"]: line for line in lines if line.get("started")}
    if not started and failure:
        raise RuntimeError(f"the verifiers runner {failure} before any rollout: "
                           f"{stderr.strip()[-3000:]}")
    outcomes = {line["session"]: line for line in lines if not line.get("started")}
    trajectories = _take(server.proxy, [s for s in started if s in outcomes])
    for session, trajectory in trajectories.items():
        if outcomes[session]["error"] is not None:
            trajectory.error = outcomes[session]["error"]
    for session in started.keys() - outcomes.keys():
        trajectories[session] = _close(server.proxy, session,
                                       f"the verifiers runner {failure} mid-rollout")
    order = sorted(started, key=lambda s: (started[s]["task_index"], started[s]["sample"]))
    return [trajectories[session] for session in order]


def _take(proxy: Proxy, sessions: list[str], timeout: float = 10.0) -> dict[str, Trajectory]:
    """The trajectories of ``sessions`` (finished over HTTP) from the proxy's queue; others
    found there go back."""
    wanted, found, others = set(sessions), {}, []
    deadline = time.monotonic() + timeout
    while wanted - found.keys():
        try:
            trajectory = proxy.finished.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"the proxy never finished sessions "
                               f"{sorted(wanted - found.keys())}") from None
        session = trajectory.rollout_id.removeprefix("proxy/")
        if session in wanted:
            found[session] = trajectory
        else:
            others.append(trajectory)
    for trajectory in others:
        proxy.finished.put(trajectory)
    return found


def _close(proxy: Proxy, session: str, error: str, wait: float = 30.0) -> Trajectory:
    """Finish a session the runner left open (reward 0, ``error`` set); a request still in
    flight for it (the killed runner's) is waited for."""
    deadline = time.monotonic() + wait
    while True:
        try:
            trajectory = proxy.finish(session, 0.0)
            break
        except ProxyError as exc:
            if exc.code != "session_busy" or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    trajectory.error = error
    return trajectory


def train(trainer, server: ProxyServer, python: str | Path, env_id: str, steps: int,
          **options) -> list[dict[str, float]]:
    """``steps`` rounds of: the trainer's ``tasks_per_step`` next tasks of ``env_id`` (in
    the taskset's order, wrapping around) x its ``samples_per_task`` through :func:`collect`
    -> :func:`~agentrl_fast.train.proxy_driver.train_step`."""
    config, history = trainer.config, []
    for _ in range(steps):
        trajectories = collect(server, python, env_id, tasks=config.tasks_per_step,
                               samples=config.rollout.samples_per_task,
                               skip=trainer.data_position, **options)
        trainer.data_position += config.tasks_per_step
        history.append(train_step(trainer, server.proxy, trajectories))
    return history
