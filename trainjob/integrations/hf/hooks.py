"""Where a ``transformers.Trainer``'s loop meets the Run: a few of its methods, replaced on one instance.

The Trainer owns its loop, so the Run's steps are driven from inside it (``Driver``). Its own
resume is exact (measured with transformers 5.25: the same bytes after random kills) when it is
handed a checkpoint directory, and that machinery is kept: the epoch to start in and the batches
to skip come from the global step, the data loader skips them (accelerate's
``skip_first_batches``), and the RNG streams are put back after the resumed epoch's first batches
were fetched. What changes is where the state comes from: trainjob's verified checkpoint, loaded
by the Run before ``train()``, instead of the Trainer's files. The loop is told to resume by a
token in place of the directory (``RESUMED``), and each method that would read a file there reads
the checkpoint the Run loaded instead:

    _inner_training_loop        gets ``RESUMED`` as its ``resume_from_checkpoint`` when the Run resumed
    _init_training_state        the Trainer's state (global step, epoch, callbacks) from the checkpoint,
                                and where to go on in the data: for a data set with a length, the
                                epoch and batch the global step gives (the Trainer's own rule);
                                for a stream (an IterableDataset, no length, trained for
                                ``max_steps``), the pass over it and the batches taken from it,
                                as saved (the Trainer's rule would start the first pass again)
    _run_epoch                  notes the pass it runs (``TrainerCheckpoint.position``)
    _load_optimizer_and_scheduler  the scheduler's state and the optimizer's param groups, once the
                                Trainer has built its scheduler (building it resets the learning rate)
    _load_scaler                nothing: the Run's load put the scaler back
    _load_rng_state             the RNG streams, at the instant the Trainer's own resume restores them
    _maybe_log_save_evaluate    after the step's logging and evaluation, the Run's step ends here:
                                the loss is reported, a checkpoint taken when due, a stop obeyed,
                                a callback's early stop (``EarlyStoppingCallback``) made the run's
                                end (``Run.end_early``: the step saved, then the gate);
                                an epoch's last step ends at the epoch's end, after its evaluation
                                (``eval_strategy="epoch"``): what the evaluation draws from the RNG
                                streams (its loader's seed) is then in the checkpoint, as it is in
                                the uninterrupted run before the next epoch begins
    training_step               sums the step's micro-batch losses for ``run.report``
    get_train_dataloader        guards the loader's worker processes (``dataloader_num_workers``)
                                against a SIGTERM or SIGINT sent to the whole process group, as
                                ``TrainingState`` guards a script's own loader; with a masked-LM
                                collator, builds the loader with its padding only (``masks.py``)
    get_batch_samples           counts the batches the Trainer takes from the pass; with a
                                masked-LM collator, draws their masks, by step (``masks.Masker``)

and one callback turns the Trainer's own saves off (``control.should_save``): trainjob's checkpoints
replace them. Must not: write a file, or decide anything the Run decides (when to save, when to stop).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

from ...errors import UsageError
from ...trainers.torch import rng as streams, workers
from .masks import Masker, Padding
from .state import TrainerCheckpoint

# What the Trainer's loop gets as its checkpoint "directory" on a resume: no path by that name is read.
RESUMED = "<trainjob: the checkpoint the Run verified and loaded>"


class Driver:
    """Runs ``trainer.train()`` as the body of ``run``'s steps (``train``)."""

    def __init__(self, trainer: Any, state: TrainerCheckpoint, run: Any, masker: Masker | None = None) -> None:
        self.trainer, self.state, self.run, self.masker = trainer, state, run, masker
        self.steps: Iterator[int] | None = None
        self.step = 0  # the step the Trainer is training (the Run yielded it)
        self.loss: Any = 0.0
        self.over = False
        self.per_epoch = 0  # optimizer steps in an epoch (the Trainer's count)
        self.epoch_ending = False  # the Trainer is in its end-of-epoch call (on_epoch_end was called)

    def train(self) -> None:
        """From the step the Run resumed at to its end: the last step or a callback's early stop
        (then the gate is due), or a stop (SIGTERM: the step is saved, ``killed``). Nothing trains
        if the Run resumed at its end, or at the step a callback stopped the training."""
        if self.state.resumed is not None and self.state.resumed.stopped:
            self.run.end_early()
        self.steps = iter(self.run)
        first = next(self.steps, None)
        if first is None:  # resumed after the last step (the gate is due), or stopped before the first
            self.over = True
            return
        self.step = first
        from transformers import TrainerCallback

        driver = self

        class NoTrainerSaves(TrainerCallback):  # trainjob's checkpoints are the run's; the Trainer writes none
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                control.should_save = False
                return control

            def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                driver.epoch_ending = True  # the next _maybe_log_save_evaluate is the epoch's end
                return self.on_step_end(args, state, control, **kw)

        callback = NoTrainerSaves()
        trainer = self.trainer
        originals = {name: getattr(trainer, name) for name in REPLACEMENTS}
        for name in REPLACEMENTS:
            setattr(trainer, name, types.MethodType(REPLACEMENTS[name], _Bound(self, originals)))
        trainer.add_callback(callback)
        try:
            trainer.train()
        finally:
            trainer.remove_callback(callback)
            for name in REPLACEMENTS:
                delattr(trainer, name)  # the class's methods again
        if not self.over:
            raise UsageError(f"the Trainer's loop ended at step {trainer.state.global_step} of {self.run.cfg.steps} "
                             "without a callback stopping it (its data ran out, or max_steps changed)")

    # --- the step loop --------------------------------------------------------------------------

    def end_of_step(self) -> None:
        """The Trainer finished the step the Run yielded (its optimizer step, logging, evaluation),
        or, for an epoch's last step, the epoch too (its evaluation)."""
        trainer = self.trainer
        epoch_end, self.epoch_ending = self.epoch_ending, False
        if self.over or trainer.state.global_step < self.step:
            return  # an epoch's end: the step already ended (or the Run has)
        if not epoch_end and self.per_epoch and trainer.state.global_step % self.per_epoch == 0:
            return  # the epoch's last step: it ends with the epoch, whose end comes next
        if trainer.state.global_step != self.step:
            raise UsageError(f"the Trainer is at step {trainer.state.global_step} where the run expected "
                             f"{self.step}; a step is one optimizer step")
        loss, self.loss = self.loss, 0.0
        self.run.report(loss)
        if trainer.control.should_training_stop and trainer.state.global_step < trainer.state.max_steps:
            self.run.end_early()  # a callback's early stop: this step is saved with the decision, then the gate
        assert self.steps is not None
        following = next(self.steps, None)  # the checkpoint when due; a stop agreed and saved
        if following is None:
            self.over = True
            if not self.run.gate_due:  # a stop or the lab's die_at: the Run ended the launch
                trainer.control.should_training_stop = True
            return
        self.step = following


