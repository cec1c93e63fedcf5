"""trainjob: a training-job engine that refuses silent success.

What trainer authors and library users import comes from here, and only what ``__all__`` lists is
promised; every other module path may move (``tests/test_public.py`` pins the list). Two optional
modules are public too, because ``import trainjob`` must not need their extras:
``trainjob.trainers.torch_state`` (the PyTorch adapter, ``trainjob[torch]``) and
``trainjob.trainers.digits`` (the built-in digits data and trainer). The command line is
``trainjob.cli.main``; the parts of the package are described in the README, "Reading the code".
"""

from .defaults import VERSION as __version__
from .errors import (AlreadyCompleted, ArtifactUnverified, InputError, NoSpace, NoVerifiedCheckpoint, PeerFailed,
                     PvcBusy, RankTimeout, Refused, Superseded, TrainJobError, TryAgainLater, UsageError, WorldSizeMismatch,
                     WriteTimeout)
from .records import Score
from .trainers.protocol import Factory, State, Trainer

__all__ = [
    "__version__",
    # Writing a trainer (docs/trainers.md).
    "Factory",
    "Score",
    "State",
    "Trainer",
    # The errors, one tree (errors.py draws it); cli.py maps its two bases to exit codes 2 and 75.
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
