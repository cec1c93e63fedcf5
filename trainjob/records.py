"""The records trainjob writes and reads, and the one converter that (de)serialises them.

Every file on the PVC and in the data directory is one of these attrs classes. The converter is
strict: unknown keys, wrong types (``true`` for an int, ``"1"`` for a float), non-finite numbers
and out-of-range values are rejected with a message naming the field. JSON encoding is canonical
(sorted keys, fixed separators) so the same record always yields the same bytes.

This module does no I/O; ``storage/pvc.py`` and ``trainers/data.py`` read and write the bytes.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import attrs
import cattrs
from attrs import validators as v
from cattrs.gen import make_dict_unstructure_fn

from .errors import InputError
from .states import State

PERSISTED_STATES = tuple(s.value for s in State if s != State.pending)  # pending is never written

N_FEATURES = 3

T = TypeVar("T")

# Formats that records and the modules beside them check, each written once here.
SHA256_HEX = r"[0-9a-f]{64}"  # a sha256 as trainjob writes it: 64 lowercase hex digits
DIGEST_HEX = r"[0-9a-f]{32}"  # a replicated entry's digest (checkpoint/replicas.py): 128 bits of a sha256
# A file name that stays inside its directory: no separator, and no first dot (so never "." or "..").
PLAIN_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}"


def is_sha256_hex(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(SHA256_HEX, value) is not None


def _finite(_inst: object, attr: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"'{attr.name}' must be a finite number, got {value!r}")


def _finite_items(_inst: object, attr: attrs.Attribute, value: list[float]) -> None:
    if not all(math.isfinite(x) for x in value):
        raise ValueError(f"'{attr.name}' must hold finite numbers, got {value!r}")


def _weights() -> Any:
    return attrs.field(
        converter=tuple,
        validator=[v.min_len(N_FEATURES), v.max_len(N_FEATURES), _finite_items],
    )


@attrs.frozen
class Sample:
    """One labelled example: three features and a 0/1 label."""

    x: tuple[float, ...] = _weights()
    y: int = attrs.field(validator=v.in_((0, 1)))


@attrs.frozen
class LinearModel:
    """Three weights and a bias; the baseline file holds one of these."""

    weights: tuple[float, ...] = _weights()
    bias: float = attrs.field(validator=_finite)


@attrs.frozen
class CheckpointPointer:
    """``checkpoint.json``: names the newest committed checkpoint directory (the lab's contract).

    A convenience for people and scripts (``.step`` is the newest committed step). The truth is
    the directories under ``checkpoints/``; resume never loads through this file, but a pointer
    naming a checkpoint that is missing or different is treated as evidence of damage.
    """

    step: int = attrs.field(validator=v.ge(0))
    attempt: int = attrs.field(validator=v.ge(1))
    world_size: int = attrs.field(validator=v.ge(1))
    loss_milli: int = attrs.field(validator=v.ge(0))
    dir: str = attrs.field(validator=v.matches_re(r"checkpoints/[A-Za-z0-9._-]+"))
    manifest_sha256: str = attrs.field(validator=v.matches_re(SHA256_HEX))


# --- sharded checkpoints: the manifest and what ranks tell each other ----------------------------

# 3: as 2, and each shard's header says where each of its slices sits (checkpoint/plan.py's
# ``placement``), so every manifest is proven by its shards, not only the one checkpoint.json's
# sha256 names. 2: every shard is hashed in parts (its header, each slice), so a rank verifies
# what it reads without hashing whole shards (docs/checkpoints.md). 1: each shard's sha256 is its
# whole file's. 1 and 2 are still read (what they prove: docs/checkpoints.md), never written.
MANIFEST_SCHEMA = 3
MANIFEST_SCHEMAS = (1, 2, 3)
# The safetensors dtypes trainjob can load into numpy, each with its numpy dtype (little-endian,
# as safetensors stores them; "bfloat16" is the numpy dtype ml_dtypes registers, which
# checkpoint/shards.py imports). A manifest claiming any other is an input error, not a crash at
# load time.
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bfloat16", "I64": "<i8", "I32": "<i4",
          "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
# Bytes per element of each, for the bounds a manifest is checked against without numpy
# (`k8s render` imports those checks); tests/test_records.py pins it to numpy's itemsize.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _shape() -> Any:
    # At least one axis: shards split tensors along the first one.
    return attrs.field(converter=tuple, validator=[
        v.min_len(1), v.max_len(8), v.deep_iterable(v.and_(v.instance_of(int), v.ge(0)))])


@attrs.frozen
class TensorSpec:
    """A whole tensor of the training state; shards split it along its first axis."""

    name: str = attrs.field(validator=v.matches_re(PLAIN_NAME))
    dtype: str = attrs.field(validator=v.in_(DTYPES))
    shape: tuple[int, ...] = _shape()


def _offsets_fit(inst: TensorSlice, _attr: attrs.Attribute, value: tuple[int, ...] | None) -> None:
    if value is not None and (len(value) != len(inst.shape) or value[0] != inst.start):
        raise ValueError(f"'offsets' must have one entry per axis of 'shape' and begin with 'start', got {value!r}")


@attrs.frozen
class TensorSlice:
    """Rows ``start .. start + shape[0]`` of the tensor ``name``, as stored in one shard file.

    ``offsets``: where the slice's first element sits along every axis of the whole tensor (a
    DTensor's local shard, sharded along another axis or a 2-D mesh); None (omitted from the
    JSON, as in every manifest written before it existed) means ``(start, 0, 0, ...)``: whole
    rows, the split every plain state uses.
    """

    name: str = attrs.field(validator=v.matches_re(PLAIN_NAME))
    dtype: str = attrs.field(validator=v.in_(DTYPES))
    shape: tuple[int, ...] = _shape()
    start: int = attrs.field(validator=v.ge(0))
    offsets: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple),
        validator=[v.optional(v.deep_iterable(v.and_(v.instance_of(int), v.ge(0)))), _offsets_fit])
    # At W > 1, of an entry every rank holds that nothing says is alike (checkpoint/replicas.py):
    # the digest of the whole entry as this rank held it, which rank 0 compared with every other
    # rank's before the commit. None (omitted) otherwise.
    digest: str | None = attrs.field(default=None, validator=v.optional(v.matches_re(DIGEST_HEX)))
    # (schema 2 and later) The sha256 of this slice's bytes in its shard file.
    sha256: str | None = attrs.field(default=None, validator=v.optional(v.matches_re(SHA256_HEX)))

    @property
    def rows(self) -> slice:
        """Where this slice sits along the whole tensor's first axis."""
        return slice(self.start, self.start + self.shape[0])

    @property
    def origin(self) -> tuple[int, ...]:
        """Its offset along every axis of the whole tensor."""
        return self.offsets if self.offsets is not None else (self.start, *(0 for _ in self.shape[1:]))

    @property
    def box(self) -> tuple[slice, ...]:
        """Where it sits in the whole tensor, one slice per axis."""
        return tuple(slice(o, o + n) for o, n in zip(self.origin, self.shape))


