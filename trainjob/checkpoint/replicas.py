"""Replicated state at W > 1: which rank's copy of an entry a checkpoint keeps, and whether the
ranks' copies agree.

Every rank holds each array that is not a DTensor shard. A checkpoint writes it once, split
across ranks by rows (``plan.rank_holds``), which is right only when every rank's copy is the
same: otherwise a resume would read rows of one rank's copy beside rows of another's, a state
no rank ever held. So each such entry has one defined source (``state_tree.py`` marks them):

    kind        the entry                                      written
    alike       under a ``Replicated`` part (DDP's parameters)  split across ranks, not compared
    rank 0      ``FromRank0`` (DDP's buffers)                   whole, by rank 0 (``sources``)
    checked     any other                                      split across ranks, once every
                                                               rank's digest of it agrees
    shard       a DTensor's local shard                        by the ranks that hold it

A checked entry's digest (``digest``: the first 128 bits of the sha256 of its bytes, computed by
each rank over its own copy; the values never leave the rank) travels in the rank's receipt, on its slice of the entry
(``TensorSlice.digest``); rank 0 compares them (``disagreements``) before the commit and refuses
the checkpoint (``ReplicasDisagree``, exit 2) naming the entry and the ranks. Nothing is
committed, so no checkpoint ever holds a mix.

Pure: no I/O; ``digest`` reads an array's memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from ..records import ShardEntry

SOURCE = 0  # the rank whose copy of a FromRank0 entry is kept: DDP broadcasts rank 0's buffers


def sources(from_rank0: Iterable[str]) -> dict[str, int]:
    """``plan.rank_holds``' ``sources``: each FromRank0 entry, from rank 0."""
    return {name: SOURCE for name in from_rank0}


def digest(array: np.ndarray) -> str:
    """The digest of one rank's copy of an entry: the first 128 bits of the sha256 of its bytes
    (C-contiguous, as every state array is; sha256 measured faster than BLAKE2b here, 544 vs 402
    MiB/s). Its dtype and shape are the manifest's, the same on every rank."""
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()[:32]


def disagreements(entries: Sequence[ShardEntry]) -> dict[str, list[list[int]]]:
    """Of every entry some rank sent a digest of, the ones whose digests differ, by name: the
    ranks grouped by the copy they hold (each group in rank order, the groups by their first
    rank). A rank that sent none for an entry others did holds a copy of its own."""
    seen: dict[str, dict[str | None, list[int]]] = {}
    for entry in sorted(entries, key=lambda e: e.rank):
        for h in entry.holds:
            if h.digest is not None:
                seen.setdefault(h.name, {})
    for entry in sorted(entries, key=lambda e: e.rank):
        for h in entry.holds:
            if h.name in seen:
                seen[h.name].setdefault(h.digest, []).append(entry.rank)
    return {name: sorted(groups.values()) for name, groups in sorted(seen.items()) if len(groups) > 1}


def _ranks(group: list[int]) -> str:
    return f"rank {group[0]}" if len(group) == 1 else "ranks " + ", ".join(map(str, group))


def refusal(step: int, found: dict[str, list[list[int]]]) -> str:
    """The one line a disagreement is refused with: the first entry (by name), which ranks hold
    which copy, how many more entries differ, and what to do."""
    name = next(iter(found))
    groups = found[name]
    held = " and ".join(_ranks(g) for g in groups[:3]) + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")
    more = f" (and {len(found) - 1} more entr{'y' if len(found) == 2 else 'ies'})" if len(found) > 1 else ""
    return (f"step {step}: the state's entry {name}{more} differs between ranks ({held} hold different "
            "values): a checkpoint written from both would mix them, so nothing was committed; keep it equal on "
            "every rank (broadcast or all-reduce it), or hand it out as trainjob.torch.FromRank0(array) to keep "
            "rank 0's copy, or in a RankLocal part to keep each rank's own (TrainingState does "
            "this for DDP's buffers when it is given the DDP-wrapped model)")
