"""A data worker stops when the process that started it says so, not when its process group is signalled.

Slurm's ``scancel`` and preemption (every process of the job step, twice), systemd, ``kill -TERM
-PGID`` and torch's elastic agent (``trainjob torchrun`` stopping its workers: their process
groups) signal whole process groups, and Ctrl-C sends SIGINT to the terminal's foreground group:
a DataLoader's worker processes get the same signal as the training process. torch's SIGTERM
handler in a worker lets it live only when its parent sent the signal. So the worker dies, the
training process's SIGCHLD handler raises "DataLoader worker ... is killed by signal" in the
middle of a step, of a validation or of the stop checkpoint, and the run ends in exit 70 with no
checkpoint, though trainjob promises that a stop finishes its step, saves a checkpoint and exits
75. (Kubernetes signals PID 1 only, so it does not hit this.)

Every loader's workers are guarded, not only the train loader's: a validation or test loader, an
HF Trainer's eval loader, a script's own second loader. Importing this module (``trainjob.torch``,
the Lightning and HF integrations all do) wraps torch's ``_set_worker_signal_handlers``, the first
thing both torch's and torchdata's worker loops call in a new worker, so that the guard is in place
before the worker does anything else (``_hook``). That reaches every worker a process starts by
fork (Linux's default), and by spawn when the script imports ``trainjob.torch`` at its top level
(the worker imports the script's module first). ``guard(loader)``, which ``TrainingState`` and the
HF integration call, also wraps a loader's ``worker_init_fn`` in ``StopOnOwner``, which reaches
that loader's workers however they were started; a worker is guarded once.

The guard: SIGTERM and SIGINT are blocked in the worker's main thread (every thread started later
inherits the mask) and a daemon thread takes them with ``sigwaitinfo``, which says who sent each
one. Another daemon thread ends the worker once that process is gone (``_leave_when_orphaned``).
What the worker does with a signal depends on who sent it (``verdict``):

- the process that started the worker (torch's ``_shutdown_workers`` and multiprocessing's exit
  handler both ``terminate()`` workers): the worker exits 0 at once, as torch's own handler does
  when the signal comes from its parent;
- any other sender, while that process lives: the signal is ignored, however many times it comes.
  The process that started the worker is stopping too: it saves its checkpoint, then shuts its
  workers down itself;
- any sender, once that process is gone: the signal acts as it would without this module.

``StopOnOwner`` can be pickled, and it records which process pickled it, so the guard works with
the fork and spawn start methods. Under forkserver, a group SIGTERM also kills the fork server,
which is the workers' parent, and torch's workers leave once their parent is gone. That case is
not covered. SIGINT is covered, because the fork server ignores it.

Owns: how DataLoader workers take SIGTERM and SIGINT, and that they end once the process that
started them is gone. Must not: change the training process's own signal handling
(``engine/job.py``'s ``StopFlag``), or anything else in a worker. A process that a worker starts
(a dataset's subprocess) inherits the blocked mask.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

STOPS = frozenset({signal.SIGTERM, signal.SIGINT})
ORPHAN_POLL = 0.5  # seconds between a worker's looks at whether the process that started it lives
END, IGNORE, AS_WITHOUT = "end", "ignore", "as without"
_guarded_pid: int | None = None  # in a worker: the guard is in place in this process


def guard(loader: Any) -> None:
    """Make ``loader``'s future worker processes end only when the process that started them tells them to.
    Does nothing when the loader has no workers, or if it is already guarded."""
    workers = getattr(loader, "num_workers", 0)
    if (isinstance(workers, int) and workers > 0 and hasattr(loader, "worker_init_fn")
            and not isinstance(loader.worker_init_fn, StopOnOwner)):
        loader.worker_init_fn = StopOnOwner(loader.worker_init_fn)


def verdict(sender: int, owner: int, owner_alive: bool) -> str:
    """What a worker does with a SIGTERM or SIGINT sent by ``sender`` (0: the kernel, such as a
    terminal's Ctrl-C), ``owner`` being the process that started the worker."""
    if sender == owner:
        return END
    return IGNORE if owner_alive else AS_WITHOUT


class StopOnOwner:
    """A loader's ``worker_init_fn``: the signal guard (module docstring), then the user's own
    function (``inner``) if there is one. A module-level class, not a closure: spawn and
    forkserver send it to each worker by value, and only a named class survives that trip."""

    def __init__(self, inner: Callable[[int], Any] | None) -> None:
        self.inner = inner
        self.owner: int | None = None  # set in the copy a spawned worker unpickles

    def __getstate__(self) -> dict[str, Any]:
        # Pickled by the process starting the worker, which is the worker's parent under spawn but
        # not under forkserver (there the fork server is the parent, and it is in the signalled group too).
        return {"inner": self.inner, "owner": os.getpid()}

    def __call__(self, worker_id: int) -> None:
        parent = os.getppid()
        _guard_this_worker(parent if self.owner is None else self.owner)  # fork: nothing was pickled
        if self.inner is not None:
            self.inner(worker_id)


def _guard_this_worker(owner: int) -> None:
    """(in a worker, once) Take SIGTERM and SIGINT on a thread of the guard's own, and leave
    when ``owner`` is gone."""
    global _guarded_pid
    if _guarded_pid == os.getpid():
        return
    _guarded_pid = os.getpid()
    parent = os.getppid()
    # Blocked before any thread starts, so every thread has them blocked and only sigwaitinfo
    # takes them. Otherwise torch's handler (which kills the worker) could run on a thread that
    # had not blocked them.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    threading.Thread(target=_take_stops, args=(owner, parent), name="trainjob-worker-stops", daemon=True).start()
    threading.Thread(target=_leave_when_orphaned, args=(owner, parent), name="trainjob-worker-orphan",
                     daemon=True).start()


class _GuardAfter:
    """torch's ``_set_worker_signal_handlers`` (``original``), then the guard, with the process
    that started the worker, its parent, as the owner. A class, so that hooking twice is seen."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        done = self.original(*args, **kwargs)
        _guard_this_worker(os.getppid())
        return done


def _hook() -> None:
    """Guard every DataLoader worker this process starts from now on (module docstring)."""
    from torch.utils.data._utils import signal_handling
    if not isinstance(signal_handling._set_worker_signal_handlers, _GuardAfter):
        signal_handling._set_worker_signal_handlers = _GuardAfter(signal_handling._set_worker_signal_handlers)


def _owner_alive(owner: int, parent: int) -> bool:
    if owner == parent:
        return os.getppid() == owner  # exact: an orphan is re-parented, and a pid may be reused
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leave_when_orphaned(owner: int, parent: int) -> None:
    """End the worker once the process that started it is gone (SIGKILLed, say), as torch's own
    watchdog means it to. That watchdog returns from the worker's loop, but the worker's exit then
    joins its result queue's feeder thread, which blocks forever on a full pipe no one reads: with
    the workers' random streams in every result (``worker_rng.py``), a few unread results fill it.
    Such an orphan held the killed run's stdout and stderr open, and its memory, indefinitely."""
    while _owner_alive(owner, parent):
        time.sleep(ORPHAN_POLL)
    os._exit(0)


def _take_stops(owner: int, parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOPS)
        what = verdict(info.si_pid, owner, _owner_alive(owner, parent))
        if what == END:
            # Exit 0 as torch's handler does for its parent. Death by the signal would make the
            # training process's SIGCHLD handler report a killed worker while Python exits.
            os._exit(0)
        if what == AS_WITHOUT:  # raised again on this thread alone, to whatever handler the worker has
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {info.si_signo})
            signal.pthread_kill(threading.get_ident(), info.si_signo)
            signal.pthread_sigmask(signal.SIG_BLOCK, {info.si_signo})


_hook()
