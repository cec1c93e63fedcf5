"""Sharded checkpoints on the PVC: stage, commit, list, verify, load, rotate and clean up.

Layout under ``P/checkpoints/`` (names are fixed width, so they sort by step):

    step-00000004-a0001-w002/            committed: manifest.json exists (it is written last)
        shard-00000-of-00002.safetensors
        shard-00001-of-00002.safetensors
        manifest.json
    .tmp-step-00000006-a0001-w002.g00000003/   being built by launch (generation) 3, or abandoned
        shard-00001-of-00002.safetensors
        shard-00001-of-00002.receipt.json   rank 1's size + sha256, read by rank 0, then removed
    .trash-step-00000002-a0001-w002      being deleted by rotation (renamed first, so a half-deleted
                                         directory never looks committed)
    rejected-step-00000008-a0001-w002    set aside by a resume because it failed verification;
                                         kept for inspection, never loaded, never deleted by trainjob

Three classes, by who calls them (as torch.distributed.checkpoint's StorageWriter says of each
method, "(all ranks)" or "(coordinator)"): ``CheckpointStore`` reads (any process), ``ShardWriter``
writes one rank's shard (every rank), ``Committer`` commits, rotates and cleans up (rank 0, the coordinator).

This module does the I/O; every choice (what to resume from, what to delete, whether a manifest
is consistent) is asked of the pure functions in ``plan.py``. Writes go through
the PVC's ``storage.backend.Backend`` only (``write_part`` for shards, inside what ``stage``
gives; ``write`` for receipts; ``publish`` for the manifest and the commit), so the same code
serves a directory and a bucket; docs/checkpoints.md says what each backend's commit is.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from . import plan
from . import shards
from .snapshot import LOCAL_KEY, PLAIN_KEY, HostArrays
from ..errors import InputError, NoSpace, StateMismatch, os_errors
from .plan import MANIFEST, Ref
from ..storage.deletion import TMP
from ..storage.pvc import Pvc, record_bytes
from ..records import CheckpointPointer, Manifest, ShardEntry, TensorSlice, TensorSpec, dumps, load
from ..tensors import np_dtype, tensor_specs

RECEIPT = ".receipt.json"
REJECTED = "rejected-"


def _destinations(specs: tuple[TensorSpec, ...], into: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An array to read each tensor into: ``into``'s own where it fits exactly, else a new one.

    A lent array must be C-contiguous and writable, and must not overlap one already chosen (a
    trainer may hand out the same buffer under two names). np.empty is enough for a new one:
    every byte is overwritten, since the shards partition the state (manifest_problems).
    """
    chosen: dict[str, np.ndarray] = {}
    for t in specs:
        a, dtype = into.get(t.name), np_dtype(t.dtype)
        fits = (isinstance(a, np.ndarray) and a.shape == tuple(t.shape) and a.dtype == dtype
                and a.flags.c_contiguous and a.flags.writeable
                and not any(np.may_share_memory(a, b) for b in chosen.values()))
        chosen[t.name] = a if fits else np.empty(t.shape, dtype=dtype)
    return chosen


def local_parts(holds: tuple[TensorSlice, ...], host: HostArrays) -> dict[str, np.ndarray]:
    """Each slice's values, as views of this rank's arrays: the whole tensor's rows, or (a
    DTensor's) the part of its local shard, which sits at ``host.boxes[name].origin``."""
    out = {}
    for h in holds:
        box = host.boxes.get(h.name)
        base = box.origin if box is not None else (0,) * len(h.shape)
        out[h.name] = host[h.name][tuple(slice(o - b, o - b + n) for o, b, n in zip(h.origin, base, h.shape))]
    return out


def _place(view: np.ndarray, h: TensorSlice) -> np.ndarray | list:
    """Where a slice's bytes go: straight into ``view`` when it is contiguous (whole rows), else
    (a column block of a DTensor's Shard(1)) through ``read_verified``'s bounded buffer."""
    return view if view.flags.c_contiguous else [(tuple(slice(0, n) for n in h.shape), view)]


