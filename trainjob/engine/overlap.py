"""--async-checkpoint on the engine's side: the machine's callbacks for the edges where the training
loop and the writer thread part (``checkpoint`` into ``snapshotted``) and meet (``land`` into
``checkpointed``), and the two calls the loop makes at step boundaries. The write is staged at
``checkpoint`` and started once its ``snapshotted`` line is logged (``start_write``).

``AsyncCheckpoints`` is a mixin for the machine's model (``job.Job``): it owns a
``BackgroundSaver`` (checkpoint/background.py) when the run asked for asynchronous checkpoints,
and none otherwise, which is what the ``async_save`` guard reads. The model provides
``write_checkpoint`` (the whole of a synchronous save but the state.json write, the log line and
the rotation that follows it: shard, receipts, commit, pointer; no machine, no log, so a thread may
run it) and ``_write_state``; ``land``'s announcement logs the line and rotates, as a synchronous
checkpoint's does.

Every method here runs on the main thread: ``transitions`` is not thread-safe, so the writer
thread never fires a trigger; the loop asks (``at_boundary``) and fires ``land`` itself. The
log's ``checkpointed`` is appended by ``land``, after the commit is durable; a failed write
raises its error from the ``commit_landed`` guard, so the state stays ``snapshotted``, nothing
is announced, and the error ends the process with its exit code (75 for storage trouble).
"""

from __future__ import annotations

from typing import Any

from transitions import EventData

from ..checkpoint.background import BackgroundSaver
from ..states import State


class AsyncCheckpoints:
    """The asynchronous half of the machine's checkpoint callbacks (mixin for ``job.Job``)."""

    saver: BackgroundSaver[int] | None = None
    state: str
    last_size: int
    # Provided by the model: write_checkpoint(step, loss_milli, tensors, specs, last_size) -> size
    # and _write_state(state); the `land` trigger is attached by machine.build.

    def enable_async(self, timeout: float) -> None:
        self.saver = BackgroundSaver(timeout)
        self.in_flight: dict[str, Any] = {}  # the facts `land` announces: the step and loss written

    # --- guards ---------------------------------------------------------------------------------

    def async_save(self, _ev: EventData) -> bool:
        return self.saver is not None

    def commit_landed(self, _ev: EventData) -> bool:
        assert self.saver is not None
        return self.saver.landed()  # re-raises the writer's error, here, on the main thread

    # --- callbacks --------------------------------------------------------------------------------

    def hand_off(self, ev: EventData) -> None:
        """Copy the live state into the staging buffers and stage the write: the loop's stall.
        The write starts once ``snapshotted`` is logged (``start_write``)."""
        kw, saver = ev.kwargs, self.saver
        assert saver is not None
        step, loss, last_size = kw["step"], kw["loss_milli"], self.last_size
        saver.hand_off(kw["live"], step,
                       lambda arrays: self.write_checkpoint(  # type: ignore[attr-defined]
                           step, loss, arrays, saver.host.specs, last_size), start=False)
        self.in_flight = dict(step=step, loss_milli=loss)

    def start_write(self) -> None:
        """(the ``snapshotted`` line appended) Start the staged write on the writer thread. Not
        before: the writer's first work is pure Python (the shard's header, the manifest), and
        the line's append would wait for the interpreter's lock meanwhile (background.py)."""
        assert self.saver is not None
        self.saver.start()

    def persist_landed(self, _ev: EventData) -> None:
        assert self.saver is not None
        self.last_size = self.saver.take()
        self._write_state(State.checkpointed)  # type: ignore[attr-defined]

    # --- the loop's calls, at step boundaries -----------------------------------------------------

    def at_boundary(self) -> None:
        """After every step: announce a checkpoint whose commit landed (or raise its error). Cheap
        while the write runs: no trigger is fired."""
        if self.state == State.snapshotted and self.saver is not None and self.saver.done():
            self.land(**self.in_flight)  # type: ignore[attr-defined]

    def settle(self) -> None:
        """Before a checkpoint, the gate or a stop: wait for the write in flight (back-pressure,
        bounded) and announce it, so the next edge starts from ``checkpointed``."""
        if self.state == State.snapshotted and self.saver is not None:
            self.saver.wait()
            self.land(**self.in_flight)  # type: ignore[attr-defined]
