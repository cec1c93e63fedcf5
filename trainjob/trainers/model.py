"""The lab's toy model: a linear classifier over three features, trained by plain SGD.

Pure arithmetic on tuples of floats. The order of every floating-point operation matches the
lab's reference (left-to-right dot product, then the bias), which is what makes its numbers
reproduce here digit for digit. No I/O and no state beyond the arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..records import Sample, Score


def _score(weights: Sequence[float], bias: float, x: Sequence[float]) -> float:
    return weights[0] * x[0] + weights[1] * x[1] + weights[2] * x[2] + bias


def train_one_epoch(
    weights: Sequence[float], bias: float, data: Sequence[Sample], lr: float
) -> tuple[tuple[float, float, float], float, float]:
    """One SGD pass over ``data`` with squared error against targets of +1/-1.

    Returns the new weights, the new bias and the mean loss over the pass.
    """
    w0, w1, w2 = weights
    loss_sum = 0.0
    for s in data:
        target = 1.0 if s.y == 1 else -1.0
        err = _score((w0, w1, w2), bias, s.x) - target
        loss_sum += 0.5 * err * err
        w0 -= lr * err * s.x[0]
        w1 -= lr * err * s.x[1]
        w2 -= lr * err * s.x[2]
        bias -= lr * err
    return (w0, w1, w2), bias, loss_sum / max(len(data), 1)


def evaluate(weights: Sequence[float], bias: float, data: Sequence[Sample]) -> Score:
    """Count correct predictions (class 1 when the score is above zero)."""
    correct = sum(1 for s in data if int(_score(weights, bias, s.x) > 0.0) == s.y)
    return Score(correct=correct, total=len(data))
