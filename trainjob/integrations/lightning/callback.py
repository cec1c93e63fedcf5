"""``TrainJob``: a Lightning Callback through which ``Trainer.fit`` runs as a ``trainjob.Run``.

Lightning owns the loop, so the callback drives the Run's step iterator from Lightning's hooks:

    setup               before the strategy wraps the model: what cannot train is refused in one line
                        (``sync_batchnorm=True`` on CPU, which DDP itself refuses with a traceback);
                        the callback moves itself after every other callback, so that a checkpoint
                        holds what EarlyStopping decided in the same hook
    on_fit_start        the strategy has set the model and optimizer up: the fit loop's data is set
                        up (``estimated_stepping_batches``, the Run's ``steps``), the Run entered: it
                        takes the PVC's lock, decides how the launch begins and, on a resume, loads
                        the newest verified checkpoint into the live state (``state.py``); on a
                        fresh start, the loader's first iterator built anew (``LightningState.restart``);
                        SIGTERM and SIGINT stay the Run's from here on (``_keep_signals``)
    on_train_batch_end  after a batch that stepped the optimizer: ``report`` the step's loss (under
                        gradient accumulation, the mean of its batches' losses), and the Run's
                        next step: its checkpoint when due, a stop agreed by the ranks (the step is
                        saved, ``killed``); when Lightning validates after the batch, that comes
                        in ``on_validation_end`` instead
    on_train_end        the gate: ``gate(module)`` scores the holdout and the baseline, ``export``
                        what the artifact publishes (the module's state_dict by default); a fit
                        that ended before the last step because ``trainer.should_stop`` was set
                        (EarlyStopping, max_time) ends the Run there (``Run.end_early``: that step
                        saved, with the stop decision and the callbacks' state, then the gate)
    on_fit_end          the Run is left; ``on_exception``: an error ends it with its code

A trainjob step is a batch that stepped the optimizer (gradient accumulation's other batches are
inside it). Every end but ``completed`` raises ``SystemExit`` with trainjob's code (exits.py), so
``trainer.fit`` returns only when the job completed; ``exit_code`` says the code either way.

Must not: write anything itself, or decide anything the machine decides (the Run does both).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from packaging.version import Version  # lightning's own dependency

from .state import LightningState, script_state, train_loader
from ...engine.run import Run, gate_arguments
from ...errors import PeerFailed, UsageError, one_line
from ...exits import EXIT_INTERNAL, exit_code_for
from ...records import Metric, Score

MIN_LIGHTNING = Version("2.5")  # its fit loop's restart stages (pyproject.toml's lightning extra says why)
Gate = Callable[[pl.LightningModule], Metric | tuple[Score, Score]]
Export = Callable[[pl.LightningModule], Mapping[str, Any]]


class _Ended(SystemExit):
    """The callback ending the process with the Run's code (Lightning's hooks pass it on)."""


class TrainJob(pl.Callback):
    """Checkpoints, resume, stop, gate and exit code of ``trainjob run`` for a ``Trainer.fit``.

    ``pvc`` and ``ckpt_every`` as ``trainjob.Run``'s; ``gate(module)`` returns, after the last
    step, a ``trainjob.Metric`` (a validation loss against its frozen value, say) or the
    holdout's and the frozen baseline's ``Score``, judged as ``Run.gate`` judges them; ``export(module)`` the arrays the artifact
    publishes (default: the module's ``state_dict()``). ``run_options``: any other keyword of
    ``trainjob.Run`` (``max_drop``, ``keep``, ``backoff_limit``, ``idempotent``,
    ``async_checkpoint``, ``rank_timeout``, ``log``, ``die_at``). The number of steps is
    Lightning's ``estimated_stepping_batches``.
    """

    def __init__(self, pvc: str | os.PathLike[str], *, ckpt_every: int, gate: Gate, export: Export | None = None,
                 **run_options: Any) -> None:
        self.pvc, self.ckpt_every, self.gate, self.export = pvc, ckpt_every, gate, export
        # Lightning draws its own progress bar: the run adds only the line saying how it ended.
        self.run_options = {"name": "lightning", "progress": False, **run_options}
        self.run: Run | None = None
        self._code: int | None = None  # an end decided before the Run existed
        self._steps: Iterator[int] | None = None
        self._step: int | None = None  # the step Lightning trains next, or None: the Run's loop is over
        self._stepped_from = 0  # trainer.global_step when the batch began
        self._window: list[Any] = []  # the losses of the step's batches so far (gradient accumulation)
        self._left = False  # the Run's ``with`` is over
        self._after_validation = False  # the step's checkpoint waits for the validation after it

    @property
    def exit_code(self) -> int:
        """The code the process ends with: the Run's (exits.py), once the fit ended."""
        if self._code is not None:
            return self._code
        if self.run is None:
            raise UsageError("TrainJob.exit_code is known once trainer.fit(...) has ended")
        return self.run.exit_code

    # --- Lightning's hooks ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            with self._guard():
                _refuse_sync_batchnorm_on_cpu(trainer, pl_module)
                _refuse_stochastic_weight_averaging(trainer)
            # Last: the hooks that share an event with EarlyStopping (on_validation_end) see its
            # decision before the step is saved. A new list: Lightning is iterating the old one.
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._guard():
            if Version(pl.__version__) < MIN_LIGHTNING:
                raise UsageError(f"lightning {pl.__version__}: trainjob's callback needs lightning >= 2.5 (with "
                                 "older releases a resume does not continue where the run was); "
                                 "pip install 'trainjob[lightning]'")
            if trainer.ckpt_path is not None:
                raise UsageError("trainer.fit(ckpt_path=...) with trainjob's callback: trainjob resumes from "
                                 "the PVC on its own; leave ckpt_path out")
            steps = trainer.estimated_stepping_batches  # sets the fit loop's data up (configure_optimizers may have)
            if trainer.train_dataloader is None:  # max_steps without max_epochs: Lightning answers max_steps as is
                trainer.fit_loop.setup_data()
            if not isinstance(steps, int) or steps < 1:
                raise UsageError(f"Lightning estimates {steps} optimizer steps; trainjob needs a finite number: "
                                 "set max_epochs or max_steps")
            state = LightningState(trainer, script_state(trainer, train_loader(trainer)))
            self.run = Run(self.pvc, state=state, steps=steps, ckpt_every=self.ckpt_every, **self.run_options)
        assert self.run is not None
        self.run.__enter__()  # an error ends the Run here, with its code
        if self.run.final is not None or self.run.error is not None:
            # Nothing to train (out of retries, an error, an idempotent relaunch of a completed
            # job): the process ends here, before Lightning trains anything, 0 included.
            self._leave(always=True)
        assert self.run.stop is not None
        _keep_signals(trainer, self.run.stop._handle)
        with self._guard():
            if not state.loaded:  # a fresh start (a resume's load started the workers anew)
                state.restart()
            self._steps = iter(self.run)
            self._next()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        with self._guard():
            if self._step is None:
                raise UsageError(f"Lightning trains past step {self._steps_total()}, the number of steps it estimated "
                                 "(estimated_stepping_batches) and the trainjob run was given")
            self._stepped_from = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stepped = trainer.global_step != self._stepped_from
        with self._guard():
            loss = _loss(outputs, self._step, required=stepped)
            if loss is not None:
                # Lightning hands out each batch's loss divided by accumulate_grad_batches (what
                # it backpropagates); the step's loss is the mean of its batches' own.
                self._window.append(loss * trainer.accumulate_grad_batches if pl_module.automatic_optimization
                                    else loss)
            if not stepped:
                return  # gradient accumulation: the optimizer did not step, the trainjob step goes on
            assert self.run is not None
            window, self._window = self._window, []
            self.run.report(window[0] if len(window) == 1 else sum(window) / len(window))
            if _validates_next(trainer):
                # The step is saved once the validation that follows it is over, as Lightning's
                # ModelCheckpoint saves then: a resume does not run that validation again, and
                # the RNG streams it drew from are saved as they are after it.
                self._after_validation = True
                return
            self._next()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._after_validation and not trainer.sanity_checking:
            self._after_validation = False
            with self._guard():
                self._next()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._step is not None:
            with self._guard():
                if not trainer.should_stop:
                    raise UsageError(f"Lightning's fit ended before step {self._step} of {self._steps_total()} "
                                     "without a stop decided (trainer.should_stop): the train loader ran out before "
                                     "estimated_stepping_batches? The steps since the last checkpoint are not saved")
                assert self.run is not None
                self.run.end_early()  # step self._step was not trained: the run ends at the one before
                self._next()
        self._gate(pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._gate(pl_module)  # a resume after the last step: the fit loop had nothing left to train
        self._leave()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, _Ended):
            return
        if _from_a_peer(exception):  # a rank left mid-step (gloo, nccl): nothing is wrong with the job
            exception = PeerFailed(one_line(f"{type(exception).__name__}: {exception}")[:300])
        self._end_with(exception)

    # --- the Run ----------------------------------------------------------------------------------

    def _next(self) -> None:
        """The Run's next step: the checkpoint of the step just reported when due, a stop agreed
        with the other ranks; then the step to train, or the end of the Run's loop."""
        assert self._steps is not None and self.run is not None
        self._step = next(self._steps, None)
        if self._step is None and not self.run.gate_due:  # stopped (its step saved, killed) or the lab's die_at
            self._leave()

    def _gate(self, module: pl.LightningModule) -> None:
        if self.run is None or not self.run.gate_due:
            return
        with self._guard():
            verdict = gate_arguments(self.gate(module))  # a Metric, or the holdout's and the baseline's Score
            export = self.export(module) if self.export is not None else module.state_dict()
            self.run.gate(**verdict, export=dict(export))

    def _steps_total(self) -> int:
        assert self.run is not None
        return self.run.cfg.steps

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Every error in a hook ends the Run with its code (the callback's own SystemExit passes)."""
        try:
            yield
        except _Ended:
            raise
        except BaseException as exc:
            self._end_with(exc)

    def _end_with(self, exc: BaseException) -> NoReturn:
        """End the launch with ``exc`` and the process with its code."""
        if self.run is None:  # before the Run was entered: said here, as the Run would
            self._code = exit_code_for(type(exc))
            if self._code == EXIT_INTERNAL:
                _say("".join(traceback.format_exception(exc)).rstrip())
            _say(f"trainjob: {one_line(str(exc)) or type(exc).__name__} (exit {self._code})")
            raise _Ended(self._code) from None
        if not self._left:
            self._left = True
            try:
                self.run.__exit__(type(exc), exc, exc.__traceback__)
            except SystemExit:
                pass  # a BaseException ends in SystemExit(its code): the same code, raised below
        raise _Ended(self.run.exit_code) from None

    def _leave(self, always: bool = False) -> None:
        """Leave the Run; any end but ``completed`` (with ``always``, any end) ends the process
        with its code."""
        assert self.run is not None
        if not self._left:
            self._left = True
            try:
                self.run.__exit__(None, None, None)
            except SystemExit:
                pass
        if always or self.run.exit_code != 0:
            raise _Ended(self.run.exit_code)


def _keep_signals(trainer: pl.Trainer, handler: Callable[[int, Any], None]) -> None:
    """SIGTERM and SIGINT stay the Run's (``handler``) from the moment it began. Lightning
    registers its own SIGTERM handler after ``on_fit_start``, with the Run's behind it: a SIGTERM
    there (its sanity check, its first batch) raised Lightning's own exit ("Received SIGTERM"),
    nothing saved and no ``killed`` logged, and under DDP it broadcasts from inside the handler.
    And its teardown puts back the handlers it found, the Run's among them, after the Run has
    left (a stop's ``_Ended``): Python resets a handler to the default while it shuts down, so a
    second SIGTERM then (Slurm's preemption sends two) ended the process by the signal, 143.
    So its registration is wrapped, on this trainer only: signals wait while Lightning
    registers, the Run's handler goes back in, and Lightning neither restores nor claims these two."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or threading.current_thread() is not threading.main_thread():
        return
    register = connector.register_signal_handlers
    stops = {signal.SIGTERM, signal.SIGINT}

    def register_around_the_run() -> None:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # one sent meanwhile waits for the Run's handler
        try:
            register()
            signal.signal(signal.SIGTERM, handler)
            for sig in stops:
                getattr(connector, "_original_handlers", {}).pop(sig, None)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    connector.register_signal_handlers = register_around_the_run


def _loss(outputs: Any, step: int | None, required: bool) -> Any:
    """The loss Lightning's training_step returned for a batch (``required``: the batch that
    stepped), as Lightning hands it to the callbacks."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if loss is None and required:
        raise UsageError(f"step {step}: training_step returned no loss (return the loss, or a dict with 'loss')")
    return loss.detach() if isinstance(loss, torch.Tensor) else loss


def _refuse_sync_batchnorm_on_cpu(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """``sync_batchnorm=True`` (or the module's own SyncBatchNorm layers) under DDP on CPU: torch's
    DistributedDataParallel refuses SyncBatchNorm on CPU with a ValueError when the strategy wraps
    the model, which would end the run 70 for a configuration."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm
    from lightning.pytorch.strategies import DDPStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy) or strategy.root_device.type != "cpu":
        return
    if isinstance(getattr(strategy, "_layer_sync", None), TorchSyncBatchNorm) \
            or any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()):
        raise UsageError("sync_batchnorm=True on CPU: torch's SyncBatchNorm works only on GPUs (DDP refuses it on "
                         "CPU); leave it out: trainjob saves BatchNorm's statistics as DDP keeps them, rank 0's, "
                         "which DDP hands to every rank at each forward")


def _refuse_stochastic_weight_averaging(trainer: pl.Trainer) -> None:
    """Lightning's ``StochasticWeightAveraging`` changes the fit partway: at its first epoch it
    adds ``initial_lr`` and ``swa_lr`` to the optimizer's param groups and a SWALR scheduler to the
    fit's. A launch resuming from a checkpoint saved after that begins without them, so the
    checkpoint no longer fits the state it is loaded into: the uninterrupted run completed, a
    killed one was refused at its relaunch (exit 2), its training lost. Refused before anything
    is written, in one line."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if any(isinstance(cb, StochasticWeightAveraging) for cb in trainer.callbacks):
        raise UsageError("StochasticWeightAveraging: trainjob cannot resume it (it adds a scheduler and optimizer "
                         "settings partway through the fit, which a relaunch does not have until then); leave it "
                         "out of the callbacks")


def _validates_next(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates right after this batch: its epoch loop's own test, as its
    ``on_advance_end`` makes it next."""
    epoch_loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    if fetcher is None or getattr(epoch_loop, "_skip_next_val", False):
        return False
    return bool(epoch_loop._should_check_val_fx(fetcher))


def _from_a_peer(exc: BaseException) -> bool:
    dist_error = getattr(torch.distributed, "DistError", None)
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1 and dist_error is not None and isinstance(exc, dist_error))


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass
