"""Every error trainjob raises on purpose, as one tree.

    TrainJobError                 base of everything below
    ├── UsageError(ValueError)    a flag or argument that cannot work        -> exit 2
    ├── InputError(ValueError)    a file trainjob reads is missing or wrong  -> exit 2
    │   ├── AlreadyCompleted      the PVC holds a completed job              -> exit 2
    │   ├── NoVerifiedCheckpoint  checkpoints exist, none verifies           -> exit 2
    │   └── WorldSizeMismatch     newest checkpoint is for other world size  -> exit 2
    └── TryAgainLater(OSError)    nothing is wrong with the job; relaunch    -> exit 75
        ├── PvcBusy               another process holds the PVC (rank) lock  -> exit 75
        ├── NoSpace               a checkpoint would not fit on the PVC      -> exit 75
        ├── RankTimeout           a bounded wait for another rank ran out    -> exit 75
        ├── PeerFailed            the coordinator (rank 0) stopped on error  -> exit 75
        └── Superseded            a newer launch took over (a rank rejoins   -> exit 75
                                  it; only escapes by mistake)

Honest failures (drift_failed, job_failed) are outcomes of the state machine, not
exceptions. The mapping from error to exit code lives in exactly one place: ``cli.py``.
This module must not import anything from the rest of the package.
"""

from __future__ import annotations


class TrainJobError(Exception):
    """Base of every error trainjob raises deliberately."""


class UsageError(TrainJobError, ValueError):
    """A command-line argument that cannot work (exit 2)."""


class InputError(TrainJobError, ValueError):
    """A file trainjob reads is missing, unreadable or invalid (exit 2).

    The message names the file and, where it can, the field or line.
    """


class AlreadyCompleted(InputError):
    """The PVC already holds a completed job; a new run would overwrite its story."""


class TryAgainLater(TrainJobError, OSError):
    """Nothing is wrong with the job itself; relaunching later is safe (exit 75)."""


class PvcBusy(TryAgainLater):
    """Another ``trainjob`` process holds the PVC's lock (or this rank's lock)."""


class NoVerifiedCheckpoint(InputError):
    """Checkpoints exist but none verifies: starting over would silently discard them."""


class WorldSizeMismatch(InputError):
    """The newest verified checkpoint was written by another world size; reshard it first."""


class NoSpace(TryAgainLater):
    """Free space on the PVC is below the size of the last checkpoint; nothing was deleted."""


class RankTimeout(TryAgainLater):
    """A bounded wait for another rank (through the PVC) ran out."""


class PeerFailed(TryAgainLater):
    """Rank 0 ended this launch with an error; the other ranks stop too."""


class Superseded(TryAgainLater):
    """A newer launch (generation) started while this rank worked for an older one.

    ``job.follow`` catches it and rejoins the new launch; were it ever to escape, relaunching
    is still the right answer.
    """