@attrs.frozen
class ShardEntry:
    """One shard file: who wrote it, its exact size and sha256 (hashed while written), its contents.

    Schema 2 and 3: the file is hashed in parts, ``header`` bytes (the safetensors header, its length
    included) hashing to ``header_sha256``, then each of ``holds`` in name order, back to back,
    hashing to its ``sha256``; ``sha256`` is then the root (``storage.digest.root``) of those
    digests, header first. Schema 1: ``sha256`` is the whole file's, and the parts are absent.

    ``file`` is a plain name (``PLAIN_NAME``, never ``.`` or ``..``), checked here and again by
    ``plan.plain_name`` before use, and the loader opens it with O_NOFOLLOW.
    """

    rank: int = attrs.field(validator=v.ge(0))
    file: str = attrs.field(validator=v.matches_re(PLAIN_NAME))
    size: int = attrs.field(validator=v.ge(0))
    sha256: str = attrs.field(validator=v.matches_re(SHA256_HEX))
    holds: tuple[TensorSlice, ...] = attrs.field(converter=tuple)
    header: int | None = attrs.field(default=None, validator=v.optional(v.ge(8)))
    header_sha256: str | None = attrs.field(default=None, validator=v.optional(v.matches_re(SHA256_HEX)))


@attrs.frozen
class Manifest:
    """``manifest.json``, written last into a checkpoint directory: the contract the loader checks.

    ``resharded_from`` is the sha256 of the source manifest's bytes when ``trainjob reshard``
    wrote this checkpoint, and None when training did.
    """

    schema: int = attrs.field(validator=v.in_(MANIFEST_SCHEMAS))
    step: int = attrs.field(validator=v.ge(0))
    attempt: int = attrs.field(validator=v.ge(1))
    world_size: int = attrs.field(validator=v.ge(1))
    loss_milli: int = attrs.field(validator=v.ge(0))
    tensors: tuple[TensorSpec, ...] = attrs.field(converter=tuple)
    shards: tuple[ShardEntry, ...] = attrs.field(converter=tuple)
    resharded_from: str | None = attrs.field(default=None,
                                              validator=v.optional(v.matches_re(SHA256_HEX)))


@attrs.frozen
class Session:
    """``ranks/session.json``: what rank 0 tells the other ranks about the current launch.

    ``generation`` grows by one with every launch of rank 0; a rank always follows the newest
    generation and discards work done for an older one. ``settings`` must equal the joining
    rank's own (steps, lr, data, ...), so every rank computes the same updates.
    """

    generation: int = attrs.field(validator=v.ge(1))
    world_size: int = attrs.field(validator=v.ge(1))
    attempt: int = attrs.field(validator=v.ge(1))
    from_step: int = attrs.field(validator=v.ge(0))
    checkpoint: str | None  # checkpoint directory name to resume from; None: start from zeros
    manifest_sha256: str | None
    settings: str


