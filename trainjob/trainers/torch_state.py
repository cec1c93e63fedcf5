"""PyTorch adapter: a module's and an optimizer's ``state_dict`` <-> trainjob's named arrays.

Needs the optional ``torch`` extra. Checkpoints stay safetensors shards: tensors are copied to
numpy arrays here, and nothing is ever pickled (``torch.save`` is never called).

Names: ``model.<state_dict key>`` for the module and ``optim.<param index>.<key>`` for the
optimizer's per-parameter state (for SGD with momentum, ``optim.3.momentum_buffer``). A 0-d
tensor (Adam's ``step``) is stored with shape ``(1,)``; shapes are restored from the live
module and optimizer, so loading needs them built exactly as when the state was taken.
``param_groups`` (lr, momentum, ...) are settings, not state: the trainer rebuilds them.

torch creates optimizer state lazily at the first step, but trainjob checkpoints the *initial*
state too, so the arrays must exist from step 0: ``materialize_sgd`` gives SGD zero momentum
buffers, which is exactly what torch's lazy first step computes when dampening is 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # a user trainer importing this without the extra: say which one
    raise ImportError("the PyTorch adapter needs torch: pip install 'trainjob[torch]'") from exc

MODEL, OPTIM = "model.", "optim."


def to_arrays(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, np.ndarray]:
    """Copies of every tensor in the module's and the optimizer's state, as named numpy arrays."""
    out = {MODEL + k: _array(v) for k, v in module.state_dict().items()}
    if optimizer is not None:
        for index, per_param in optimizer.state_dict()["state"].items():
            for key, value in per_param.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {index}.{key} is {type(value).__name__}, not a tensor")
                out[f"{OPTIM}{index}.{key}"] = _array(value)
    return out


def from_arrays(arrays: dict[str, np.ndarray], module: torch.nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load ``arrays`` (from ``to_arrays``) into the module and the optimizer, strictly."""
    live = module.state_dict()
    module.load_state_dict({k: _tensor(arrays[MODEL + k], v) for k, v in live.items()}, strict=True)
    if optimizer is None:
        return
    sd = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    for name, array in arrays.items():
        if name.startswith(OPTIM):
            index, key = name[len(OPTIM):].split(".", 1)
            template = sd["state"].get(int(index), {}).get(key)
            state.setdefault(int(index), {})[key] = _tensor(array, template)
    extra = set(arrays) - {MODEL + k for k in live} - {f"{OPTIM}{i}.{k}" for i, d in state.items() for k in d}
    if extra:
        raise KeyError(f"arrays the module and optimizer do not have: {sorted(extra)}")
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def materialize_sgd(optimizer: torch.optim.SGD) -> None:
    """Give every parameter a zero momentum buffer now, rather than at torch's first step."""
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or group.get("dampening", 0) != 0:
            raise ValueError("materialize_sgd needs momentum > 0 and dampening 0 (else zeros are not equivalent)")
        for p in group["params"]:
            optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))


def _array(t: torch.Tensor) -> np.ndarray:
    a = t.detach().cpu().numpy().copy()
    return a.reshape(1) if a.ndim == 0 else a


def _tensor(array: np.ndarray, template: torch.Tensor | None) -> torch.Tensor:
    t = torch.from_numpy(np.array(array, copy=True))
    return t.reshape(template.shape).to(template.dtype) if template is not None else t
