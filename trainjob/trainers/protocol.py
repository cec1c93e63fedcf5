"""The Trainer protocol: the whole of what the engine knows about a model.

A trainer is built by a *factory* ``factory(data: Path | None, lr: float) -> Trainer`` (a class or
a function whose parameters are named ``data`` and ``lr``: it is checked before it is called, and
called by those names; whatever else it raises is a usage error naming it) and then driven by the
engine, on every rank alike:

    state = trainer.initial_state()           # named arrays: model AND optimizer state
    state, loss = trainer.step(state, step)    # one step (numbered from 1); mean loss, a float >= 0
    trainer.evaluate(state)                    # Score on the holdout set
    trainer.baseline()                         # Score of the frozen reference model
    trainer.export(state)                      # the arrays to publish (usually without optimizer state)
    trainer.data_sha256                        # a resume refuses to continue on other data

The state is a ``dict[str, np.ndarray]``: every array the next step depends on, or a kill changes
the result. Everything the engine checkpoints is in it; the scalars it keeps itself are the step
and the loss, so a step must be a pure function of ``(state, step)`` (derive shuffles from the step
number, never from a generator that lives outside the state). A trainer's own scalars go in as
arrays of shape ``(1,)``. Each array is split across ranks along its first axis (checkpoint/plan.py).

Optional capability: ``force_weights(state, values) -> state`` (the linear trainer's teaching hook
behind ``--force-weights``). Trainers without it refuse that flag.

This module loads trainers and checks what they return; it does no training and no I/O.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import InputError, TrainJobError, UsageError
from ..records import Score, TensorSpec, is_sha256_hex
from ..tensors import tensor_specs

State = dict[str, np.ndarray]

BUILTIN = {"linear": "trainjob.trainers.linear:make", "digits": "trainjob.trainers.digits:make"}
METHODS = ("initial_state", "step", "evaluate", "baseline", "export")


class Trainer(Protocol):
    """For type checkers and readers; ``build`` checks the members at run time."""

    data_sha256: str

    def initial_state(self) -> State: ...

    def step(self, state: State, step: int) -> tuple[State, float]: ...

    def evaluate(self, state: State) -> Score: ...

    def baseline(self) -> Score: ...

    def export(self, state: State) -> State: ...


Factory = Callable[[Path | None, float], Trainer]


def resolve(spec: str) -> Factory:
    """The factory named by ``spec``: a built-in name, or ``package.module:factory``."""
    target = BUILTIN.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--trainer {spec!r}: expected one of {', '.join(BUILTIN)} or package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
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
        raise UsageError(f"--trainer {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    missing = [m for m in METHODS if not callable(getattr(trainer, m, None))]
    if not is_sha256_hex(getattr(trainer, "data_sha256", None)):
        missing.append("data_sha256 (64 hex digits)")
    if missing:
        raise UsageError(f"--trainer {spec!r}: {type(trainer).__name__} does not fit the Trainer protocol; "
                         f"missing {', '.join(missing)} (see docs/trainers.md)")
    return trainer


def specs(state: Mapping[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    """The state's arrays as the manifest describes them, checking each can be checkpointed."""
    for name, array in state.items():
        if not isinstance(array, np.ndarray) or array.ndim < 1:
            raise UsageError(f"trainer state {name!r}: expected a numpy array with at least one axis "
                             f"(store a scalar as shape (1,)), got {type(array).__name__}")
    try:
        return tensor_specs(state)
    except (KeyError, ValueError, TypeError) as exc:
        raise UsageError(f"trainer state: cannot be checkpointed: {exc}") from None


def check_resumable(expected: tuple[TensorSpec, ...], found: tuple[TensorSpec, ...], where: str) -> None:
    """A checkpoint resumes only into a trainer whose initial state has exactly its arrays."""
    if expected != found:
        def show(ts: tuple[TensorSpec, ...]) -> str:
            return ", ".join(f"{t.name}{list(t.shape)}:{t.dtype}" for t in ts)
        raise InputError(f"{where}: holds {show(found)} but this --trainer's state is {show(expected)}; "
                         "relaunch with the trainer that wrote it")


def check_loss(loss: float, step: int) -> float:
    if not (isinstance(loss, float | int) and np.isfinite(loss) and loss >= 0):
        raise UsageError(f"step {step}: the trainer's loss is {loss!r}, not a finite number >= 0 "
                         "(training diverged: lower --lr)")
    return float(loss)
