"""A scheduling model of the Triton attention kernels on a GPU: how long the plain and the
prefix-shared packings' forward and dk/dv launches take when their programs are dealt to the
processors in launch order, from the launcher's own tile tables. It reads the one H200
measurement of the prefix-shared op (``bench/results/gpu_2026-12-04/prefix_sharing.md``: the
plain packing and the one-split prefix kernels at head dim 64) and predicts the launches no GPU
has run yet (the dk/dv split over several programs, other shapes). A model, not a
measurement: it calibrates two numbers on two timings.

    python bench/attention_schedule_model.py [--record PATH.md]

The model:

- Programs: the launcher's grids (``agentrl_fast/ops/varlen_attention_triton.py``): one per
  (tile, head) in the order of its tile table (longest work first); the prefix dk/dv kernel
  runs every split of the prefixes' tiles first, a tile's splits side by side. A program's
  cost is its loop's iterations (key blocks of the forward, (query head, query block) entries
  of the dk/dv kernel) plus a fixed number (``FIXED``: loads, stores).
- Processors: ``PROCESSORS`` each holding as many programs at once as the kernel's registers,
  warps and shared memory allow (``bench/results/triton_compile.md``, triton 3.6.0: the
  H200's); a program starts on the first free slot, in launch order (greedy list scheduling).
- Time: iterations of the longest slot x a per-iteration time, one for the forward's (128 x
  128 tiles at D 64), one for the dk/dv kernel's (64 x 64): the two unknowns, solved from the
  H200's plain and one-split shared times. Split programs add a pass over their float32 sums
  at the measured copy bandwidth. Launch gaps, caches and the preprocess are left out (the
  same or smaller in the shared packing).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import heapq
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from agentrl_fast.ops import varlen_attention_triton as launcher  # noqa: E402

COMPILE_REPORT = ROOT / "bench/results/triton_compile.md"
# The H200 (bench/results/gpu_2026-12-04): 132 processors of 64K registers, 228 KB of shared
# memory and 64 warps each; the copy bandwidth its GAE stage measured.
PROCESSORS, REGISTERS, SHARED_BYTES, WARPS = 132, 65536, 233472, 64
COPY_BYTES_PER_MS = 4160e9 / 1e3
FIXED = 1.0  # a program's iterations outside its loop
# The calibration: bf16, a 2048-token prompt + 8 suffixes of 256, 8 query / 2 KV heads of 64,
# forward + backward, ms (gpu_2026-12-04/prefix_sharing.md: plain; shared with one split).
MEASURED = {"plain": 1.06, "shared, 1 split": 0.94}
LONG_PROMPT = (1, 2048, 8, 256, 8, 2)  # (prompts, prompt, suffixes, suffix, Hq, Hk)
# Forward (BLOCK_M, BLOCK_N) and dk/dv (BLOCK, STEP) at bf16 D 64: the kernels' defaults then
# and now (agentrl_fast/kernels/varlen_attention.py).
FORWARD_TILE, DKDV_TILE = (128, 128), (64, 64)
OTHER_SHAPES = [(2, 2048, 8, 256, 8, 2), (4, 2048, 8, 256, 8, 2), (1, 2048, 4, 512, 8, 2),
                (1, 2048, 16, 256, 8, 2), (1, 4096, 8, 1024, 8, 2), (1, 2048, 8, 256, 32, 8),
                (8, 1024, 4, 256, 8, 2)]


# Batches whose plain dk/dv launch order the report compares (lengths, query heads, KV heads,
# programs per processor: 2 as at D 64, 1 as at D 128).
ORDER_BATCHES = [([2304] * 8, 8, 2, 2), ([1000] * 16, 16, 4, 2), ([2048] * 8, 32, 8, 2),
                 ([2048] * 8, 32, 8, 1), ([2048] * 8, 28, 4, 1), ([4096] * 4, 32, 8, 1),
                 ([16384], 32, 8, 1)]


def programs_per_processor(kernel: str) -> int:
    """How many programs of ``kernel`` (a configuration of the compile report) one processor
    holds: registers (allocated per warp in units of 256), shared memory and warps."""
    pattern = re.compile(rf"^\| {re.escape(kernel)} \| 3\.6\.0 \| (\d+) \| \d+ \| (\d+) \| \d+ "
                         rf"\| (\d+) \|", re.M)
    match = pattern.search(COMPILE_REPORT.read_text())
    if match is None:
        raise SystemExit(f"{COMPILE_REPORT}: no triton 3.6.0 row for {kernel}")
    warps, registers, shared = (int(x) for x in match.groups())
    per_warp = math.ceil(registers * 32 / 256) * 256
    return min(REGISTERS // (per_warp * warps), SHARED_BYTES // max(shared, 1), WARPS // warps)


def makespan(costs: list[float], slots: int) -> float:
    """Iterations until the last program ends: each program, in order, on the slot free first."""
    free = [0.0] * slots
    end = 0.0
    for cost in costs:
        start = heapq.heappop(free)
        end = max(end, start + cost)
        heapq.heappush(free, start + cost)
    return end


@dataclass
class Shape:
    """``prompts`` prompts of ``prompt`` tokens with ``suffixes`` suffixes of ``suffix`` each."""
    prompts: int
    prompt: int
    suffixes: int
    suffix: int
    heads_q: int
    heads_k: int

    @property
    def name(self) -> str:
        return (f"{self.prompts} x (prompt {self.prompt} + {self.suffixes} x {self.suffix}), "
                f"{self.heads_q}/{self.heads_k} heads")

    def plain_cu(self) -> torch.Tensor:
        count = self.prompts * self.suffixes
        return torch.arange(count + 1, dtype=torch.int32) * (self.prompt + self.suffix)

    def shared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens, prefix_of) of the shared packing: each prompt, then its suffixes."""
        lengths, prefix_of = [], []
        for _ in range(self.prompts):
            prefix_of += [-1] + [len(lengths)] * self.suffixes
            lengths += [self.prompt] + [self.suffix] * self.suffixes
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
        return cu, torch.tensor(prefix_of, dtype=torch.int32)

    def ideal(self) -> float:
        """Plain (query, key) pairs over shared pairs."""
        whole = self.prompt + self.suffix
        plain = self.suffixes * whole * (whole + 1) // 2
        shared = (self.prompt * (self.prompt + 1) // 2
                  + self.suffixes * self.suffix * (self.prompt + (self.suffix + 1) / 2))
        return plain / shared


