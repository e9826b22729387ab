"""Reward functions for tool-using tasks (reward.function: rltrain.tools.rewards:NAME)."""

from __future__ import annotations

from rltrain.rewards import extract_last_number


def final_number_digits(response: str, ground_truth: str, prompt: str) -> float:
    """Partial credit for the last number of the whole response (tool observations included, so a correct
    calculator answer the model asked for counts): the digits matching the ground truth's position by
    position over the longer of the two, 1.0 for the exact answer, 0.0 without a number.

    Dense enough for a tiny model to climb from random text: a call with most of the expression right
    gives a number that shares leading digits with the answer."""
    got, truth = extract_last_number(response), extract_last_number(ground_truth)
    if got is None or truth is None:
        return 0.0
    a, b = f"{got:g}", f"{truth:g}"
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b))
