"""The critic beside the policy: on one process with the models on the CPU, the critic's
scoring and update of a mini-batch run in a worker thread while the policy's run in the
caller, each on half the intra-op threads (models this small gain little from a second thread
per op, and the two share nothing)."""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Callable, Iterator

import torch


class CriticOverlap:
    """``beside(both)`` yields ``submit(fn, *args) -> result()``. ``enabled`` (the config's
    ``overlap_critic`` on one process with CPU models): with ``both`` and 2+ threads ``fn`` runs
    in the worker thread; otherwise when its result is asked for."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use

    @contextlib.contextmanager
    def beside(self, both: bool) -> Iterator[Callable]:
        threads = torch.get_num_threads()
        if not (both and self.enabled and threads >= 2):
            yield lambda fn, *args: (lambda: fn(*args))
            return
        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="agentrl_fast-critic")

        def run(fn, *args):
            torch.set_num_threads(threads // 2)  # per thread under OpenMP
            return fn(*args)

        jobs = []

        def submit(fn, *args):
            jobs.append(self.worker.submit(run, fn, *args))
            return jobs[-1].result

        torch.set_num_threads(threads - threads // 2)
        try:
            yield submit
        finally:
            concurrent.futures.wait(jobs)  # never leave a job running on a model (on errors too)
            torch.set_num_threads(threads)