@dataclass
class Model:
    """What the model assumes: the programs a processor holds of each launch (forward, dk/dv,
    prefix forward, prefix dk/dv) and a program's iterations outside its loop."""
    forward: int
    dkdv: int
    prefix_forward: int
    prefix_dkdv: int
    fixed: float = FIXED

    @classmethod
    def read(cls) -> Model:
        """The compile report's programs per processor (bf16 D 64), ``FIXED``."""
        return cls(*(programs_per_processor(name) for name in (
            "varlen_attention_forward_bf16_d64", "varlen_attention_backward_bf16_d64",
            "varlen_attention_prefix_forward_bf16_d64",
            "varlen_attention_prefix_backward_bf16_d64")))


def plain_costs(shape: Shape, fixed: float) -> tuple[list[float], list[float]]:
    """Per-program iterations of the plain forward and dk/dv launches, in launch order."""
    cu = shape.plain_cu()
    block_m, block_n = FORWARD_TILE
    bounds, sequence, tile_block, _ = launcher.tile_table(cu, int(cu[-1]), block_m, True)
    lengths = (bounds[1:] - bounds[:-1]).tolist()
    forward = [fixed + math.ceil(min(lengths[s], (b + 1) * block_m) / block_n)
               for s, b in zip(sequence.tolist(), tile_block.tolist()) if s >= 0
               for _ in range(shape.heads_q)]
    return forward, plain_dkdv_costs(cu, shape.heads_q, shape.heads_k, fixed)


def plain_dkdv_costs(cu: torch.Tensor, heads_q: int, heads_k: int,
                     fixed: float) -> list[float]:
    """Per-program iterations of the plain dk/dv launch over ``cu`` (int32), in launch order."""
    block, step = DKDV_TILE
    groups = heads_q // heads_k
    bounds, sequence, tile_block, _ = launcher.tile_table(cu, int(cu[-1]), block, True,
                                                          by_length=True)
    lengths = (bounds[1:] - bounds[:-1]).tolist()
    return [fixed + groups * math.ceil((lengths[s] - b * block) / step)
            for s, b in zip(sequence.tolist(), tile_block.tolist()) if s >= 0
            for _ in range(heads_k)]