def expected_sha256(pointer: CheckpointPointer | None, ref: Ref) -> str | None:
    """The sha256 ``checkpoint.json`` recorded for ``ref``'s manifest when it names ``ref``: what
    every reader of that checkpoint checks its manifest against (None: it names another)."""
    return pointer.manifest_sha256 if pointer is not None and pointer.dir == f"checkpoints/{ref.name}" else None


@attrs.frozen
class Verification:
    """What ``verify`` found: ``reason`` is None when the checkpoint is sound. ``tensors`` is the
    whole state when it was asked for (``load=True``) and everything verified, else None."""

    manifest: Manifest | None
    sha256: str | None
    reason: str | None
    tensors: dict[str, np.ndarray] | None = attrs.field(default=None, eq=False, repr=False)
    metadata: dict[int, dict[str, str]] | None = attrs.field(default=None, eq=False, repr=False)  # by rank


@attrs.frozen
class Loaded:
    ref: Ref
    manifest: Manifest
    manifest_sha256: str
    tensors: dict[str, np.ndarray]
    metadata: dict[int, dict[str, str]] = attrs.field(factory=dict)  # each rank's shard header metadata

    @property
    def size(self) -> int:
        return sum(s.size for s in self.manifest.shards)

    def documents(self, rank: int) -> tuple[str | None, str | None]:
        """The plain values (rank 0's shard) and rank ``rank``'s rank-local state, as JSON text."""
        return self.metadata.get(0, {}).get(PLAIN_KEY), self.metadata.get(rank, {}).get(LOCAL_KEY)


