"""A trainer whose state is as large as ``BENCH_STATE_MIB`` says, for scripts/bench.py's engine figure.

    BENCH_STATE_MIB=64 PYTHONPATH=scripts trainjob run --pvc P --trainer bench_trainer:make

Each step scales every weight in place (touching every byte, as an optimizer step does), so a
checkpoint has real bytes to write; the scores are fixed, so the gate passes and the run
completes. It exports one weight: the published artifact is not what is being measured.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from trainjob import Score


class BigState:
    def __init__(self, mib: int) -> None:
        self.rows = max(1, (mib << 20) // (4 * 1024))
        self.data_sha256 = hashlib.sha256(f"bench-{mib}".encode()).hexdigest()
        self.w = np.ones((self.rows, 1024), dtype=np.float32)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"w": self.w}

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        self.w[...] = arrays["w"]

    def step(self, step: int) -> float:
        self.w *= np.float32(0.999)
        return float(self.w[0, 0])

    def evaluate(self) -> Score:
        return Score(correct=1, total=1)

    def baseline(self) -> Score:
        return Score(correct=1, total=1)

    def export(self) -> dict[str, np.ndarray]:
        return {"w": self.w[:1, :1].copy()}


def make(data: object, lr: float) -> BigState:
    return BigState(int(os.environ.get("BENCH_STATE_MIB", "64")))
