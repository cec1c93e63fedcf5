"""Pure checkpoint policy: how state splits across ranks, how a reshard moves it, which
checkpoint to resume from, which to delete, and whether a manifest is self-consistent.

No I/O, no clock, no globals: every function takes plain values (names, manifests, a verify
callback) and returns plain values, so each policy is tested in isolation, with hypothesis.
``store.py`` does the I/O and asks these functions what to do.

The split rule (documented in docs/checkpoints.md): every tensor is split along its first axis
into ``world_size`` contiguous ranges, rank ``r`` owning rows ``[r*n//W, (r+1)*n//W)``. A
DTensor's local shard is split the same way among the ranks that hold it alike (``rank_holds``),
and a load reads, by offsets, the parts of saved slices that overlap what it wants (``plan_reads``). For the
linear trainer the state is one tensor ``params = [w0, w1, w2, bias]`` (float64), so at W=2 rank
0 owns ``w0, w1`` and rank 1 owns ``w2, bias``; at W > 4 some ranks own an empty slice.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence

import attrs

from ..records import DTYPE_BYTES, PLAIN_NAME, Manifest, ShardEntry, TensorSlice, TensorSpec
from ..storage.digest import root

MANIFEST = "manifest.json"
# A shard header's metadata key (manifest schema 3): where each of its slices sits in which tensor
# (``placement``), hashed with the shard, so no manifest can say otherwise unnoticed.
SLICES_KEY = "trainjob.slices"
# In a sharded state (some DTensor), a plain tensor up to this size (an optimizer's step counter,
# a norm's buffer) is written whole by rank 0: every rank reads all of it on a resume anyway, and
# so finds every such entry in one place (rank 0's shard, whose header it reads for the plain
# values) instead of opening every other rank's shard for a few bytes.
SMALL_BYTES = 64 << 10
MAX_WORLD_SIZE = 64  # the local launcher starts this many processes at most; sanity, not physics
# The most bytes a tensor's shape may span, each zero dimension counted as 1: numpy refuses to make
# an array (even an empty one) whose dimensions, zeros aside, multiply past what an index counts
# ("array is too big"), so a manifest naming such a shape is corrupt, not a crash (70) at load.
MAX_EXTENT = 1 << 62
_NAME = re.compile(r"step-(\d{8})-a(\d{4})-w(\d{3})")  # at most defaults.MAX_STEP and MAX_ATTEMPT


# --- names -------------------------------------------------------------------------------------

@attrs.frozen(order=True)
class Ref:
    """A committed checkpoint directory, identified by its name (step, attempt, world size)."""

    attempt: int
    step: int
    world_size: int

    @property
    def name(self) -> str:
        return f"step-{self.step:08d}-a{self.attempt:04d}-w{self.world_size:03d}"

    @classmethod
    def parse(cls, name: str) -> Ref | None:
        m = _NAME.fullmatch(name)
        if not m:
            return None
        step, attempt, world = map(int, m.groups())
        return cls(attempt=attempt, step=step, world_size=world) if attempt >= 1 and world >= 1 else None


def world_size_problem(world_size: int) -> str | None:
    """Why ``world_size`` cannot be used (the one bound ``run``, ``reshard`` and ``k8s render``
    share), or None."""
    if 1 <= world_size <= MAX_WORLD_SIZE:
        return None
    return f"--world-size must be from 1 to {MAX_WORLD_SIZE}, got {world_size}"


def plain_name(name: str) -> bool:
    """A file name that stays inside its directory: no separator, no ``..``, not absolute."""
    return re.fullmatch(PLAIN_NAME, name) is not None


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


# --- the split ---------------------------------------------------------------------------------

def split_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous, balanced ``[start, stop)`` row ranges, one per rank, covering ``0..rows``."""
    return [(r * rows // world_size, (r + 1) * rows // world_size) for r in range(world_size)]


@attrs.frozen
class Local:
    """What one rank holds of one tensor: the box at ``origin`` (one offset per axis) of extent
    ``shape`` in the whole tensor, held alike by ``replicas`` ranks, this one being number
    ``replica`` of them. A plain tensor is the whole box, held by all ``W`` ranks; a DTensor's is
    its local shard (``snapshot.py`` reads it from the placements), its replicas the ranks along
    the mesh axes it is replicated on."""

    origin: tuple[int, ...]
    shape: tuple[int, ...]
    replica: int
    replicas: int


def rank_holds(tensors: Sequence[TensorSpec], world_size: int, rank: int,
               local: Mapping[str, Local] | None = None,
               sources: Mapping[str, int] | None = None) -> tuple[TensorSlice, ...]:
    """What rank ``rank``'s shard holds: of every tensor, its replica's row range of the box it
    holds (``local``, by name; a tensor not in it is held whole by every rank). So what several
    ranks hold alike is written once, split along its first axis as the documented rule says,
    and a DTensor's shard is written by the ranks that hold it, never gathered.

    ``sources``: tensors every rank holds but whose copies may differ (DDP's buffers), by name,
    with the one rank whose copy the checkpoint keeps: that rank writes it whole and every other
    an empty slice, so no checkpoint holds rows of one rank's copy beside another's. When
    ``local`` holds some DTensor, a plain tensor of at most ``SMALL_BYTES`` is written whole by
    rank 0 the same way."""
    out = []
    for t in tensors:
        box = (local or {}).get(t.name) or Local(origin=(0,) * len(t.shape), shape=t.shape, replica=rank,
                                                 replicas=world_size)
        source = (sources or {}).get(t.name)
        if source is None and local and t.name not in local and DTYPE_BYTES[t.dtype] * math.prod(t.shape) <= SMALL_BYTES:
            source = 0
        if source is not None and t.name not in (local or {}):
            rows = t.shape[0] if rank == source else 0
            out.append(TensorSlice(name=t.name, dtype=t.dtype, shape=(rows, *t.shape[1:]), start=0))
            continue
        start, stop = split_rows(box.shape[0], box.replicas)[box.replica]
        origin = (box.origin[0] + start, *box.origin[1:])
        out.append(TensorSlice(name=t.name, dtype=t.dtype, shape=(stop - start, *box.shape[1:]), start=origin[0],
                               offsets=origin if any(origin[1:]) else None))
    return tuple(out)


def plan_shards(tensors: Sequence[TensorSpec], world_size: int) -> list[tuple[TensorSlice, ...]]:
    """What each rank's shard holds when every rank holds the whole state: its row range of every
    tensor (the documented split)."""
    return [rank_holds(tensors, world_size, rank) for rank in range(world_size)]


Span = tuple[tuple[int, int], ...]  # one [start, stop) per axis


def _meet(a_origin: Sequence[int], a_shape: Sequence[int], b_origin: Sequence[int],
          b_shape: Sequence[int]) -> Span | None:
    """Where two boxes of one tensor overlap, in the tensor's coordinates; None if they do not."""
    span = tuple((max(ao, bo), min(ao + an, bo + bn)) for ao, an, bo, bn in zip(a_origin, a_shape, b_origin, b_shape))
    return span if all(lo < hi for lo, hi in span) else None


@attrs.frozen
class Piece:
    """Copy the part ``src`` (one ``[start, stop)`` per axis, in the coordinates of the slice
    rank ``src_rank``'s shard holds of ``tensor``) to the part ``dest`` of the destination."""

    tensor: str
    src_rank: int
    src: Span
    dest: Span

    @property
    def src_index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.src)

    @property
    def dest_index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.dest)

    @property
    def size(self) -> int:
        return math.prod(b - a for a, b in self.src)


