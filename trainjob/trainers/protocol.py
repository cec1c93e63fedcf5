"""The Trainer protocol: the whole of what the engine knows about a model.

A trainer is a *Stateful* object, as torch.distributed.checkpoint calls one: it keeps its own
state (model AND optimizer) and hands it out only when asked. It is built by a *factory*
``factory(data: Path | None, lr: float) -> Trainer`` (a class or a function whose parameters are
named ``data`` and ``lr``: it is checked before it is called, and called by those names; whatever
else it raises is a usage error naming it) and driven by the engine, on every rank alike:

    trainer.state_dict()            # the live state: named numpy arrays or torch tensors (any device)
    trainer.load_state_dict(arrays) # at a resume only: copy a checkpoint's arrays into the live state
    loss = trainer.step(step)       # one step (numbered from 1) in place; mean loss, a float >= 0
    trainer.evaluate()              # Score on the holdout set
    trainer.baseline()              # Score of the frozen reference model
    trainer.export()                # the arrays to publish (usually without optimizer state)
    trainer.data_sha256             # a resume refuses to continue on other data

The engine reads ``state_dict()`` only when a checkpoint is due (and once at the start, to learn
its shape), writes it and lets go: it never keeps a copy between checkpoints. Everything a kill
must not lose is in it; the scalars the engine keeps itself are the step and the loss, so a step
must be a pure function of (the state, the step number): derive shuffles from the step number,
never from a generator that lives outside the state. A trainer's own scalars go in as arrays of
shape ``(1,)``. Each array is split across ranks along its first axis (checkpoint/plan.py).

``load_state_dict`` receives the types ``state_dict`` handed out (a torch tensor for a tensor, on
the CPU), already checked against the manifest: the same names, shapes and dtypes.

Optional capabilities: ``force_weights(values)`` (the linear trainer's teaching hook behind
``--force-weights``; trainers without it refuse that flag), and ``artifact_format = "json"``
(publish ``model-vN.json`` as the lab does, for a model of a few float64 numbers; the default is
``model-vN.safetensors``).

This module loads trainers and checks what they return; it does no training and no I/O.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..errors import (InputError, OutOfMemory, TrainJobError, UsageError, importing, memory_errors, missing_extra,
                      one_line)
from ..records import Score, TensorSpec, is_sha256_hex
from .builtin import BUILTIN

State = Mapping[str, Any]  # name -> numpy array or torch tensor

METHODS = ("state_dict", "load_state_dict", "step", "evaluate", "baseline", "export")


class Stateful(Protocol):
    """What a checkpoint holds, as torch.distributed.checkpoint names it: the live state, handed
    out by ``state_dict()`` when a checkpoint is due and filled in place by ``load_state_dict()``
    at a resume. A ``trainjob.Run`` around your own loop needs only this."""

    def state_dict(self) -> State: ...

    def load_state_dict(self, arrays: State) -> None: ...


class Trainer(Stateful, Protocol):
    """For type checkers and readers; ``build`` checks the members at run time."""

    data_sha256: str

    def step(self, step: int) -> float: ...

    def evaluate(self) -> Score: ...

    def baseline(self) -> Score: ...

    def export(self) -> State: ...


Factory = Callable[[Path | None, float], Trainer]


def resolve(spec: str) -> Factory:
    """The factory named by ``spec``: a built-in name, or ``package.module:factory``."""
    target = BUILTIN.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--trainer {spec!r}: expected one of {', '.join(BUILTIN)} or package.module:factory")
    try:
        with importing(f"--trainer {spec!r}"):
            module = importlib.import_module(module_name)
    except ImportError as exc:
        if (missing := missing_extra(exc, f"--trainer {spec!r}")) is not None:
            raise missing from None
        raise UsageError(f"--trainer {spec!r}: cannot import {module_name}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise UsageError(f"--trainer {spec!r}: {module_name} has no callable {attr}")
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):  # a builtin has no signature to check
        raise UsageError(f"--trainer {spec!r}: the factory must be a class or a function taking (data, lr), "
                         f"not a {type(obj).__name__}")
    return obj  # type: ignore[no-any-return]


def build(spec: str, data: Path | None, lr: float) -> Trainer:
    """Load and build the trainer, refusing one that does not fit the protocol (one line, exit 2)."""
    factory = resolve(spec)
    # By name, so that a function that merely takes two arguments (shutil.rmtree would delete
    # --data) is refused before it is called.
    try:
        inspect.signature(factory).bind(data=data, lr=lr)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--trainer {spec!r}: the factory must accept (data, lr) by those names: {exc}") from None
    try:
        trainer = factory(data=data, lr=lr)
    except TrainJobError:
        raise
    except (Exception, SystemExit) as exc:  # the user's code failed, not trainjob: a usage error, named
        if (missing := missing_extra(exc, f"--trainer {spec!r}")) is not None:
            raise missing from None
        raise UsageError(f"--trainer {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    missing = [m for m in METHODS if not callable(getattr(trainer, m, None))]
    if not is_sha256_hex(getattr(trainer, "data_sha256", None)):
        missing.append("data_sha256 (64 hex digits)")
    if missing:
        raise UsageError(f"--trainer {spec!r}: {type(trainer).__name__} does not fit the Trainer protocol; "
                         f"missing {', '.join(missing)} (see docs/trainers.md)")
    return trainer


def check_resumable(expected: tuple[TensorSpec, ...], found: tuple[TensorSpec, ...], where: str) -> None:
    """A checkpoint resumes only into a trainer whose initial state has exactly its arrays."""
    if expected != found:
        def show(ts: tuple[TensorSpec, ...]) -> str:
            return ", ".join(f"{t.name}{list(t.shape)}:{t.dtype}" for t in ts)
        raise InputError(f"{where}: holds {show(found)} but this --trainer's state is {show(expected)}; "
                         "relaunch with the trainer that wrote it")


# The largest loss recorded: its thousandths (``loss_milli``, an integer in the log and the
# manifests) stay exact in every JSON reader, JavaScript's and jq's included (2**53).
MAX_LOSS = 2**53 / 1000


def check_loss(loss: Any, step: int) -> float:
    """A step's loss as a float, or a UsageError (exit 2) saying what is wrong with it: a number
    from 0 to ``MAX_LOSS`` (a Python int of any size, a numpy scalar), or a tensor or array of
    exactly one element. A meta-device tensor holds no value to report."""
    where = f"step {step}: the loss"
    if hasattr(loss, "item") and not isinstance(loss, float | int):  # a torch or numpy value
        if getattr(getattr(loss, "device", None), "type", None) == "meta":
            raise UsageError(f"{where} is a tensor on the meta device, which holds no values; report a "
                             "loss computed on a real device")
        count = loss.numel() if callable(getattr(loss, "numel", None)) else getattr(loss, "size", 1)
        if count != 1:
            raise UsageError(f"{where} has {count} elements; report one number per step (e.g. loss.mean())")
        loss = loss.item()
    if isinstance(loss, bool) or not isinstance(loss, float | int):
        raise UsageError(f"{where} is {_shown(loss)} ({type(loss).__name__}), not a number: report a float, an int "
                         "or a one-element tensor")
    if not loss >= 0 or loss == float("inf"):
        raise UsageError(f"{where} is {_shown(loss)}, not a finite number >= 0 (training diverged: lower --lr)")
    if loss > MAX_LOSS:
        raise UsageError(f"{where} is {_shown(loss)}, too large to record: trainjob logs a loss in thousandths, "
                         f"exact up to {MAX_LOSS:.4g}; training diverged (lower --lr), or scale the loss down")
    return float(loss)


def _shown(value: object) -> str:
    """A value in a message: short, one line; an int too long to print (Python refuses past 4300
    digits) by its size."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"a {value.bit_length()}-bit integer"
    return one_line(repr(value))[:60]


def restore(trainer: Stateful, arrays: State) -> None:
    """Hand a verified checkpoint to the trainer; its failure is bad input (exit 2), not a bug."""
    try:
        with memory_errors("load_state_dict"):
            trainer.load_state_dict(arrays)
    except OutOfMemory:  # the checkpoint is fine: retryable (75), not bad input
        raise
    except Exception as exc:  # whatever the trainer's own code raises, said in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UsageError(f"load_state_dict raised {type(exc).__name__}: {first}; it must accept the "
                         "arrays its own state_dict() returns (same names, shapes, dtypes)") from None
