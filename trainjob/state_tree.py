"""A nested state as a checkpoint stores it: named arrays, plus plain values as two JSON documents.

A Stateful's ``state_dict()`` may nest mappings (``{"model": {...}, "optim": {"state": ...,
"param_groups": [...]}}``). ``split`` takes it apart:

- every array leaf (a numpy array or a torch tensor) under a path of dict keys becomes one named
  array, named by its keys joined with ``.`` (``optim.state.0.weight.exp_avg``): the shards hold
  those, split across ranks as before;
- everything else is plain values (``plain.py``), kept where it stood, in one document of the
  replicated state (written once, in rank 0's shard) and one of the rank-local state: the parts
  wrapped in ``RankLocal`` (RNG streams, a data loader's position), written by every rank in its
  own shard.

At W > 1 every rank holds each array that is not a DTensor shard; how its one copy in the
checkpoint is chosen (docs/checkpoints.md, "Replicated state"):

- an array wrapped in ``FromRank0`` is rank 0's, written whole by rank 0 (DDP's buffers: the
  ranks' copies drift apart in a step, and DDP broadcasts rank 0's at the next forward);
- an array under a ``Replicated`` part is alike on every rank by construction (DDP's parameters,
  the optimizer state over them): split across ranks as it is;
- any other array is split across ranks only once the ranks' digests of it agree
  (``checkpoint/replicas.py``); ``Split.checked`` names them.

``join`` puts the three back together into the nested shape ``split`` took apart. A flat mapping
of arrays, as trainers have always returned, splits into itself and no document. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from .plain import PlainError


class RankLocal(dict):  # type: ignore[type-arg]
    """A part of a state that differs from rank to rank (each rank's RNG streams, its data
    loader's position): saved by every rank in its own shard, and handed back to the same rank.
    Plain values only. A resume at another world size cannot map it (docs/trainers.md)."""


class Replicated(dict):  # type: ignore[type-arg]
    """A part of a state every rank holds alike by construction (DDP's parameters and the
    optimizer state over them): at W > 1 written once, split across ranks, and not compared
    between ranks. Arrays and plain values; a ``FromRank0`` or ``RankLocal`` inside keeps its own
    rule."""


@attrs.frozen
class FromRank0:
    """One array every rank holds but whose copies may differ, of which a checkpoint keeps rank
    0's, written whole by rank 0 (DDP's buffers with ``broadcast_buffers=True``: what DDP itself
    broadcasts to every rank at the next forward). A resume hands it to every rank."""

    array: Any


@attrs.frozen
class Split:
    arrays: dict[str, Any]  # name -> array leaf
    paths: dict[str, tuple[str, ...]]  # name -> its path of keys
    plain: dict[str, Any] | None  # the replicated plain values, dicts kept; None: a flat mapping of arrays
    local: list[Any] | None  # the rank-local parts as [[path of keys, part], ...]; None: there is none
    from_rank0: frozenset[str] = frozenset()  # array names wrapped in FromRank0
    checked: frozenset[str] = frozenset()  # array names neither FromRank0 nor under Replicated


def is_array(value: object, torch: Any) -> bool:
    return isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor))


def split(state: Mapping[str, Any], torch: Any) -> Split:
    """Take ``state`` apart (``torch``: the torch module when it is loaded, else None).
    PlainError naming the path for a key that is not a str, or an array inside a list or a
    RankLocal part; plain values are checked when they are encoded."""
    arrays: dict[str, Any] = {}
    paths: dict[str, tuple[str, ...]] = {}
    local: list[Any] = []
    from_rank0: set[str] = set()
    checked: set[str] = set()

    def walk(node: Mapping[str, Any], path: tuple[str, ...], alike: bool) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for key, value in node.items():
            if not isinstance(key, str):
                raise PlainError(f"{'.'.join(path) or 'the state'}: a key of type {type(key).__name__} ({key!r}); "
                                 "keys must be str")
            here = (*path, key)
            name = ".".join(here)
            if isinstance(value, FromRank0):
                if not is_array(value.array, torch):
                    raise PlainError(f"{name}: FromRank0 holds an array, not a {type(value.array).__name__}")
                from_rank0.add(name)
                value = value.array
            elif is_array(value, torch) and not alike:
                checked.add(name)
            if is_array(value, torch):
                if name in paths:
                    raise PlainError(f"{name}: two entries have this name once their keys are joined with '.'")
                arrays[name], paths[name] = value, here
            elif isinstance(value, RankLocal):
                _no_arrays(value, name, torch)
                local.append([list(here), dict(value)])
            elif isinstance(value, Mapping):
                doc[key] = walk(value, here, alike or isinstance(value, Replicated))
            else:
                _no_arrays(value, name, torch)
                doc[key] = value
        return doc

    doc = walk(state, (), isinstance(state, Replicated))
    flat = not doc and all(len(p) == 1 for p in paths.values())
    return Split(arrays, paths, None if flat else doc, local or None, frozenset(from_rank0), frozenset(checked))


def _no_arrays(value: Any, path: str, torch: Any) -> None:
    if is_array(value, torch) or isinstance(value, FromRank0):
        raise PlainError(f"{path}: an array inside a list or a RankLocal part; arrays belong in dicts of the "
                         "replicated state (convert a small one to a list, or its bytes to a hex str)")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _no_arrays(v, f"{path}.{k}", torch)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _no_arrays(v, f"{path}[{i}]", torch)


def _put(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc.setdefault(key, {})
    doc[path[-1]] = value


def join(arrays: Mapping[str, Any], paths: Mapping[str, tuple[str, ...]], plain: dict[str, Any] | None,
         local: list[Any] | None) -> dict[str, Any]:
    """The nested state: ``plain`` (a fresh document, filled in place), each rank-local part and
    each array at its path."""
    out: dict[str, Any] = plain if plain is not None else {}
    for path, part in local or ():
        _put(out, tuple(path), part)
    for name, array in arrays.items():
        _put(out, paths.get(name, (name,)), array)
    return out