class CheckpointStore:
    """The ``checkpoints/`` directory of one PVC, as any process reads it: list, verify, load.

    Read-only (``trainjob verify`` uses it beside a running job). What a rank writes at a
    checkpoint is ``ShardWriter``'s; what only rank 0 writes is ``Committer``'s.
    """

    def __init__(self, pvc: Pvc) -> None:
        self.pvc, self.backend = pvc, pvc.backend
        self.root = pvc.root / "checkpoints"

    def path(self, ref: Ref) -> Path:
        return self.root / ref.name

    def rel(self, path: Path) -> str:
        return self.pvc.key(path)

    # --- listing -----------------------------------------------------------------------------

    def entries(self) -> list[str]:
        return self.backend.list("checkpoints")

    def committed(self) -> list[Ref]:
        """Every published checkpoint, by its name (its manifest is checked by ``verify``)."""
        published = self.backend.published("checkpoints", MANIFEST)
        return [ref for name in published if (ref := Ref.parse(name)) is not None]

    # --- verification and loading --------------------------------------------------------------

    def read_manifest(self, ref: Ref, sizes: bool = True, expect_sha256: str | None = None) -> tuple[Manifest, str]:
        """The manifest and the sha256 of its bytes; InputError naming the problem. ``sizes``:
        check every shard file's size first (a rank reading only its share checks the size of
        each file it opens instead: W stat calls, or bucket requests, per rank add up).
        ``expect_sha256``: the sha256 its bytes must have (``checkpoint.json``'s, or that of a
        manifest verified before); a schema-1 or 2 manifest nothing vouches for so must place
        every slice where its shards' headers pin it down (``plan.unpinned``)."""
        directory = self.path(ref)
        if self.pvc.local:  # a bucket has no directories, and no links to follow
            st = None
            # Not lexists() then lstat(): rotation may take it away in between (verify runs beside
            # a job). Any other OSError (EIO) is storage trouble (75), never "missing".
            with os_errors(self.rel(directory), "cannot stat it", InputError):
                try:
                    st = os.lstat(directory)
                except FileNotFoundError:
                    pass
            if st is None:
                raise InputError(f"{self.rel(directory)}: missing")
            if not stat.S_ISDIR(st.st_mode):
                raise InputError(f"{self.rel(directory)}: not a directory (a symlink is never followed)")
        path = directory / MANIFEST
        raw = self.pvc.read_bytes(path)
        if raw is None:
            raise InputError(f"{self.rel(path)}: missing: the checkpoint was never committed")
        manifest, sha = load(raw, Manifest, where=self.rel(path)), hashlib.sha256(raw).hexdigest()
        if expect_sha256 is not None and sha != expect_sha256:
            raise InputError(f"{self.rel(path)}: differs from the manifest checkpoint.json recorded (sha256 "
                             f"{expect_sha256[:12]}...)")
        problems = plan.manifest_problems(manifest, ref.name) or (self._size_problems(directory, manifest)
                                                                  if sizes else [])
        if problems:
            raise InputError(f"{self.rel(path)}: {'; '.join(problems)}")
        if manifest.schema < 3 and expect_sha256 is None and (loose := plan.unpinned(manifest)):
            raise InputError(f"{self.rel(path)}: schema {manifest.schema}'s shard headers cannot say where the "
                             f"slices of {', '.join(loose)} sit, and no sha256 recorded elsewhere vouches for this "
                             "manifest (checkpoint.json names another checkpoint): refused rather than trusted")
        return manifest, sha

    def _size_problems(self, directory: Path, manifest: Manifest) -> list[str]:
        """Each shard file's size on disk against the manifest's, before anything is sized from
        the manifest: with ``manifest_problems`` (its tensors fit in its shards' sizes), no
        allocation can exceed the bytes actually on the PVC."""
        problems = []
        for shard in manifest.shards:
            try:
                actual = self.backend.size(self.rel(directory / shard.file))
            except OSError as exc:
                problems.append(shards.unreadable(directory / shard.file, exc, "cannot stat"))
                continue
            if actual is None:
                problems.append(f"{shard.file}: No such file or directory")
            elif actual != shard.size:
                problems.append(f"{shard.file}: {actual} bytes, the manifest says {shard.size}")
        return problems

    def check_files(self, ref: Ref, manifest: Manifest, into: Mapping[str, np.ndarray] | None = None,
                    metadata: dict[int, dict[str, str]] | None = None) -> str | None:
        """Size and sha256 of every shard, one thread per shard; and no file beside them.

        With ``into`` (the whole state's arrays), each shard is read straight into its rows while
        it is hashed, and its header is checked against the manifest: one read of every byte.
        ``metadata`` receives each shard's header metadata, by rank (the plain values).
        """
        directory = self.path(ref)
        expected = {MANIFEST, *(s.file for s in manifest.shards)}
        extra = sorted(set(self.backend.list(self.rel(directory))) - expected)
        if extra:
            return f"{self.rel(directory)}: holds files the manifest does not list: {', '.join(extra)}"

        def check(shard: ShardEntry) -> str | None:
            # One verification for run, reshard and verify: with or without ``into``, the header
            # is checked against the manifest and every byte hashed (what verify calls ok loads).
            rows = None if into is None else {h.name: _place(into[h.name][h.box], h) for h in shard.holds}
            meta = None if metadata is None else metadata.setdefault(shard.rank, {})
            with self.backend.reading(self.rel(directory / shard.file)) as path:
                return shards.read_verified(path, shard.holds, rows, shard.size, shard.sha256, meta,
                                            shards.shard_parts(shard), self._header_check(manifest, shard))

        if len(manifest.shards) == 1:
            reasons = [check(manifest.shards[0])]
        else:  # readv and hashlib release the GIL: threads hash shards on all cores
            with ThreadPoolExecutor(max_workers=min(len(manifest.shards), os.cpu_count() or 1, 16)) as pool:
                reasons = list(pool.map(check, manifest.shards))
        bad = [r for r in reasons if r]
        return f"{self.rel(directory)}: {'; '.join(bad)}" if bad else None

    @staticmethod
    def _header_check(manifest: Manifest, shard: ShardEntry) -> shards.MetaCheck:
        return lambda meta: plan.header_problem(manifest, shard, meta)

    def verify(self, ref: Ref, expect_sha256: str | None = None, load: bool = False,
               into: Mapping[str, np.ndarray] | None = None) -> Verification:
        """Check the manifest, names, sizes and sha256 of every byte; with ``load``, also read the
        state (in the same pass) and check each shard's header against the manifest.

        ``into`` (a trainer's freshly built state) lends its arrays: a tensor is read into the
        array of the same name, shape and dtype instead of a new one, so a resume holds the state
        once, not the initial state and the checkpoint's side by side (as torch.distributed's
        checkpoint loads in place). Until the verdict is good their contents are undefined."""
        try:
            manifest, sha = self.read_manifest(ref, expect_sha256=expect_sha256)
        except InputError as exc:
            return Verification(None, None, str(exc))
        full = _destinations(manifest.tensors, into or {}) if load else None
        metadata: dict[int, dict[str, str]] = {}  # the headers are read either way: cheap, and reshard needs them
        reason = self.check_files(ref, manifest, full, metadata)
        return Verification(manifest, sha, reason, full if reason is None else None,
                            metadata if reason is None else None)

    def load(self, ref: Ref, expect_sha256: str | None = None, verdict: Verification | None = None,
             into: Mapping[str, np.ndarray] | None = None) -> Loaded:
        """Verify and read in one pass (unless ``verdict`` already holds the state), into ``into``'s
        arrays where they fit (see ``verify``); InputError when it does not verify. No tensor is
        handed out before every shard's sha256 matched."""
        if verdict is None or verdict.tensors is None:
            verdict = self.verify(ref, expect_sha256, load=True, into=into)
        if verdict.reason is not None or verdict.manifest is None or verdict.sha256 is None or verdict.tensors is None:
            raise InputError(f"{verdict.reason}; run `trainjob verify --pvc {self.pvc.root}` for details")
        return Loaded(ref, verdict.manifest, verdict.sha256, verdict.tensors, verdict.metadata or {})

    def load_local(self, ref: Ref, specs: tuple[TensorSpec, ...], wanted: Mapping[str, tuple[tuple[int, ...],
                   tuple[int, ...]]], rank: int, expect_sha256: str | None = None,
                   into: Mapping[str, np.ndarray] | None = None, verify_all: bool = False) -> Loaded:
        """This rank's part of the checkpoint (``wanted``: by name, the box of the whole tensor it
        holds, as ``HostState.wanted`` gives it), read by offsets (``plan.plan_reads``) from the
        shards that overlap it, whatever world size and placements wrote them; into ``into``'s
        arrays where they fit. This rank's own shard is read whole, hashed, and its header
        checked against the manifest (so each byte of a checkpoint is checked by some rank when
        every rank loads); of any other, only the slices it needs, each checked against its
        digest (schema 2), or the whole shard hashed (schema 1, which has no part digests). One
        it needs nothing from is not opened; of rank 0's, the header is read for the plain
        values. ``verify_all``: hash every shard in the same pass, reading each once (rank 0,
        when it picks the checkpoint for every rank alone). StateMismatch (exit 2) when the
        manifest's tensors are not ``specs`` (the live model's whole shapes), before a byte is
        read; InputError when a shard does not verify."""
        manifest, sha = self.read_manifest(ref, sizes=verify_all, expect_sha256=expect_sha256)
        where = self.rel(self.path(ref) / MANIFEST)
        if manifest.tensors != tuple(specs):
            mine, theirs = {t.name: t for t in specs}, {t.name: t for t in manifest.tensors}
            name = next((n for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n)), "?")
            said = lambda t: f"{t.dtype}{list(t.shape)}" if t else "absent"  # noqa: E731
            raise StateMismatch(f"{where}: {name} is {said(theirs.get(name))} there, {said(mine.get(name))} in the "
                             "live state (its whole shape); relaunch with the model that wrote it")
        local = {t.name: wanted[t.name][1] for t in specs}
        dest = {}
        for t in specs:
            a = (into or {}).get(t.name)
            fits = (isinstance(a, np.ndarray) and a.shape == tuple(local[t.name]) and a.dtype == np_dtype(t.dtype)
                    and a.flags.c_contiguous and a.flags.writeable
                    and not any(np.may_share_memory(a, b) for b in dest.values()))
            dest[t.name] = a if fits else np.empty(local[t.name], dtype=np_dtype(t.dtype))
        targets: dict[int, dict[str, Any]] = {}
        for p in plan.plan_reads(manifest, wanted):
            out = dest[p.tensor][p.dest_index]
            targets.setdefault(p.src_rank, {}).setdefault(p.tensor, []).append((p.src_index, out))
        by_rank = {s.rank: s for s in manifest.shards}
        for r, wants in targets.items():  # a piece that is the whole slice, into contiguous memory: no copy
            for name, pieces in wants.items():
                (_, out), hold = pieces[0], next(h for h in by_rank[r].holds if h.name == name)
                if len(pieces) == 1 and out.shape == tuple(hold.shape) and out.flags.c_contiguous:
                    wants[name] = out
        own = {rank} if rank < manifest.world_size else set()
        whole = set(range(manifest.world_size)) if verify_all else own if manifest.schema >= 2 else None
        reading = sorted(set(range(manifest.world_size)) if verify_all else {*targets, 0, *own})
        directory, metadata = self.path(ref), {}

        def check(r: int) -> str | None:
            # Schema 2: this rank's own shard is read whole (so every byte of a checkpoint is
            # checked by the rank that wrote it, whatever the others need), from any other only
            # the slices it needs (and rank 0's header, for the plain values), each checked
            # against its own digest. Schema 1 has no part digests: a shard is hashed whole.
            shard = by_rank[r]
            agrees = self._header_check(manifest, shard)
            with self.backend.reading(self.rel(directory / shard.file)) as path:
                if whole is not None and r not in whole:
                    return shards.read_parts(path, shard, targets.get(r, {}), metadata.setdefault(r, {}) if r == 0
                                             else None, agrees)
                return shards.read_verified(path, shard.holds, targets.get(r, {}), shard.size, shard.sha256,
                                            metadata.setdefault(r, {}), shards.shard_parts(shard), agrees)

        for r in reading:
            metadata.setdefault(r, {})
        with ThreadPoolExecutor(max_workers=max(1, min(len(reading), os.cpu_count() or 1, 16))) as pool:
            bad = [reason for reason in pool.map(check, reading) if reason]
        if bad:
            raise InputError(f"{self.rel(directory)}: {'; '.join(bad)}; run `trainjob verify --pvc "
                             f"{self.pvc.root}` for details")
        return Loaded(ref, manifest, sha, dest, metadata)

    def staging(self, ref: Ref, generation: int) -> Path:
        """Where launch ``generation`` builds checkpoint ``ref`` before rank 0 commits it: on a
        directory a tmp directory of its own, renamed into place by the commit; on a bucket (no
        rename) the checkpoint's own key, which counts once the manifest's create succeeds."""
        if not self.pvc.local:
            return self.path(ref)
        return self.root / f"{TMP}{ref.name}.g{generation:08d}"

    def receipt_path(self, staging: Path, rank: int, world_size: int) -> Path:
        return staging / (plan.shard_file(rank, world_size) + RECEIPT)

    def pointer(self, m: Manifest, ref: Ref, sha: str) -> CheckpointPointer:
        return CheckpointPointer(step=m.step, attempt=m.attempt, world_size=m.world_size,
                                 loss_milli=m.loss_milli, dir=f"checkpoints/{ref.name}", manifest_sha256=sha)


