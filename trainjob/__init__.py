"""trainjob: a training-job engine that refuses silent success.

What trainer authors and library users import comes from here, and only what ``__all__`` lists is
promised; every other module path may move (``tests/test_public.py`` pins the list). Optional
modules are public too, because ``import trainjob`` must not need their extras:
``trainjob.torch`` (the PyTorch adapter, its one public path: ``TrainingState`` and the
tensors-only helpers, ``trainjob[torch]``), ``trainjob.trainers.digits`` (the built-in digits
data and trainer), ``trainjob.integrations.hf`` (a transformers ``Trainer`` under trainjob,
``trainjob[hf]``; docs/hf.md) and ``trainjob.integrations.lightning`` (a Lightning ``Callback``,
``trainjob[lightning]``; docs/lightning.md); ``trainjob.trainers.torch_state`` is the helpers' deprecated old
path. The command line is ``trainjob.cli.main``; the parts of the package are described in
docs/explanation/code.md, "Reading the code".
"""

import os
from typing import TYPE_CHECKING

from .defaults import VERSION as __version__
from .errors import (AlreadyCompleted, ArtifactUnverified, InputError, MissingExtra, NoSpace, NoVerifiedCheckpoint,
                     OutOfMemory, PeerFailed, PeerRefused, PvcBusy, RankTimeout, Refused, ReplicasDisagree, StateMismatch,
                     Superseded, TrainJobError, TryAgainLater, UsageError, WorldSizeMismatch, WriteTimeout)

if "TRAINJOB_LAUNCHER_PID" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
    # A rank process started by a launcher dies with it (ranks/parent.py), from this first import on.
    from .ranks.parent import die_with_launcher

    die_with_launcher()

if TYPE_CHECKING:  # for type checkers; at run time ``__getattr__`` below imports each on first use
    from .engine.run import Run
    from .records import Metric, Score
    from .trainers.protocol import Factory, State, Stateful, Trainer

__all__ = [
    "__version__",
    # Your own training loop (docs/howto/own-loop.md).
    "Run",
    "Stateful",
    # Writing a trainer (docs/trainers.md).
    "Factory",
    "Metric",
    "Score",
    "State",
    "Trainer",
    # The errors, one tree (errors.py draws it); exits.py maps its two bases to exit codes 2 and 75.
    "AlreadyCompleted",
    "ArtifactUnverified",
    "InputError",
    "MissingExtra",
    "NoSpace",
    "NoVerifiedCheckpoint",
    "OutOfMemory",
    "PeerFailed",
    "PeerRefused",
    "PvcBusy",
    "RankTimeout",
    "Refused",
    "ReplicasDisagree",
    "StateMismatch",
    "Superseded",
    "TrainJobError",
    "TryAgainLater",
    "UsageError",
    "WorldSizeMismatch",
    "WriteTimeout",
]


# Where each name that is not an error lives. They are imported on first use, so that `import
# trainjob` and the commands which need none of them (`trainjob --help`, `status`, `k8s render`)
# start without the engine, numpy or cattrs (tests/test_startup.py pins that).
_LAZY = {"Run": "engine.run", "Score": "records", "Metric": "records", "Factory": "trainers.protocol", "State": "trainers.protocol",
         "Stateful": "trainers.protocol", "Trainer": "trainers.protocol"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'trainjob' has no attribute {name!r}")
    import importlib

    from .errors import importing

    with importing(f"trainjob.{name}"):
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
