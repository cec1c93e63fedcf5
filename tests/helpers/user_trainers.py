"""Trainers for the tests of ``--trainer package.module:factory`` (on PYTHONPATH as ``user_trainers``)."""

import os
import sys
import time

from trainjob.errors import InputError
from trainjob.trainers.data import load_dataset
from trainjob.trainers.digits import DigitsTrainer, make
from trainjob.trainers.linear import LinearTrainer


class Forgetful(DigitsTrainer):
    """The digits trainer, except that its state_dict leaves out the momentum buffers: the engine
    checkpoints only W and b, so a kill loses the buffers (the bug the protocol's "model AND
    optimizer state" rule exists to prevent)."""

    def state_dict(self):
        return {"W": self.W, "b": self.b}


def forgetful(data, lr):
    return Forgetful(make(data, lr).directory, lr)


def not_a_trainer(data, lr):
    return object()


NOT_CALLABLE = 3


def no_arguments():
    return object()


WATCH = {"built": [], "stepped": [], "loaded": []}


class Watched(LinearTrainer):
    """The linear trainer, noting the array it built and the one each step trains."""

    def __init__(self, data, lr):
        super().__init__(data, lr)
        WATCH["built"].append(self.params)

    def load_state_dict(self, arrays):
        WATCH["loaded"].append(arrays["params"])
        super().load_state_dict(arrays)

    def step(self, step):
        WATCH["stepped"].append((step, self.params, self.params.copy()))
        return super().step(step)


def watched(data, lr):
    return Watched(load_dataset(data), lr)


def raises(data, lr):
    return 1 / 0


def exits(data, lr):
    raise SystemExit(0)  # would end the run with exit 0, having trained nothing


def refused_at_rank_1(data, lr):
    """Rank 1 alone meets bad input (its own data, say): the launch must end 2, not 75. Rank 1 by
    torchrun's RANK, the --rank flag, or as an srun task (SLURM_PROCID inside a step)."""
    argv = sys.argv
    if (os.environ.get("RANK") == "1" or ("--rank" in argv and argv[argv.index("--rank") + 1] == "1")
            or ("SLURM_STEP_ID" in os.environ and os.environ.get("SLURM_PROCID") == "1")):
        raise InputError("rank 1: its data cannot be read")
    return Watched(load_dataset(data), lr)


class Slow(LinearTrainer):
    """The linear trainer, each step taking TRAINJOB_TEST_STEP_SECONDS (default 0.05) longer: a
    run long enough to be signalled mid-way, whose bytes do not depend on the delay. Once the file
    TRAINJOB_TEST_FAST_FILE names exists (a test's last signal has landed), at full speed again."""

    def step(self, step):
        if not os.path.exists(os.environ.get("TRAINJOB_TEST_FAST_FILE", "")):
            time.sleep(float(os.environ.get("TRAINJOB_TEST_STEP_SECONDS", "0.05")))
        return super().step(step)


def slow(data, lr):
    return Slow(load_dataset(data), lr)