def shared_forward_costs(shape: Shape, fixed: float) -> list[float]:
    cu, prefix_of = shape.shared()
    block_m, block_n = FORWARD_TILE
    bounds, prefix, sequence, tile_block, _ = launcher.prefix_tile_table(
        cu, prefix_of, int(cu[-1]), block_m)
    lengths, prefix = (bounds[1:] - bounds[:-1]).tolist(), prefix.tolist()
    costs = []
    for s, b in zip(sequence.tolist(), tile_block.tolist()):
        if s >= 0:
            own = math.ceil(min(lengths[s], (b + 1) * block_m) / block_n)
            keys = math.ceil(lengths[prefix[s]] / block_n) if prefix[s] >= 0 else 0
            costs += [fixed + own + keys] * shape.heads_q
    return costs


def shared_dkdv(shape: Shape, splits: int | None, fixed: float
                ) -> tuple[list[float], int, float]:
    """(per-program iterations in launch order, the split count, ms of the split sums' pass)
    of the prefix dk/dv launch; ``splits`` None: the launcher's own count on this device.
    Launch order: every split of the prefixes' tiles (a tile's splits side by side), then the
    table's tiles, a split prefix tile's program returning at once (no iterations)."""
    cu, prefix_of = shape.shared()
    groups = shape.heads_q // shape.heads_k
    block, step = DKDV_TILE
    (bounds, sequence, tile_block, _, query_ptr, _, _, _, _, split_tile,
     facts) = launcher.prefix_dkdv_table(cu, prefix_of, int(cu[-1]), block, step)
    if splits is None:
        splits = launcher.split_count(facts, shape.heads_k, groups, PROCESSORS)
    lengths, query_ptr = (bounds[1:] - bounds[:-1]).tolist(), query_ptr.tolist()
    entries = []  # per tile of the table: (own blocks, all blocks) or None (a padding slot)
    for s, b in zip(sequence.tolist(), tile_block.tolist()):
        own = math.ceil((lengths[s] - b * block) / step) if s >= 0 else 0
        entries.append((own, own + query_ptr[s + 1] - query_ptr[s]) if s >= 0 else None)

    def chunk(total: int, split: int) -> int:  # the kernel's j0:j1 of a split tile
        work = groups * total
        return (split + 1) * work // splits - split * work // splits

    first = []  # the split programs
    if splits > 1:
        first = [fixed + chunk(entries[t][1], split)
                 for t in split_tile.tolist()[:facts[1]] for _ in range(shape.heads_k)
                 for split in range(splits)]
    table = []
    for entry in entries:
        if entry is not None:
            own, total = entry
            split_here = total > own and splits > 1
            table += [0.0 if split_here else fixed + groups * total] * shape.heads_k
    sums = (2 * splits * 4 + 2 * 2) * facts[0] * shape.heads_k * 64 if splits > 1 else 0
    return first + table, splits, sums / COPY_BYTES_PER_MS


@dataclass
class Iterations:
    """Longest slot's iterations of each launch."""
    forward: float
    dkdv: float
    sums_ms: float = 0.0


def plain_iterations(shape: Shape, model: Model) -> Iterations:
    forward, dkdv = plain_costs(shape, model.fixed)
    return Iterations(makespan(forward, PROCESSORS * model.forward),
                      makespan(dkdv, PROCESSORS * model.dkdv))


def shared_iterations(shape: Shape, model: Model, splits: int | None
                      ) -> tuple[Iterations, int]:
    dkdv, splits, sums_ms = shared_dkdv(shape, splits, model.fixed)
    forward = shared_forward_costs(shape, model.fixed)
    return Iterations(makespan(forward, PROCESSORS * model.prefix_forward),
                      makespan(dkdv, PROCESSORS * model.prefix_dkdv), sums_ms), splits


def calibrate(model: Model) -> tuple[float, float]:
    """(ms per forward iteration, ms per dk/dv iteration) that reproduce ``MEASURED``."""
    shape = Shape(*LONG_PROMPT)
    plain = plain_iterations(shape, model)
    shared, _ = shared_iterations(shape, model, 1)
    a = torch.tensor([[plain.forward, plain.dkdv], [shared.forward, shared.dkdv]],
                     dtype=torch.float64)
    b = torch.tensor([MEASURED["plain"], MEASURED["shared, 1 split"]], dtype=torch.float64)
    forward_ms, dkdv_ms = torch.linalg.solve(a, b).tolist()
    return forward_ms, dkdv_ms


