"""``trainjob.torch``: the PyTorch adapter's public names, its one public path (needs ``trainjob[torch]``).

    from trainjob.torch import TrainingState

``TrainingState`` holds a training script's model, optimizer, LR scheduler, data loader, grad
scaler and RNG streams as one Stateful for ``trainjob.Run`` (docs/trainers.md, "The whole
training state"). ``RankLocal`` marks a part of your own Stateful's state that differs by rank.
``state_dict``, ``load_state_dict`` and ``materialize_sgd`` are the smaller, tensors-only helpers:
a module's and an SGD optimizer's live tensors by name, for a Stateful or a trainer of your own
(examples/own_loop.py, examples/torch_digits.py).
"""

from .state_tree import RankLocal
from .trainers.torch import TrainingState
from .trainers.torch.tensors import load_state_dict, materialize_sgd, state_dict

__all__ = ["RankLocal", "TrainingState", "load_state_dict", "materialize_sgd", "state_dict"]
