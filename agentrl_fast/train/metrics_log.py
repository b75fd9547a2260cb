"""A run's metrics on disk: ``metrics.jsonl`` (one JSON row per step: ``kind``, ``step`` and
the numeric metrics) and TensorBoard events (``tb/``, scalars ``<kind>/<metric>``), from the
CLI's runs and from a script alike:

    with MetricsLogger("runs/mine") as logger:
        trainer.train(callback=logger,          # a "train" row per step
                      warmup_callback=lambda m: logger.write("critic_warmup", m["step"], m))
        logger.write("eval", trainer.step_index, evaluate(...))
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLogger:
    """Appends to ``<run_dir>/metrics.jsonl`` and writes TensorBoard events to
    ``<run_dir>/tb`` (when tensorboard is installed: it is a dependency)."""

    def __init__(self, run_dir: str | Path):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # tolerate its absence in odd installs
            self.writer = None

    def write(self, kind: str, step: int, metrics: dict) -> None:
        """One row: ``kind`` ("train", "eval", "warmstart", "critic_warmup", ...), ``step``
        and the numeric values of ``metrics`` (others are left out)."""
        row = {"kind": kind, "step": step, **{k: v for k, v in metrics.items()
                                               if isinstance(v, (int, float))}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if key not in ("kind", "step"):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
            self.writer.flush()

    def __call__(self, metrics: dict) -> None:
        """A ``Trainer.train`` callback: the step's metrics as a "train" row."""
        self.write("train", int(metrics["step"]), metrics)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
