"""torch.distributed.checkpoint's names for a module's state, learnt once instead of at every checkpoint.

``get_model_state_dict`` and ``get_optimizer_state_dict`` check their options and look up every
parameter's FQN on each call: about 100 ms each for a GPT-2 of 12.7M parameters under LoRA (467
parameters) on a loaded 2-core machine, at every checkpoint, where the adapter they name takes
milliseconds to write (issue 58). For a module no FSDP shards (plain, DDP- or
torch.compile-wrapped), what they hand out is torch's own ``state_dict()`` with each key renamed
(DDP's ``module.``, torch.compile's ``_orig_mod.`` dropped) and the optimizer's parameter indices
named by FQN, which ``optim.Layout`` already knows. The same holds for FSDP2 (``fully_shard``):
its own ``state_dict()`` already hands out each parameter as the DTensor of this rank's shard,
which DCP passes on (a new DTensor object per call, over the same local tensor), and its
optimizer's state is the optimizer's own DTensors. ``ModelNames`` learns the renaming at its
first call, checks it against DCP's own result, and applies it after. An FSDP1 module
(``FullyShardedDataParallel``) always goes through DCP, which gathers or shards what torch's own
``state_dict()`` does not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _get_fqns, get_model_state_dict


def fsdp1(model: torch.nn.Module) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``, whose ``state_dict()`` is not DCP's) wraps
    some of ``model``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return bool(FullyShardedDataParallel.fsdp_modules(model))


class ModelNames:
    """``get_model_state_dict(model)``, at the cost of ``model.state_dict()`` after the first call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._dcp = fsdp1(model)
        self._rename: dict[str, str] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self._dcp:
            return get_model_state_dict(self.model)
        own = self.model.state_dict()
        if self._rename is not None and self._rename.keys() == own.keys():
            return {self._rename[k]: v for k, v in own.items()}
        theirs = get_model_state_dict(self.model)
        rename = {k: next(iter(_get_fqns(self.model, k))) for k in own}
        ours = {rename[k]: v for k, v in own.items()}
        if ours.keys() == theirs.keys() and all(_same(ours[k], v) for k, v in theirs.items()):
            self._rename = rename
        else:  # a value that is not a tensor (a module's extra state), or one DCP hands out otherwise
            self._dcp = True
        return theirs


def _same(a: Any, b: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):  # FSDP2: the same shard, placed the same
        return (isinstance(a, DTensor) and isinstance(b, DTensor) and a.device_mesh == b.device_mesh
                and a.placements == b.placements and a.shape == b.shape and _same(a.to_local(), b.to_local()))
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride())
