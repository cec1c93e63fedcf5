"""``trainjob.torch``: the PyTorch adapter's public names (needs ``trainjob[torch]``).

    from trainjob.torch import TrainingState

``TrainingState`` holds a training script's model, optimizer, LR scheduler, data loader, grad
scaler and RNG streams as one Stateful for ``trainjob.Run`` (docs/trainers.md, "The whole
training state"). ``RankLocal`` marks a part of your own Stateful's state that differs by rank.
"""

from .state_tree import RankLocal
from .trainers.torch import TrainingState

__all__ = ["RankLocal", "TrainingState"]
