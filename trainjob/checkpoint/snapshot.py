"""A trainer's live state as host arrays a shard can be written from, and back.

A trainer's ``state_dict()`` hands out its live arrays: numpy arrays, or torch tensors on any
device (float64/32/16, bfloat16, integers, bool). ``HostState.snapshot`` turns them into numpy
arrays on the host without copying what is already there (a numpy array is itself; a CPU
tensor is a view of its own memory, bfloat16 through ``ml_dtypes``), and copies what is on a
device once into a host buffer it keeps for the next checkpoint (pinned when CUDA is present).
``live`` turns host arrays read from a checkpoint back into the types the trainer handed out,
for its ``load_state_dict``: a torch tensor viewing the host array, never a numpy round trip.

A state may nest mappings and hold plain values beside its arrays (``state_tree.py``): a snapshot
names each array by its path and encodes the plain values as JSON text (``plain.py``), one
document of the replicated values and one of the rank-local parts, which travel with the host
arrays (``HostArrays.metadata``) into the shard's header, covered by its sha256.

It also holds the rules a state must keep between checkpoints (the same array names, shapes and
dtypes as at the first snapshot; dense, contiguous, at least one axis; plain values of the types
``plain.py`` knows) and refuses a state that breaks one with a UsageError naming the entry and
what to change, before anything is written. At a resume, ``live`` checks a checkpoint's plain
values against the live state's (the same keys and kinds) before handing anything over.

At W > 1 a snapshot also says, from the state's marks (``state_tree.py``), which arrays one rank
writes whole (``HostArrays.sources``: DDP's buffers, from rank 0) and which are compared across
ranks before a commit (``HostArrays.checked``, their digests: ``replicas.py``).

A DTensor (FSDP2's parameters and optimizer state) is taken as its rank's local shard, with the
place of that shard in the whole tensor (``dtensor_box``, from its placements): no rank gathers
what it does not hold. The place depends only on the DTensor's mesh, placements and whole shape,
so a ``HostState`` works it out once per run for each of those (``HostState.box``), not at every
checkpoint. ``live`` wraps a local shard read back into a DTensor of the same mesh
and placements.

torch is never imported here: a value is a tensor only if torch is already loaded (the trainer
imported it), a DTensor only if torch.distributed.tensor is. No I/O.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import plan, replicas, shards
from .. import plain, state_tree as tree
from ..errors import InputError, UsageError, importing, one_line
from ..records import PLAIN_NAME, TensorSpec

# torch dtype name -> safetensors code; the numpy side of each code is in shards.py.
_TORCH_CODE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


PLAIN_KEY, LOCAL_KEY = "trainjob.plain", "trainjob.local"  # shard metadata: the two plain documents
STATE, EXPORT = "state_dict()", "export"  # what handed the arrays out, as a message names it


class HostArrays(dict[str, np.ndarray]):
    """One snapshot's host arrays, with its plain values as JSON text: ``plain`` (replicated,
    stored in rank 0's shard) and ``local`` (this rank's RankLocal parts, in its own shard).
    ``boxes``: for each DTensor, where its local shard (the array here) sits in the whole
    tensor and which of the ranks holding it alike this one is (``plan.Local``)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], plain_text: str | None = None,
                 local_text: str | None = None, boxes: Mapping[str, plan.Local] | None = None,
                 specs: tuple[TensorSpec, ...] | None = None, sources: Mapping[str, int] | None = None,
                 checked: frozenset[str] = frozenset()) -> None:
        super().__init__(arrays)
        self.plain, self.local = plain_text, local_text
        self.boxes = dict(boxes or {})
        self.specs = specs  # the whole tensors (a DTensor's global shape), as the manifest lists them
        # At W > 1 (replicas.py): the entries one rank writes whole, and those whose ranks' copies
        # are compared before a commit (a DTensor's shard never is).
        self.sources = dict(sources or {})
        self.checked = frozenset(n for n in checked if n not in self.boxes)

    def digests(self) -> dict[str, str]:
        """This rank's digest of each checked entry (``replicas.digest``), by name."""
        return {name: replicas.digest(self[name]) for name in sorted(self.checked)}

    def metadata(self, rank: int) -> dict[str, str]:
        """What rank ``rank``'s shard header holds besides its arrays."""
        meta = {}
        if self.plain is not None and rank == 0:
            meta[PLAIN_KEY] = self.plain
        if self.local is not None:
            meta[LOCAL_KEY] = self.local
        return meta


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def is_dtensor(value: object) -> bool:
    """A torch.distributed DTensor (an FSDP2 parameter, its optimizer state): only when torch
    has loaded its distributed tensor package already, as any script that made one has."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(value, mod.DTensor)


def dtensor_box(name: str, t: Any) -> plan.Local:
    """Where a DTensor's local shard sits in the whole tensor, and which replica of that box this
    rank holds (the ranks along the mesh axes it is Replicate on hold it alike). UsageError naming
    the entry for a placement trainjob cannot store (Partial: pending sums, not values; a
    strided shard), before anything is written."""
    with importing("torch.distributed.tensor"):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not (type(p) is Shard or isinstance(p, Replicate)):  # _StridedShard subclasses Shard
            raise UsageError(f"state_dict()[{name!r}]: a DTensor placed {p}; trainjob stores Shard(d) and "
                             "Replicate placements only (redistribute a Partial one, or hand out its "
                             "full_tensor())")
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise UsageError(f"state_dict()[{name!r}]: a DTensor on a mesh this rank is not part of; every rank "
                         "of the run must be in the mesh of every DTensor it checkpoints")
    shape, origin = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    replica, replicas = 0, 1
    for axis, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            size = mesh.size(axis)
            replica, replicas = replica * size + coord[axis], replicas * size
    return plan.Local(origin=tuple(int(o) for o in origin), shape=tuple(int(n) for n in shape),
                      replica=replica, replicas=replicas)


def _cpu_view(t: Any) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (``t`` on the CPU, dense, contiguous)."""
    t = t.detach()
    if str(t.dtype).removeprefix("torch.") == "bfloat16":  # numpy has no bfloat16: reinterpret the bits
        return t.view(_torch().int16).numpy().view(shards.np_dtype("BF16"))
    return t.numpy()


