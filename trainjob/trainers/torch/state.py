"""``TrainingState``: everything a PyTorch training script's next step depends on, as one Stateful.

    state = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader, scaler=scaler,
                          extra={"ema": ema, "noise": generator})
    with trainjob.Run(pvc, state=state, ...) as run: ...

``state_dict()`` hands out, as one nested mapping (``state_tree.py``):

    model       the module's tensors by FQN (torch.distributed.checkpoint's get_model_state_dict:
                plain, DDP and torch.compile'd modules alike), the live tensors, never copies;
                without its frozen parameters (those that do not require grad: ``frozen.py``),
                which the rank part references by their digest
    optim       the optimizer's state by parameter FQN, from step 0 (``optim.py``), its param
                groups (lr as the scheduler left it, betas, weight decay, initial_lr) as plain values
    scheduler   any torch.optim.lr_scheduler's state_dict(): plain values
    scaler      a torch.amp.GradScaler's state_dict(): plain values
    extra       each named member's state_dict() (a module's as the model's: 0-d tensors given an axis)
    rank        RankLocal: this rank's RNG streams (``rng.py``; ``rng=False`` leaves them out), the
                loader's position (``loader.py``), the named torch/numpy Generators in ``extra``,
                the frozen parameters' reference (their sha256; a resume checks the live ones)

``load_state_dict`` puts each back where it came from, in that order. Under DDP every rank holds
the same parameters, optimizer and scheduler: those are written once, split across ranks; DDP's
buffers (BatchNorm's statistics) are rank 0's, or each rank's own with ``broadcast_buffers=False``
(``ddp.py``); the ``rank`` part is each rank's own. Nothing here runs per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from . import ddp, frozen as frozen_base, loader as loader_state, names, optim, rng as streams, worker_rng, workers
from ...plain import PlainError
from ...state_tree import RankLocal
from ...errors import UsageError


# A load without the frozen parameters: they stay as the script built them (``frozen.py``).
_NOT_STRICT = StateDictOptions(strict=False)


class TrainingState:
    """A training script's whole state, for ``trainjob.Run(state=...)`` (module docstring).

    ``model``: the module (DDP- or torch.compile-wrapped, or not). ``optimizer`` any torch.optim
    optimizer over the model's parameters; ``scheduler`` any LR scheduler; ``loader`` a
    torchdata ``StatefulDataLoader``. If it has worker processes, its ``worker_init_fn`` is
    wrapped so that the workers ignore a SIGTERM or SIGINT sent to the whole process group
    (``workers.py``); build the state before the loader's first ``iter()``. ``scaler`` a
    ``torch.amp.GradScaler``; ``extra``: more members by name, each an object with
    ``state_dict()``/``load_state_dict()`` (same on every rank) or a ``torch.Generator``/
    ``numpy.random.Generator`` (per rank). ``rng=False``: leave the global RNG streams out (a
    script that draws nothing random after its start). The model's parameters that do not
    require grad (a LoRA's base, frozen layers) are referenced by their digest, not written
    (``frozen.py``); ``write_frozen=True`` writes them at every checkpoint (a script that changes
    them itself, or unfreezes layers as it trains).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, loader: Any = None, scaler: Any = None,
                 extra: Mapping[str, Any] | None = None, rng: bool = True, write_frozen: bool = False) -> None:
        """Checks what it is given, but refuses it only when the state is first asked for (at
        the ``with trainjob.Run``): raised here, before the Run exists, a refusal would end the
        script in Python's exit 1, which trainjob's table keeps for an honest failure."""
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.scaler, self.extra, self.rng = scaler, dict(extra or {}), rng
        self._layout: optim.Layout | None = None
        self._refusal: str | None = None
        self._marks = ddp.Marks(model) if isinstance(model, torch.nn.Module) else None
        self._base = frozen_base.Base(model) if isinstance(model, torch.nn.Module) and not write_frozen else None
        self._names = names.ModelNames(model) if isinstance(model, torch.nn.Module) else None
        try:
            self._check()
        except (TypeError, ValueError) as exc:
            self._refusal = f"TrainingState: {exc}"
        else:
            # Now, before the Run's first state_dict() starts the workers: their random streams
            # go into the loader's snapshot (worker_rng.py), and a signal to the whole process
            # group must not kill them in the middle of the stop checkpoint (workers.py).
            worker_rng.install(self.loader)
            workers.guard(self.loader)

    def _check(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"model= must be a torch.nn.Module, got {type(self.model).__name__}")
        for name, member in (("scheduler", self.scheduler), ("scaler", self.scaler), *self.extra.items()):
            if member is not None and not _is_stateful(member) and not streams.is_generator(member):
                raise TypeError(f"{name} is a {type(member).__name__}, which has no state_dict()/load_state_dict()")
        if self.loader is not None:
            loader_state.check(self.loader)
            if (why := worker_rng.refusal(self.loader)) is not None:
                raise ValueError(why)
        if self.optimizer is not None:
            self._layout = optim.Layout(self.model, self.optimizer)

    def _refuse(self) -> None:
        if self._refusal is not None:
            raise UsageError(self._refusal)

    def state_dict(self) -> dict[str, Any]:
        self._refuse()
        assert self._marks is not None
        assert self._names is not None
        tensors, frozen = self._split(self._names.state_dict())
        out: dict[str, Any] = {"model": self._marks.model(tensors)}
        if self.optimizer is not None:
            assert self._layout is not None
            out["optim"] = self._marks.optim(optim.state_dict(self.model, self.optimizer, self._layout))
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        local: dict[str, Any] = {}
        if frozen:
            assert self._base is not None
            local["frozen"] = self._base.reference(frozen)
        if (buffers := self._marks.rank_local(tensors)) is not None:
            local["buffers"] = buffers
        shared = {k: _module_state(m) if isinstance(m, torch.nn.Module) else m.state_dict()
                  for k, m in self.extra.items() if not streams.is_generator(m)}
        if shared:
            out["extra"] = shared
        generators = {k: streams.generator_state(m) for k, m in self.extra.items() if streams.is_generator(m)}
        if generators:
            local["generators"] = generators
        if self.rng:
            local["rng"] = streams.capture()
        if self.loader is not None:
            try:
                local["loader"] = loader_state.state_dict(self.loader)
            except PlainError as exc:
                raise UsageError(f"TrainingState: the loader's state_dict(): {exc}") from None
            except ValueError as exc:  # worker_rng.check_state: what the workers' state shows
                raise UsageError(f"TrainingState: {exc}") from None
        if local:
            out["rank"] = RankLocal(local)
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._refuse()
        live = get_model_state_dict(self.model)
        local = state.get("rank")  # absent after `trainjob reshard --drop-rank-local`
        _, frozen = self._split(live)
        if frozen:  # before anything is loaded: a checkpoint of another base is refused untouched
            assert self._base is not None
            self._base.check(frozen, None if local is None else local.get("frozen"))
        saved = dict(state["model"])
        if self._marks is not None and self._marks.per_rank:  # DDP's buffers: this rank's own, else the live ones
            for k in self._marks.buffers & live.keys():
                saved[k] = local["buffers"][k] if local is not None else live[k]
        set_model_state_dict(self.model, {k: _unaxis(v, live[k].shape) for k, v in saved.items()},
                             options=_NOT_STRICT if frozen else None)
        if self.optimizer is not None:
            assert self._layout is not None
            optim.load_state_dict(self.model, self.optimizer, self._layout, state["optim"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        for k, m in self.extra.items():
            if isinstance(m, torch.nn.Module):  # an EMA copy (AveragedModel), a teacher: as the model is
                live = m.state_dict()
                m.load_state_dict({n: _unaxis(v, live[n].shape) if n in live else v
                                   for n, v in state["extra"][k].items()})
            elif not streams.is_generator(m):
                m.load_state_dict(state["extra"][k])
        if local is None:
            return
        for k, m in self.extra.items():
            if streams.is_generator(m):
                streams.set_generator_state(m, local["generators"][k])
        if self.rng:
            streams.restore(local["rng"])
        if self.loader is not None:
            loader_state.load_state_dict(self.loader, local["loader"])


    def _split(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The model's entries a checkpoint writes (a 0-d one given an axis), and its frozen ones."""
        kept, frozen = self._base.split(tensors) if self._base is not None else (dict(tensors), {})
        return {k: _axis(v) for k, v in kept.items()}, frozen


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _module_state(module: torch.nn.Module) -> dict[str, Any]:
    """An ``extra`` module's tensors, a 0-d one (AveragedModel's ``n_averaged``) given an axis as
    the model's are."""
    return {k: _axis(v) if isinstance(v, torch.Tensor) else v for k, v in module.state_dict().items()}


def _axis(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        return t.detach().reshape(1)
    # state_dict() hands out detached tensors already; detaching a DTensor again is a dispatch
    # through DTensor's machinery (tens of microseconds each), for every parameter at every checkpoint.
    return t.detach() if t.requires_grad or t.grad_fn is not None else t


def _unaxis(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return t.reshape(shape) if len(shape) == 0 and t.shape == (1,) else t
