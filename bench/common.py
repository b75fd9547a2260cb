"""Shared by every benchmark script: timing, device facts and the one row format.

Every benchmark writes rows with the same fields (Liger-Kernel's convention), one JSON object
per line, to a file under ``bench/results/`` (or the folder given with ``--out``):

    op, provider, shape, dtype, device, time_ms, tokens_per_s, gbps, tflops, ratio, peak_gib,
    commit, date

``gbps`` (achieved bandwidth, bytes the op must move / time) or ``tflops`` is filled where the
op is bandwidth- or compute-bound; ``ratio`` is the provider's time over ours (> 1: we are
faster).
"""

import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@dataclass
class Row:
    op: str
    provider: str
    shape: str
    dtype: str
    device: str
    time_ms: float
    tokens_per_s: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    ratio: float | None = None
    peak_gib: float | None = None  # peak device memory above the inputs (CUDA), where measured
    commit: str = field(default_factory=lambda: git_commit())
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def benchmark(fn, device: torch.device, *, warmup: int = 3, repeats: int = 10,
              max_seconds: float = 10.0) -> float:
    """Median time of ``fn()`` in milliseconds, within about ``max_seconds`` (slow baselines stop
    repeating early). CUDA: CUDA events; ``triton.testing.do_bench`` (L2 flushed between calls)
    when one call takes under a tenth of ``max_seconds``. CPU: wall clock."""
    if device.type == "cuda":
        return _cuda_median_ms(fn, repeats, max_seconds)
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
        if time.perf_counter() - start > max_seconds / 2:
            break
    times = []
    start = time.perf_counter()
    while len(times) < repeats:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > max_seconds:
            break
    return statistics.median(times)


def _cuda_median_ms(fn, repeats: int, max_seconds: float) -> float:
    # The first call also compiles (Triton JIT, torch.compile): timed only to pick the method.
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    if first < max_seconds / 10:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    start = time.perf_counter()
    while len(times) < repeats and time.perf_counter() - start < max_seconds:
        times.append(cuda_event_ms(fn))
    return statistics.median(times)


def latency_ms(seconds: list[float]) -> dict:
    """``n``, ``p50_ms``, ``p95_ms`` (nearest rank: the largest of 2 to 20) and ``mean_ms`` of
    latencies given in seconds."""
    ordered = sorted(seconds)
    return {"n": len(ordered), "p50_ms": 1e3 * statistics.median(ordered),
            "p95_ms": 1e3 * ordered[math.ceil(0.95 * len(ordered)) - 1],
            "mean_ms": 1e3 * statistics.fmean(ordered)}


def cuda_event_ms(fn) -> float:
    """One call of ``fn()`` timed with CUDA events (milliseconds)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Measured device-to-device (or memory-to-memory) copy bandwidth: read + write bytes / time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = benchmark(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def write_rows(rows: list[Row], name: str, out_dir: str | os.PathLike | None = None) -> Path:
    """Append rows to ``<out_dir or bench/results>/<name>.jsonl``; returns the path."""
    folder = Path(out_dir) if out_dir else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with path.open("a") as handle:
        for row in rows:
            handle.write(json.dumps(asdict(row)) + "\n")
    return path


def print_table(rows: list[Row]) -> None:
    header = f"{'op':<10} {'provider':<44} {'shape':<34} {'dtype':<9} {'time ms':>10} " \
             f"{'Mtok/s':>10} {'GB/s':>8} {'ratio':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        tok = f"{r.tokens_per_s / 1e6:.2f}" if r.tokens_per_s else "-"
        gbps = f"{r.gbps:.1f}" if r.gbps else "-"
        ratio = f"{r.ratio:.1f}x" if r.ratio else "-"
        print(f"{r.op:<10} {r.provider:<44} {r.shape:<34} {r.dtype:<9} {r.time_ms:>10.3f} "
              f"{tok:>10} {gbps:>8} {ratio:>10}")


def write_record(path: str | os.PathLike, text: str, command: str | None = None) -> Path:
    """Write a results record (markdown starting with its ``# `` title) with the header
    ``bench/results_index.py`` reads: the ``Summary:`` paragraph of the file it replaces is kept
    (a person writes it once the numbers are read; without one the index check says so), and
    ``Command:`` (default: this process's command line) and ``Date ..., commit ...`` lines are
    added when ``text`` has none."""
    path = Path(path)
    lines = text.rstrip("\n").splitlines()
    head = [lines.pop(0)] if lines and lines[0].startswith("# ") else []
    added = []
    kept = _summary(path)
    if kept and not any(line.startswith("Summary:") for line in lines):
        added += ["", *kept]
    if not any(line.startswith("Command") for line in lines):
        command = command or " ".join(["python", *sys.argv])
        added += ["", f"Command: `{command}`"]
    if not re.search(r"\b20\d\d-\d\d-\d\d\b", text) or not re.search(r"\bcommit\b", text, re.I):
        added += ["", f"Date {datetime.date.today().isoformat()}, commit {git_commit()}."]
    path.write_text("\n".join(head + added + lines) + "\n")
    return path


def _summary(path: Path) -> list[str]:
    """The ``Summary:`` paragraph of the record at ``path`` (empty when none). The same reading
    as ``results_index.split_summary``, kept here: importing the index from every benchmark
    would add it to each GPU-suite stage's module list."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    for start, line in enumerate(lines):
        if line.startswith("Summary:"):
            end = start
            while end < len(lines) and lines[end].strip():
                end += 1
            return lines[start:end]
    return []
