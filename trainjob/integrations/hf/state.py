"""``TrainerCheckpoint``: everything a ``transformers.Trainer``'s next step depends on, as one Stateful.

    model       the model's tensors (``TrainingState``: torch.distributed.checkpoint's FQN-keyed
                helpers; a tied embedding appears under both names, as the model's own state_dict has it)
    optim       the optimizer's state by FQN from step 0 and its param groups (``TrainingState``)
    scaler      accelerate's GradScaler, when the run uses one (fp16)
    hf          plain text: the LR scheduler's ``state_dict()`` and the Trainer's own ``TrainerState``
                (global step, epoch, log history, best metric, the states of its ExportableState
                callbacks: an EarlyStoppingCallback's patience counter) with its control's
                ``should_training_stop`` (a callback's early stop, decided in the saved step) and
                where the data stands (``POSITION``: the pass over the train data and the batches
                taken from it, what a stream's resume needs), each as
                one JSON string: they grow as the run goes (the log history), and a checkpoint's plain
                values must otherwise keep their shape from the first one on
    rank        RankLocal: this rank's RNG streams (Python, numpy, torch CPU and CUDA), and the frozen
                parameters' reference (``TrainingState``: a LoRA's base is not written, its digest is)

A resume puts the model, the optimizer and the scaler back at once (the Run's load); the rest
waits in ``resumed`` until the Trainer's loop asks for it where its own resume would read its
files (``hooks.py``): the scheduler after the Trainer built it, the RNG streams after the resumed
epoch's first batches were fetched. Must not: write anything, or import transformers at module
level (the caller passes the Trainer in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ... import plain
from ...errors import UsageError
from ...state_tree import RankLocal
from ...trainers.torch import TrainingState
from ...trainers.torch import rng as streams


@dataclasses.dataclass
class Resumed:
    """What a verified checkpoint holds for the Trainer's loop, kept until its loop asks."""

    step: int
    trainer_state: dict[str, Any]
    stopped: bool  # a callback stopped the training at this step: the run ends here (an early stop)
    position: tuple[int, int] | None  # (the pass over the train data, batches taken from it); None: not saved
    scheduler: Any
    param_groups: list[dict[str, Any]]
    rng: dict[str, Any]


class TrainerCheckpoint:
    """A ``transformers.Trainer``'s whole training state for ``trainjob.Run(state=...)``. The
    Trainer's optimizer must exist (``trainer.create_optimizer()``); its scheduler is read
    wherever the Trainer keeps it when a checkpoint is due. ``refusal``: a reason this Trainer
    cannot run under trainjob, raised (UsageError, exit 2) when the Run first asks for the state,
    before anything on the PVC is written."""

    def __init__(self, trainer: Any, refusal: str | None = None) -> None:
        self.trainer, self.refusal = trainer, refusal
        self.resumed: Resumed | None = None
        self.position = (0, 0)  # the Trainer's pass over the train data and the batches taken from it (hooks.py)
        self._torch: TrainingState | None = None
        if refusal is None:
            self._torch = TrainingState(model=trainer.model, optimizer=trainer.optimizer,
                                        scaler=getattr(trainer.accelerator, "scaler", None), rng=False)

    def state_dict(self) -> dict[str, Any]:
        if self.refusal is not None:
            raise UsageError(self.refusal)
        assert self._torch is not None
        out = self._torch.state_dict()
        scheduler = self.trainer.lr_scheduler
        if scheduler is None:  # before train() builds it: the groups as they will be once it has
            for group in out["optim"]["param_groups"]:
                group.setdefault("initial_lr", group["lr"])
        out["hf"] = {"scheduler": plain.encode(None if scheduler is None else scheduler.state_dict(), "scheduler"),
                     "trainer": plain.encode({**trainer_state(self.trainer), POSITION: list(self.position)},
                                             "trainer_state")}
        out["rank"] = RankLocal({**out.get("rank", {}), "rng": streams.capture()})
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        assert self._torch is not None
        self._torch.load_state_dict(state)
        saved = plain.decode(state["hf"]["trainer"])
        stopped = bool(saved.pop(STOPPED, False))  # both absent from checkpoints written before they were saved
        position = saved.pop(POSITION, None)
        rng = state["rank"]["rng"] if "rank" in state else streams.capture()
        streams.restore(rng)  # now, for a resume that goes straight to the gate; again where the loop wants it
        self.resumed = Resumed(step=int(saved["global_step"]), trainer_state=saved, stopped=stopped,
                               position=None if position is None else (int(position[0]), int(position[1])),
                               scheduler=plain.decode(state["hf"]["scheduler"]),
                               param_groups=list(state["optim"]["param_groups"]), rng=rng)


# Saved beside the TrainerState's fields: the TrainerControl's early stop (a callback's decision), and
# the pass over the train data with the batches taken from it.
STOPPED, POSITION = "should_training_stop", "trainjob_data_position"


def trainer_state(trainer: Any) -> dict[str, Any]:
    """The Trainer's ``TrainerState`` as plain values, with its ExportableState callbacks' states
    as the Trainer's own checkpoint records them (by class name), and ``STOPPED``: whether a
    callback stopped the training in the step being saved, before its last (the TrainerControl's
    other flags are left out: they say what the step that is being saved should still do)."""
    from transformers.trainer_callback import ExportableState

    state = dataclasses.asdict(trainer.state)
    callbacks: dict[str, list[Any]] = {}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ExportableState):
            callbacks.setdefault(type(cb).__name__, []).append(cb.state())
    state["stateful_callbacks"] = callbacks
    state[STOPPED] = bool(trainer.control.should_training_stop) and trainer.state.global_step < trainer.state.max_steps
    return state