def ms(iterations: Iterations, rates: tuple[float, float]) -> float:
    return iterations.forward * rates[0] + iterations.dkdv * rates[1] + iterations.sums_ms


def tflops(iteration_flops: float, slots: int, ms_per_iteration: float) -> float:
    return iteration_flops * slots / (ms_per_iteration * 1e9)


def longest_first_ms(shape: Shape, model: Model, rates: tuple[float, float],
                     splits: int | None) -> tuple[float, float]:
    """(plain ms, shared ms) with both dk/dv launches' programs dealt longest first (the
    forward's tables already are), ``splits`` as in ``shared_dkdv``."""
    forward, dkdv = plain_costs(shape, model.fixed)
    plain = (makespan(forward, PROCESSORS * model.forward) * rates[0]
             + makespan(sorted(dkdv, reverse=True), PROCESSORS * model.dkdv) * rates[1])
    costs, _, sums_ms = shared_dkdv(shape, splits, model.fixed)
    forward = shared_forward_costs(shape, model.fixed)
    shared = (makespan(forward, PROCESSORS * model.prefix_forward) * rates[0] + sums_ms
              + makespan(sorted(costs, reverse=True), PROCESSORS * model.prefix_dkdv) * rates[1])
    return plain, shared


def sensitivity(model: Model, shape: Shape) -> list[tuple[Model, float]]:
    """(model, predicted shared ms at the launcher's split count), each recalibrated: the
    fixed cost from 0 to 4, then one and two programs per processor in every launch instead
    of the compile report's."""
    variants = [dataclasses.replace(model, fixed=fixed) for fixed in (0.0, 1.0, 2.0, 4.0)]
    variants += [Model(n, n, n, n, model.fixed) for n in (1, 2)]
    return [(variant, ms(shared_iterations(shape, variant, None)[0], calibrate(variant)))
            for variant in variants]


def report(model: Model) -> list[str]:
    """The record's sections (markdown lines)."""
    rates = calibrate(model)
    shape = Shape(*LONG_PROMPT)
    return (calibration_section(model, rates, shape) + splits_section(model, rates, shape)
            + shapes_section(model, rates) + sensitivity_section(model, shape)
            + order_section(model, rates, shape))


def calibration_section(model: Model, rates: tuple[float, float], shape: Shape) -> list[str]:
    plain = plain_iterations(shape, model)
    one, _ = shared_iterations(shape, model, 1)
    forward_flops = 4 * FORWARD_TILE[0] * FORWARD_TILE[1] * 64  # D 64
    dkdv_flops = 10 * DKDV_TILE[0] * DKDV_TILE[1] * 64  # 5 products: S, dP, dV, dK, dQ
    forward_rate = tflops(forward_flops, PROCESSORS * model.forward, rates[0])
    dkdv_rate = tflops(dkdv_flops, PROCESSORS * model.dkdv, rates[1])
    return [
        "## Calibration", "",
        f"Programs per processor (compile report, triton 3.6.0, bf16 D 64): forward "
        f"{model.forward}, dk/dv with the atomic dq {model.dkdv}, prefix forward "
        f"{model.prefix_forward}, prefix dk/dv {model.prefix_dkdv}; {PROCESSORS} "
        f"processors; {model.fixed:g} fixed iteration per program.", "",
        "| launch | longest slot (iterations) |", "| --- | --- |",
        f"| plain forward | {plain.forward:.0f} |", f"| plain dk/dv | {plain.dkdv:.0f} |",
        f"| shared forward | {one.forward:.0f} |", f"| shared dk/dv, 1 split | {one.dkdv:.0f} |",
        "",
        f"Solved from the H200's {MEASURED['plain']} ms (plain) and "
        f"{MEASURED['shared, 1 split']} ms (shared, one split): {rates[0] * 1e3:.2f} us per "
        f"forward iteration (128 x 128 x D 64: {forward_rate:.0f} TFLOP/s over the device), "
        f"{rates[1] * 1e3:.2f} us per dk/dv iteration (64 x 64: {dkdv_rate:.0f} TFLOP/s). "
        f"Plain: forward {plain.forward * rates[0]:.3f} ms, backward "
        f"{plain.dkdv * rates[1]:.3f} ms.", ""]


