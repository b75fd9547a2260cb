"""The Triton kernels of ``varlen_attention`` compiled for sm_90 (no GPU needed), under this
process's triton and under triton 3.6 (the side environment ``triton36``, without torch): the bf16 forward's PTX uses ``wgmma`` (Hopper's matrix path), and
the bf16/fp16 forwards at D = 64 and 128 use no spill. (``tests/test_triton_kernels.py``
compiles every configuration; the compile report is ``bench/results/triton_compile.md`` (``python bench/triton_compile_report.py``).)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from side_envs import side_env_python

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TRITONS = ["installed", "triton36"]  # this process's triton; the side environment's
HOT = [f"varlen_attention_forward_{dtype}_d{head_dim}" for dtype in ("bf16", "fp16")
       for head_dim in (64, 128)]

SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import triton_aot
names = set(json.loads(sys.argv[1]))
for module in triton_aot.load_kernel_modules():
    for spec in getattr(module, "aot_specs", lambda: [])():
        if spec["name"] in names:
            print(json.dumps(triton_aot.compile_spec(spec)), flush=True)
"""


@pytest.mark.parametrize("triton", TRITONS)
def test_hot_forward_configurations_use_wgmma_and_do_not_spill(triton):
    python = sys.executable if triton == "installed" else side_env_python(triton)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([python, "-c", SCRIPT.format(tests=str(TESTS)), json.dumps(HOT)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    rows = {row["name"]: row for row in map(json.loads, filter(None, result.stdout.splitlines()))}
    assert set(rows) == set(HOT), result.stderr[-4000:]
    for name, row in rows.items():
        assert row["ok"] and row["ptxas_ok"], json.dumps(row)[-3000:]
        assert row["spill_bytes"] == 0, f"{name} spills {row['spill_bytes']} bytes ({row['triton']})"
        if "_bf16_" in name:
            assert row["wgmma"], f"{name}: no wgmma in the PTX under triton {row['triton']}"