@attrs.frozen
class RankNote:
    """A rank's note for one generation: ``join`` (I am here) or ``stop`` (I stop after ``step``;
    ``signal`` is the signal this rank received, empty when it stops because a peer does)."""

    rank: int = attrs.field(validator=v.ge(0))
    step: int = attrs.field(validator=v.ge(0))
    signal: str = ""


@attrs.frozen
class Refusal:
    """A rank >= 1 ending the launch it trained in with exit 2 (a loss that is not a number, a
    state it cannot checkpoint): rank 0 logs it (``refused``) and ends every rank with 2, so the
    log says what the job's exit says, though only this rank saw the cause."""

    rank: int = attrs.field(validator=v.ge(1))
    step: int = attrs.field(validator=v.ge(0))
    message: str


@attrs.frozen
class Candidate:
    """A checkpoint rank 0 asks every rank to verify its share of before it resumes from it
    (the store's ``verify`` key: ranks/store.py's verdict round). ``nonce`` names the rank 0
    process asking, ``round`` the candidate, from newest; ``lend``: read into the live state's
    own arrays (rank 0 does, when a resume is due)."""

    nonce: str = attrs.field(validator=v.matches_re(r"[0-9a-f]{32}"))
    round: int = attrs.field(validator=v.ge(1))
    world_size: int = attrs.field(validator=v.ge(1))
    checkpoint: str = attrs.field(validator=v.matches_re(PLAIN_NAME))
    manifest_sha256: str | None = attrs.field(validator=v.optional(v.matches_re(SHA256_HEX)))
    lend: bool


@attrs.frozen
class Outcome:
    """How rank 0 ended a generation (0: before it published one): a final machine state, or
    ``error`` with its message; ``code`` is the exit code rank 0 ends with, which every other rank
    exits with too (75 for an error whose code rank 0 did not say)."""

    generation: int = attrs.field(validator=v.ge(0))
    state: str
    message: str = ""
    code: int = attrs.field(default=75, validator=v.in_((0, 1, 2, 70, 75)))


@attrs.frozen
class RunState:
    """Where the machine stood when this PVC was last written (``state.json``).

    ``lr`` and ``data_sha256`` pin what an in-flight attempt was training on, so a relaunch
    with other settings is refused instead of silently mixing two runs into one artifact.
    """

    state: str = attrs.field(validator=v.in_(PERSISTED_STATES))
    attempt: int = attrs.field(validator=v.ge(1))
    lr: float = attrs.field(validator=_finite)
    data_sha256: str = attrs.field(validator=v.matches_re(SHA256_HEX))


@attrs.frozen
class Score:
    """``correct`` predictions out of ``total``: what the gate compares, the holdout's against the
    frozen baseline's (``correct * 100 >= baseline_correct * (100 - max_drop)``, in integers)."""

    correct: int = attrs.field(validator=v.ge(0))
    total: int = attrs.field(validator=v.ge(0))

    def __str__(self) -> str:
        return f"{self.correct}/{self.total}"


@attrs.frozen
class Metric:
    """A metric the trained model scored (a validation loss, a perplexity, an accuracy) against
    the frozen ``baseline`` value it must hold up against: what ``Run.gate(metric=...)`` and the
    integrations' gates judge, with ``max_drop`` percent as the tolerance (the rule is
    ``engine/decisions.py``'s ``metric_counts``). ``higher_is_better``: False for a loss.
    ``name`` is how the verdict names it. Checked by the gate (exit 2), not here."""

    value: float
    baseline: float = attrs.field(kw_only=True)
    higher_is_better: bool = attrs.field(kw_only=True)
    name: str = attrs.field(default="metric", kw_only=True)

    def __str__(self) -> str:
        return f"{self.name} {self.value:.6g} vs baseline {self.baseline:.6g}"


def _values_fill_shape(inst: NamedArray, _attr: attrs.Attribute, value: tuple[float, ...]) -> None:
    if len(value) != math.prod(inst.shape):
        raise ValueError(f"'values' must hold {math.prod(inst.shape)} numbers for shape {list(inst.shape)}, "
                         f"got {len(value)}")


@attrs.frozen
class NamedArray:
    """One published array: its shape and its values in C order (floats, exact in JSON)."""

    name: str = attrs.field(validator=v.matches_re(PLAIN_NAME))
    shape: tuple[int, ...] = _shape()
    values: tuple[float, ...] = attrs.field(converter=tuple, validator=[_finite_items, _values_fill_shape])

    @classmethod
    def of(cls, name: str, array: Any) -> NamedArray:
        return cls(name=name, shape=tuple(array.shape), values=tuple(float(x) for x in array.ravel()))