def as_tensor(array: np.ndarray) -> Any:
    """A CPU torch tensor viewing ``array``'s memory (bfloat16 included)."""
    torch = _torch()
    if shards.dtype_code(array) == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _check(name: str, value: Any, source: str = STATE,
           box: Callable[[str, Any], object] = dtensor_box) -> tuple[str, Any, object]:
    """The safetensors dtype code of one state value, the value as this rank holds it (a
    DTensor's local shard) and, for a DTensor, ``box``'s answer (None otherwise); UsageError
    saying what to change. ``box``: how a DTensor's placements are checked and where its shard
    sits (``dtensor_box``, or a ``HostState``'s cached one)."""
    where = f"{source}[{name!r}]"
    placed = None
    if is_dtensor(value):
        placed = box(name, value)  # its placements, before anything is written
        with _torch().no_grad():  # the local shard itself, not an autograd Function's output (20 us each)
            value = value.to_local()
    return _code(where, value), value, placed


def _code(where: str, value: Any) -> str:
    if is_tensor(value):
        t: Any = value
        if t.device.type == "meta":
            raise UsageError(f"{where}: a tensor on the meta device holds no values; materialize it "
                             "(to_empty(), then initialize or load it) before it is checkpointed or exported")
        if t.layout != _torch().strided:
            raise UsageError(f"{where}: a sparse tensor ({t.layout}) cannot be checkpointed; "
                             "return .to_dense() of it")
        code = _TORCH_CODE.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise UsageError(f"{where}: dtype {t.dtype} cannot be stored in a shard; "
                             f"use one of {', '.join('torch.' + k for k in _TORCH_CODE)}")
        if not t.is_contiguous():
            raise UsageError(f"{where}: a non-contiguous tensor (shape {list(t.shape)}, strides "
                             f"{list(t.stride())}); keep the state in contiguous tensors (.contiguous())")
        return code
    if not isinstance(value, np.ndarray):
        raise UsageError(f"{where}: expected a numpy array or a torch tensor, got {type(value).__name__}")
    if not value.flags.c_contiguous:
        raise UsageError(f"{where}: a non-contiguous array; keep the state in C-contiguous arrays "
                         "(np.ascontiguousarray)")
    try:
        return shards.dtype_code(value)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None


def _ndim(value: object) -> int | None:
    return value.dim() if is_tensor(value) else value.ndim if isinstance(value, np.ndarray) else None


def _with_axis(value: Any) -> Any:
    """A 0-d tensor or array as shape (1,), sharing its memory (a view, so a resume reads into it)."""
    return value.detach().reshape(1) if is_tensor(value) else value.reshape(1)


