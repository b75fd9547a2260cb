"""bench/bench_cpu_attention_auto.py at tiny sizes: its table, and a rerun keeping the record's
hand-written summary."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # bench/ is not a package

import bench_cpu_attention_auto as bench


def test_tiny_run_writes_a_record_and_keeps_its_summary(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    record = tmp_path / "auto.md"
    bench.main(["--tiny", "--repeats", "1", "--threads", "1", "--record", str(record)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 * len(bench.HEAD_DIMS)
    # tiny batches: queries see a few dozen keys, so auto picks native (the timings vary)
    assert all(line.split("|")[7].strip() == "native" for line in rows), rows
    text = record.read_text()
    assert "Summary: (to write by hand" in text and rows[0] in text
    record.write_text(text.replace("Summary: (to write by hand from the table)",
                                   "Summary: kept\nacross lines."))
    bench.main(["--tiny", "--repeats", "1", "--threads", "1", "--record", str(record)])
    assert "Summary: kept\nacross lines.\n\nCommand:" in record.read_text()
