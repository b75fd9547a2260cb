"""bench/critic_study.py's bookkeeping (the study itself is a benchmark, hours of CPU): the
summary columns computed from a run's eval curve, the rows file dropping smoke rows at the
first full-setting row, and a work folder refusing another setting's runs."""

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # bench/ is not a package

import critic_study as study  # noqa: E402


def row(seed: int, curve: list[tuple[int, float]], quick: bool = False) -> dict:
    return {"task": "default", "cell": "ppo", "seed": seed, "curve": curve,
            "setting": {"quick": quick}}


def test_curve_mean_leaves_out_the_warm_start_and_first_reaching_reads_each_seed():
    runs = [row(0, [(0, 0.3), (10, 0.8), (20, 0.95), (30, 0.9)]),
            row(1, [(20, 0.5), (0, 0.2), (10, 0.92)]),  # unordered: sorted by step
            row(2, [(0, 0.1), (10, 0.5)])]
    assert study.curve_mean(runs[0]) == pytest.approx((0.8 + 0.95 + 0.9) / 3)
    assert study.first_reaching(runs, 0.9) == "20 / 10 / -"


def test_the_first_full_row_drops_the_smoke_rows(tmp_path):
    out = tmp_path / "study"
    study.append_row(row(0, [], quick=True), out)
    study.append_row(row(1, [], quick=True), out)
    assert [r["seed"] for r in study.load_rows(out)] == [0, 1]
    study.append_row(row(2, []), out)
    study.append_row(row(3, []), out)
    rows = study.load_rows(out)
    assert [r["seed"] for r in rows] == [2, 3] and not any(r["setting"]["quick"] for r in rows)


def test_a_work_folder_refuses_another_setting(tmp_path):
    (tmp_path / "setting.json").write_text(json.dumps({"steps": 7}))
    args = argparse.Namespace(work=str(tmp_path), out=tmp_path / "rows", tasks=[], seeds=[],
                              cells=[], steps=100, eval_every=10, command="")
    with pytest.raises(SystemExit, match="another setting"):
        study.run_all(args, {"steps": 100})
    assert json.loads((tmp_path / "setting.json").read_text()) == {"steps": 7}
