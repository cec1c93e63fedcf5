"""Every error trainjob raises on purpose, as one tree.

    TrainJobError                 base of everything below
    ├── UsageError(ValueError)    a flag or argument that cannot work        -> exit 2
    ├── InputError(ValueError)    a file trainjob reads is missing or wrong  -> exit 2
    │   └── AlreadyCompleted      the PVC holds a completed job              -> exit 2
    └── TryAgainLater(OSError)    nothing is wrong with the job; relaunch    -> exit 75
        └── PvcBusy               another run holds the PVC lock             -> exit 75

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
    """Another ``trainjob run`` holds the PVC's lock."""
