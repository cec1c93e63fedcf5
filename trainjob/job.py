"""The engine: drives the state machine through one process's share of a training job.

``run`` loads what the PVC holds, lets the machine decide how this process begins, trains step
by step, and hands the result to the gate. ``Job`` is the machine's model: its guards ask the
pure functions in ``decisions.py``, its ``persist_*`` callbacks write to the PVC, and
``announce`` appends the log event. The engine never writes a file or a log line itself.
"""

from __future__ import annotations

import hashlib
import signal
from collections import ChainMap
from collections.abc import Sequence
from typing import Any

import attrs
from transitions import EventData

from . import decisions, machine
from .data import Dataset
from .errors import AlreadyCompleted, InputError, UsageError
from .eventlog import EventLog
from .model import evaluate, train_one_epoch
from .pvc import Pvc
from .records import Artifact, Checkpoint, RunState, dumps, load


@attrs.frozen
class RunConfig:
    steps: int = 10
    ckpt_every: int = 2
    lr: float = 0.05
    max_drop: int = 20
    backoff_limit: int = 2
    die_at: int | None = None
    force_weights: tuple[float, float, float] | None = None

    def check(self) -> None:
        """Raise UsageError for settings that cannot work, naming the flag and what to change."""
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1, got {self.steps}")
        if self.ckpt_every < 1:
            raise UsageError(f"--ckpt-every must be at least 1, got {self.ckpt_every}")
        if not (self.lr > 0 and self.lr < float("inf")):
            raise UsageError(f"--lr must be a positive finite number, got {self.lr}")
        if not 0 <= self.max_drop <= 100:
            raise UsageError(f"--max-drop is a percentage from 0 to 100, got {self.max_drop}")
        if self.backoff_limit < 0:
            raise UsageError(f"--backoff-limit must be 0 or more, got {self.backoff_limit}")
        if self.die_at is not None and not 1 <= self.die_at <= self.steps:
            raise UsageError(f"--die-at must be a step from 1 to --steps ({self.steps}), got {self.die_at}")


