"""bench/attention_schedule_model.py: its list scheduling, its split programs' iterations, its
calibration's plumbing, and the report end to end."""

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
    """At every split count the programs' loop iterations add up to the one-split launch's
    (the chunks partition each prefix tile's (head, block) entries), the split programs come
    first, a tile's splits side by side, and the table's programs of split tiles do nothing."""
    shape, fixed = model.Shape(*shape), 1.0
    whole, _, _ = model.shared_dkdv(shape, 1, fixed)
    for splits in (2, 3, 5, 8):
        costs, used, sums_ms = model.shared_dkdv(shape, splits, fixed)
        busy = [cost for cost in costs if cost > 0]
        assert used == splits and sums_ms > 0
        assert sum(busy) - fixed * len(busy) == sum(whole) - fixed * len(whole)
        assert max(costs) < max(whole)
        first = busy[:splits]  # the longest prefix tile's first KV head: its splits
        assert max(first) - min(first) <= 1  # (chunks of one list differ by at most one entry)


def test_the_calibration_solves_for_positive_iteration_times():
    """The two iteration times reproduce the two H200 timings they are solved from (the
    plumbing: both launches' iterations reach the solve) and are positive, about the same
    device FLOP rate each."""
    chosen = model.Model.read()
    rates = model.calibrate(chosen)
    assert all(rate > 0 for rate in rates)
    shape = model.Shape(*model.LONG_PROMPT)
    plain = model.ms(model.plain_iterations(shape, chosen), rates)
    shared = model.ms(model.shared_iterations(shape, chosen, 1)[0], rates)
    assert plain == pytest.approx(model.MEASURED["plain"], rel=1e-9)
    assert shared == pytest.approx(model.MEASURED["shared, 1 split"], rel=1e-9)


def test_the_report_runs_and_names_the_launchers_split_count():
    lines = model.report(model.Model.read())
    assert any("(the launcher's)" in line for line in lines)
    assert lines[0] == "## Calibration"