class ShardWriter(CheckpointStore):
    """What every rank does at a checkpoint (all ranks), as torch.distributed.checkpoint's
    StorageWriter splits it. In order, for one checkpoint:

    1. (rank 0) ``Committer.create_staging``; ranks >= 1 wait for the directory to appear.
    2. (all ranks) ``write_shard``: this rank's slice of the state, into the staging directory.
    3. (ranks >= 1) ``write_receipt`` (or the store's key): the shard's size and sha256, for rank
       0 to gather; ``settle`` before it (files) or before saying the shard is durable (store).
    4. (rank 0) ``Committer.read_receipt`` for every other rank, then ``commit`` (which waits for
       the others' word that their shards are durable before its rename), then ``rotate``.
    """

    def write_shard(self, staging: Path, rank: int, world_size: int, step: int,
                    tensors: Mapping[str, np.ndarray], fsync_later: bool = False) -> ShardEntry:
        """(all ranks) Write this rank's slice of ``tensors`` (the whole state) into ``staging``;
        ``fsync_later``: see ``write_slices``."""
        host = tensors if isinstance(tensors, HostArrays) else HostArrays(tensors)
        specs = host.specs or tensor_specs(tensors)
        holds = plan.rank_holds(specs, world_size, rank, host.boxes, host.sources)
        if world_size > 1 and host.checked:  # rank 0 compares them before the commit (replicas.py)
            digests = host.digests()
            holds = tuple(attrs.evolve(h, digest=digests[h.name]) if h.name in digests else h for h in holds)
        return self.write_slices(staging, rank, world_size, step, specs, holds, local_parts(holds, host),
                                 host.metadata(rank), fsync_later)

    def write_slices(self, staging: Path, rank: int, world_size: int, step: int, tensors: tuple[TensorSpec, ...],
                     holds: tuple[TensorSlice, ...], mine: Mapping[str, np.ndarray],
                     documents: Mapping[str, str] | None = None, fsync_later: bool = False) -> ShardEntry:
        """(all ranks; reshard writes every rank's) Write rank ``rank``'s shard holding ``mine``
        (described by ``holds``, slices of ``tensors``) and ``documents`` (its plain values,
        ``HostArrays.metadata``) into ``staging``. Its header says where each slice sits
        (``plan.placement``), as every reader checks the manifest against.

        ``fsync_later``: return once the bytes are written, the shard's fsync left running. Rank 0
        passes it for its own shard (its ``Committer.commit`` waits for it before the rename, so
        it runs on while the receipts and the manifest are gathered); another rank passes it and
        calls ``settle`` before it says the shard is durable (its transport's ``deliver``)."""
        name = plan.shard_file(rank, world_size)
        meta = {**(documents or {}), "rank": str(rank), "world_size": str(world_size), "step": str(step),
                plan.SLICES_KEY: plan.placement_text(holds, tensors)}
        sizes, stream = shards.encode_parts(mine, meta)
        written = self.backend.write_part(self.rel(staging / name), stream, sync=not fsync_later, parts=sizes)
        digests = dict(zip(sorted(mine), written.parts[1:]))  # in the file's order, after the header
        return ShardEntry(rank=rank, file=name, size=written.size, sha256=written.sha256,
                          holds=tuple(attrs.evolve(h, sha256=digests[h.name]) for h in holds),
                          header=sizes[0], header_sha256=written.parts[0])

    def settle(self) -> None:
        """(a rank that wrote with ``fsync_later`` and commits nothing) Wait until what it wrote
        is durable; raises the first fsync's error."""
        self.backend.settle()

    def write_receipt(self, staging: Path, entry: ShardEntry) -> None:
        """(ranks >= 1) Tell rank 0 this rank's shard is written, with its size and sha256.

        Not fsynced: rank 0 reads it in this launch and copies it into the manifest, whose commit
        makes it durable; a crash before that commit abandons the whole staging directory."""
        self.backend.write(self.rel(staging / (entry.file + RECEIPT)), (dumps(entry) + "\n").encode(),
                           durable=False)


