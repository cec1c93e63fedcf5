"""The engine: the state machine's model for one job, and what a launch is configured with.

``Job`` is the machine's model for rank 0 (the coordinator): its guards ask the pure functions in
``decisions.py``, its ``persist_*`` callbacks write to the PVC (checkpoints through the stores,
state through ``Pvc``), and its ``announce*`` callbacks append log events. ``run.py`` drives it
from a training loop; nothing else writes a file or a log line for a job.

The state a checkpoint holds is read from the trainer's ``state_dict()`` only when one is due,
through ``snapshot.HostState`` (host arrays, no copy of what is already in host memory); the
engine keeps no copy between checkpoints, only the step and the loss.

Every rank computes the same full update (SGD over the same samples in the same order is
sequential, so splitting the arithmetic would change the numbers); each rank *persists* only its
slice of every array, and a resume reassembles the arrays from all shards. That is what keeps the
weights bit-for-bit equal at every world size.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import numpy as np

import attrs
from transitions import EventData

from . import decisions
from ..checkpoint import plan
from ..checkpoint import replicas, shards
from . import machine
from .overlap import AsyncCheckpoints
from ..checkpoint.store import Committer, Loaded
from ..defaults import ASYNC_WRITE_TIMEOUT
from .config import RunConfig
from ..errors import (AlreadyCompleted, InputError, NoVerifiedCheckpoint, ReplicasDisagree, StateMismatch,
                      UsageError, WorldSizeMismatch)
from ..storage.eventlog import EventLog
from ..checkpoint.plan import Ref
from ..storage.pvc import Pvc
from ..ranks.coordination import Coordinator
from ..records import MANIFEST_SCHEMA, Artifact, CheckpointPointer, Manifest, NamedArray, RunState, dumps, load
from ..checkpoint import snapshot
from ..checkpoint.snapshot import Gathered, HostState
from ..states import State as JobState


ARTIFACT_FORMATS = ("json", "safetensors")
ARTIFACT_KEY = "trainjob.artifact"  # the safetensors header's metadata key holding the Artifact record


def artifact_names(attempt: int) -> tuple[str, str]:
    """The artifact attempt ``attempt`` publishes, in each format (ARTIFACT_FORMATS' order)."""
    return f"model-v{attempt}.json", f"model-v{attempt}.safetensors"


def read_artifact_record(data: bytes, where: str) -> Artifact:
    """The Artifact record of a published file: the JSON itself, or a safetensors header's metadata."""
    if where.endswith(".json"):
        return load(data, Artifact, where=where)
    try:
        meta = shards.read_metadata(data)
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None
    return load(meta.get(ARTIFACT_KEY, ""), Artifact, where=f"{where} (metadata {ARTIFACT_KEY})")


class StopFlag:
    """Records SIGTERM/SIGINT so the loop can checkpoint and exit 75 at the next step boundary.

    A signal is passed on at once to the handler it displaced when that is a Python function (an
    enclosing ``Run``'s flag, the script's own handler): every enclosing Run stops at its next
    step boundary too, and the script learns of it as it would without trainjob. The default
    actions (terminate; ``KeyboardInterrupt``) are not replayed: the run's stop, a checkpoint and
    exit 75, is the answer to them. Install on the main thread only (Python's rule for signals).
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._displaced: dict[int, Any] = {}

    def install(self) -> Callable[[], None]:
        """Catch SIGTERM and SIGINT from now on; returns what puts the previous handlers back."""
        displaced: dict[int, Any] = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        self._displaced = displaced

        def uninstall() -> None:
            for sig, handler in displaced.items():
                # None: a handler set outside Python, which Python cannot put back; the default is nearest.
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        return uninstall

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        displaced = self._displaced.get(signum)
        if callable(displaced) and displaced is not signal.default_int_handler:
            displaced(signum, frame)


class MachineModel:
    """The base of the machine's models (``Job``, ``Reshard``): what every one does at its first
    transition: clean up after killed writers, and announce the optional notes
    (``machine.NOTED_WITHIN``) before its own event."""

    def __init__(self, pvc: Pvc, log: EventLog) -> None:
        self.pvc, self.log, self.store = pvc, log, Committer(pvc)
        self.notes: list[tuple[str, dict[str, Any]]] = []  # announced within the next transition

    def persist_cleanup(self, _ev: EventData) -> None:
        removed = self.store.cleanup()
        if removed:
            self.notes.append(("cleaned_up", dict(removed=len(removed), paths=",".join(removed))))

    def announce_notes(self, _ev: EventData) -> None:
        for event, facts in self.notes:
            self.log.append(event, machine.format_detail(event, facts))
        self.notes.clear()


def already_completed(pvc: Pvc, attempt: int) -> AlreadyCompleted:
    """The lab's refusal of a start on a completed job (without ``--idempotent``)."""
    return AlreadyCompleted(f"{pvc.root}: this job already completed (attempt {attempt}); use a fresh --pvc for a "
                            "new job")


class Job(MachineModel, AsyncCheckpoints):
    """The state machine's model for rank 0 (the coordinator) of one launch."""

    state: str  # set by transitions.Machine

    def __init__(self, cfg: RunConfig, pvc: Pvc, log: EventLog, data_sha256: str, peers: Coordinator) -> None:
        """Nothing is read here: ``read`` is the explicit step that reads and verifies the PVC."""
        super().__init__(pvc, log)
        self.cfg, self.data_sha256, self.peers = cfg, data_sha256, peers
        self.last: RunState | None = None
        self.completion_announced = False
        self.pointer: CheckpointPointer | None = None
        self.attempts_started = 0  # the PVC's counter, once ``read``
        self.attempt = 1
        self.from_step = 0
        self.persisted_state: str | None = None
        self.artifact: dict[str, Any] = {}
        self.rejected: list[tuple[Ref, str]] = []
        self.loaded: Loaded | None = None
        self.last_size = 0
        self.rotate_after: Ref | None = None  # the checkpoint committed, not yet announced (its rotation is due)
        if cfg.async_checkpoint:
            self.enable_async(ASYNC_WRITE_TIMEOUT)
        machine.build(self)

    def read(self, into: dict[str, np.ndarray] | None = None, host: Any = None) -> None:
        """Read what the PVC holds (state, log, pointer, attempts) and, when an attempt is in
        flight, verify and load its newest sound checkpoint, reading it into ``into``'s arrays
        where they fit (the trainer's own: see ``CheckpointStore.verify``; lent only when the
        attempt will resume, since a verification that fails leaves them undefined). Call once, before
        ``start``; it writes nothing. Raises AlreadyCompleted, WorldSizeMismatch or
        NoVerifiedCheckpoint (each exit 2) or InputError for a corrupt PVC file. ``host`` (the
        live state's ``HostState``): when it is sharded (DTensors), candidates are verified
        without being held, then only this rank's part of the chosen one is read, by offsets."""
        pvc, log = self.pvc, self.log
        self.last = pvc.read_state()
        self.completion_announced = decisions.completion_announced(
            self.last.state if self.last else None, log.last_event() == "completed")
        if self.completion_announced:
            raise already_completed(pvc, self.last.attempt)
        self.pointer = pvc.read_checkpoint()
        self.attempts_started = pvc.read_attempts()  # the PVC's counter: attempts begun so far
        self.attempt = max(self.attempts_started, 1)  # the one this process runs; set by the start
        self.persisted_state = self.last.state if self.last else None
        if self.last is None or self.last.state not in decisions.ATTEMPT_ENDED:
            # Verify before any write. Without a run record the resume depends on the step found.
            self._discover(self.last.attempt if self.last else self.attempt, into if self.last else None,
                           host if host is not None and host.sharded else None)

    def _discover(self, attempt: int, into: dict[str, np.ndarray] | None, host: Any = None) -> None:
        """Find the newest checkpoint of ``attempt`` that verifies; refuse loudly if there is none."""
        pointer = self.pointer if self.pointer is not None and self.pointer.attempt == attempt else None
        named = Ref.parse(pointer.dir.removeprefix("checkpoints/")) if pointer else None
        refs = self.store.committed()
        verdicts = {}
        sharded: dict[Ref, Loaded] = {}

        def verify(ref: Ref) -> str | None:
            expect = pointer.manifest_sha256 if ref == named else None
            if host is None:
                verdicts[ref] = self.store.verify(ref, expect, load=True, into=into)
                return verdicts[ref].reason
            # Sharded: this rank's part read by offsets. Through a verdict round every rank
            # verifies its own share (ranks/store.py); without one, rank 0 hashes every shard
            # in the same pass, since it picks the checkpoint for every rank. So does a rank 0
            # that a stop reached (the launch will not train): it waits for no other rank.
            shared = (self.peers is not None and self.peers.shares_verification and not self.peers.solo
                      and ref.world_size == self.cfg.world_size and not self.peers.stop_signal())

            def mine(every: bool) -> str | None:
                try:
                    sharded[ref] = self.store.load_local(ref, host.specs, host.wanted(), 0, expect, into,
                                                         verify_all=every)
                except StateMismatch:
                    raise  # another model's checkpoint is not damage: refused, nothing set aside
                except InputError as exc:
                    return str(exc)
                return None

            if not shared:
                return mine(True)
            verdict = self.peers.verify_round(ref.name, expect, into is not None, lambda: mine(False))
            if verdict is None:  # a stop came before every verdict: this rank checks every shard itself
                return mine(True)
            bad = [why if r == 0 else f"rank {r}: {why}" for r, why in verdict if why]
            if bad:
                sharded.pop(ref, None)
            return "; ".join(bad) if bad else None

        pick = plan.pick_resume(refs, attempt, self.cfg.world_size, verify)
        rejected = list(pick.rejected)
        if named is not None and named not in refs:  # the newest commit vanished: damage, not "no checkpoint"
            rejected.insert(0, (named, f"{pointer.dir}: missing, but checkpoint.json names it"))
        if pick.mismatch is not None:
            m = pick.mismatch
            raise WorldSizeMismatch(
                f"{self.store.path(m)}: the newest verified checkpoint (step {m.step}) was written by "
                f"{m.world_size} rank(s), this run has {self.cfg.world_size}; run `trainjob reshard --pvc "
                f"{self.pvc.root} --world-size {self.cfg.world_size}` first, or relaunch with "
                f"--world-size {m.world_size}")
        if pick.chosen is None and rejected:
            reasons = "; ".join(f"{ref.name}: {why}" for ref, why in rejected)
            raise NoVerifiedCheckpoint(
                f"{self.pvc.root}: no checkpoint verifies, and starting over would discard them ({reasons}); "
                f"run `trainjob verify --pvc {self.pvc.root}` to inspect them")
        if pick.chosen is not None and host is not None:
            self.loaded = sharded[pick.chosen]
            self.last_size = self.loaded.size
        elif pick.chosen is not None:
            self.loaded = self.store.load(pick.chosen, verdict=verdicts[pick.chosen])
            self.last_size = self.loaded.size
        self.rejected = rejected

    # --- guards: each one asks exactly one pure decision --------------------------------------

    def completion_unannounced(self, _ev: EventData) -> bool:
        return decisions.completion_unannounced(
            self.last.state if self.last else None, self.completion_announced
        )

    def should_resume(self, _ev: EventData | None = None) -> bool:
        return decisions.should_resume(
            self.last.state if self.last else None, self.loaded.manifest.step if self.loaded else None,
            self.cfg.steps
        )

    def within_backoff(self, _ev: EventData) -> bool:
        return decisions.within_backoff(self.attempts_started, self.cfg.backoff_limit)

    def should_checkpoint(self, ev: EventData) -> bool:
        return ev.kwargs.get("force", False) or decisions.should_checkpoint(
            ev.kwargs["step"], self.cfg.ckpt_every, self.cfg.steps
        )

    def drift_passes(self, ev: EventData) -> bool:
        holdout, baseline = ev.kwargs["holdout"], ev.kwargs["baseline"]
        return decisions.drift_passes(holdout.correct, holdout.total, baseline.correct, self.cfg.max_drop)

    # --- persistence: runs before the state changes ---------------------------------------------

    def _write_state(self, state: str) -> None:
        if state != self.persisted_state:
            self.pvc.write_state(
                RunState(state=state, attempt=self.attempt, lr=self.cfg.lr, data_sha256=self.data_sha256)
            )
            self.persisted_state = state

    def persist_state(self, ev: EventData) -> None:
        self._write_state(ev.transition.dest)

    def persist_resume(self, ev: EventData) -> None:
        if self.last is not None:
            self.attempt = self.last.attempt
            # The counter is bumped right after state.json, so it may lag by one, never more.
            if self.attempts_started not in (self.attempt - 1, self.attempt):
                raise InputError(
                    f"{self.pvc.attempts_path}: says {self.attempts_started} attempts but state.json says attempt "
                    f"{self.attempt} is in flight; one of them was edited, fix it by hand"
                )
            if (self.last.lr, self.last.data_sha256) != (self.cfg.lr, self.data_sha256):
                raise InputError(
                    f"{self.pvc.state_path}: attempt {self.attempt} was cut short while training with "
                    f"--lr {self.last.lr} on other data or settings; relaunch it with the same --lr and --data"
                )
        loaded = self.loaded
        if loaded is not None and loaded.manifest.step > self.cfg.steps:
            raise InputError(f"{self.store.rel(self.store.path(loaded.ref))}: checkpoint is at step "
                             f"{loaded.manifest.step}, beyond --steps {self.cfg.steps}")
        self.from_step = loaded.manifest.step if loaded else 0
        for ref, reason in self.rejected:  # out of the way of new commits, kept for inspection
            moved = self.store.set_aside(ref)
            self.notes.append(("checkpoint_rejected", dict(path=f"checkpoints/{ref.name}",
                                                           moved_to=moved or "-", reason=reason)))
        if loaded is not None:
            pointer = self.store.pointer(loaded.manifest, loaded.ref, loaded.manifest_sha256)
            if pointer != self.pointer:  # killed between commit and pointer, or fell back
                self.pvc.write_checkpoint(pointer)
        self._write_state(JobState.resumed)
        if self.attempts_started < self.attempt:  # died between writing state.json and attempts
            self.pvc.write_attempts(self.attempt)

    def persist_start(self, _ev: EventData) -> None:
        self.attempt = self.attempts_started + 1
        # state.json first: if we die before the counter is bumped, the relaunch still sees an
        # attempt in flight and resumes it, instead of burning a second attempt number.
        self._write_state(JobState.started)
        self.pvc.write_attempts(self.attempt)

    def persist_checkpoint(self, ev: EventData) -> None:
        kw = ev.kwargs
        self.last_size = self.write_checkpoint(kw["step"], kw["loss_milli"], kw["state"], kw["specs"], self.last_size)
        self._write_state(JobState.checkpointed)

    def write_checkpoint(self, step: int, loss_milli: int, tensors: dict[str, np.ndarray], specs: Any,
                         last_size: int) -> int:
        """Write rank 0's shard, gather the others' receipts, commit and point (in that order;
        the shard's fsync runs on into the commit, the pointer's beside the commit's last, and
        the one that makes the pointer's rename durable is left running: docs/checkpoints.md);
        return the checkpoint's size. No machine, no log, no rotation: the async writer thread
        runs it too. ``announce`` logs the checkpoint, then rotates (``rotate_after``)."""
        world = self.cfg.world_size
        ref = Ref(attempt=self.attempt, step=step, world_size=world)
        self.store.check_space(last_size or sum(a.nbytes for a in tensors.values()) + 4096 * world)
        staging = self.store.create_staging(ref, self.peers.generation)
        entries = [self.store.write_shard(staging, 0, world, ref.step, tensors, fsync_later=True)]
        entries += self.peers.gather(lambda r: self.store.receipt_path(staging, r, world).exists(),
                                     lambda r: self.store.read_receipt(staging, r, world), ref.step)
        if found := replicas.disagreements(entries):  # a checkpoint written from both copies would mix them
            raise ReplicasDisagree(replicas.refusal(step, found))
        manifest = Manifest(schema=MANIFEST_SCHEMA, step=ref.step, attempt=ref.attempt, world_size=world,
                            loss_milli=loss_milli, tensors=specs, shards=entries)
        if problems := plan.coverage_problems(manifest.tensors, manifest.shards):  # DTensors not spanning every rank
            raise UsageError(f"step {step}: the ranks' shards do not make up the state ({'; '.join(problems)}); "
                             "every DTensor must be on a mesh of all the run's ranks (nothing was committed)")
        self.store.commit(staging, ref, manifest, point=True, others=lambda: self.peers.durable(ref.step))
        self.rotate_after = ref
        return sum(e.size for e in entries)

    def recall_artifact(self, _ev: EventData) -> None:
        """Re-read the artifact the killed predecessor published, to announce it truthfully."""
        self.attempt = self.last.attempt
        names = artifact_names(self.attempt)
        name = next((n for n in names if os.path.lexists(self.pvc.artifacts / n)), names[0])
        data = self.pvc.read_artifact(name)  # says what is missing, refuses a symlink
        record = read_artifact_record(data, str(self.pvc.artifacts / name))
        self.artifact = {"sha256": hashlib.sha256(data).hexdigest(), "path": f"artifacts/{name}",
                         "holdout": record.holdout, "baseline": record.baseline}

    def persist_artifact(self, ev: EventData) -> None:
        kw = ev.kwargs
        step = kw.get("step") or self.cfg.steps  # the run's last step, or the one it stopped early at
        record = Artifact(attempt=self.attempt, step=step, trainer=self.cfg.trainer, arrays=(),
                          holdout=kw["holdout"], baseline=kw["baseline"])
        if isinstance(kw["exported"], Gathered):  # a sharded model: gathered and written tensor by tensor
            name = artifact_names(self.attempt)[1]
            stream = shards.encode_lazy(kw["exported"].specs, kw["exported"].host, {ARTIFACT_KEY: dumps(record)})
            self.artifact = {"sha256": self.pvc.write_artifact(name, stream), "path": f"artifacts/{name}"}
            return
        exported = snapshot.exported(kw["exported"], step)  # checked and on the host
        if kw["format"] == "json":  # the lab's model-vN.json: the arrays as exact JSON numbers
            record = attrs.evolve(record, arrays=tuple(NamedArray.of(n, a) for n, a in sorted(exported.items())))
            name, data = artifact_names(self.attempt)[0], (dumps(record) + "\n").encode()
        else:  # safetensors: the tensors as raw bytes, the record (without arrays) in the header
            name = artifact_names(self.attempt)[1]
            data = b"".join(shards.encode(exported, {ARTIFACT_KEY: dumps(record)}))
        # The hash of the very bytes written (computed while writing), not a re-serialisation.
        self.artifact = {"sha256": self.pvc.write_artifact(name, data), "path": f"artifacts/{name}"}

    # --- announcements: run after the state changed ---------------------------------------------

    def _facts(self, ev: EventData) -> ChainMap[str, Any]:
        own = dict(steps=self.cfg.steps, attempt=self.attempt, attempts=self.attempts_started,
                   backoff_limit=self.cfg.backoff_limit, from_step=self.from_step,
                   max_drop=self.cfg.max_drop, **self.artifact)
        return ChainMap(ev.kwargs, own)

    def _append(self, event: str, ev: EventData) -> None:
        self.log.append(event, machine.format_detail(event, self._facts(ev)),
                        fsync=machine.STATE_FOR_EVENT.get(event) not in machine.UNSYNCED)

    def announce_artifact(self, ev: EventData) -> None:
        self._append("artifact_written", ev)

    def announce(self, ev: EventData) -> None:
        self._append(machine.EVENT_FOR_STATE[self.state], ev)
        if self.state == JobState.snapshotted:
            self.start_write()  # the staged write, once its line is out (overlap.py)
        if self.state == JobState.checkpointed and self.rotate_after is not None:
            # After the line: its fsync ran beside the one that makes the pointer's rename
            # durable, which rotation waits for before its own rename. Then the delete, the line
            # durable: its journal work would otherwise land in that fsync (docs/checkpoints.md).
            # A kill before this leaves one checkpoint too many, which the next rotation hides,
            # and one mid-delete a `.trash-` directory for cleanup.
            protect, self.rotate_after = self.rotate_after, None
            self.store.rotate(self.cfg.keep, self.cfg.world_size, protect=protect)
            self.store.start_deletions()
