"""Every error trainjob raises on purpose, as one tree, and the one place OS errors become it.

    TrainJobError                 base; raised bare, it is unclassified     -> exit 70
    ├── Refused(ValueError)       the request cannot work; retrying cannot help -> exit 2
    │   ├── UsageError            a flag or argument that cannot work
    │   └── InputError            a file trainjob reads is missing or wrong
    │       ├── AlreadyCompleted      the PVC holds a completed job
    │       ├── ArtifactUnverified    a completed job's artifact fails its logged hash
    │       ├── NoVerifiedCheckpoint  checkpoints exist, none verifies
    │       └── WorldSizeMismatch     newest checkpoint is for another world size
    └── TryAgainLater(OSError)    nothing is wrong with the job; relaunch      -> exit 75
        ├── PvcBusy               another process holds the PVC (rank) lock
        ├── NoSpace               the PVC (or a checkpoint about to be saved) is out of space
        ├── RankTimeout           a bounded wait for another rank ran out
        ├── PeerFailed            the coordinator (rank 0) stopped on error
        └── Superseded            a newer launch took over (a rank rejoins it; only escapes
                                  by mistake)

Each class below the root subclasses exactly one exit-code base (``Refused`` or
``TryAgainLater``), and the builtin it resembles, as attrs' errors do, so callers may catch
either. The exit codes are mapped from those bases in one table in ``cli.py``; a test walks
every subclass and checks it has exactly one code.

Honest failures (drift_failed, job_failed) are outcomes of the state machine, not exceptions.

``os_errors`` is the one translation from ``OSError`` to this tree: storage trouble (a full,
read-only or failing disk) is always retryable, anything else is what the caller says it means
there (a bad path the user gave is ``InputError``; a failed write on the PVC is
``TryAgainLater``). The OSError stays chained as the cause.

This module must not import anything from the rest of the package.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager


class TrainJobError(Exception):
    """Base of every error trainjob raises deliberately; raised bare it is unclassified (exit 70)."""


class Refused(TrainJobError, ValueError):
    """The request cannot work as given; relaunching the same way cannot help (exit 2)."""


class UsageError(Refused):
    """A command-line argument that cannot work (exit 2)."""


class InputError(Refused):
    """A file trainjob reads is missing, unreadable or invalid (exit 2).

    The message names the file and, where it can, the field or line.
    """


class AlreadyCompleted(InputError):
    """The PVC already holds a completed job; a new run would overwrite its story."""


class ArtifactUnverified(InputError):
    """The PVC holds a completed job, but its artifact is missing or no longer matches the sha256
    the log recorded: the published model cannot be trusted, and no relaunch can repair it."""


class NoVerifiedCheckpoint(InputError):
    """Checkpoints exist but none verifies: starting over would silently discard them."""


class WorldSizeMismatch(InputError):
    """The newest verified checkpoint was written by another world size; reshard it first."""


class TryAgainLater(TrainJobError, OSError):
    """Nothing is wrong with the job itself; relaunching later is safe (exit 75)."""


class PvcBusy(TryAgainLater):
    """Another ``trainjob`` process holds the PVC's lock (or this rank's lock)."""


class NoSpace(TryAgainLater):
    """The PVC is out of space (or below the size of the next checkpoint); nothing was deleted."""


class RankTimeout(TryAgainLater):
    """A bounded wait for another rank (through the PVC) ran out."""


class PeerFailed(TryAgainLater):
    """Rank 0 ended this launch with an error; the other ranks stop too."""


class Superseded(TryAgainLater):
    """A newer launch (generation) started while this rank worked for an older one.

    ``job.follow`` catches it and rejoins the new launch; were it ever to escape, relaunching
    is still the right answer.
    """


# errno -> error class for trouble with the storage itself, whatever the file: the job and its
# input are fine, and the same command can succeed once the disk (or the node) recovers.
# A read-only file system is here too: ext4 remounts read-only after a disk error.
STORAGE_TROUBLE: dict[int, type[TryAgainLater]] = {
    errno.ENOSPC: NoSpace, errno.EDQUOT: NoSpace,
    **dict.fromkeys((errno.EIO, errno.EROFS, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ESTALE,
                     errno.ETIMEDOUT, errno.ENOLCK, errno.EMFILE, errno.ENFILE, errno.ENOMEM,
                     errno.ENOBUFS, errno.EDEADLK), TryAgainLater),
}


def classify(exc: OSError, otherwise: type[TrainJobError]) -> type[TrainJobError]:
    """The class an OSError becomes: storage trouble is retryable, the rest is ``otherwise``."""
    return STORAGE_TROUBLE.get(exc.errno or 0, otherwise)


@contextmanager
def os_errors(where: object, doing: str, otherwise: type[TrainJobError] = TryAgainLater) -> Iterator[None]:
    """Turn an OSError raised inside into this tree's error, as ``WHERE: DOING: STRERROR``.

    ``otherwise`` is what any error that is not storage trouble means at this call site:
    ``InputError`` where the path came from the user (missing, a directory, a name too long),
    ``TryAgainLater`` (the default) for the PVC's own files. Errors of this tree (TryAgainLater
    is an OSError too) pass through untouched.
    """
    try:
        yield
    except TrainJobError:
        raise
    except OSError as exc:
        raise classify(exc, otherwise)(f"{where}: {doing}: {exc.strerror or exc}") from exc
