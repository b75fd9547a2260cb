"""bench/bench_native_row_pairs.py on tiny shapes: both ways run, the bits compared, a record."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_benchmark_compares_pairs_with_one_row_at_a_time(tmp_path):
    record = tmp_path / "pairs.md"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_native_row_pairs.py"),
                             "--tiny", "--repeats", "1", "--record", str(record)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    text = record.read_text()
    assert text.startswith("# Native CPU attention") and "Command:" in text
    rows = [line for line in text.splitlines() if line.startswith("| 41 x 3") or
            line.startswith("| 20 x 2")]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("yes") for row in rows), rows
