"""Asynchronous checkpoints: one write in flight, on a thread, behind reusable host staging buffers.

``BackgroundSaver`` is the whole of it, for one rank. At a due step the training loop calls
``hand_off``: the trainer's live state is copied into host staging buffers (``HostState`` with
``copy=True``, buffers kept and reused at every checkpoint, so the memory cost is one copy of
the state), and the writer thread runs the caller's ``write`` on that copy (write, hash, fsync,
commit: whatever a synchronous save does) while the loop trains on. The copy is the only stall,
unless the previous write is still running: then ``hand_off`` first waits for it (back-pressure:
at most one checkpoint in flight, so the buffers are never overwritten under a write), and that
wait is counted in ``stall_seconds`` too. The writer is one thread for the whole run, started by
``prepare`` before the loop and handed each write through a queue: starting a thread per
checkpoint stalled the loop until the new thread was scheduled (measured under load on 2 cores:
5 ms median, a third of an async checkpoint's stall at 1.5 MiB). ``release`` and ``close`` end it.
``hand_off(start=False)`` stages the write without starting it, and ``start`` starts it: the
engine logs ``snapshotted`` in between, so that the loop's last work of the checkpoint does not
wait for the interpreter's lock while the writer's first, pure Python work (the shard's header,
the manifest) holds it (measured with the HF Trainer: 4 ms of a 14 ms stall, the line's append
taking 2.4 ms instead of 0.6).

The loop asks at each step boundary (``done``, then ``landed``): ``landed`` says the write ended
well (``take`` then hands its result over and frees the slot), or re-raises the error it ended with (an ``OSError`` already translated to the
errors tree by the store, e.g. ``NoSpace``): an error is kept until the loop has seen it, never
dropped, and never raised on the writer thread alone (torch.distributed.checkpoint's async_save
could lose one there). ``wait`` is the bounded join: ``TryAgainLater`` when the write did not end
within its timeout, never a hang.

Must not: touch the state machine (``transitions`` is not thread-safe: triggers are fired on the
main thread by whoever calls ``landed``), log anything, or write a file itself (``write`` does,
through the store). The writer thread never handles signals (Python runs handlers on the main
thread), so a SIGTERM is the loop's to act on.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import numpy as np

from ..errors import WriteTimeout
from .snapshot import HostState

T = TypeVar("T")
Write = Callable[[dict[str, np.ndarray]], T]


class _Write:
    """One handed-off write: its outcome, set by the writer thread before ``ended``."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.run, self.ended = run, threading.Event()
        self.started = False  # handed to the writer thread (``start``)
        self.result: Any = None
        self.error: BaseException | None = None


def _writer(writes: queue.SimpleQueue[_Write | None]) -> None:
    """The writer thread: each write handed to it, in turn, until told to end (None)."""
    while (write := writes.get()) is not None:
        try:
            write.result = write.run()
        except BaseException as exc:  # kept for the main thread, which raises it at its boundary
            write.error = exc
        finally:
            write.ended.set()


