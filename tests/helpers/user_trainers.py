"""Trainers for the tests of ``--trainer package.module:factory`` (on PYTHONPATH as ``user_trainers``)."""

from trainjob.trainers.data import load_dataset
from trainjob.trainers.digits import DigitsTrainer, make
from trainjob.trainers.linear import LinearTrainer


class Forgetful(DigitsTrainer):
    """The digits trainer, except that the momentum buffers live on the object, not in the state:
    the engine checkpoints only W and b, so a kill loses the buffers (the bug the protocol's
    "model AND optimizer state" rule exists to prevent)."""

    def initial_state(self):
        state = super().initial_state()
        self.vW, self.vb = state.pop("vW"), state.pop("vb")
        return state

    def step(self, state, step):
        if not hasattr(self, "vW"):
            self.initial_state()  # a resumed process starts its buffers from zero
        full, loss = super().step({**state, "vW": self.vW, "vb": self.vb}, step)
        self.vW, self.vb = full.pop("vW"), full.pop("vb")
        return full, loss


def forgetful(data, lr):
    return Forgetful(make(data, lr).directory, lr)


def not_a_trainer(data, lr):
    return object()


NOT_CALLABLE = 3


def no_arguments():
    return object()


WATCH = {"built": [], "stepped": []}


class Watched(LinearTrainer):
    """The linear trainer, noting the arrays it built and the ones each step is handed."""

    def initial_state(self):
        state = super().initial_state()
        WATCH["built"].append(state["params"])
        return state

    def step(self, state, step):
        WATCH["stepped"].append((step, state["params"]))
        return super().step(state, step)


def watched(data, lr):
    return Watched(load_dataset(data), lr)


def raises(data, lr):
    return 1 / 0


def exits(data, lr):
    raise SystemExit(0)  # would end the run with exit 0, having trained nothing
