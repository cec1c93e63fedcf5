"""Exit codes: what each outcome of a run, and each error, exits with. The one table.

    0   completed (``verify``: everything verifies; ``reshard``: the new checkpoint is committed)
    1   honest failure: drift_failed or job_failed; a log no run could have written (status --path,
        replay, which still writes its page); ``verify``: something that matters does not verify
    2   usage or input error (bad flag or argument, missing or invalid file, already-completed PVC,
        no checkpoint verifies, world-size mismatch, a misused ``Run``; under ``--idempotent``, a
        completed PVC whose artifact fails its logged sha256)
    75  killed, preempted, PVC busy, storage trouble or full, out of memory while loading a
        checkpoint, a rank that did not answer in time; a resource or I/O fault (EMFILE, ENOMEM,
        EIO) while a command loads its modules (``errors.importing``); a peer lost in a collective
        of a step (``ranks/lost.py``: PeerFailed, whichever collective it was); in a ``Run``'s body,
        ``SystemExit`` (any code) or ``KeyboardInterrupt``: safe to relaunch
    70  an unexpected internal error (a bug, never an honest failure), including an error no
        exit-code base classifies, and any other ``BaseException`` (``GeneratorExit``, a bare one)

Errors map to codes by the one exit-code base each subclasses (errors.py draws the tree). The
engine's ``Run`` and the command line both read this module; how ``supervise`` and ``k8s render``
read these codes back is cli.py's.

A launch of W rank processes (the local launcher, ``trainjob torchrun``) exits with one code for
the job, ``job_exit`` of its ranks' codes: the rule every launcher, ``supervise``'s children and
the chaos campaign read a launch by. Pure: no I/O.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

from .errors import Refused, TrainJobError, TryAgainLater
from .states import State

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_RELAUNCH = 0, 1, 2, 70, 75

# Errors by the exit-code base they subclass (each class has exactly one of these bases). A bare
# TrainJobError is unclassified: a bug, never an honest failure.
EXIT_FOR_ERROR: dict[type[BaseException], int] = {
    Refused: EXIT_USAGE,           # UsageError, InputError and its kin: retrying cannot help
    TryAgainLater: EXIT_RELAUNCH,  # PvcBusy, NoSpace, OutOfMemory, RankTimeout, PeerFailed, WriteTimeout, Superseded
    TrainJobError: EXIT_INTERNAL,
    # Raised by a Run's own loop before its outcome: the process was asked to end (sys.exit of
    # any code, Ctrl-C raised as an exception) with the attempt in flight. A SIGTERM or SIGINT
    # delivered to the process ends in 75 too; the exit code a script chose cannot speak for the
    # run (0 would claim `completed`, 1 a gate verdict).
    SystemExit: EXIT_RELAUNCH,
    KeyboardInterrupt: EXIT_RELAUNCH,
}
# Where the machine (or a log) ended -> exit code. Anything still training was cut short.
EXIT_FOR_STATE = {State.completed: EXIT_OK, State.drift_failed: EXIT_FAILED, State.job_failed: EXIT_FAILED,
                  State.killed: EXIT_RELAUNCH, State.refused: EXIT_USAGE}


def exit_code_for(error: type[BaseException]) -> int:
    """The exit code of the first exit-code base in the error's method resolution order; an
    error outside the tree (a bug, or the user's own code failing, any other BaseException) is
    internal, 70."""
    return next((EXIT_FOR_ERROR[base] for base in error.__mro__ if base in EXIT_FOR_ERROR), EXIT_INTERNAL)


# A rank's status that is not one of trainjob's codes, read as one: stopped by a launcher or the
# kernel (SIGTERM, SIGINT; SIGKILL, an OOM kill included; negative as Python reports it, 128 + N
# as a shell or a container runtime does) is relaunchable, as a kill always is; any other signal
# or code is a crash, never an honest failure.
_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
STOPPED_BY = frozenset({-s for s in _STOPS} | {128 + s for s in _STOPS})
TRAINJOBS = frozenset({EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_RELAUNCH})
# When ranks disagree, the code that says most about the job wins: an input no relaunch can fix,
# then a bug, then an honest failure, then success; "relaunch" only when nothing else was said.
# Ranks agree on every outcome rank 0 decides (they exit with its outcome, ranks/); they
# disagree when a rank meets a cause first and the others only see it go (75), or when a rank is
# stopped after the outcome was decided (0 and 75: the outcome stands, as nothing exits 0 before
# rank 0 logged ``completed``).
PRECEDENCE = (EXIT_USAGE, EXIT_INTERNAL, EXIT_FAILED, EXIT_OK, EXIT_RELAUNCH)


def rank_exit(code: int) -> int:
    """One rank process's exit status (negative: the signal that ended it) as trainjob's code."""
    if code in TRAINJOBS:
        return code
    return EXIT_RELAUNCH if code in STOPPED_BY else EXIT_INTERNAL


def job_exit(codes: Iterable[int]) -> int:
    """The job's exit code from its rank processes' exit statuses: the most telling of them
    (``PRECEDENCE``), each read by ``rank_exit``; no rank at all is relaunchable."""
    said = {rank_exit(code) for code in codes}
    return next((code for code in PRECEDENCE if code in said), EXIT_RELAUNCH)


def exit_code_for_state(state: str) -> int:
    """The exit code of a run that ended in ``state``; a state still training was cut short."""
    return EXIT_FOR_STATE.get(state, EXIT_RELAUNCH)  # type: ignore[call-overload]
