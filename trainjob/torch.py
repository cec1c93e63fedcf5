"""``trainjob.torch``: the PyTorch adapter's public names (needs ``trainjob[torch]``).

    from trainjob.torch import TrainingState

``TrainingState`` holds a training script's model, optimizer, LR scheduler, data loader, grad
scaler and RNG streams as one Stateful for ``trainjob.Run`` (docs/trainers.md, "The whole
training state"). For your own Stateful at W > 1 (docs/checkpoints.md, "Replicated state"):
``RankLocal`` marks a part of its state that differs by rank (plain values and small arrays),
``FromRank0`` an array whose copies may differ of which rank 0's is kept, ``Replicated`` a part
alike on every rank by construction (not compared at a checkpoint).
"""

from .state_tree import FromRank0, RankLocal, Replicated
from .trainers.torch import TrainingState

__all__ = ["FromRank0", "RankLocal", "Replicated", "TrainingState"]
