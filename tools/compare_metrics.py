"""Compare two runs' ``metrics.jsonl`` field by field, timings left out: the redesign's check
that behaviour did not change (tools/golden_runs.sh).

    python tools/compare_metrics.py EXPECTED.jsonl GOT.jsonl

Every row and every field must be identical (floats bit for bit, as JSON writes them), except
timings: keys containing ``seconds``, ending in ``_per_second``, or ``tok_s``. Exit status 1
with the differences listed.
"""

import json
import sys


def is_timing(key: str) -> bool:
    return "seconds" in key or key.endswith("_per_second") or key == "tok_s"


def rows(path: str) -> list[dict]:
    with open(path) as handle:
        return [{k: v for k, v in json.loads(line).items() if not is_timing(k)}
                for line in handle if line.strip()]


def differences(expected: list[dict], got: list[dict]) -> list[str]:
    found = []
    if len(expected) != len(got):
        found.append(f"{len(expected)} rows expected, {len(got)} got")
    for index, (a, b) in enumerate(zip(expected, got)):
        for key in sorted(set(a) | set(b)):
            if a.get(key, "<missing>") != b.get(key, "<missing>"):
                found.append(f"row {index} ({a.get('kind')} step {a.get('step')}) {key}: "
                             f"{a.get(key, '<missing>')!r} != {b.get(key, '<missing>')!r}")
    return found


def main() -> int:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    found = differences(rows(sys.argv[1]), rows(sys.argv[2]))
    print("\n".join(found) if found else f"identical: {sys.argv[2]} (timings left out)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