class BackgroundSaver(Generic[T]):
    """One rank's asynchronous checkpoints: staging buffers, one writer thread at a time, its
    outcome kept for the main thread. Every method is for the main thread."""

    def __init__(self, timeout: float, name: str = "trainjob-checkpoint-writer") -> None:
        self.host = HostState(copy=True)  # the staging buffers, reused by every checkpoint
        self.timeout, self.name = timeout, name
        self.step: int | None = None  # the step whose write is in flight (or ended, not yet landed)
        self.stall_seconds = 0.0  # the loop's time in hand_off and wait: copies and back-pressure
        self.copies = 0
        self._write: _Write | None = None  # the write in flight, or ended and not yet taken
        self._writes: queue.SimpleQueue[_Write | None] | None = None  # the writer thread's, while it runs
        self._thread: threading.Thread | None = None

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Allocate the staging buffers now, at the start of a run, by one copy of ``state``: the
        first checkpoint then stalls for a copy only, not for allocating and faulting in a second
        state's worth of pages (measured: about 3x a copy). Checks the state as a snapshot does."""
        if not self.in_flight:
            self.host.snapshot(state, 0)
        self._start_writer()

    def _start_writer(self) -> queue.SimpleQueue[_Write | None]:
        if self._writes is None:
            self._writes = queue.SimpleQueue()
            self._thread = threading.Thread(target=_writer, args=(self._writes,), name=self.name, daemon=True)
            self._thread.start()
            # A run that ends on a path that neither releases nor closes its saver (a launch with
            # nothing to train) leaves no thread behind once the saver is gone: the thread holds
            # the queue only, never the saver.
            self._unused = weakref.finalize(self, self._writes.put, None)
        return self._writes

    def _end_writer(self) -> None:
        """End the writer thread: at once when it is idle (joined, so it is gone when this
        returns); a write still stuck in it ends it when the write returns. A later ``hand_off``
        starts another."""
        if self._writes is not None and self._thread is not None:
            self._unused.detach()
            self._writes.put(None)
            if self._write is None or not self._write.started or self._write.ended.is_set():
                self._thread.join()
            self._writes = self._thread = None

    @property
    def in_flight(self) -> bool:
        """A write was handed off and its outcome not yet taken by ``landed``."""
        return self.step is not None

    def hand_off(self, state: Mapping[str, Any], step: int, write: Write[T], start: bool = True) -> None:
        """Copy ``state`` (a trainer's ``state_dict()``) into the staging buffers and start
        ``write`` on them in the background (``start=False``: once ``start`` is called). The
        previous write must have landed (``landed``): the table allows no second checkpoint in
        flight, so this is a caller's bug otherwise. Raises what the snapshot raises (UsageError)
        before anything is started."""
        if self.in_flight:
            raise RuntimeError(f"checkpoint step {step} handed off while step {self.step} is in flight")
        began = time.perf_counter()
        arrays = self.host.snapshot(state, step)  # the stall: one copy of the state, into buffers kept
        self.copies += 1
        self._write, self.step = _Write(lambda: write(arrays)), step
        if start:
            self.start()
        self.stall_seconds += time.perf_counter() - began

    def start(self) -> None:
        """Start the write ``hand_off(start=False)`` staged, on the writer thread."""
        if self._write is None or self._write.started:
            raise RuntimeError("start() without a write staged by hand_off(start=False)")
        self._write.started = True
        self._start_writer().put(self._write)

    def done(self) -> bool:
        """Has the write in flight ended (well or not)? False when none is in flight. Cheap: the
        loop asks after every step."""
        return self._write is not None and self._write.ended.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the write in flight ends (back-pressure, draining before the end of a run);
        counted as stall. WriteTimeout after ``timeout`` seconds (default: the saver's)."""
        if self._write is None:
            return
        if not self._write.started:
            raise RuntimeError(f"wait() for checkpoint step {self.step}, whose write was never started")
        began = time.perf_counter()
        limit = self.timeout if timeout is None else timeout
        self._write.ended.wait(limit)
        self.stall_seconds += time.perf_counter() - began
        if not self._write.ended.is_set():
            raise WriteTimeout(f"the background write of checkpoint step {self.step} did not end within "
                               f"{limit:g}s; relaunch (the previous checkpoint stands)")

    def landed(self) -> bool:
        """Did the write in flight end well? False while it runs (or when none is in flight).
        Re-raises its error when it failed, and frees the slot: the error is reported exactly
        once, on the main thread, at the boundary that asked."""
        if not self.done():
            return False
        assert self._write is not None  # ended: its outcome was set before (the event orders it)
        if self._write.error is not None:
            error = self._write.error
            self._write, self.step = None, None
            raise error
        return True

    def take(self) -> T:
        """The result of the write that ``landed``; frees the slot for the next ``hand_off``."""
        if not self.landed():
            raise RuntimeError("take() before the write in flight landed")
        assert self._write is not None
        result = self._write.result
        self._write, self.step = None, None
        return result

    def release(self) -> None:
        """Drop the staging buffers once the last checkpoint landed (the run's end: the gate's
        export should not find a second copy of the state still held). No write may be in flight."""
        if self.in_flight:
            raise RuntimeError(f"release() while checkpoint step {self.step} is in flight")
        self.host.buffers.clear()
        self._end_writer()

    def close(self, timeout: float) -> None:
        """On the way out after an error elsewhere: give the write in flight up to ``timeout``
        seconds to end, and drop its outcome (the error being raised is the one to report; a
        write cut short leaves only a staging directory the next start removes; one never started
        is dropped)."""
        if self._write is not None and self._write.started:
            self._write.ended.wait(timeout)
        self._end_writer()
        self._write, self.step = None, None