class StopFlag:
    """Records SIGTERM/SIGINT so the loop can checkpoint and exit 75 at the next step boundary."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal = signal.Signals(signum).name


class Job:
    """The state machine's model for one process of one attempt."""

    state: str  # set by transitions.Machine

    def __init__(self, cfg: RunConfig, pvc: Pvc, log: EventLog, data_sha256: str) -> None:
        self.cfg, self.pvc, self.log, self.data_sha256 = cfg, pvc, log, data_sha256
        self.last = pvc.read_state()
        completed = self.last is not None and self.last.state == "completed"
        self.completion_announced = completed and log.last_event() == "completed"
        if self.completion_announced:
            raise AlreadyCompleted(
                f"{pvc.root}: this job already completed (attempt {self.last.attempt}); "
                "use a fresh --pvc for a new job"
            )
        self.checkpoint_loaded = pvc.read_checkpoint()
        self.attempts = pvc.read_attempts()
        self.attempt = max(self.attempts, 1)
        self.resume_from: Checkpoint | None = None
        self.from_step = 0
        self.persisted_state: str | None = self.last.state if self.last else None
        self.artifact: dict[str, Any] = {}
        machine.build(self)

    # --- guards: each one asks exactly one pure decision --------------------------------------

    def completion_unannounced(self, _ev: EventData) -> bool:
        return decisions.completion_unannounced(
            self.last.state if self.last else None, self.completion_announced
        )

    def should_resume(self, _ev: EventData) -> bool:
        ckpt = self.checkpoint_loaded
        return decisions.should_resume(
            self.last.state if self.last else None, ckpt.step if ckpt else None, self.cfg.steps
        )

    def within_backoff(self, _ev: EventData) -> bool:
        return decisions.within_backoff(self.attempts, self.cfg.backoff_limit)

    def should_checkpoint(self, ev: EventData) -> bool:
        return ev.kwargs.get("force", False) or decisions.should_checkpoint(
            ev.kwargs["step"], self.cfg.ckpt_every, self.cfg.steps
        )

    def drift_passes(self, ev: EventData) -> bool:
        holdout, baseline = ev.kwargs["holdout"], ev.kwargs["baseline"]
        return decisions.drift_passes(holdout.correct, holdout.total, baseline.correct, self.cfg.max_drop)

    # --- persistence: runs before the state changes ---------------------------------------------

    def _write_state(self, state: str) -> None:
        if state != self.persisted_state:
            self.pvc.write_state(
                RunState(state=state, attempt=self.attempt, lr=self.cfg.lr, data_sha256=self.data_sha256)
            )
            self.persisted_state = state

    def persist_state(self, ev: EventData) -> None:
        self._write_state(ev.transition.dest)

    def persist_resume(self, ev: EventData) -> None:
        if self.last is not None:
            self.attempt = self.last.attempt
            # The counter is bumped right after state.json, so it may lag by one, never more.
            if self.attempts not in (self.attempt - 1, self.attempt):
                raise InputError(
                    f"{self.pvc.attempts_path}: says {self.attempts} attempts but state.json says attempt "
                    f"{self.attempt} is in flight; one of them was edited, fix it by hand"
                )
            if (self.last.lr, self.last.data_sha256) != (self.cfg.lr, self.data_sha256):
                raise InputError(
                    f"{self.pvc.state_path}: attempt {self.attempt} was cut short while training with "
                    f"--lr {self.last.lr} on other data or settings; relaunch it with the same --lr and --data"
                )
        ckpt = self.checkpoint_loaded
        if ckpt is not None and ckpt.attempt != self.attempt:
            # The newest checkpoint is an earlier, ended attempt's: this attempt was killed before
            # its own first checkpoint and starts again from step 0.
            ckpt = None
        if ckpt is not None and ckpt.step > self.cfg.steps:
            raise InputError(
                f"{self.pvc.checkpoint_path}: checkpoint is at step {ckpt.step}, beyond --steps {self.cfg.steps}"
            )
        self.resume_from = ckpt
        self.from_step = ckpt.step if ckpt else 0
        self._write_state("resumed")
        if self.attempts < self.attempt:  # died between writing state.json and attempts
            self.pvc.write_attempts(self.attempt)

    def persist_start(self, _ev: EventData) -> None:
        self.attempt = self.attempts + 1
        # state.json first: if we die before the counter is bumped, the relaunch still sees an
        # attempt in flight and resumes it, instead of burning a second attempt number.
        self._write_state("started")
        self.pvc.write_attempts(self.attempt)

    def persist_checkpoint(self, ev: EventData) -> None:
        kw = ev.kwargs
        self.pvc.write_checkpoint(
            Checkpoint(attempt=self.attempt, step=kw["step"], weights=kw["weights"], bias=kw["bias"],
                       loss_milli=kw["loss_milli"])
        )
        self._write_state("checkpointed")

    def recall_artifact(self, _ev: EventData) -> None:
        """Re-read the artifact the killed predecessor published, to announce it truthfully."""
        self.attempt = self.last.attempt
        name = f"model-v{self.attempt}.json"
        data = self.pvc.read_artifact(name)
        record = load(data, Artifact, where=str(self.pvc.artifacts / name))
        self.artifact = {"sha256": hashlib.sha256(data).hexdigest(), "path": f"artifacts/{name}",
                         "holdout": record.holdout, "baseline": record.baseline}

    def persist_artifact(self, ev: EventData) -> None:
        kw = ev.kwargs
        record = Artifact(attempt=self.attempt, step=self.cfg.steps, weights=kw["weights"], bias=kw["bias"],
                          holdout=kw["holdout"], baseline=kw["baseline"])
        data = (dumps(record) + "\n").encode()
        name = f"model-v{self.attempt}.json"
        self.pvc.write_artifact(name, data)
        # Hash the very bytes that were written, not a re-serialisation.
        self.artifact = {"sha256": hashlib.sha256(data).hexdigest(), "path": f"artifacts/{name}"}

    # --- announcements: run after the state changed ---------------------------------------------

    def _facts(self, ev: EventData) -> ChainMap[str, Any]:
        own = dict(steps=self.cfg.steps, attempt=self.attempt, attempts=self.attempts,
                   backoff_limit=self.cfg.backoff_limit, from_step=self.from_step,
                   max_drop=self.cfg.max_drop, **self.artifact)
        return ChainMap(ev.kwargs, own)

    def _append(self, event: str, ev: EventData) -> None:
        self.log.append(event, machine.DETAIL[event](self._facts(ev)))

    def announce_artifact(self, ev: EventData) -> None:
        self._append("artifact_written", ev)

    def announce(self, ev: EventData) -> None:
        self._append(machine.EVENT_FOR_STATE[self.state], ev)


def run(cfg: RunConfig, pvc: Pvc, log: EventLog, data: Dataset, stop: StopFlag) -> str:
    """Run this process's share of the job; return the state the machine ended in."""
    job = Job(cfg, pvc, log, data.sha256)
    job.start()
    if job.state in machine.FINAL:
        return job.state

    ckpt = job.resume_from
    weights: Sequence[float] = ckpt.weights if ckpt else (0.0, 0.0, 0.0)
    bias = ckpt.bias if ckpt else 0.0
    step = last_saved = job.from_step
    loss = ckpt.loss_milli if ckpt else 0

    def stop_now() -> str:
        if step > last_saved:  # save the step we finished before obeying the signal
            job.checkpoint(step=step, weights=weights, bias=bias, loss_milli=loss, force=True)
        job.kill(at_step=step, signal=stop.signal)
        return job.state

    while step < cfg.steps:
        if stop.signal:
            return stop_now()
        step += 1
        weights, bias, mean_loss = train_one_epoch(weights, bias, data.train, cfg.lr)
        loss = decisions.loss_milli(mean_loss)
        if job.checkpoint(step=step, weights=weights, bias=bias, loss_milli=loss):
            last_saved = step
        if cfg.die_at == step:
            job.kill(at_step=step)
            return job.state
    if stop.signal:
        return stop_now()

    if cfg.force_weights is not None:  # teaching hook: make a finished run fail the gate
        weights, bias = cfg.force_weights, 0.0
    job.gate(weights=weights, bias=bias,
             holdout=evaluate(weights, bias, data.holdout),
             baseline=evaluate(data.baseline.weights, data.baseline.bias, data.holdout))
    return job.state
