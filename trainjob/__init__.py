"""trainjob: a training-job engine that refuses silent success.

What trainer authors and library users import comes from here, and only what ``__all__`` lists is
promised; every other module path may move (``tests/test_public.py`` pins the list). Optional
modules are public too, because ``import trainjob`` must not need their extras:
``trainjob.torch`` (the PyTorch adapter: ``TrainingState``, ``trainjob[torch]``),
``trainjob.trainers.torch_state`` (its older, tensors-only helpers) and
``trainjob.trainers.digits`` (the built-in digits data and trainer). The command line is
``trainjob.cli.main``; the parts of the package are described in the README, "Reading the code".
"""

from typing import TYPE_CHECKING

from .defaults import VERSION as __version__
from .errors import (AlreadyCompleted, ArtifactUnverified, InputError, NoSpace, NoVerifiedCheckpoint, PeerFailed,
                     PvcBusy, RankTimeout, Refused, Superseded, TrainJobError, TryAgainLater, UsageError, WorldSizeMismatch,
                     WriteTimeout)
from .records import Score
from .trainers.protocol import Factory, State, Stateful, Trainer

if TYPE_CHECKING:  # for type checkers; at run time ``__getattr__`` below imports it on first use
    from .engine.run import Run

__all__ = [
    "__version__",
    # Your own training loop (README, "Bring your own loop").
    "Run",
    "Stateful",
    # Writing a trainer (docs/trainers.md).
    "Factory",
    "Score",
    "State",
    "Trainer",
    # The errors, one tree (errors.py draws it); exits.py maps its two bases to exit codes 2 and 75.
    "AlreadyCompleted",
    "ArtifactUnverified",
    "InputError",
    "NoSpace",
    "NoVerifiedCheckpoint",
    "PeerFailed",
    "PvcBusy",
    "RankTimeout",
    "Refused",
    "Superseded",
    "TrainJobError",
    "TryAgainLater",
    "UsageError",
    "WorldSizeMismatch",
    "WriteTimeout",
]


def __getattr__(name: str) -> object:
    # ``Run`` is the engine (numpy, transitions, ...); imported on first use, so that commands which
    # need none of it (``trainjob k8s render``, ``status``) start without loading it.
    if name == "Run":
        from .engine.run import Run
        return Run
    raise AttributeError(f"module 'trainjob' has no attribute {name!r}")