# --- the replaced methods, each bound to a _Bound (the driver, and the Trainer's originals) -------------


def _inner_training_loop(b: _Bound, *args: Any, **kw: Any) -> Any:
    if b.driver.state.resumed is not None:
        kw["resume_from_checkpoint"] = RESUMED
    return b.originals["_inner_training_loop"](*args, **kw)


def _init_training_state(b: _Bound, max_steps: int, per_epoch: int, epochs: int, resume: Any,
                          trial: Any) -> tuple[int, int]:
    trainer, driver = b.driver.trainer, b.driver
    driver.per_epoch = per_epoch
    out = b.originals["_init_training_state"](max_steps, per_epoch, epochs, None, trial)
    if max_steps != driver.run.cfg.steps:
        raise UsageError(f"the Trainer counts {max_steps} steps where the run was set up for "
                         f"{driver.run.cfg.steps}; change the Trainer's arguments only before trainjob's run")
    resumed = driver.state.resumed
    if resume != RESUMED or resumed is None:
        return out
    from transformers import TrainerState
    from transformers.trainer_utils import has_length

    trainer.state = TrainerState(**resumed.trainer_state)
    trainer._load_callback_state()
    trainer.state.init_training_references(trainer, max_steps, epochs, trial)
    step = trainer.state.global_step
    if step != driver.step - 1:
        raise UsageError(f"the checkpoint's Trainer state is at step {step}, its tensors at {driver.step - 1}")
    if not has_length(trainer.train_dataset):  # a stream: its passes are not max_steps long
        if resumed.position is None:
            raise UsageError("the checkpoint does not say where in the stream the run was (written before trainjob "
                             "saved it); start the run on a fresh PVC")
        return resumed.position
    return step // per_epoch, (step % per_epoch) * trainer.args.gradient_accumulation_steps


