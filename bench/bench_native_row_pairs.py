"""The native CPU attention kernel's query rows in pairs against one at a time: forward +
backward wall time of the same build, each way in its own process
(``AGENTRL_FAST_NATIVE_ROWS_ALONE=1`` is read once), with the outputs and gradients compared bit
for bit.

    python bench/bench_native_row_pairs.py [--threads 1] [--tiny] [--record PATH.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (sequence lengths, query heads, KV heads, head dim): long sequences where pairs share the
# most, mid and short ones, and head dim 16 (one row at a time either way)
SHAPES = [([2048] * 4, 8, 2, 64), ([2048] * 4, 8, 2, 128), ([600] * 12, 8, 2, 64),
          ([300] * 20, 4, 2, 32), ([200] * 40, 4, 2, 16)]
TINY = [([41, 9, 1], 4, 2, 32), ([20, 7], 2, 1, 16)]  # the plumbing (tests)


def child(threads: int, repeats: int, shapes: list) -> None:
    """Print one JSON line per shape: the best of ``repeats`` fwd+bwd times and a digest of
    the outputs' bits."""
    import hashlib
    import time

    import torch

    from agentrl_fast.ops import varlen_attention

    torch.set_num_threads(threads)
    for lengths, hq, hk, d in shapes:
        gen = torch.Generator().manual_seed(0)
        total = sum(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        leaves = [torch.randn(total, h, d, generator=gen).requires_grad_() for h in (hq, hk, hk)]
        dout = torch.randn(total, hq, d, generator=gen)

        def run():
            out = varlen_attention(*leaves, cu, max(lengths), backend="native")
            return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

        results = run()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        digest = hashlib.sha256(b"".join(x.numpy().tobytes() for x in results)).hexdigest()
        print(json.dumps({"shape": f"{lengths[0]} x {len(lengths)}, {hq}/{hk} heads of {d}",
                          "ms": round(best * 1e3, 1), "bits": digest[:16]}), flush=True)


def measure(alone: bool, threads: int, repeats: int, tiny: bool) -> list[dict]:
    env = {**os.environ, "AGENTRL_FAST_NATIVE_ROWS_ALONE": "1" if alone else "0",
           "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run([sys.executable, __file__, "--child", "--threads", str(threads),
                             "--repeats", str(repeats)] + (["--tiny"] if tiny else []), env=env, capture_output=True, text=True,
                            check=True, cwd=ROOT)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the best is kept")
    parser.add_argument("--record", type=Path, default=None, help="write the markdown record")
    parser.add_argument("--tiny", action="store_true", help="two small shapes (the plumbing)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.threads, args.repeats, TINY if args.tiny else SHAPES)
        return 0
    pairs, alone = (measure(flag, args.threads, args.repeats, args.tiny) for flag in (False, True))
    lines = ["# Native CPU attention: query rows in pairs against one at a time", "",
             f"Forward + backward, float32, causal, {args.threads} thread(s), best of "
             f"{args.repeats}; both columns the same build, one at a time forced by "
             "`AGENTRL_FAST_NATIVE_ROWS_ALONE=1`; bits: the outputs' and gradients' digests "
             "compared.", "",
             "| shape | pairs ms | one at a time ms | speed-up | same bits |",
             "| --- | --- | --- | --- | --- |"]
    for p, a in zip(pairs, alone):
        lines.append(f"| {p['shape']} | {p['ms']} | {a['ms']} | {a['ms'] / p['ms']:.2f}x | "
                     f"{'yes' if p['bits'] == a['bits'] else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    if args.record:
        sys.path.insert(0, str(ROOT / "bench"))
        import common

        common.write_record(args.record, text)
    return 0 if all(p["bits"] == a["bits"] for p, a in zip(pairs, alone)) else 1


if __name__ == "__main__":
    sys.exit(main())
