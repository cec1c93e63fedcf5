"""``trainjob reshard``: rewrite one committed checkpoint for another world size.

The machine's ``reshard`` edge, with its own small model: pick the source (the newest checkpoint,
or the newest at ``--step``), verify it as a resume does (refusing it, exit 2, when it does not:
never an older step instead), then build the new checkpoint shard by
shard, each read by offsets from the source shards that overlap it (``plan.plan_reads``,
``CheckpointStore.load_local``: one new shard in memory at a time), and commit it like any other: staged in a
tmp directory, manifest last, one rename. The source is left alone (rotation removes it later),
so a kill at any instant leaves the PVC as it was, plus at most a staging directory that the
next start deletes. Takes the job lock: never runs beside a ``run``.

Plain values (the replicated document in rank 0's shard) go to the new rank 0's shard. Rank-local
state (each rank's RNG streams, data loader position) cannot be mapped to another number of
ranks: a source that holds some is refused (exit 2) unless ``drop_rank_local`` is given, and the
drop is logged (``rank_local_dropped``).
"""

from __future__ import annotations

from collections import ChainMap

from transitions import EventData

from ..checkpoint import plan
from . import machine
from ..checkpoint.snapshot import LOCAL_KEY, PLAIN_KEY
from ..checkpoint.store import CheckpointStore, Verification, expected_sha256
from ..errors import AlreadyCompleted, InputError, NoVerifiedCheckpoint
from ..storage.eventlog import EventLog
from .job import MachineModel
from ..checkpoint.plan import Ref
from ..storage.pvc import Pvc
from ..records import MANIFEST_SCHEMA, Manifest
from ..states import State

STAGING_GENERATION = 0  # reshard runs alone under the job lock, like a one-rank launch


def pick_source(store: CheckpointStore, step: int | None, world_size: int) -> tuple[Ref, Verification]:
    """The newest checkpoint (at ``step``, if given), verified as a resume verifies it: its
    manifest against the sha256 ``checkpoint.json`` recorded when the pointer names it. Of that
    step, one of another world size than ``world_size`` first (the one of the same size is the
    target, already there). Never an older step in place of a newer one that does not verify: a
    run sets such a checkpoint aside and says so (``checkpoint_rejected``); a reshard refuses,
    and an older step is resharded only when ``--step`` names it."""
    refs = [r for r in store.committed() if step is None or r.step == step]
    if not refs:
        where = f" at step {step}" if step is not None else ""
        raise InputError(f"{store.root}: no committed checkpoint{where} to reshard")
    newest = max((r.attempt, r.step) for r in refs)
    pointer = store.pvc.read_checkpoint()
    reasons = []
    for ref in sorted((r for r in refs if (r.attempt, r.step) == newest), key=lambda r: r.world_size == world_size):
        verdict = store.verify(ref, expected_sha256(pointer, ref))  # every byte hashed, in bounded memory
        if verdict.reason is None:
            return ref, verdict
        reasons.append(verdict.reason)
    raise NoVerifiedCheckpoint(f"{store.root}: the newest checkpoint to reshard (step {newest[1]}) does not verify "
                               f"({'; '.join(reasons)}); run `trainjob verify --pvc {store.pvc.root}` to inspect it, "
                               "and reshard an older step only by naming it (--step)")


class Reshard(MachineModel):
    """The machine's model for one ``trainjob reshard`` process."""

    state: str  # set by transitions.Machine

    def __init__(self, pvc: Pvc, log: EventLog, world_size: int, step: int | None,
                 drop_rank_local: bool = False) -> None:
        super().__init__(pvc, log)
        last = pvc.read_state()
        if last is not None and last.state == State.completed:
            raise AlreadyCompleted(f"{pvc.root}: this job already completed; there is nothing to resume")
        self.source, verdict = pick_source(self.store, step, world_size)
        assert verdict.manifest is not None and verdict.sha256 is not None
        self.manifest, self.source_sha = verdict.manifest, verdict.sha256
        self.target = Ref(attempt=self.source.attempt, step=self.source.step, world_size=world_size)
        metadata, self.dropped = verdict.metadata or {}, False
        self.plain = metadata.get(0, {}).get(PLAIN_KEY)
        if any(LOCAL_KEY in m for m in metadata.values()) and world_size != self.source.world_size:
            if not drop_rank_local:
                raise InputError(
                    f"{self.store.rel(self.store.path(self.source))}: holds rank-local state (each rank's RNG streams or "
                    f"data loader position) for {self.source.world_size} rank(s), which cannot be mapped to "
                    f"{world_size}; rerun with --drop-rank-local to reshard without it (each rank then resumes "
                    "with its own RNG and loader as the script builds them)")
            self.dropped = True
        machine.build(self)

    def target_exists(self) -> bool:
        """A previous reshard (perhaps killed before logging) already wrote the target: verify it."""
        if self.target not in self.store.committed():  # published only: a bucket's unpublished prefix is litter
            return False
        verdict = self.store.verify(self.target, expected_sha256(self.pvc.read_checkpoint(), self.target))
        if verdict.reason is not None:
            raise InputError(f"{verdict.reason}; it is in the way of the reshard: inspect it with "
                             f"`trainjob verify --pvc {self.pvc.root}`")
        return True

    def persist_reshard(self, _ev: EventData) -> None:
        src, n = self.manifest, self.target.world_size
        if self.dropped:  # after persist_cleanup's note, in NOTED_WITHIN's order
            self.notes.append(("rank_local_dropped", dict(from_world_size=src.world_size, world_size=n)))
        staging = self.store.create_staging(self.target, STAGING_GENERATION)
        entries = []
        for rank, holds in enumerate(plan.plan_shards(src.tensors, n)):
            # One new shard at a time, read by offsets from the source shards that overlap it (each
            # hashed again as it is read): never the whole state in this process, whatever its size.
            mine = self.store.load_local(self.source, src.tensors, {h.name: (h.origin, h.shape) for h in holds},
                                         src.world_size, self.source_sha).tensors
            documents = {PLAIN_KEY: self.plain} if rank == 0 and self.plain is not None else {}
            entries.append(self.store.write_slices(staging, rank, n, src.step, src.tensors, holds, mine, documents))
            del mine
        manifest = Manifest(schema=MANIFEST_SCHEMA, step=src.step, attempt=src.attempt, world_size=n,
                            loss_milli=src.loss_milli, tensors=src.tensors, shards=entries,
                            resharded_from=self.source_sha)
        sha = self.store.commit(staging, self.target, manifest)
        pointer = self.pvc.read_checkpoint()
        if pointer is not None and pointer.dir == f"checkpoints/{self.source.name}":
            self.pvc.write_checkpoint(self.store.pointer(manifest, self.target, sha))

    def announce(self, _ev: EventData) -> None:
        facts = ChainMap(dict(step=self.source.step, from_world_size=self.source.world_size,
                              world_size=self.target.world_size, path=f"checkpoints/{self.target.name}",
                              source_manifest_sha256=self.source_sha))
        event = machine.EVENT_FOR_STATE[self.state]
        self.log.append(event, machine.format_detail(event, facts))
