"""An optimizer's state by parameter FQN, from step 0 on, without touching the optimizer.

torch creates most optimizers' per-parameter state (Adam's moments and ``step``, SGD's momentum)
lazily, at the first ``step()``, but a checkpoint must hold the same entries from the start.
torch.distributed.checkpoint's ``get_optimizer_state_dict`` fills them by a dummy ``step()`` on
zero gradients, which advances ``step`` and so changes every later update (and in older torch
applied AdamW's weight decay): a wrapped script would no longer train as it did unwrapped.

Here the real optimizer is never stepped. ``Layout`` runs the optimizer's class once on
parameters of the meta device (no memory, nothing real changes) to learn which entries its lazy
state has, with which dtypes and shapes; until torch creates a parameter's state, the checkpoint
holds zeros of that layout and records ``created: false`` for it, and a resume leaves such a
parameter's state uncreated, for torch to create exactly as it would have. A parameter that does
not require grad (frozen: it gets no gradient, so torch creates no state for it) has none. Parameters whose state
exists go through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _get_fqns, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from . import names
from ...errors import UsageError

# Not strict: a parameter whose state torch has not created is left out of what is loaded.
_NOT_STRICT = StateDictOptions(strict=False)


def param_fqns(model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """Each parameter's FQN as torch.distributed.checkpoint names it (without DDP's ``module.``
    and torch.compile's ``_orig_mod.``)."""
    out = {}
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name)
        out[p] = next(iter(fqns))
    return out


class Layout:
    """What the optimizer's state holds per parameter once torch has created it: ``{fqn: {key:
    (dtype, shape, device) or a plain value}}``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        fqn_of = param_fqns(model)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [p for p in self.params if p not in fqn_of]
        if missing:
            raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not the model's")
        self.fqns = [fqn_of[p] for p in self.params]
        self.entries = self._learn(optimizer)
        self.fsdp1 = names.fsdp1(model)  # DCP's get_optimizer_state_dict, always (names.py)

    def _learn(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        created = {p: optimizer.state[p] for p in self.params if p in optimizer.state}
        if len(created) == len(self.params):
            return {f: _describe(created[p]) for f, p in zip(self.fqns, self.params)}
        shadows = []
        for p in self.params:
            s = torch.zeros_like(p, device="meta").requires_grad_(p.requires_grad)
            if p.requires_grad:  # a frozen parameter gets no gradient, so torch never creates its state
                s.grad = torch.zeros_like(s)
            shadows.append(s)
        by_param = dict(zip(self.params, shadows))
        groups = []
        for g in optimizer.param_groups:
            group = {k: v for k, v in g.items() if k != "params"}
            # The single-tensor path runs on meta tensors; fused/foreach kernels may not. The lazy
            # state's entries and dtypes are the same either way.
            group.update(params=[by_param[p] for p in g["params"]], foreach=False,
                         **({"fused": False} if "fused" in group else {}))
            groups.append(group)
        shadow = type(optimizer)(groups)
        try:
            shadow.step()
        except Exception as exc:  # an optimizer whose step reads values (.item()) on meta tensors
            raise ValueError(f"{type(optimizer).__name__}: cannot learn the layout of its state before its "
                             f"first step ({type(exc).__name__}: {exc}); take one optimizer step before "
                             "the run begins") from None
        out = {}
        for fqn, p, s in zip(self.fqns, self.params, shadows):
            out[fqn] = _describe(created[p]) if p in created else _describe(shadow.state[s], like=p)
        return out

    def zeros(self, fqn: str) -> dict[str, Any]:
        """The state torch has not created yet, as the checkpoint holds it: for a DTensor
        parameter (FSDP2), an entry of its shape is a DTensor sharded as it is, as torch's own
        lazy state will be (each rank holds its shard, never the whole)."""
        p = self.params[self.fqns.index(fqn)]
        return {k: (_zeros_like_sharded(p, v[0]) if _is_dtensor(p) and v[1] == p.shape
                    else torch.zeros(v[1], dtype=v[0], device=v[2])) if isinstance(v, tuple) else v
                for k, v in self.entries[fqn].items()}

    def shape(self, fqn: str, key: str) -> torch.Size | None:
        v = self.entries.get(fqn, {}).get(key)
        return v[1] if isinstance(v, tuple) else None


def _is_dtensor(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(p, DTensor)


def _zeros_like_sharded(p: Any, dtype: torch.dtype) -> Any:
    return torch.zeros_like(p.detach(), dtype=dtype, memory_format=torch.contiguous_format)


def _describe(state: dict[str, Any], like: torch.Tensor | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            device = like.device if like is not None and v.device.type == "meta" else v.device
            out[k] = (v.dtype, v.shape, device)
        else:
            out[k] = v
    return out


def state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: Layout) -> dict[str, Any]:
    """``{"state": {fqn: {key: tensor or value}}, "param_groups": [...], "created": {fqn: bool}}``;
    the tensors are the optimizer's own (a 0-d one as a shape-(1,) view)."""
    now = [p for g in optimizer.param_groups for p in g["params"]]
    if len(now) != len(layout.params) or any(a is not b for a, b in zip(now, layout.params)):
        raise UsageError(f"the optimizer's parameters changed since the run began ({len(layout.params)} then, "
                         f"{len(now)} now: a param group added as layers are unfrozen?); a checkpoint holds the "
                         "same entries at every step: give the optimizer every parameter it will train from the "
                         "start (a frozen one gets no state until it has a gradient)")
    if optimizer.state and layout.fsdp1:
        sd = get_optimizer_state_dict(model, optimizer)  # its dummy step runs only on an empty state
        state = {fqn: {k: _axis(v) for k, v in entries.items()} for fqn, entries in sd["state"].items()}
        groups = sd["param_groups"]
    else:  # what get_optimizer_state_dict gives, by the names the layout learnt (names.py)
        own = optimizer.state_dict()
        state = {layout.fqns[i]: {k: _axis(v) for k, v in entries.items()} for i, entries in own["state"].items()}
        groups = _groups(own, layout)
    created = {fqn: fqn in state for fqn in layout.fqns}
    for fqn in layout.fqns:
        if fqn not in state:
            state[fqn] = {k: _axis(v) for k, v in layout.zeros(fqn).items()}
    return {"state": state, "param_groups": groups, "created": created}