class Committer(ShardWriter):
    """What only rank 0 does (rank 0; also ``trainjob reshard``, which runs alone under the job
    lock): create the staging directory, gather receipts, commit, rotate, and keep the directory
    tidy (set aside rejected checkpoints, remove what killed writers left). The order of one
    checkpoint is in ``ShardWriter``'s docstring; ``check_space`` comes before all of it."""

    def check_space(self, needed: int) -> None:
        """(rank 0, first) Refuse a save that cannot fit (75), before anything is written or deleted."""
        free = self.backend.free_space()
        if free is not None and free < needed:
            raise NoSpace(f"{self.root}: {free} bytes free, but the next checkpoint needs about {needed} "
                          "(the size of the last one); free some space or lower --keep, then relaunch "
                          "(every checkpoint already on the PVC was kept)")

    def create_staging(self, ref: Ref, generation: int) -> Path:
        """(rank 0, before any shard) The directory every rank writes its shard into."""
        staged = self.backend.stage(self.rel(self.path(ref)), self.rel(self.staging(ref, generation)))
        return self.pvc.root / staged

    def read_receipt(self, staging: Path, rank: int, world_size: int) -> ShardEntry:
        """(rank 0, after its own shard) Rank ``rank``'s receipt, once ``receipt_path`` exists."""
        path = self.receipt_path(staging, rank, world_size)
        entry = self.pvc.read_record(path, ShardEntry)
        if entry is None or entry.rank != rank or entry.file != plan.shard_file(rank, world_size):
            raise InputError(f"{path}: missing or not rank {rank}'s receipt")
        return entry

    def commit(self, staging: Path, ref: Ref, manifest: Manifest, point: bool = False,
               others: Callable[[], object] | None = None) -> str:
        """(rank 0, after every receipt) Write the manifest last and rename the directory into
        place; return the manifest's sha256. ``point``: then replace ``checkpoint.json`` with a
        pointer to it, its fsync beside the commit's last one (``durable.commit_dir``), and leave the
        fsync that makes its rename durable running: ``rotate`` waits for it, so the
        ``checkpointed`` line's fsync can run beside it (docs/checkpoints.md). ``others()``: waits
        until the other ranks' shards are durable (``Coordinator.durable``), called while this
        rank's fsyncs of the commit run, before the rename."""
        if self.pvc.local:  # receipt files (the files transport's) were for rank 0 only; the manifest now says it all
            # One listing, not an unlink per shard: through the store there are none, and W - 1
            # failed unlinks on a network file system are W - 1 round trips to its server.
            for name in os.listdir(staging):
                if name.endswith(RECEIPT):
                    (staging / name).unlink(missing_ok=True)
        data, then = record_bytes(manifest), None
        if point:  # the manifest's sha256 is known before it is written: the pointer can be written beside it
            pointer = self.pointer(manifest, ref, hashlib.sha256(data).hexdigest())
            then = (self.pvc.key(self.pvc.checkpoint_path), record_bytes(pointer))
        written = self.backend.publish(self.rel(staging), self.rel(self.path(ref)), MANIFEST, data, then, others)
        return written.sha256

    def _remove(self, path: Path, wait: bool = True) -> bool:
        """Delete a checkpoint so that it never looks committed while half-deleted (``delete_tree``)."""
        return self.backend.delete_tree(self.rel(path), wait=wait)

    def rotate(self, keep: int, world_size: int, protect: Ref) -> list[str]:
        """(rank 0, after the commit and the pointer) Hide the oldest so that ``keep`` remain;
        ``start_deletions`` deletes them in the background. First waits until the pointer's
        rename is durable: a power loss must never leave the old pointer naming a checkpoint
        already on its way out."""
        self.backend.settle()
        removed = []
        for ref in plan.to_rotate(self.committed(), keep, world_size, protect):
            if self._remove(self.path(ref), wait=False):  # hidden now, its blocks freed later
                removed.append(ref.name)
        return removed

    def start_deletions(self) -> None:
        """(rank 0, once the checkpoint that rotated is announced durably) Free what ``rotate``
        hid, in the background: its journal work then never lands in that announcement's fsync."""
        self.backend.start_deletions()

    def set_aside(self, ref: Ref) -> str:
        """(rank 0, at a resume) Move a checkpoint that failed verification out of the way of new commits."""
        taken = set(self.entries())
        dest, n = f"{REJECTED}{ref.name}", 1
        while dest in taken:
            dest, n = f"{REJECTED}{ref.name}.{n}", n + 1
        if not self.backend.move(self.rel(self.path(ref)), self.rel(self.root / dest)):
            return ""  # it was missing to begin with
        return self.rel(self.root / dest)

    def cleanup(self) -> list[str]:
        """(rank 0, at its first transition) Delete what killed writers left (under the job lock): tmp files on the PVC, staging
        and trash directories. Returns the paths removed, relative to the PVC."""
        removed = [self.rel(p) for p in self.pvc.remove_stray_tmp()]
        for name in self.backend.unpublished("checkpoints", MANIFEST):
            if self._remove(self.root / name):
                removed.append(f"checkpoints/{name}")
        return removed