def _load_optimizer_and_scheduler(b: _Bound, checkpoint: Any) -> None:
    resumed = b.driver.state.resumed
    if checkpoint != RESUMED or resumed is None:
        return b.originals["_load_optimizer_and_scheduler"](checkpoint)
    trainer = b.driver.trainer
    # Building the scheduler set each group's lr to its first step's: the checkpoint's come back.
    for group, saved in zip(trainer.optimizer.param_groups, resumed.param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if resumed.scheduler is not None:
        trainer.lr_scheduler.load_state_dict(resumed.scheduler)
    return None


def _load_scaler(b: _Bound, checkpoint: Any) -> None:
    if checkpoint != RESUMED:
        return b.originals["_load_scaler"](checkpoint)
    return None  # the Run's load put it back (TrainingState's scaler)


def _load_rng_state(b: _Bound, checkpoint: Any) -> None:
    resumed = b.driver.state.resumed
    if checkpoint != RESUMED or resumed is None:
        return b.originals["_load_rng_state"](checkpoint)
    streams.restore(resumed.rng)
    return None


def _get_train_dataloader(b: _Bound) -> Any:
    trainer, masker = b.driver.trainer, b.driver.masker
    if masker is not None:  # the loader pads; the masks are drawn by step (get_batch_samples)
        trainer.data_collator = Padding(masker.collator)
    try:
        loader = b.originals["get_train_dataloader"]()
    finally:
        if masker is not None:
            trainer.data_collator = masker.collator
    workers.guard(loader)  # its workers outlive a signal sent to the whole process group (TrainingState's guard)
    return loader


def _run_epoch(b: _Bound, *args: Any, **kw: Any) -> Any:
    # The pass, and the batches of it a resume skips (the Trainer's loop takes them as keywords).
    resumed = kw["epoch"] == kw["epochs_trained"] and kw["resume_from_checkpoint"] is not None
    b.driver.state.position = (kw["epoch"], kw["steps_trained_in_current_epoch"] if resumed else 0)
    return b.originals["_run_epoch"](*args, **kw)


def _get_batch_samples(b: _Bound, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
    driver = b.driver
    if driver.masker is not None:
        epoch_iterator = driver.masker.batches(epoch_iterator, driver.trainer.state.global_step + 1)
    samples, count = b.originals["get_batch_samples"](epoch_iterator, num_batches, device)
    epoch, taken = driver.state.position
    driver.state.position = (epoch, taken + len(samples))
    return samples, count


def _maybe_log_save_evaluate(b: _Bound, *args: Any, **kw: Any) -> Any:
    out = b.originals["_maybe_log_save_evaluate"](*args, **kw)
    b.driver.end_of_step()
    return out


def _training_step(b: _Bound, *args: Any, **kw: Any) -> Any:
    loss = b.originals["training_step"](*args, **kw)
    b.driver.loss = b.driver.loss + loss.detach()
    return loss


REPLACEMENTS = {"_inner_training_loop": _inner_training_loop, "_init_training_state": _init_training_state,
                "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler, "_load_scaler": _load_scaler,
                "_load_rng_state": _load_rng_state, "_maybe_log_save_evaluate": _maybe_log_save_evaluate,
                "training_step": _training_step, "get_train_dataloader": _get_train_dataloader,
                "get_batch_samples": _get_batch_samples, "_run_epoch": _run_epoch}


class _Bound:
    """What a replaced method is bound to: the driver, and the Trainer's methods it replaced."""

    def __init__(self, driver: Driver, originals: dict[str, Any]) -> None:
        self.driver, self.originals = driver, originals
