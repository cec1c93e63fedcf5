"""A module's and an optimizer's live tensors as one trainjob state, and back (tensors only).

Public as ``trainjob.torch.state_dict``, ``load_state_dict`` and ``materialize_sgd``. For a whole
training script (any optimizer from step 0, scheduler, data loader, RNG streams), use
``trainjob.torch.TrainingState`` instead; these smaller helpers suit a trainer or a loop whose
state is a module and an SGD optimizer's tensors and nothing else. It must not grow into a second
``TrainingState``: anything that is not a tensor belongs there.

Needs the optional ``torch`` extra. ``state_dict`` hands out the live tensors themselves (no copy,
any device): trainjob reads them only when a checkpoint is due and writes them into safetensors
shards from host memory (checkpoint/snapshot.py copies device tensors once, into reusable
buffers). ``load_state_dict`` copies a checkpoint's tensors into the live ones in place, so the
module and optimizer keep their tensors (and anything that holds them). Nothing is pickled.

Names: ``model.<state_dict key>`` for the module and ``optim.<param index>.<key>`` for the
optimizer's per-parameter state (for SGD with momentum, ``optim.3.momentum_buffer``), indexed as
``optimizer.state_dict()`` indexes parameters. A 0-d tensor (Adam's ``step``) is handed out as a
shape-``(1,)`` view of itself. ``param_groups`` (lr, momentum, ...) are settings, not state: the
trainer rebuilds them.

torch creates optimizer state lazily at the first step, but trainjob checkpoints the *initial*
state too, so the tensors must exist from step 0: ``materialize_sgd`` gives SGD zero momentum
buffers, which is exactly what torch's lazy first step computes when dampening is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch  # the package's __init__ said which extra brings it, if it is missing

MODEL, OPTIM = "model.", "optim."


def state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """The live tensors of the module's and the optimizer's state, by name (views, never copies)."""
    out = {MODEL + k: _axis(v) for k, v in module.state_dict().items()}
    if optimizer is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {index}.{key} is {type(value).__name__}, not a tensor")
                out[f"{OPTIM}{index}.{key}"] = _axis(value)
    return out


def load_state_dict(arrays: Mapping[str, Any], module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Copy ``arrays`` (tensors or numpy arrays named as ``state_dict`` names them) into the live
    tensors, in place; KeyError naming what is missing or extra."""
    live = state_dict(module, optimizer)
    if set(arrays) != set(live):
        missing, extra = sorted(set(live) - set(arrays)), sorted(set(arrays) - set(live))
        raise KeyError(f"arrays do not match the module and optimizer: missing {missing}, extra {extra}")
    with torch.no_grad():
        for name, t in live.items():
            t.copy_(torch.as_tensor(arrays[name]).reshape(t.shape))


def materialize_sgd(optimizer: torch.optim.SGD) -> None:
    """Give every parameter a zero momentum buffer now, rather than at torch's first step."""
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or group.get("dampening", 0) != 0:
            raise ValueError("materialize_sgd needs momentum > 0 and dampening 0 (else zeros are not equivalent)")
        for p in group["params"]:
            optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))


def _axis(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(1) if t.dim() == 0 else t.detach()
