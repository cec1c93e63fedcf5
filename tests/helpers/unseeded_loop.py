"""An own loop whose initial weights come from an unseeded generator, so two runs publish different
bytes: what docs/troubleshooting.md's "NOT DETERMINISTIC" is about (tests/test_docs_troubleshooting.py).

    python unseeded_loop.py PVC
"""

import sys

import numpy as np

import trainjob

weights = np.random.default_rng().normal(size=4)  # no seed: the mistake


class Weights:
    def state_dict(self) -> dict[str, np.ndarray]:
        return {"w": weights}

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        weights[:] = arrays["w"]


with trainjob.Run(sys.argv[1], state=Weights(), steps=4, ckpt_every=2) as run:
    for step in run:
        weights *= 0.9
        run.report(float(np.abs(weights).sum()))
    run.gate(holdout=trainjob.Score(correct=1, total=1), baseline=trainjob.Score(correct=1, total=1),
             export={"w": weights})
sys.exit(run.exit_code)
