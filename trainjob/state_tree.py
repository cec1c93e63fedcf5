"""A nested state as a checkpoint stores it: named arrays, plus plain values as two JSON documents.

A Stateful's ``state_dict()`` may nest mappings (``{"model": {...}, "optim": {"state": ...,
"param_groups": [...]}}``). ``split`` takes it apart:

- every array leaf (a numpy array or a torch tensor) under a path of dict keys becomes one named
  array, named by its keys joined with ``.`` (``optim.state.0.weight.exp_avg``): the shards hold
  those, split across ranks as before;
- everything else is plain values (``plain.py``), kept where it stood, in one document of the
  replicated state (written once, in rank 0's shard) and one of the rank-local state: the parts
  wrapped in ``RankLocal`` (RNG streams, a data loader's position, arrays as their exact bytes),
  written by every rank in its own shard.

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

from .plain import Array, PlainError


class RankLocal(dict):  # type: ignore[type-arg]
    """A part of a state that differs from rank to rank (each rank's RNG streams, its data
    loader's position, statistics of its own batches): saved by every rank in its own shard, and
    handed back to the same rank. Plain values, and arrays (numpy or torch, kept as their exact
    bytes in the shard's header: meant for small ones). A resume at another world size cannot
    map it (docs/trainers.md)."""


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
    PlainError naming the path for a key that is not a str, or an array inside a list of the
    replicated state; plain values are checked when they are encoded. An array in a RankLocal
    part becomes a ``plain.Array`` (``arrays_back`` turns it back)."""
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
                local.append([list(here), _exact(dict(value), name, torch)])
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
        raise PlainError(f"{path}: an array inside a list; arrays belong in dicts of the state, or anywhere "
                         "in a RankLocal part")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _no_arrays(v, f"{path}.{k}", torch)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _no_arrays(v, f"{path}[{i}]", torch)


_SCALARS = frozenset({int, float, bool, str, type(None)})  # what _exact hands back as it is


def _exact(value: Any, path: str, torch: Any) -> Any:
    """A RankLocal part with each array in it as a ``plain.Array`` of its exact bytes."""
    if isinstance(value, FromRank0):
        raise PlainError(f"{path}: FromRank0 inside a RankLocal part; a rank-local array is each rank's own")
    if torch is not None and isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor":
            raise PlainError(f"{path}: a DTensor inside a RankLocal part; hand out its local shard (to_local())")
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return Array(str(t.dtype).removeprefix("torch."), tuple(t.shape), data, torch=True)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise PlainError(f"{path}: a numpy array of Python objects cannot be checkpointed")
        return Array(value.dtype.name, value.shape, np.ascontiguousarray(value).tobytes(), torch=False)
    if isinstance(value, Mapping):
        return {k: _exact(v, f"{path}.{k}", torch) for k, v in value.items()}
    if isinstance(value, list | tuple):  # a subclass (a namedtuple) is written as its base anyway
        if all(type(v) in _SCALARS for v in value):  # an RNG's state: hundreds of ints, each its own path
            items = list(value)
        else:
            items = [_exact(v, f"{path}[{i}]", torch) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def arrays_back(value: Any, torch: Any, path: str = "") -> Any:
    """``value`` (decoded plain values) with each ``plain.Array`` an array again: a CPU tensor
    where it was a tensor (``torch``: the torch module), else a numpy array; PlainError when its
    bytes do not make its dtype and shape."""
    if isinstance(value, Array):
        return _array(value, torch, path or "the rank-local state")
    if isinstance(value, dict):
        return {k: arrays_back(v, torch, f"{path}.{k}" if path else k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [arrays_back(v, torch, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _array(a: Array, torch: Any, path: str) -> Any:
    count = 1
    for n in a.shape:
        count *= n
    if a.torch:
        dtype = getattr(torch, a.dtype, None) if torch is not None else None
        if torch is None or not isinstance(dtype, torch.dtype) or dtype.itemsize * count != len(a.data):
            raise PlainError(f"{path}: {len(a.data)} bytes are not a {a.describe()}")
        flat = torch.frombuffer(bytearray(a.data), dtype=dtype) if a.data else torch.empty(0, dtype=dtype)
        return flat.reshape(a.shape)
    try:
        if a.dtype == "bfloat16":
            import ml_dtypes  # noqa: F401  (registers numpy's bfloat16, as tensors.py does)
        dtype = np.dtype(a.dtype)
    except TypeError:
        raise PlainError(f"{path}: {a.dtype!r} is not a numpy dtype") from None
    if dtype.hasobject or dtype.itemsize * count != len(a.data):
        raise PlainError(f"{path}: {len(a.data)} bytes are not a {a.describe()}")
    return np.frombuffer(a.data, dtype=dtype).reshape(a.shape).copy()


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
