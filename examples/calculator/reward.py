"""The calculator example's reward: 1.0 when the last number in the answer is the task's."""

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(answer: str, task: dict) -> float:
    numbers = _NUMBER.findall(answer.replace(",", ""))
    return float(bool(numbers) and abs(float(numbers[-1]) - float(task["answer"])) < 1e-6)
