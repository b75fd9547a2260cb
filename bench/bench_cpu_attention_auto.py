"""`auto`'s choice on the CPU between our native kernel and torch's flash kernel (`cpu_flash`):
forward + backward of both on plain causal batches of one sequence length and on one prompt with
8 suffixes, at head dims 32, 64 and 128, beside the batch's `mean_keys` and what `auto` picks
(`CPU_FLASH_*` in agentrl_fast/ops/varlen_attention.py).

    python bench/bench_cpu_attention_auto.py [--threads 2] [--tiny] [--record PATH.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import time
from pathlib import Path

import torch

from agentrl_fast.ops.varlen_attention import (CPU_FLASH_FROM_KEYS, CPU_FLASH_WIDE_FROM_KEYS,
                                               CPU_FLASH_WIDE_HEAD_DIM, mean_keys,
                                               resolve_backend, varlen_attention)

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIMS = (32, 64, 128)
TOKENS = 8192  # per plain batch: 8192 / L sequences of L
PLAIN_LENGTHS = (256, 512, 768, 1024, 2048, 4096)
PREFIXES = ((256, 64), (512, 128), (768, 128), (1024, 256), (2048, 256))  # (prompt, suffix)
SUFFIXES = 8
HEADS = (8, 2)


def layout(kind: str, size: tuple[int, ...]) -> tuple[list[int], list[int] | None]:
    """(lengths, prefix_of) of a plain batch (``size = (L,)``) or a prompt with suffixes."""
    if kind == "plain":
        return [size[0]] * max(1, TOKENS // size[0]), None
    prompt, suffix = size
    return [prompt] + [suffix] * SUFFIXES, [-1] + [0] * SUFFIXES


def layout_tensors(lengths: list[int], prefix_of: list[int] | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cu_seqlens [B+1] int32, prefix_of [B] int32 or None)."""
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return cu, None if prefix_of is None else torch.tensor(prefix_of, dtype=torch.int32)


def time_ms(backend: str, lengths: list[int], prefix_of: list[int] | None, head_dim: int,
            repeats: int) -> float:
    """Best of ``repeats`` forward + backward calls (after one warm-up)."""
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    cu, parents = layout_tensors(lengths, prefix_of)
    leaves = [torch.randn(total, h, head_dim, generator=gen).requires_grad_()
              for h in (HEADS[0], HEADS[1], HEADS[1])]
    dout = torch.randn(total, HEADS[0], head_dim, generator=gen)

    def run():
        out = varlen_attention(*leaves, cu, max(lengths), prefix_of=parents, backend=backend)
        torch.autograd.grad(out, leaves, dout)

    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def rows(args) -> list[str]:
    cases = [("plain", (length,)) for length in PLAIN_LENGTHS] + [("prefix", p) for p in PREFIXES]
    if args.tiny:
        cases = [("plain", (64,)), ("prefix", (48, 16))]
    lines = ["| batch | head dim | mean keys | native ms | cpu_flash ms | native / cpu_flash | "
             "auto picks | the faster? |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for head_dim in HEAD_DIMS:
        for kind, size in cases:
            lengths, prefix_of = layout(kind, size)
            cu, parents = layout_tensors(lengths, prefix_of)
            q = torch.empty(sum(lengths), HEADS[0], head_dim)
            keys = mean_keys(cu, q.shape[0], parents)
            picked = resolve_backend("auto", q.device, q, q[:, :HEADS[1]], cu, parents)
            native = time_ms("native", lengths, prefix_of, head_dim, args.repeats)
            flash = time_ms("cpu_flash", lengths, prefix_of, head_dim, args.repeats)
            faster = "native" if native <= flash else "cpu_flash"
            name = (f"{len(lengths)} x {size[0]}" if kind == "plain"
                    else f"prompt {size[0]} + {SUFFIXES} x {size[1]}")
            line = (f"| {name} | {head_dim} | {keys:.0f} | {native:.0f} | {flash:.0f} | "
                    f"{native / flash:.2f} | {picked} | {'yes' if picked == faster else 'no'} |")
            print(line, flush=True)
            lines.append(line)
    return lines


def kept_summary(record: Path) -> str:
    """The ``Summary:`` paragraph of an earlier ``record`` (written by hand), or a stub."""
    if record.exists():
        paragraphs = record.read_text().split("\n\n")
        for paragraph in paragraphs:
            if paragraph.startswith("Summary:"):
                return paragraph
    return "Summary: (to write by hand from the table)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="two small batches (the plumbing)")
    parser.add_argument("--record", type=Path, help="write the table here (markdown)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    table = rows(args)
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True).stdout.strip()
        header = [
            "# `auto` on the CPU: native against cpu_flash by the keys a query sees", "",
            kept_summary(args.record), "",
            f"Command: `python bench/bench_cpu_attention_auto.py --threads {args.threads} "
            f"--record {args.record}`", "",
            f"Date {datetime.date.today()}, commit {commit}. Machine: {platform.machine()}, "
            f"{args.threads} threads, torch {torch.__version__}; float32, {HEADS[0]} query / "
            f"{HEADS[1]} KV heads, causal, forward + backward, best of {args.repeats} after a "
            f"warm-up; plain batches of {TOKENS} tokens; auto's threshold "
            f"{CPU_FLASH_FROM_KEYS} mean keys, {CPU_FLASH_WIDE_FROM_KEYS} from head dim "
            f"{CPU_FLASH_WIDE_HEAD_DIM}. Run time {time.time() - start:.0f} s.", ""]
        args.record.write_text("\n".join(header + table) + "\n")


if __name__ == "__main__":
    main()
