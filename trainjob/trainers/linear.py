"""The lab's toy model as a Trainer: three weights and a bias, one SGD epoch per step.

The state is one float64 vector ``params = [w0, w1, w2, bias]`` (plain SGD has no optimizer
state). Every number comes from ``model.py`` exactly as before the Trainer protocol existed:
float64 -> Python float and back is exact, so the lab's figures (loss_milli 310/241/228/226/225,
holdout 20/20, forced-zero 14/20) do not move.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .data import Dataset, load_dataset
from .model import evaluate, train_one_epoch
from ..records import Score
from .protocol import State


def params_state(weights: Sequence[float], bias: float) -> State:
    return {"params": np.array([*weights, bias], dtype=np.float64)}


def params_of(state: State) -> tuple[tuple[float, float, float], float]:
    w0, w1, w2, bias = (float(x) for x in state["params"])  # float64 -> float: exact
    return (w0, w1, w2), bias


class LinearTrainer:
    def __init__(self, data: Dataset, lr: float) -> None:
        self.data, self.lr = data, lr
        self.data_sha256 = data.sha256

    def initial_state(self) -> State:
        return params_state((0.0, 0.0, 0.0), 0.0)

    def step(self, state: State, step: int) -> tuple[State, float]:
        weights, bias = params_of(state)
        weights, bias, mean_loss = train_one_epoch(weights, bias, self.data.train, self.lr)
        return params_state(weights, bias), mean_loss

    def evaluate(self, state: State) -> Score:
        return evaluate(*params_of(state), self.data.holdout)

    def baseline(self) -> Score:
        return evaluate(self.data.baseline.weights, self.data.baseline.bias, self.data.holdout)

    def export(self, state: State) -> State:
        weights, bias = params_of(state)
        return {"weights": np.array(weights, dtype=np.float64), "bias": np.array([bias], dtype=np.float64)}

    def force_weights(self, state: State, values: Sequence[float]) -> State:
        """Teaching hook (``--force-weights``): gate these weights, bias 0, instead of the trained ones."""
        return params_state(tuple(values), 0.0)


def make(data: Path | None, lr: float) -> LinearTrainer:
    return LinearTrainer(load_dataset(data), lr)
