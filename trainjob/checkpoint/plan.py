"""Pure checkpoint policy: how state splits across ranks, how a reshard moves it, which
checkpoint to resume from, which to delete, and whether a manifest is self-consistent.

No I/O, no clock, no globals: every function takes plain values (names, manifests, a verify
callback) and returns plain values, so each policy is tested in isolation, with hypothesis.
``store.py`` does the I/O and asks these functions what to do.

The split rule (documented in docs/checkpoints.md): every tensor is split along its first axis
into ``world_size`` contiguous ranges, rank ``r`` owning rows ``[r*n//W, (r+1)*n//W)``. For the
linear trainer the state is one tensor ``params = [w0, w1, w2, bias]`` (float64), so at W=2 rank
0 owns ``w0, w1`` and rank 1 owns ``w2, bias``; at W > 4 some ranks own an empty slice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import attrs

from ..records import DTYPE_BYTES, PLAIN_NAME, Manifest, TensorSlice, TensorSpec

MANIFEST = "manifest.json"
MAX_WORLD_SIZE = 64  # the local launcher starts this many processes at most; sanity, not physics
_NAME = re.compile(r"step-(\d{8})-a(\d{4})-w(\d{3})")


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


def plan_shards(tensors: Sequence[TensorSpec], world_size: int) -> list[tuple[TensorSlice, ...]]:
    """What each rank's shard holds: its row range of every tensor (the documented split)."""
    per_rank: list[list[TensorSlice]] = [[] for _ in range(world_size)]
    for t in tensors:
        for rank, (start, stop) in enumerate(split_rows(t.shape[0], world_size)):
            per_rank[rank].append(TensorSlice(name=t.name, dtype=t.dtype, shape=(stop - start, *t.shape[1:]),
                                              start=start))
    return [tuple(p) for p in per_rank]


@attrs.frozen
class Piece:
    """Copy ``rows`` rows of ``tensor`` from source rank ``src_rank`` (at row ``src_row`` of its
    slice) to row ``dest_row`` of the destination rank's slice."""

    tensor: str
    src_rank: int
    src_row: int
    dest_row: int
    rows: int

    @property
    def src_rows(self) -> slice:
        return slice(self.src_row, self.src_row + self.rows)

    @property
    def dest_rows(self) -> slice:
        return slice(self.dest_row, self.dest_row + self.rows)


def plan_reshard(source: Manifest, world_size: int) -> list[tuple[Piece, ...]]:
    """For each destination rank, the pieces of source shards that make up its new shard.

    The destination layout is ``plan_shards(source.tensors, world_size)``: a resharded
    checkpoint is indistinguishable from one written by ``world_size`` ranks in the first place.
    """
    plan: list[tuple[Piece, ...]] = []
    for dest_slices in plan_shards(source.tensors, world_size):
        pieces = []
        for dest in dest_slices:
            d = dest.rows
            for shard in source.shards:
                for src in shard.holds:
                    if src.name != dest.name:
                        continue
                    s = src.rows
                    lo, hi = max(d.start, s.start), min(d.stop, s.stop)
                    if lo < hi:
                        pieces.append(Piece(tensor=dest.name, src_rank=shard.rank, src_row=lo - s.start,
                                            dest_row=lo - d.start, rows=hi - lo))
        plan.append(tuple(pieces))
    return plan


def manifest_problems(m: Manifest, name: str | None = None) -> list[str]:
    """Everything that makes a (schema-valid) manifest inconsistent; empty when it is sound.

    Ranks are exactly 0..W-1, file names plain and distinct, and each shard holds exactly the
    documented split of every tensor, so the shards partition the state with no gap or overlap.
    ``name`` is the checkpoint directory's name, which must agree with the manifest.
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
    expected = plan_shards(m.tensors, m.world_size)
    for shard in m.shards:
        if shard.holds != expected[shard.rank]:
            problems.append(f"rank {shard.rank}'s shard does not hold its documented slice of the state")
        elif (claimed := sum(slice_bytes(h) for h in shard.holds)) + 8 > shard.size:
            problems.append(f"rank {shard.rank}'s tensors need {claimed} bytes, more than its {shard.size}-byte file")
    return problems


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
