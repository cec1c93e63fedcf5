"""The lab's toy model as a Trainer: three weights and a bias, one SGD epoch per step.

The state is one float64 vector ``params = [w0, w1, w2, bias]`` (plain SGD has no optimizer
state), kept on the trainer and updated in place. Every number comes from ``model.py`` exactly
as before the Trainer protocol existed: float64 -> Python float and back is exact, so the lab's
figures (loss_milli 310/241/228/226/225, holdout 20/20, forced-zero 14/20) do not move. It
publishes JSON (``artifact_format``): the lab's ``model-v1.json``, byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .data import Dataset, load_dataset
from .model import evaluate, train_one_epoch
from ..records import Score


def params_of(params: np.ndarray) -> tuple[tuple[float, float, float], float]:
    w0, w1, w2, bias = (float(x) for x in params)  # float64 -> float: exact
    return (w0, w1, w2), bias


class LinearTrainer:
    artifact_format = "json"

    def __init__(self, data: Dataset, lr: float) -> None:
        self.data, self.lr = data, lr
        self.data_sha256 = data.sha256
        self.params = np.zeros(4, dtype=np.float64)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"params": self.params}

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        self.params[...] = arrays["params"]

    def step(self, step: int) -> float:
        weights, bias, mean_loss = train_one_epoch(*params_of(self.params), self.data.train, self.lr)
        self.params[...] = (*weights, bias)
        return mean_loss

    def evaluate(self) -> Score:
        return evaluate(*params_of(self.params), self.data.holdout)

    def baseline(self) -> Score:
        return evaluate(self.data.baseline.weights, self.data.baseline.bias, self.data.holdout)

    def export(self) -> dict[str, np.ndarray]:
        weights, bias = params_of(self.params)
        return {"weights": np.array(weights, dtype=np.float64), "bias": np.array([bias], dtype=np.float64)}

    def force_weights(self, values: Sequence[float]) -> None:
        """Teaching hook (``--force-weights``): gate these weights, bias 0, instead of the trained ones."""
        self.params[...] = (*values, 0.0)


def make(data: Path | None, lr: float) -> LinearTrainer:
    return LinearTrainer(load_dataset(data), lr)