def exported(export: Mapping[str, Any], step: int) -> dict[str, np.ndarray]:
    """A gate's export as host arrays an artifact is written from: each name as it was handed out,
    a 0-d tensor kept 0-d (safetensors stores shape []), tied tensors (one tensor under two names,
    as GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) once per name, a non-contiguous
    one copied contiguous (written once, unlike a checkpoint). UsageError naming what cannot be
    published, before anything is written."""
    if isinstance(export, Mapping):
        export = {n: v.contiguous() if is_tensor(v) and not is_dtensor(v) and v.device.type != "meta"
                  and v.layout == _torch().strided else np.asarray(v, order="C") if isinstance(v, np.ndarray) else v
                  for n, v in export.items()}
    host = HostState()
    arrays = host.snapshot(export, step, EXPORT)
    if arrays.plain is not None or arrays.local is not None:  # an artifact holds arrays only
        raise UsageError("export: publish a flat mapping of names to arrays (no nesting, no plain values)")
    if not arrays:
        raise UsageError("export: an empty mapping, an artifact with nothing in it; export the arrays a user of "
                         "the model needs, such as its weights")
    return {n: a.reshape(()) if n in host.scalars else a for n, a in arrays.items()}


def specs_of(state: Mapping[str, Any], source: str = STATE,
             box: Callable[[str, Any], object] = dtensor_box) -> tuple[TensorSpec, ...]:
    """The state as the manifest describes it; UsageError for a value that cannot be checkpointed
    (``source``: what handed it out, named in the message; ``box``: as ``_check``'s)."""
    return _described(state, source, box)[0]


def _described(state: Mapping[str, Any], source: str,
               box: Callable[[str, Any], object]) -> tuple[tuple[TensorSpec, ...], dict[str, Any], dict[str, Any]]:
    """``specs_of``, each value as this rank holds it, and each DTensor's box (``_check``'s)."""
    if not isinstance(state, Mapping):
        raise UsageError(f"{source} returned {type(state).__name__}, expected a mapping of names to arrays")
    specs, held, boxes = [], {}, {}
    for name, value in sorted(state.items()):
        dtype, held[name], placed = _check(name, value, source, box)
        if placed is not None:
            boxes[name] = placed
        try:
            specs.append(_spec(name, dtype, tuple(value.shape)))
        except (TypeError, ValueError) as exc:  # what the manifest cannot hold: one line, not the validator's repr
            raise UsageError(_unstorable(name, source) if re.fullmatch(PLAIN_NAME, name) is None else
                             f"{source}[{name!r}]: cannot be checkpointed: {one_line(str(exc.args[0]))[:200]}") from None
    return tuple(specs), held, boxes


# A state's description is the same at every checkpoint: each spec is validated once, not per save
# (a hundredth of a millisecond each, for every array of the state; issue 56's sharded save).
_spec = functools.lru_cache(maxsize=1 << 16)(lambda name, dtype, shape: TensorSpec(name=name, dtype=dtype, shape=shape))


def _unstorable(name: str, source: str) -> str:
    shown = one_line(repr(name)) if len(name) <= 60 else f"{one_line(repr(name[:40]))}... ({len(name)} characters)"
    return (f"{source}: the name {shown} cannot be stored; a name is 1 to 200 letters, digits, '_', '.' or '-', "
            "not beginning with '.' or '-'")


def _changes(first: tuple[TensorSpec, ...], now: tuple[TensorSpec, ...]) -> str:
    """What differs between two descriptions of the state, for a one-line message."""
    was, got = {t.name: t for t in first}, {t.name: t for t in now}
    if set(was) != set(got):
        gone, new = sorted(set(was) - set(got)), sorted(set(got) - set(was))
        return (f"names changed ({'missing ' + ', '.join(gone) if gone else ''}"
                f"{'; ' if gone and new else ''}{'new ' + ', '.join(new) if new else ''}); "
                "return the same names at every checkpoint")
    name = next(n for n in sorted(was) if was[n] != got[n])
    return (f"state_dict()[{name!r}] is now {got[name].dtype}{list(got[name].shape)}, was "
            f"{was[name].dtype}{list(was[name].shape)}; keep every array's shape and dtype")


