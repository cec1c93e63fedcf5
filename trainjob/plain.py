"""Plain (non-tensor) state values as JSON text, exactly, without pickle.

A state's plain leaves are int (any size), float (binary64), bool, str and None, in lists,
tuples and dicts with str keys. JSON holds most of them as they are; what it cannot hold exactly
is written as a one-key object whose key starts with ``$``:

    {"$int": "-0x1f"}            an int outside +-2**53 (JSON readers round those; Python refuses
                                 to print ints of more than 4300 digits, hex has no such limit)
    {"$float": "7ff8000000000000"}  a non-finite float, by its 64 bits (nan payloads included)
    {"$tuple": [...]}            a tuple (torch's ``betas``, python ``random``'s state)
    {"$array": {"dtype": "float32", "shape": [3], "hex": "...", "torch": true}}
                                 an ``Array``: an array's exact bytes, as a rank-local part holds
                                 one (``state_tree.py`` makes it of a tensor or numpy array)

A dict key that starts with ``$`` is written with one more ``$`` in front, so no user key can
be read back as one of those. Finite floats are written by ``repr`` (exact, ``-0.0`` included).
``encode`` of any other type (a set, bytes, an object, a lambda, a tensor) raises ``PlainError``
naming the path of the value; ``decode`` raises it for text ``encode`` cannot have written.

``check_like`` compares a checkpoint's values with the live state's before either is used.
Pure: no I/O.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

_EXACT = 2 ** 53  # every int of smaller magnitude survives any JSON reader


class PlainError(ValueError):
    """A value that is not plain, or text that does not decode: the message names the path."""


class Array:
    """An array as a plain value: its dtype's name (numpy's, or torch's without ``torch.``),
    shape, raw bytes (C order, the machine's little-endian), and whether it was a torch tensor.
    Made and turned back into an array by ``state_tree.py``; here it is only written and read."""

    __slots__ = ("dtype", "shape", "data", "torch")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes, torch: bool) -> None:
        self.dtype, self.shape, self.data, self.torch = dtype, tuple(shape), bytes(data), torch

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Array) and (self.dtype, self.shape, self.data, self.torch) == (
            other.dtype, other.shape, other.data, other.torch)

    def __repr__(self) -> str:
        return f"Array({self.dtype}{list(self.shape)}, {len(self.data)} bytes)"

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)} {'tensor' if self.torch else 'array'}"


def _bits(x: float) -> str:
    return struct.pack(">d", x).hex()


def _to_json(value: Any, path: str) -> Any:
    # bool before int: True is an int in Python, and stays a bool here.
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value) if -_EXACT < value < _EXACT else {"$int": hex(value)}
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": _bits(value)}
    if isinstance(value, list | tuple):
        # Every checkpoint holds each rank's RNG streams (Python's random: 625 ints, numpy's: 624):
        # a list of ints JSON holds exactly is written whole, not int by int (about 1 ms each time).
        if all(type(v) is int and -_EXACT < v < _EXACT for v in value):
            items = list(value)
        else:
            items = [_to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return {"$tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, Array):
        return {"$array": {"dtype": value.dtype, "shape": list(value.shape), "hex": value.data.hex(),
                           "torch": value.torch}}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise PlainError(f"{path}: a key of type {type(k).__name__} ({k!r}); keys must be str")
            out["$" + k if k.startswith("$") else k] = _to_json(v, f"{path}.{k}" if path else k)
        return out
    raise PlainError(f"{path or 'the value'}: a {type(value).__name__} cannot be checkpointed as a plain value; "
                     "use int, float, bool, str, None, or lists/tuples/dicts of them")


def encode(value: Any, path: str = "") -> str:
    """Canonical JSON text holding ``value`` exactly (sorted keys, no spaces)."""
    return json.dumps(_to_json(value, path), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _from_json(value: Any, path: str) -> Any:
    if isinstance(value, list):
        return [_from_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, inner), = value.items()
        if key == "$int" and isinstance(inner, str):
            try:
                return int(inner, 16)
            except ValueError:
                raise PlainError(f"{path}: {inner!r} is not a hex int") from None
        if key == "$float" and isinstance(inner, str) and len(inner) == 16:
            try:
                return struct.unpack(">d", bytes.fromhex(inner))[0]
            except ValueError:
                raise PlainError(f"{path}: {inner!r} is not the hex of a float's 64 bits") from None
        if key == "$tuple" and isinstance(inner, list):
            return tuple(_from_json(v, f"{path}[{i}]") for i, v in enumerate(inner))
        if key == "$array":
            return _array(inner, path)
    if any(k.startswith("$") and not k.startswith("$$") for k in value):
        raise PlainError(f"{path}: an object with a key starting with a single '$' that is not an encoded value")
    out = {}
    for k, v in value.items():
        name = k[1:] if k.startswith("$") else k
        out[name] = _from_json(v, f"{path}.{name}" if path else name)
    return out


def _array(inner: Any, path: str) -> Array:
    if not (isinstance(inner, dict) and set(inner) == {"dtype", "shape", "hex", "torch"}
            and isinstance(inner["dtype"], str) and isinstance(inner["torch"], bool)
            and isinstance(inner["hex"], str) and isinstance(inner["shape"], list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in inner["shape"])):
        raise PlainError(f"{path}: not an encoded array")
    try:
        data = bytes.fromhex(inner["hex"])
    except ValueError:
        raise PlainError(f"{path}: the array's bytes are not hex") from None
    return Array(inner["dtype"], tuple(inner["shape"]), data, inner["torch"])


def decode(text: str) -> Any:
    """The value ``encode`` wrote as ``text``; PlainError for anything else."""
    def reject(name: str) -> None:
        raise PlainError(f"non-finite number {name} (encode writes them as $float)")

    try:
        parsed = json.loads(text, parse_constant=reject)
    except RecursionError:
        raise PlainError("nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError, and ints past Python's digit limit
        raise PlainError(str(exc)) from None
    return _from_json(parsed, "")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Array):
        return value.describe()  # an array fits only one of its dtype, shape and library
    if isinstance(value, int | float):
        return "number"  # an lr given as 1 becomes 0.5 once a scheduler scales it
    return type(value).__name__


def check_like(live: Any, found: Any, path: str = "") -> None:
    """Raise PlainError naming the first entry where ``found`` (from a checkpoint) does not fit
    ``live`` (the state it would be loaded into): the same dict keys, the same list lengths, and
    the same kind of leaf (int and float are both numbers; None fits anything, either way)."""
    if live is None or found is None:
        return
    where = path or "the plain values"
    if _kind(live) != _kind(found):
        raise PlainError(f"{where}: the checkpoint holds a {_kind(found)}, the live state a {_kind(live)}")
    if isinstance(live, dict):
        if set(live) != set(found):
            missing, extra = sorted(set(live) - set(found)), sorted(set(found) - set(live))
            raise PlainError(f"{where}: keys differ (the checkpoint lacks {missing}, has extra {extra})")
        for k in live:
            check_like(live[k], found[k], f"{path}.{k}" if path else k)
    elif isinstance(live, list | tuple):
        if len(live) != len(found):
            raise PlainError(f"{where}: the checkpoint holds {len(found)} items, the live state {len(live)}")
        for i, (a, b) in enumerate(zip(live, found)):
            check_like(a, b, f"{path}[{i}]")
