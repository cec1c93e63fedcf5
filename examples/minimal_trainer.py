"""A complete trainer: logistic regression with momentum on its own synthetic data.

    PYTHONPATH=examples trainjob run --pvc pvc --trainer minimal_trainer:make
"""

import hashlib

import numpy as np

from trainjob import Score


class Minimal:
    def __init__(self, lr):
        rng = np.random.default_rng(0)  # the data is fixed: the same on every rank and launch
        x = rng.normal(size=(400, 2))
        y = (x @ [1.0, -2.0] > 0.3).astype(np.int64)
        self.train, self.holdout = (x[:300], y[:300]), (x[300:], y[300:])
        self.lr = lr
        self.data_sha256 = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()
        # Everything the next step depends on: the model AND the optimizer's momentum.
        self.state = {"w": np.zeros(2), "b": np.zeros(1), "vw": np.zeros(2), "vb": np.zeros(1)}

    def state_dict(self):  # the live arrays: trainjob reads them when a checkpoint is due
        return self.state

    def load_state_dict(self, arrays):  # a resume: copy a verified checkpoint into them
        for name, live in self.state.items():
            live[...] = arrays[name]

    def step(self, step):
        w, b, vw, vb = (self.state[k] for k in ("w", "b", "vw", "vb"))
        x, y = self.train
        order = np.random.default_rng([1, step]).permutation(len(y))  # from the step number only
        losses = []
        for i in range(0, len(y), 50):
            idx = order[i:i + 50]
            p = 1 / (1 + np.exp(-(x[idx] @ w + b)))
            losses.append(float(-np.mean(y[idx] * np.log(p + 1e-12) + (1 - y[idx]) * np.log(1 - p + 1e-12))))
            vw[...] = 0.9 * vw - self.lr * x[idx].T @ (p - y[idx]) / len(idx)
            vb[...] = 0.9 * vb - self.lr * np.array([np.mean(p - y[idx])])
            w += vw
            b += vb
        return float(np.mean(losses))

    def evaluate(self):
        x, y = self.holdout
        return Score(correct=int(((x @ self.state["w"] + self.state["b"] > 0) == y).sum()), total=len(y))

    def baseline(self):
        x, y = self.holdout
        return Score(correct=int(((x @ [1.0, -1.0] > 0) == y).sum()), total=len(y))  # a fixed reference

    def export(self):
        return {"w": self.state["w"], "b": self.state["b"]}  # publish the model, not the optimizer


def make(data, lr):  # the factory: trainjob passes --data (unused here) and --lr
    return Minimal(lr)