def _groups(own: dict[str, Any], layout: Layout) -> list[dict[str, Any]]:
    """The param groups of ``own`` (``optimizer.state_dict()``) as ``get_optimizer_state_dict``
    gives them, without its dummy step."""
    groups = own["param_groups"]
    for g in groups:
        g["params"] = [layout.fqns[i] for i in g["params"]]
    return groups


def load_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: Layout,
                    saved: dict[str, Any]) -> None:
    created = saved["created"]
    state = {fqn: {k: _unaxis(v, layout.shape(fqn, k)) for k, v in entries.items()}
             for fqn, entries in saved["state"].items() if created.get(fqn)}
    if not state:  # nothing created yet: only the hyper-parameters (a scheduler may have set lr)
        for group, was in zip(optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in was.items() if k != "params"})
        optimizer.state.clear()
        return
    with _without_dummy_step(layout):
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": saved["param_groups"]},
                                 options=_NOT_STRICT)
    for fqn, p in zip(layout.fqns, layout.params):
        if not created.get(fqn):
            optimizer.state.pop(p, None)


@contextlib.contextmanager
def _without_dummy_step(layout: Layout) -> Iterator[None]:
    """``set_optimizer_state_dict`` steps an optimizer with no state on zero gradients first,
    unless some parameter has a gradient: with lr 0 that leaves most weights alone, but not a
    -0.0 under SGD's weight decay. One placeholder gradient skips it; the loaded state replaces
    whatever the optimizer held."""
    p = next((p for p in layout.params if p.grad is None and p.requires_grad), None)
    if p is not None:
        p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
    try:
        yield
    finally:
        if p is not None:
            p.grad = None


def _axis(v: Any) -> Any:
    return v.detach().reshape(1) if isinstance(v, torch.Tensor) and v.dim() == 0 else v


def _unaxis(v: Any, shape: torch.Size | None) -> Any:
    if isinstance(v, torch.Tensor) and shape is not None and len(shape) == 0 and v.shape == (1,):
        return v.reshape(())
    return v

