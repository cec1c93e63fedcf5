"""Deprecated path of the tensors-only PyTorch helpers: import them from ``trainjob.torch``.

``trainjob.trainers.torch_state`` was public before the adapter had one path; it stays, warning,
so trainers written against it keep working. It holds nothing of its own and must not grow:
the helpers live in ``trainers/torch/tensors.py``.
"""

import warnings

from .torch.tensors import load_state_dict, materialize_sgd, state_dict

__all__ = ["load_state_dict", "materialize_sgd", "state_dict"]

warnings.warn("trainjob.trainers.torch_state is deprecated: import state_dict, load_state_dict and "
              "materialize_sgd from trainjob.torch", DeprecationWarning, stacklevel=2)
