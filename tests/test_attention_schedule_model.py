"""bench/attention_schedule_model.py: its list scheduling, its split programs' iterations (the
kernel's chunks of each prefix tile's entries), its calibration, and the report end to end."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # bench/ is not a package

import attention_schedule_model as model


def test_programs_start_in_launch_order_on_the_slot_free_first():
    assert model.makespan([3, 3, 3], 2) == 6
    assert model.makespan([1, 1, 5], 2) == 6  # launch order, not longest first (5)
    assert model.makespan([5, 1, 1], 2) == 5
    assert model.makespan([], 4) == 0


@pytest.mark.parametrize("shape", [model.LONG_PROMPT, (2, 300, 3, 70, 6, 2), (1, 64, 5, 1, 4, 4)])
def test_split_programs_share_each_prefix_tile_entries(shape):
    """At every split count the programs' loop iterations add up to the one-split launch's: the
    chunks partition each prefix tile's (head, block) entries as the kernel's j0:j1 do."""
    shape = model.Shape(*shape)
    whole, _, _ = model.shared_dkdv(shape, 1)
    for splits in (2, 3, 5, 8):
        costs, used, sums_ms = model.shared_dkdv(shape, splits)
        assert used == splits and sums_ms > 0
        assert sum(costs) - model.FIXED * len(costs) == sum(whole) - model.FIXED * len(whole)
        assert max(costs) < max(whole)


def test_the_calibration_reproduces_the_two_h200_timings():
    occupancy = model.Occupancy.read()
    rates = model.calibrate(occupancy)
    assert all(rate > 0 for rate in rates)
    shape = model.Shape(*model.LONG_PROMPT)
    plain = model.ms(model.plain_iterations(shape, occupancy), rates)
    shared = model.ms(model.shared_iterations(shape, occupancy, 1)[0], rates)
    assert plain == pytest.approx(model.MEASURED["plain"], rel=1e-9)
    assert shared == pytest.approx(model.MEASURED["shared, 1 split"], rel=1e-9)


def test_the_report_runs_and_names_the_launchers_split_count():
    lines = model.report(model.Occupancy.read())
    assert any("(the launcher's)" in line for line in lines)
    assert lines[0] == "## Calibration"