def plan_reads(source: Manifest, wanted: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> list[Piece]:
    """Where each wanted box (``{name: (origin, shape)}`` in the whole tensor) comes from: the
    parts of the saved slices that overlap it, and nothing else. The reshard-by-offsets rule
    (docs/checkpoints.md): the manifest's slices partition each tensor (``manifest_problems``),
    so the pieces fill every wanted element exactly once, whatever world size or placements
    wrote them and whatever reads them."""
    pieces = []
    for shard in source.shards:
        for src in shard.holds:
            want = wanted.get(src.name)
            if want is None:
                continue
            origin, shape = want
            span = _meet(src.origin, src.shape, origin, shape)
            if span is not None:
                pieces.append(Piece(tensor=src.name, src_rank=shard.rank,
                                    src=tuple((lo - o, hi - o) for (lo, hi), o in zip(span, src.origin)),
                                    dest=tuple((lo - o, hi - o) for (lo, hi), o in zip(span, origin))))
    return pieces


def plan_reshard(source: Manifest, world_size: int) -> list[tuple[Piece, ...]]:
    """For each destination rank, the pieces of source shards that make up its new shard.

    The destination layout is ``plan_shards(source.tensors, world_size)``: a resharded
    checkpoint is indistinguishable from one written by ``world_size`` plain ranks in the first
    place (a DTensor's checkpoint included: ``plan_reads`` loads it into any sharding).
    """
    return [tuple(plan_reads(source, {h.name: (h.origin, h.shape) for h in dest}))
            for dest in plan_shards(source.tensors, world_size)]


def coverage_problems(tensors: Sequence[TensorSpec], shards: Sequence[ShardEntry]) -> list[str]:
    """Whether the shards' slices partition every tensor: each inside its tensor, with its dtype,
    no two overlapping, and together as many elements as the tensor has (so no gap either)."""
    problems: list[str] = []
    by_name = {t.name: t for t in tensors}
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {n: [] for n in by_name}
    for shard in shards:
        if len({h.name for h in shard.holds}) != len(shard.holds):
            problems.append(f"rank {shard.rank}'s shard holds one tensor twice")
        for h in shard.holds:
            t = by_name.get(h.name)
            if t is None:
                problems.append(f"rank {shard.rank}'s shard holds {h.name}, which the manifest does not list")
            elif h.dtype != t.dtype or len(h.shape) != len(t.shape) or any(
                    o + n > whole for o, n, whole in zip(h.origin, h.shape, t.shape)):
                problems.append(f"rank {shard.rank}'s slice of {h.name} ({h.dtype}{list(h.shape)} at "
                                f"{list(h.origin)}) does not fit the tensor ({t.dtype}{list(t.shape)})")
            elif math.prod(h.shape):
                boxes[h.name].append((h.origin, h.shape))
    if problems:
        return problems
    for name, found in boxes.items():
        total, held = math.prod(by_name[name].shape), sum(math.prod(s) for _, s in found)
        if held != total:
            problems.append(f"{name}: the shards hold {held} of its {total} elements (a gap or an overlap)")
            continue
        found.sort()
        active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for origin, shape in found:  # a sweep along the first axis: only boxes still open can meet
            active = [a for a in active if a[0][0] + a[1][0] > origin[0]]
            if any(_meet(o, s, origin, shape) for o, s in active):
                problems.append(f"{name}: two shards hold the same elements")
                break
            active.append((origin, shape))
    return problems


def manifest_problems(m: Manifest, name: str | None = None) -> list[str]:
    """Everything that makes a (schema-valid) manifest inconsistent; empty when it is sound.

    Ranks are exactly 0..W-1, file names plain and distinct, and the shards' slices partition
    every tensor with no gap or overlap (``coverage_problems``): the documented split for a
    plain state, each rank's local shards for a DTensor's. ``name`` is the checkpoint
    directory's name, which must agree with the manifest.
    """
    problems = []
    if name is not None and Ref.parse(name) != Ref(attempt=m.attempt, step=m.step, world_size=m.world_size):
        problems.append(f"directory name {name} disagrees with step/attempt/world_size in the manifest")
    # Bounds before any work sized from the manifest: the world size is checked against the shards
    # actually listed before a range of it is built, and every list below is at most that long.
    if (problem := world_size_problem(m.world_size)) is not None or len(m.shards) != m.world_size:
        problems.append(f"world_size {m.world_size} is not the {len(m.shards)} shard(s) listed"
                        if problem is None else f"world_size: {problem.removeprefix('--world-size ')}")
        return problems
    if sorted(s.rank for s in m.shards) != list(range(m.world_size)):
        problems.append(f"shards must be ranks 0..{m.world_size - 1} once each, "
                        f"got {sorted(s.rank for s in m.shards)}")
        return problems
    files = [s.file for s in m.shards]
    for f in files:
        if not plain_name(f) or f == MANIFEST:
            problems.append(f"shard file name {f!r} is not a plain file name")
    if len(set(files)) != len(files):
        problems.append("two shards name the same file")
    if len({t.name for t in m.tensors}) != len(m.tensors):
        problems.append("two tensors have the same name")
        return problems
    for t in m.tensors:  # a slice fits inside its tensor (coverage_problems), so bounding these bounds all
        if DTYPE_BYTES[t.dtype] * math.prod(n or 1 for n in t.shape) >= MAX_EXTENT:
            problems.append(f"{t.name}'s shape {list(t.shape)} is beyond what an array can hold")
    if problems:
        return problems
    problems += coverage_problems(m.tensors, m.shards)
    for shard in m.shards:
        if (claimed := sum(slice_bytes(h) for h in shard.holds)) + 8 > shard.size:
            problems.append(f"rank {shard.rank}'s tensors need {claimed} bytes, more than its {shard.size}-byte file")
        parted = [shard.header is not None, shard.header_sha256 is not None, *(h.sha256 is not None for h in shard.holds)]
        if m.schema >= 2 and not all(parted):
            problems.append(f"rank {shard.rank}'s shard lacks the part digests schema {m.schema} has")
        elif m.schema < 2 and any(parted):
            problems.append(f"rank {shard.rank}'s shard has part digests, which schema {m.schema} has not")
        elif m.schema >= 2 and shard.header is not None and shard.header + claimed != shard.size:
            problems.append(f"rank {shard.rank}'s header ({shard.header} bytes) and tensors ({claimed}) are not "
                            f"its {shard.size}-byte file")
        elif (parts := part_digests(shard)) is not None and shard.sha256 != root(parts):
            # A whole-file reader checks the root, a reader of one slice its digest: they must agree.
            problems.append(f"rank {shard.rank}'s sha256 is not the root of its part digests")
    return problems


def part_digests(shard: ShardEntry) -> list[str] | None:
    """(schema 2 and later) A shard's part digests in file order, the header's first: what its
    ``sha256`` is the root of (``storage.digest.root``); None for a shard without them."""
    if shard.header_sha256 is None or any(h.sha256 is None for h in shard.holds):
        return None
    return [shard.header_sha256, *(h.sha256 or "" for h in sorted(shard.holds, key=lambda h: h.name))]


# --- what a shard's own header proves of its manifest ---------------------------------------------

def placement(holds: Sequence[TensorSlice], tensors: Sequence[TensorSpec]) -> dict[str, dict[str, list[int]]]:
    """Where each slice sits, as a shard's header says it (``SLICES_KEY``, schema 3): by name, its
    offset along every axis of its tensor and that tensor's whole shape. With the name, dtype and
    shape the header gives each tensor anyway, everything a load takes from a slice's entry."""
    whole = {t.name: list(t.shape) for t in tensors}
    return {h.name: {"offsets": list(h.origin), "whole": whole.get(h.name, [])} for h in holds}


def placement_text(holds: Sequence[TensorSlice], tensors: Sequence[TensorSpec]) -> str:
    return json.dumps(placement(holds, tensors), sort_keys=True, separators=(",", ":"))


def header_problem(m: Manifest, shard: ShardEntry, meta: Mapping[str, str]) -> str | None:
    """Why a shard's header metadata (hashed with the shard: no edit of the manifest beside it can
    change it) disagrees with what manifest ``m`` says of that shard; None when it agrees.

    Every shard trainjob ever wrote says its rank, world size and step; from schema 3 it says
    where each slice sits too (``placement``), and whenever it does, the manifest must say the
    same. So a manifest that moves a slice, or hands a shard to another rank, is refused by every
    reader, whichever checkpoint it is and whatever vouches for it."""
    for key, value in (("rank", shard.rank), ("world_size", m.world_size), ("step", m.step)):
        if meta.get(key) != str(value):
            return f"its header says {key} {meta.get(key)}, the manifest {value}"
    said = meta.get(SLICES_KEY)
    if said is None:
        return f"its header does not say where its slices sit, as schema {m.schema} has it" if m.schema >= 3 else None
    try:
        places = json.loads(said)
    except (ValueError, RecursionError):
        places = None
    want = placement(shard.holds, m.tensors)
    if places != want:
        name = next((n for n in sorted(want) if not isinstance(places, dict) or places.get(n) != want[n]),
                    "a tensor the manifest does not list")
        there = places.get(name) if isinstance(places, dict) else None
        return f"its header puts {name} at {there}, the manifest at {want.get(name)}"
    return None


def unpinned(m: Manifest) -> list[str]:
    """(schema 1 and 2, whose shard headers say each slice's rank and shape but not where it sits)
    The tensors whose slices' places those headers do not pin down: a tensor is pinned when its
    non-empty slices are whole rows, back to back from row 0 in the order of the ranks holding
    them (the documented split; a DTensor's Shard(0) on one mesh axis; a tensor one rank writes
    whole), since each rank's row count then fixes every start. Any other place (Shard(1), a 2-D
    mesh) only a sha256 recorded elsewhere can vouch for (``checkpoint.json``'s, of the newest)."""
    out, by_rank = [], [{h.name: h for h in s.holds} for s in sorted(m.shards, key=lambda s: s.rank)]
    for t in m.tensors:
        row = 0
        for holds in by_rank:
            h = holds.get(t.name)
            if h is None or not math.prod(h.shape):
                continue
            if h.origin != (row, *(0 for _ in h.shape[1:])) or h.shape[1:] != t.shape[1:]:
                out.append(t.name)
                break
            row += h.shape[0]
    return out


def slice_offsets(shard: ShardEntry) -> list[tuple[TensorSlice, int]]:
    """(schema 2) Each slice of a shard with its byte offset in the file: after the header, in
    name order, back to back, as ``shards.encode`` writes them."""
    assert shard.header is not None
    out, at = [], shard.header
    for h in sorted(shard.holds, key=lambda h: h.name):
        out.append((h, at))
        at += slice_bytes(h)
    return out


def slice_bytes(s: TensorSlice) -> int:
    """The bytes a slice's data takes in a shard (its header aside). Widths come from
    records.DTYPE_BYTES, not from a code's digits (BF16's are not its width alone)."""
    return DTYPE_BYTES[s.dtype] * math.prod(s.shape)


# --- which checkpoint to resume from -----------------------------------------------------------

@attrs.frozen
class ResumePick:
    """``chosen``: resume from it. ``mismatch``: the newest verified step exists only for another
    world size. Neither and ``rejected`` non-empty: nothing verifies. ``rejected`` lists every
    checkpoint tried and refused, newest first, with the reason."""

    chosen: Ref | None = None
    mismatch: Ref | None = None
    rejected: tuple[tuple[Ref, str], ...] = ()


def pick_resume(refs: Sequence[Ref], attempt: int, world_size: int,
                verify: Callable[[Ref], str | None]) -> ResumePick:
    """The newest checkpoint of ``attempt`` that verifies, preferring this world size.

    Walks steps from newest to oldest and calls ``verify`` (which returns a reason, or None when
    the checkpoint is sound) lazily, stopping at the first step with a sound checkpoint. If that
    step is sound only for another world size, report a mismatch rather than falling back to an
    older step: falling back would silently throw away training the operator can keep by
    resharding.
    """
    rejected: list[tuple[Ref, str]] = []
    mine = sorted((r for r in refs if r.attempt == attempt),
                  key=lambda r: (-r.step, r.world_size != world_size, r.world_size))
    steps = sorted({r.step for r in mine}, reverse=True)
    for step in steps:
        other: Ref | None = None
        for ref in (r for r in mine if r.step == step):
            reason = verify(ref)
            if reason is not None:
                rejected.append((ref, reason))
            elif ref.world_size == world_size:
                return ResumePick(chosen=ref, rejected=tuple(rejected))
            elif other is None:
                other = ref
        if other is not None:
            return ResumePick(mismatch=other, rejected=tuple(rejected))
    return ResumePick(rejected=tuple(rejected))


# --- rotation ----------------------------------------------------------------------------------

def newest_first(refs: Sequence[Ref], world_size: int) -> list[Ref]:
    """Newest attempt, then newest step; at equal step, this world size counts as newer."""
    return sorted(refs, key=lambda r: (r.attempt, r.step, r.world_size == world_size, -r.world_size),
                  reverse=True)


def to_rotate(refs: Sequence[Ref], keep: int, world_size: int, protect: Ref | None) -> list[Ref]:
    """The committed checkpoints to delete so that ``keep`` remain, oldest first.

    ``protect`` (the newest checkpoint known to verify) is never deleted, even when ``keep``
    newer-looking ones exist: they may be damaged, and it may be the only one that loads.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    ordered = newest_first(refs, world_size)
    return [r for r in reversed(ordered[keep:]) if r != protect]
