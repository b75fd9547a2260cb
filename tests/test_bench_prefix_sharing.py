"""bench/bench_prefix_sharing.py: its FLOP model counts what the layouts attend, and the script
runs end to end at tiny sizes (its three tables, rows of each part)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # bench/ is not a package

import bench_prefix_sharing as bench

from agentrl_fast.models.packing import pack_shared


def test_the_long_prompt_layouts_and_their_ideal():
    layouts = bench.long_prompt_layouts(2048, 8, 256)
    assert layouts.plain_tokens == 8 * 2304 and layouts.shared_rows == 2048 + 8 * 256
    # plain: 8 causal sequences of 2304; shared: the prompt once, each suffix reads it all
    plain = 8 * 2304 * 2305 // 2
    shared = 2048 * 2049 // 2 + 8 * (256 * 257 // 2 + 256 * 2048)
    assert bench.plain_pairs(layouts.plain_cu) == plain
    assert bench.shared_pairs(layouts.shared_cu, layouts.prefix_of) == shared
    assert round(plain / shared, 2) == 3.24
    third = layouts.rows[2 * 2304:3 * 2304]  # the third sequence: the prompt, then suffix 2
    assert third.tolist() == list(range(2048)) + list(range(2048 + 512, 2048 + 768))
    assert bench.attention_flops(1, 8, 64) == 4 * 64 * 8 * 3.5


def test_the_pairs_a_shared_layout_saves_are_its_prefixes_own():
    """Sharing a prefix of P tokens among n sequences saves (n - 1) P (P + 1) / 2 pairs: its
    own causal part, counted once; the suffixes still read all of it."""
    prompt = list(range(100, 130))  # 30 shared tokens
    sequences = [prompt + [1, 2, 3], prompt + [4] * 9, prompt + [5, 6], list(range(7, 20))]
    layout = pack_shared(sequences, [30, 30, 30, 13])
    plain_cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0).tolist()
    saved = bench.plain_pairs(plain_cu) - bench.shared_pairs(layout.cu_seqlens.tolist(),
                                                             layout.prefix_of.tolist())
    assert saved == 2 * 30 * 31 // 2
    assert layout.saved_tokens == 60
    assert bench.trie_saved([s[:n] for s, n in zip(sequences, [30, 30, 30, 13])]) == 60
    assert bench.trie_saved([[1, 2, 3], [1, 2, 4], [1, 5]]) == 3  # "1" twice, "1 2" once


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end_on_tiny_sizes(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_prefix_sharing.py"),
                             "--device", "cpu", "--tiny", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "prefix_sharing.jsonl").read_text()
            .splitlines()]
    assert {r["op"] for r in rows} == {"prefix_attention", "prefix_step", "prefix_trainer_step"}
    assert {"native shared", "native plain", "native+generic shared"} <= {r["provider"]
                                                                          for r in rows}
    assert all(r["time_ms"] > 0 and r["ratio"] > 0 for r in rows)
    record = (tmp_path / "prefix_sharing.md").read_text()
    assert record.startswith("# Prefix-shared (tree) packing") and "Command: `" in record
    assert "| 2x2 task | 1 |" in record and "| 4x1 shuffle | 1 |" in record
    assert "## The trainer's step" in record and record.count("| 2x2 task |") == 2
    assert "prompt 256 + 4 x 64" in record and "main job 2x2 task" in record


def test_the_long_prompts_time_each_split_count_after_one_split():
    """On CUDA's long prompts the split sweep follows ``triton+1split``; elsewhere (no Triton
    variant, as on the CPU) the backends stay as they are; the launcher's count is an int."""
    backends = ["triton", "triton+1split", "torch"]
    assert bench.long_prompt_backends(backends) == [
        "triton", "triton+1split", "triton+2split", "triton+4split", "triton+8split", "torch"]
    assert bench.long_prompt_backends(["native", "cpu_flash"]) == ["native", "cpu_flash"]
    layouts = bench.long_prompt_layouts(2048, 8, 256)
    assert bench.launcher_splits(layouts, (8, 2), torch.bfloat16, 64, torch.device("cpu")) >= 1