@attrs.frozen
class Artifact:
    """The versioned model a passing run publishes as ``artifacts/model-v{attempt}.json``:
    the arrays the trainer exports (the linear trainer's: ``weights`` and ``bias``). Other
    trainers publish ``model-v{attempt}.safetensors``: the tensors, and this record with no
    ``arrays`` in the header's metadata."""

    attempt: int = attrs.field(validator=v.ge(1))
    step: int = attrs.field(validator=v.ge(0))
    trainer: str
    arrays: tuple[NamedArray, ...] = attrs.field(converter=tuple)
    holdout: Score
    baseline: Score


@attrs.frozen
class Event:
    """One line of the JSON-lines decision log.

    ``source`` says who decided: absent (None) for ``trainjob run`` itself, ``"supervisor"`` for
    ``trainjob supervise``. It is optional and omitted when None, so logs written before it
    existed still parse and the run's own lines keep their exact bytes.
    """

    ts: str
    event: str
    detail: str
    source: str | None = None


# The ``source`` of the lines ``trainjob supervise`` writes: ``status`` tells them from the run's.
SUPERVISOR = "supervisor"


# --- the converter -----------------------------------------------------------------------------

converter = cattrs.Converter(forbid_extra_keys=True)
converter.register_unstructure_hook(
    Event, make_dict_unstructure_fn(Event, converter, _cattrs_omit_if_default=True)
)
# A slice's ``offsets`` is written only when it says more than ``start`` (a DTensor's shard):
# a plain state's manifest keeps the bytes it always had.
converter.register_unstructure_hook(
    TensorSlice, make_dict_unstructure_fn(TensorSlice, converter, _cattrs_omit_if_default=True)
)
converter.register_unstructure_hook(  # a schema-1 receipt or manifest keeps its bytes
    ShardEntry, make_dict_unstructure_fn(ShardEntry, converter, _cattrs_omit_if_default=True)
)


def _strict(kind: type, accepts: tuple[type, ...]) -> None:
    def structure(value: Any, _type: type) -> Any:
        # bool is an int subclass in Python; JSON's true is never a number here.
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepts):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return kind(value)

    converter.register_structure_hook(kind, structure)


_strict(int, (int,))
_strict(float, (int, float))
_strict(str, (str,))
_strict(bool, (bool,))


def _describe(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return "required field is missing"
    if len(exc.args) > 1 and isinstance(exc.args[0], str) and exc.args[0]:  # attrs: (message, attr, ...)
        return exc.args[0]
    return str(exc) or type(exc).__name__


def structure(data: Any, cls: type[T], *, where: str) -> T:
    """Build ``cls`` from parsed JSON, or raise InputError naming ``where`` and the field."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return converter.structure(data, cls)
    except cattrs.BaseValidationError as exc:
        problems = cattrs.transform_error(exc, path=where, format_exception=_describe)
        raise InputError("; ".join(problems)) from None
    except (TypeError, ValueError) as exc:  # raised by an attrs validator in __init__
        raise InputError(f"{where}: {exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON")


def once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict (``object_pairs_hook``); ValueError when a key is given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        keys = [k for k, _ in pairs]
        twice = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise ValueError(f"key {twice!r} appears twice in one object")
    return out


# One decoder for every parse: json.loads with any keyword builds a new JSONDecoder per call,
# which was a quarter of `status`'s time on a log of a million lines.
_STRICT = json.JSONDecoder(parse_constant=_reject_constant)
# A record file (a manifest, the pointer, the state): a key given twice is refused, as in a shard's
# header, rather than the last one silently winning. Log lines keep the decoder above: the check
# costs a Python call per object, and `status` parses a million of them.
_RECORD = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=once_each)


def parse_json(text: str | bytes, *, where: str, once_each: bool = False) -> Any:
    """Parse strict JSON (no NaN/Infinity; with ``once_each``, no key twice in one object),
    raising InputError that names ``where``."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")  # json.loads would guess UTF-16/32 from the first bytes
        return (_RECORD if once_each else _STRICT).decode(text)
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:
        raise InputError(f"{where}: invalid JSON: {exc}") from None


def load(text: str | bytes, cls: type[T], *, where: str) -> T:
    """The record ``cls`` that ``text`` holds, or InputError naming ``where`` and the field.
    A log line (``Event``) is parsed as fast as it can be; every other record refuses a key
    given twice."""
    return structure(parse_json(text, where=where, once_each=cls is not Event), cls, where=where)


def dumps(record: Any) -> str:
    """Canonical JSON for a record: sorted keys, no spaces, exact float round-trip."""
    return json.dumps(converter.unstructure(record), sort_keys=True, separators=(",", ":"),
                      allow_nan=False)