class HostState:
    """The host side of one trainer's state: what the first snapshot looked like, which values
    were torch tensors, and the reusable host buffers for those that live on a device.

    ``copy=True`` copies even host-resident values into the buffers (a snapshot that must not
    change while the trainer steps on, as an asynchronous save needs); the default copies only
    what is not already in host memory.
    """

    def __init__(self, copy: bool = False) -> None:
        self.copy = copy
        self.specs: tuple[TensorSpec, ...] | None = None
        self.paths: dict[str, tuple[str, ...]] = {}  # array name -> its path in a nested state
        self.plain: Any = None  # the first snapshot's plain documents, what a checkpoint's must fit
        self.local: Any = None
        self.tensors: set[str] = set()  # names whose live value is a torch tensor
        self.scalars: set[str] = set()  # names whose live value is 0-d (stored as shape (1,))
        self.dtensors: dict[str, tuple[Any, Any, Any]] = {}  # name -> (mesh, placements, stride) of a DTensor
        self.boxes: dict[str, plan.Local] = {}  # name -> where this rank's shard of a DTensor sits
        # (mesh, placements, whole shape) -> the box they give this rank: fixed for the run (``box``)
        self.known_boxes: dict[tuple[Any, ...], plan.Local] = {}
        self.buffers: dict[str, np.ndarray] = {}

    def box(self, name: str, t: Any) -> plan.Local:
        """``dtensor_box(name, t)``, worked out once per run for each mesh, placements and whole
        shape: all it depends on (this rank's coordinate in the mesh is fixed for the process).
        A DTensor handed out anew at every checkpoint (``state_dict()`` detaches each parameter)
        costs a dictionary lookup, not the placements' arithmetic; one whose mesh, placements
        or shape changed is worked out (and checked) again."""
        key = (t.device_mesh, tuple(t.placements), tuple(t.shape))
        found = self.known_boxes.get(key)
        if found is None:
            found = self.known_boxes[key] = dtensor_box(name, t)
        return found

    @property
    def sharded(self) -> bool:
        """Whether some array is a DTensor: this rank holds only its shard of the state."""
        return bool(self.boxes)

    def wanted(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """What this rank's state holds of each tensor, as ``plan.plan_reads`` takes it: a
        DTensor's local box, a plain tensor's whole."""
        assert self.specs is not None
        return {t.name: ((b.origin, b.shape) if (b := self.boxes.get(t.name)) else ((0,) * len(t.shape), t.shape))
                for t in self.specs}

    def _buffer(self, name: str, spec: TensorSpec, like: Any) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None:
            dtype = shards.np_dtype(spec.dtype)
            shape = self.boxes[name].shape if name in self.boxes else spec.shape  # a DTensor's: its local shard
            if is_tensor(like):
                torch = _torch()
                pinned = torch.cuda.is_available()  # page-locked: the device copies by DMA
                host = torch.empty(shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
                buf = _cpu_view(host)
            else:
                buf = np.empty(shape, dtype=dtype)
            self.buffers[name] = buf
        return buf

    def snapshot(self, state: Mapping[str, Any], step: int, source: str = STATE) -> HostArrays:
        """Host arrays holding ``state`` (a trainer's ``state_dict()``; ``source`` names what
        handed it out) as it is now, and its plain values as text.

        The first call fixes the names, shapes and dtypes; a later state that differs is a
        UsageError naming the array (``step`` says when). Raises before anything is written."""
        if not isinstance(state, Mapping):
            raise UsageError(f"{source} returned {type(state).__name__}, expected a mapping of names to arrays")
        try:
            parts = tree.split(state, _torch())
            plain_text = None if parts.plain is None else plain.encode(parts.plain)
            local_text = None if parts.local is None else plain.encode(parts.local)
        except plain.PlainError as exc:
            raise UsageError(f"{source}: {exc}") from None
        state = parts.arrays
        # A 0-d value (BatchNorm's num_batches_tracked, Adam's step) is stored with one axis, a
        # view of its memory: a shard's slices split a tensor along its first axis.
        scalars = {n for n, v in state.items() if _ndim(v) == 0 and not is_dtensor(v)}
        state = {n: _with_axis(v) if n in scalars else v for n, v in state.items()}
        # A DTensor's whole shape, its placements checked, and where this rank's shard sits.
        specs, held, boxes = _described(state, source, self.box)
        if self.specs is None:
            self.specs, self.paths, self.scalars = specs, parts.paths, scalars
            self.plain, self.local = parts.plain, parts.local
            self.tensors = {n for n, v in state.items() if is_tensor(v)}
            self.dtensors = {n: (v.device_mesh, v.placements, v.stride()) for n, v in state.items() if is_dtensor(v)}
            self.boxes = boxes
        elif specs != self.specs:
            raise UsageError(f"step {step}: {_changes(self.specs, specs)}")
        elif boxes != self.boxes:
            changed = next(n for n in sorted(set(boxes) | set(self.boxes)) if boxes.get(n) != self.boxes.get(n))
            raise UsageError(f"step {step}: state_dict()[{changed!r}] is sharded otherwise than at the first "
                             "checkpoint; keep every DTensor's mesh and placements")
        out: dict[str, np.ndarray] = {}
        device_copies = False
        for spec in specs:
            value = held[spec.name]  # a DTensor's: this rank's shard, its place in the whole in ``boxes``
            on_host = not is_tensor(value) or value.device.type == "cpu"
            if on_host and not self.copy:
                out[spec.name] = _cpu_view(value) if is_tensor(value) else value
                continue
            buf = self._buffer(spec.name, spec, value)
            if is_tensor(value):
                as_tensor(buf).copy_(value.detach(), non_blocking=not on_host)
                device_copies = device_copies or not on_host
            else:
                np.copyto(buf, value)
            out[spec.name] = buf
        if device_copies:
            _torch().cuda.synchronize()  # the non-blocking copies above must land before a write
        return HostArrays(out, plain_text, local_text, boxes, specs, replicas.sources(parts.from_rank0),
                          parts.checked)

    def live(self, arrays: Mapping[str, np.ndarray], plain_text: str | None = None,
             local_text: str | None = None, where: str = "the checkpoint",
             local_dropped: bool = False) -> dict[str, Any]:
        """A checkpoint as the state the trainer handed out: ``arrays`` (host arrays read from it)
        as a CPU tensor viewing the same memory where its value was a tensor, else the array, at
        their paths, with the plain values decoded from ``plain_text`` and ``local_text`` (the
        shard metadata). InputError (exit 2) naming the entry when they do not fit the live state's
        (keys, kinds), or a document the live state has is missing (the rank-local one may be, when
        ``local_dropped``: a reshard was told to drop it, and the state keeps its own)."""
        docs = []
        for name, like, text, may_lack in (("plain values", self.plain, plain_text, False),
                                           ("rank-local state", self.local, local_text, local_dropped)):
            if like is None or (text is None and may_lack):
                docs.append(None)
                continue
            if text is None:
                raise InputError(f"{where}: holds no {name}, but the live state has some; relaunch with the "
                                 "script that wrote it")
            try:
                found = plain.decode(text)
                plain.check_like(like, found)
                found = tree.arrays_back(found, _torch())  # a rank-local array: a tensor again where it was one
            except plain.PlainError as exc:
                raise InputError(f"{where}: {name}: {exc}") from None
            docs.append(found)
        tensors = {n: as_tensor(a) if n in self.tensors else a for n, a in arrays.items()}
        for n in self.scalars & tensors.keys():  # given back without the axis it was stored with (a view)
            tensors[n] = tensors[n].reshape(())
        for n, (mesh, placements, stride) in self.dtensors.items():  # a local shard back into its DTensor
            with importing("torch.distributed.tensor"):
                from torch.distributed.tensor import DTensor
            spec = next(t for t in self.specs or () if t.name == n)
            tensors[n] = DTensor.from_local(tensors[n].to(mesh.device_type), mesh, placements, run_check=False,
                                            shape=_torch().Size(spec.shape), stride=stride)
        if docs == [None, None] and all(len(p) == 1 for p in self.paths.values()):
            return tensors  # a flat mapping of arrays, as it was handed out
        return tree.join(tensors, self.paths, docs[0], docs[1])


class Gathered:
    """An export holding DTensors (a sharded model's weights), to be published whole without
    any rank holding the whole model at once: ``specs`` describes it without gathering, and
    ``host(name)`` gathers one tensor (``full_tensor()``, a collective) as a host array for rank
    0 to write and drop before the next. Every other rank calls ``drain`` meanwhile, which joins
    the same collectives in the same (name) order."""

    def __init__(self, export: Mapping[str, Any]) -> None:
        if not isinstance(export, Mapping) or not all(is_tensor(v) for v in export.values()):
            raise UsageError("export: a sharded model publishes a flat mapping of names to tensors "
                             "(its state_dict())")
        self.export = dict(export)
        self.specs = specs_of(self.export)  # each DTensor's whole shape; its placements checked

    @staticmethod
    def wanted(export: object) -> bool:
        """Whether ``export`` holds a DTensor, and so is published through a ``Gathered``."""
        return isinstance(export, Mapping) and any(is_dtensor(v) for v in export.values())

    def _full(self, name: str) -> Any:
        v = self.export[name]
        return v.full_tensor() if is_dtensor(v) else v

    def host(self, name: str) -> np.ndarray:
        return _cpu_view(self._full(name).detach().cpu().contiguous())

    def drain(self) -> None:
        for name in sorted(self.export):  # encode_lazy's order
            if is_dtensor(self.export[name]):
                self._full(name)
