"""``trainjob.torch``: the PyTorch adapter's public names, its one public path (needs ``trainjob[torch]``).

    from trainjob.torch import TrainingState

``TrainingState`` holds a training script's model, optimizer, LR scheduler, data loader, grad
scaler and RNG streams as one Stateful for ``trainjob.Run`` (docs/trainers.md, "The whole
training state"). ``state_dict``, ``load_state_dict`` and ``materialize_sgd`` are the smaller,
tensors-only helpers: a module's and an SGD optimizer's live tensors by name, for a Stateful or a
trainer of your own (examples/own_loop.py, examples/torch_digits.py). For your own Stateful at
W > 1 (docs/checkpoints.md, "Replicated state"): ``RankLocal`` marks a part of its state that
differs by rank (plain values and small arrays), ``FromRank0`` an array whose copies may differ of
which rank 0's is kept, ``Replicated`` a part alike on every rank by construction (not compared
at a checkpoint).
"""

from .state_tree import FromRank0, RankLocal, Replicated
from .trainers.torch import TrainingState
from .trainers.torch.tensors import load_state_dict, materialize_sgd, state_dict

__all__ = ["FromRank0", "RankLocal", "Replicated", "TrainingState", "load_state_dict", "materialize_sgd",
           "state_dict"]
