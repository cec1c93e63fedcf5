"""A data loader's position as one plain value.

torchdata's ``StatefulDataLoader`` hands out where it is (``state_dict()``: the sampler's
generator as a uint8 tensor, counters, with workers a snapshot per worker) and takes it back
before its next ``iter()``. Its shape changes as it runs (before the first batch, mid-epoch, with
workers, each worker's random streams as bytes: ``worker_rng.py``), so the checkpoint holds it as
one JSON string, tensors and bytes as hex: the loader checks its own state when it loads it;
trainjob checks that the checkpoint has one.

A trap, measured with torchdata 0.11: resumed mid-epoch, the loader rebuilds the epoch's
permutation from its generator's state at the epoch's start, but draws from that generator more
times than an uninterrupted loader did, so every *later* epoch is shuffled differently. So the
generators a loader shuffles with are saved as they are now, and a load builds the resumed
iterator at once (the loader's next ``iter()`` returns it) and then puts them back. Without a
generator of its own, a loader draws a seed from torch's *global* stream for every iterator it
builds, the resumed one included, where the uninterrupted run drew none: every dropout mask after
the resume would differ (``trainjob prove`` found it in a script passing no ``generator=``). So
that stream is put back too.

A sampler shuffled by epoch (torch's ``DistributedSampler``, which Lightning puts into every
loader under DDP) draws its order from ``seed + epoch``, and the loader's state holds only how far
into that order it is: a resumed iterator built while the sampler is still at epoch 0 walks
epoch 0's order from the saved position (``trainjob prove`` found Lightning's DDP default
diverging from the first resume past epoch 0). So each such sampler's epoch is saved too, and put
back before the resumed iterator is built.
"""

from __future__ import annotations

from typing import Any

import torch

from . import worker_rng
from ... import plain

_TENSOR = "trainjob.tensor"  # not a name torchdata's state uses: marks a tensor in the text
_BYTES = "trainjob.bytes"  # and bytes (the workers' random streams, worker_rng.py)


def check(loader: object) -> None:
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        raise TypeError(f"loader= is a {type(loader).__name__}, which cannot hand out its position; use "
                        "torchdata.stateful_dataloader.StatefulDataLoader (the same arguments as DataLoader)")


def _out(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {_TENSOR: [str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()
                          if t.numel() else ""]}
    if isinstance(value, bytes):
        return {_BYTES: value.hex()}
    if isinstance(value, dict):
        return {k: _out(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_out(v) for v in value)
    return value


def _in(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            dtype, shape, data = value[_TENSOR]
            raw = torch.frombuffer(bytearray.fromhex(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            return raw.view(getattr(torch, dtype)).reshape(shape).clone()
        if set(value) == {_BYTES}:
            return bytes.fromhex(value[_BYTES])
        return {k: _in(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_in(v) for v in value)
    return value


def as_text(value: Any, what: str) -> str:
    """A nested value with tensors and bytes in it (a loader's or a callback's state) as one JSON
    string, exactly (module docstring); PlainError naming ``what`` for anything else."""
    return plain.encode(_out(value), what)


def from_text(text: str) -> Any:
    return _in(plain.decode(text))


def _generators(loader: Any) -> list[torch.Generator]:
    found: list[torch.Generator] = []
    for g in (getattr(loader, "generator", None), getattr(getattr(loader, "sampler", None), "generator", None)):
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def epoch_samplers(loader: Any) -> list[Any]:
    """The loader's samplers that are told their epoch (``set_epoch``), as Lightning finds them:
    its ``sampler`` and its batch sampler's."""
    found: list[Any] = []
    for s in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if callable(getattr(s, "set_epoch", None)) and isinstance(getattr(s, "epoch", None), int) \
                and all(s is not f for f in found):
            found.append(s)
    return found


def state_dict(loader: Any) -> str:
    state = {"loader": loader.state_dict(), "generators": [g.get_state() for g in _generators(loader)]}
    if samplers := epoch_samplers(loader):  # absent otherwise: the record as before
        state["samplers"] = [{"sampler": type(s).__name__, "epoch": s.epoch} for s in samplers]
    worker_rng.check_state(loader, state["loader"])
    return as_text(state, "loader")


def load_state_dict(loader: Any, text: str) -> None:
    state = from_text(text)
    samplers, saved = epoch_samplers(loader), state.get("samplers", [])
    if saved and len(samplers) != len(saved):
        raise ValueError(f"the loader has {len(samplers)} sampler(s) with an epoch, the checkpoint's "
                         f"{len(saved)}")
    for sampler, record in zip(samplers, saved):  # before the resumed iterator draws its order
        sampler.set_epoch(record["epoch"])
    loader.load_state_dict(state["loader"])
    generators = _generators(loader)
    if len(generators) != len(state["generators"]):
        raise ValueError(f"the loader shuffles with {len(generators)} generator(s), the checkpoint's with "
                         f"{len(state['generators'])}")
    drawn_from = torch.get_rng_state()  # torch's global stream, as the rest of the load restored it
    loader.state_dict()  # builds the resumed iterator now, drawing what it draws; next iter() returns it
    torch.set_rng_state(drawn_from)
    for g, saved in zip(generators, state["generators"]):
        g.set_state(saved)