def splits_section(model: Model, rates: tuple[float, float], shape: Shape) -> list[str]:
    lines = ["## The long prompt at each dk/dv split count (predicted)", "",
             f"{shape.name}, bf16 D 64; ideal {shape.ideal():.2f}x.", "",
             "| dk/dv splits | shared forward it. | shared dk/dv it. | split sums ms | "
             "shared ms | speed-up | % of ideal |", "| --- | --- | --- | --- | --- | --- | --- |"]
    own = shared_iterations(shape, model, None)[1]
    plain_ms = ms(plain_iterations(shape, model), rates)
    for splits in range(1, 9):
        shared, _ = shared_iterations(shape, model, splits)
        speedup = plain_ms / ms(shared, rates)
        mark = " (the launcher's)" if splits == own else ""
        lines.append(f"| {splits}{mark} | {shared.forward:.0f} | {shared.dkdv:.0f} | "
                     f"{shared.sums_ms:.4f} | {ms(shared, rates):.3f} | {speedup:.2f}x | "
                     f"{speedup / shape.ideal():.0%} |")
    return lines


def shapes_section(model: Model, rates: tuple[float, float]) -> list[str]:
    lines = ["", "## Shapes at the launcher's split count (predicted, bf16 D 64)", "",
             "Last column: both dk/dv launches (plain and shared) dealt longest first, the "
             "launcher's split count (see the last section).", "",
             "| shape | ideal | splits | plain ms | shared ms | speed-up | % of ideal | "
             "best split count: % of ideal | % of ideal, longest first |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape in (Shape(*s) for s in [LONG_PROMPT] + OTHER_SHAPES):
        plain_ms = ms(plain_iterations(shape, model), rates)
        shared, splits = shared_iterations(shape, model, None)
        best = max((plain_ms / ms(shared_iterations(shape, model, n)[0], rates), n)
                   for n in range(1, 9))
        speedup = plain_ms / ms(shared, rates)
        plain_lf, shared_lf = longest_first_ms(shape, model, rates, None)
        lines.append(f"| {shape.name} | {shape.ideal():.2f}x | {splits} | {plain_ms:.3f} | "
                     f"{ms(shared, rates):.3f} | {speedup:.2f}x | {speedup / shape.ideal():.0%} | "
                     f"{best[1]}: {best[0] / shape.ideal():.0%} | "
                     f"{plain_lf / shared_lf / shape.ideal():.0%} |")
    return lines


def sensitivity_section(model: Model, shape: Shape) -> list[str]:
    lines = ["", "## How much the prediction leans on the fixed cost and the occupancy", "",
             "The long prompt at the launcher's split count, recalibrated with each fixed "
             "cost per program (iterations) and programs per processor (forward, dk/dv, "
             "prefix forward, prefix dk/dv):", "",
             "| fixed | programs per processor | shared ms | % of ideal |",
             "| --- | --- | --- | --- |"]
    for variant, shared_ms in sensitivity(model, shape):
        lines.append(f"| {variant.fixed:g} | {variant.forward}, {variant.dkdv}, "
                     f"{variant.prefix_forward}, {variant.prefix_dkdv} | {shared_ms:.3f} | "
                     f"{MEASURED['plain'] / shared_ms / shape.ideal():.0%} |")
    return lines


def order_section(model: Model, rates: tuple[float, float], shape: Shape) -> list[str]:
    _, dkdv = plain_costs(shape, model.fixed)
    slots = PROCESSORS * model.dkdv
    plain_ms = ms(plain_iterations(shape, model), rates)
    lines = ["", "## The plain dk/dv launch's order", "",
             f"The plain backward deals its tiles by sequence length, each sequence's tiles in "
             f"block order (`tile_table(..., by_length=True)`). On the long prompt's 8 "
             f"sequences x 2 KV heads ({len(dkdv)} programs on {slots} slots) that leaves the "
             f"last sequences' longest tiles to start late: {makespan(dkdv, slots):.0f} "
             f"iterations against {makespan(sorted(dkdv, reverse=True), slots):.0f} longest "
             f"first and {sum(dkdv) / slots:.0f} on average per slot. Dealt longest first "
             f"the plain packing would take "
             f"{longest_first_ms(shape, model, rates, None)[0]:.3f} ms here instead of "
             f"{plain_ms:.3f}: the shared packing's figures above lean on this; the last "
             f"column of the shapes' table gives them against it. Longest first has not been "
             f"measured: with many sequences it runs far more of them at once, whose queries "
             f"then share the L2 cache less.", "",
             "Plain dk/dv launches of other batches (64 x 64 tiles; 2 programs per "
             "processor as at D 64, 1 as at D 128), longest slot in iterations: the order "
             "matters where the grid is a few waves deep.", "",
             "| sequences | heads (q / KV) | programs | slots | by length | longest first | "
             "average |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for lengths, heads_q, heads_k, per_processor in ORDER_BATCHES:
        costs = plain_dkdv_costs(torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
                                 heads_q, heads_k, model.fixed)
        slots = PROCESSORS * per_processor
        lines.append(f"| {len(lengths)} x {lengths[0]} | {heads_q} / {heads_k} | {len(costs)} | "
                     f"{slots} | {makespan(costs, slots):.0f} | "
                     f"{makespan(sorted(costs, reverse=True), slots):.0f} | "
                     f"{sum(costs) / slots:.0f} |")
    return lines


def header(model: Model) -> list[str]:
    """Title, summary (the long prompt's prediction), command, date and commit."""
    rates = calibrate(model)
    shape = Shape(*LONG_PROMPT)
    plain_ms = ms(plain_iterations(shape, model), rates)
    shared, splits = shared_iterations(shape, model, None)
    speedup = plain_ms / ms(shared, rates)
    plain_lf, shared_lf = longest_first_ms(shape, model, rates, None)
    fair = plain_lf / shared_lf / shape.ideal()
    others, gain = [], 0.0
    for other in (Shape(*x) for x in [LONG_PROMPT] + OTHER_SHAPES):
        fractions = {n: ms(plain_iterations(other, model), rates)
                     / ms(shared_iterations(other, model, n)[0], rates) / other.ideal()
                     for n in [None, *range(1, 9)]}
        if other != shape:
            others.append(fractions[None])
        gain = max(gain, max(fractions.values()) - fractions[None])
    moved = [MEASURED["plain"] / shared_ms / shape.ideal() - speedup / shape.ideal()
             for _, shared_ms in sensitivity(model, shape)]
    low, high = min(moved), max(moved)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    return [
        "# A scheduling model of the Triton attention kernels on the H200: the prefix-shared "
        "op's dk/dv splits", "",
        f"Summary: a model, not a measurement. Calibrated on the H200's two timings of the "
        f"long prompt (plain {MEASURED['plain']} ms, one-split shared "
        f"{MEASURED['shared, 1 split']} ms, bf16 D 64), it predicts the prefix kernels with "
        f"the launcher's {splits} dk/dv splits at {ms(shared, rates):.3f} ms, {speedup:.2f}x "
        f"the plain packing of an ideal "
        f"{shape.ideal():.2f}x ({speedup / shape.ideal():.0%}; {fair:.0%} against a plain "
        f"backward dealt longest first, which ours is not), {min(others):.0%}-{max(others):.0%} "
        f"over the other shapes below; a split count chosen per shape would add up to "
        f"{gain * 100:.0f} points. Over the fixed cost and the occupancy it assumes it moves "
        f"{low * 100:+.0f} to {high * 100:+.0f} points. A GPU run of "
        f"`bench/bench_prefix_sharing.py` times the split counts it ranks.", "",
        "Command: `python bench/attention_schedule_model.py --record "
        "bench/results/attention_schedule_model.md`", "",
        f"Date {datetime.date.today()}, commit {commit}. No GPU: the launcher's tile tables "
        f"on the CPU, the H200's numbers from `gpu_2026-12-04/`.", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, help="write the report here (markdown)")
    args = parser.parse_args()
    model = Model.read()
    text = "\n".join(report(model)) + "\n"
    print(text)
    if args.record:
        args.record.write_text("\n".join(header(model)) + "\n" + text)


if __name__ == "__main__":
    main()
