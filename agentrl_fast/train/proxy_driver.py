"""Training an unchanged agent through the proxy: N agents (threads) against the server ->
finished sessions -> ``Trainer.train_on`` -> the generator serves the new weights.

    proxy = proxy_for(trainer)                      # the trainer's generator and sampling
    with ProxyServer(proxy) as server:
        history = train(trainer, server, agent, steps=10)   # agent(base_url, task) -> reward
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence

from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.proxy import Proxy, ProxyServer
from agentrl_fast.train.data import next_tasks


def proxy_for(trainer, **options) -> Proxy:
    """A proxy on ``trainer``'s generator with its rollout sampling and budgets (the
    generator the trainer refreshes after each update)."""
    rollout = trainer.config.rollout
    options = {"context_budget": rollout.context_budget,
               "max_total_tokens": rollout.max_total_tokens, "seed": trainer.config.seed,
               "version": trainer.step_index, **options}
    return Proxy(trainer.engine.generator, trainer.chat_format, rollout.sampling, **options)


def _run_agent(server: ProxyServer, agent, task, sample_index: int) -> Trajectory:
    proxy = server.proxy
    session = proxy.create_session(task_id=getattr(task, "id", None), sample_index=sample_index)
    try:
        reward = agent(server.base_url(session), task)
    except Exception as error:  # noqa: BLE001 - the agent's failure is this rollout's only
        trajectory = proxy.finish(session, 0.0)
        trajectory.error = f"the agent raised {type(error).__name__}: {error}"
        return trajectory
    return proxy.finish(session, float(reward or 0.0))


def collect(server: ProxyServer, agent: Callable[[str, Any], float], tasks: Sequence,
            samples_per_task: int = 1, workers: int = 8) -> list[Trajectory]:
    """Run ``agent(base_url, task) -> reward`` for every task ``samples_per_task`` times, on
    ``workers`` threads, each run in a session of its own; the finished trajectories in
    (task, sample) order. An agent that raises gives a trajectory with ``error`` (not trained
    on)."""
    jobs = [(task, sample) for task in tasks for sample in range(samples_per_task)]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
        return list(pool.map(lambda job: _run_agent(server, agent, *job), jobs))


def fresh(trajectories: Sequence[Trajectory], version: int, max_staleness: int
          ) -> list[Trajectory]:
    """Those whose every action token is at most ``max_staleness`` versions behind
    ``version`` (a session that spanned an update carries more than one version)."""
    def oldest(t: Trajectory) -> int:
        return min((v for s in t.sub_traces for v in s.action_versions()), default=version)
    return [t for t in trajectories if version - oldest(t) <= max_staleness]


def train_step(trainer, proxy: Proxy, trajectories: Sequence[Trajectory],
               max_staleness: int = 0) -> dict[str, float]:
    """One update on finished sessions (``Trainer.train_on``, generation paused meanwhile);
    the proxy then samples with the new weights, as version ``trainer.step_index``."""
    kept = fresh(trajectories, trainer.step_index, max_staleness)
    with proxy.paused():
        metrics = trainer.train_on(kept)
        if proxy.generator is not trainer.engine.generator:  # train_on refreshed the trainer's
            proxy.generator.update_weights(trainer.rollout_policy)
        proxy.version = trainer.step_index
    metrics["stale_rollouts_dropped"] = len(trajectories) - len(kept)
    return metrics


def train(trainer, server: ProxyServer, agent: Callable[[str, Any], float], steps: int,
          workers: int = 8, log: Callable[[dict], None] | None = None) -> list[dict[str, float]]:
    """``steps`` rounds of: the trainer's next ``tasks_per_step`` tasks x ``samples_per_task``
    agent runs through the proxy (:func:`collect`) -> :func:`train_step`."""
    config, history = trainer.config, []
    for _ in range(steps):
        tasks, trainer.data_position = next_tasks(trainer.tasks, trainer.data_position,
                                                  config.tasks_per_step, config.seed)
        trajectories = collect(server, agent, tasks, config.rollout.samples_per_task, workers)
        metrics = train_step(trainer, server.proxy, trajectories)
        history.append(metrics)
        if log is not None:
            log(metrics)
    return history
