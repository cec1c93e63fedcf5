"""scikit-learn's handwritten digits, offline: the data files ``gen`` writes and a numpy trainer.

Data (``trainjob gen --dataset digits DIR``): the 1,797 bundled 8x8 images (no download), pixel
values scaled to [0, 1], split by index (every fifth image is holdout: 360; the rest train:
1,437), written as safetensors files (loading them runs no code). ``baseline.safetensors`` is a frozen
reference model: softmax regression trained by ``gen`` with a fixed recipe (full-batch gradient
descent), so the gate has a real model to compare against. Only ``gen`` needs scikit-learn.

Trainer (``--trainer digits``): softmax regression trained by mini-batch SGD with momentum. One
step is one epoch of mini-batches in an order drawn from the step number alone, so a step is a
pure function of (state, step). The state, kept on the trainer and updated in place, is the model
(``W``, ``b``) AND the momentum buffers (``vW``, ``vb``): drop the buffers from ``state_dict`` and
a resumed run computes other weights (tests/trainers/test_digits.py shows it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .data import files_sha256, read_data_file
from ..errors import InputError, UsageError, importing
from ..records import Score

FILES = ("train.safetensors", "holdout.safetensors", "baseline.safetensors")
FEATURES, CLASSES = 64, 10
HOLDOUT_EVERY = 5
BATCH = 32
MOMENTUM = 0.9
SEED = 8  # the shuffle of step s is default_rng([SEED, s]).permutation
BASELINE_EPOCHS, BASELINE_LR = 30, 0.5


# --- the model: plain numpy, float64 ----------------------------------------------------------

def logits(W: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    return x @ W + b


def loss_and_grads(W: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean cross-entropy over the batch and its gradients with respect to W and b."""
    z = logits(W, b, x)
    z = z - z.max(axis=1, keepdims=True)  # stable softmax: same probabilities, no overflow
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-300).mean())
    p[np.arange(n), y] -= 1.0
    p /= n
    return loss, x.T @ p, p.sum(axis=0)


def accuracy(W: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> Score:
    return Score(correct=int((logits(W, b, x).argmax(axis=1) == y).sum()), total=len(y))


# --- data --------------------------------------------------------------------------------------

def generate_files() -> dict[str, bytes]:
    """The three files, as bytes (the same on every call)."""
    try:
        with importing("scikit-learn"):
            from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError("--dataset digits needs scikit-learn: pip install 'trainjob[digits]'") from None
    bunch = load_digits()
    x = np.asarray(bunch.data, dtype=np.float64) / 16.0
    y = np.asarray(bunch.target, dtype=np.int64)
    holdout = np.arange(len(y)) % HOLDOUT_EVERY == 0
    xt, yt = x[~holdout], y[~holdout]
    W, b = np.zeros((FEATURES, CLASSES)), np.zeros(CLASSES)
    for _ in range(BASELINE_EPOCHS):  # the frozen reference recipe: full-batch gradient descent
        _, gW, gb = loss_and_grads(W, b, xt, yt)
        W, b = W - BASELINE_LR * gW, b - BASELINE_LR * gb
    return {
        "train.safetensors": st_save({"x": np.ascontiguousarray(xt), "y": np.ascontiguousarray(yt)}),
        "holdout.safetensors": st_save({"x": np.ascontiguousarray(x[holdout]), "y": np.ascontiguousarray(y[holdout])}),
        "baseline.safetensors": st_save({"W": W, "b": b}),
    }


def _arrays(path: Path, raw: bytes, want: dict[str, tuple[str, int | None]]) -> dict[str, np.ndarray]:
    """The arrays of one file, checked: exactly ``want``'s names, dtypes and column counts."""
    try:
        arrays = st_load(raw)
    except Exception as exc:  # safetensors raises its own error types; any of them means a bad file
        raise InputError(f"{path}: not a safetensors file: {exc}") from None
    if sorted(arrays) != sorted(want):
        raise InputError(f"{path}: expected arrays {sorted(want)}, got {sorted(arrays)}")
    for name, (dtype, cols) in want.items():
        a = arrays[name]
        if a.dtype != np.dtype(dtype) or (cols is not None and (a.ndim != 2 or a.shape[1] != cols)):
            raise InputError(f"{path}: {name} is {a.dtype}{list(a.shape)}, expected {dtype} with {cols} columns")
    return arrays


class DigitsTrainer:
    def __init__(self, directory: Path, lr: float) -> None:
        self.directory, self.lr = directory, lr
        raw = {n: read_data_file(directory / n, "--dataset digits ") for n in FILES}
        sets = []
        for n in FILES[:2]:
            s = _arrays(directory / n, raw[n], {"x": ("float64", FEATURES), "y": ("int64", None)})
            if len(s["x"]) != len(s["y"]) or not len(s["y"]) or not np.isin(s["y"], np.arange(CLASSES)).all():
                raise InputError(f"{directory / n}: x and y disagree in length, are empty, or y is not 0..9")
            sets.append(s)
        (self.x, self.y), (self.hx, self.hy) = ((s["x"], s["y"]) for s in sets)
        self.base = _arrays(directory / FILES[2], raw[FILES[2]], {"W": ("float64", CLASSES), "b": ("float64", None)})
        if self.base["W"].shape != (FEATURES, CLASSES) or self.base["b"].shape != (CLASSES,):
            raise InputError(f"{directory / FILES[2]}: expected W[64, 10] and b[10]")
        self.data_sha256 = files_sha256(raw, FILES)
        self.W, self.b = np.zeros((FEATURES, CLASSES)), np.zeros(CLASSES)
        self.vW, self.vb = np.zeros((FEATURES, CLASSES)), np.zeros(CLASSES)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"W": self.W, "b": self.b, "vW": self.vW, "vb": self.vb}

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        for name, live in self.state_dict().items():
            live[...] = arrays[name]

    def step(self, step: int) -> float:
        W, b, vW, vb = self.W, self.b, self.vW, self.vb
        order = np.random.default_rng([SEED, step]).permutation(len(self.y))
        losses = []
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            loss, gW, gb = loss_and_grads(W, b, self.x[idx], self.y[idx])
            losses.append(loss)
            vW[...] = MOMENTUM * vW - self.lr * gW  # in place, the same arithmetic as a new array
            vb[...] = MOMENTUM * vb - self.lr * gb
            W += vW
            b += vb
        return float(np.mean(losses))

    def evaluate(self) -> Score:
        return accuracy(self.W, self.b, self.hx, self.hy)

    def baseline(self) -> Score:
        return accuracy(self.base["W"], self.base["b"], self.hx, self.hy)

    def export(self) -> dict[str, np.ndarray]:
        return {"W": self.W, "b": self.b}  # the momentum buffers are not part of the model


def make(data: Path | None, lr: float) -> DigitsTrainer:
    if data is None:
        raise UsageError("--trainer digits needs --data DIR written by `trainjob gen --dataset digits DIR` "
                         "(which needs trainjob[digits])")
    if not data.is_dir():
        raise InputError(f"{data}: data directory not found (create it with `trainjob gen --dataset digits {data}`)")
    return DigitsTrainer(data, lr)
