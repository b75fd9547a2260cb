"""Write train.jsonl and eval.jsonl: small arithmetic tasks, the same every run.

    python make_tasks.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def task(rng: random.Random) -> dict:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    form = rng.randrange(4)
    if form == 0:
        expression, answer = f"{a} + {b} * {c}", a + b * c
    elif form == 1:
        expression, answer = f"({a} - {b}) * {c}", (a - b) * c
    elif form == 2:
        expression, answer = f"{a * c} / {c} + {b}", a + b
    else:
        expression, answer = f"{a} * {c} - {b}", a * c - b
    return {"prompt": f"What is {expression}?", "answer": answer}


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    rng = random.Random(0)
    rows, seen = [], set()
    while len(rows) < 350:
        row = task(rng)
        if row["prompt"] not in seen:  # eval prompts never occur in train
            seen.add(row["prompt"])
            rows.append(row)
    write(HERE / "train.jsonl", [{"id": f"train-{i}", **r} for i, r in enumerate(rows[:300])])
    write(HERE / "eval.jsonl", [{"id": f"eval-{i}", **r} for i, r in enumerate(rows[300:])])
