"""A W-rank own loop whose one rank alone sees a loss that is not a number (tests/engine/test_run_ranks.py).

    python refuse_on_one_rank.py PVC RANK WORLD_SIZE   # files: each rank a process of its own
    trainjob torchrun --nproc-per-node 2 refuse_on_one_rank.py PVC   # the store: RANK from torchrun

Rank 1 reports NaN at step 7, after the first checkpoint (step 5); every other rank trains on.
Plain numpy state: no torch, so the test launches in a second.
"""

import os
import sys

import numpy as np

import trainjob


class Weights:
    def __init__(self):
        self.w = np.zeros(4)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, arrays):
        self.w = np.array(arrays["w"])


pvc = sys.argv[1]
rank = int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ["RANK"])
world = int(sys.argv[3]) if len(sys.argv) > 3 else int(os.environ["WORLD_SIZE"])
state = Weights()
with trainjob.Run(pvc, state=state, steps=20, ckpt_every=5, rank=rank, world_size=world, rank_timeout=20) as run:
    for step in run:
        state.w += 0.1
        run.report(float("nan") if rank == 1 and step == 7 else 1.0 / step)
    run.gate(export={"w": state.w}, holdout=trainjob.Score(9, 10), baseline=trainjob.Score(5, 10))
sys.exit(run.exit_code)
