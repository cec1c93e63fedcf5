"""The engine's driver: one launch of a job, driven by a training loop, yours or the CLI's.

    with trainjob.Run("pvc", state=model, steps=1000, ckpt_every=100) as run:
        for step in run:              # from the step a resume found, to the last (or an agreed stop)
            run.report(train_step(step))
        run.gate(holdout=..., baseline=..., export=...)
    sys.exit(run.exit_code)

Entering takes the rank's identity (torchrun's RANK and WORLD_SIZE), the PVC lock, and lets the
machine decide how this launch begins (resume, fresh attempt, or job_failed: ``Job``); the ranks
join. Iterating yields each step to train; after the body, the step's checkpoint when one is
due, and on a stop (SIGTERM or SIGINT at any rank) the agreed last step is saved and the loop
ends. ``gate`` is the drift gate and the published artifact. Leaving ends the launch. Every end
is a state on the PVC and an exit code (``exits.py``); ``trainjob run`` is a client of this
class (cli.py's ``train``), so a script gets exactly the CLI's guarantees and log.

Misuse, each with its end (the attempt stays in flight on the PVC, resumable from its newest
checkpoint, and nothing half-written counts). Every end is decided in ``__exit__`` (``__enter__``
for the start) through ``exits.py``'s one table, so no way out of the ``with`` block exits 0
without ``completed``, or 1 without ``drift_failed``/``job_failed``:

    an exception in the loop body, in  its exit code (a TrainJobError's; 70 for any other), no
    ``state_dict`` or ``load_state_dict``  checkpoint of the step it interrupted; a refused load is 2
    a process group's error for a lost  PeerFailed, exit 75, one line naming the rank that left
    peer, from any collective (W > 1)   (``ranks/lost.py``), without a ``try`` in the loop
    ``sys.exit()`` of any code, or a     SystemExit(75): the process ends, the step is not saved
    raised ``KeyboardInterrupt``, in the  (once the outcome is decided: SystemExit(its code))
    body or the state's methods
    ``GeneratorExit``, a bare            SystemExit(70), with its traceback
    ``BaseException``
    out of memory loading a checkpoint   OutOfMemory, exit 75 (the checkpoint is not at fault)
    a step ended without ``report``,    UsageError, exit 2
    ``report`` twice in one step
    a loss that is not a number from 0  UsageError, exit 2, naming the step (``check_loss``: a
    to 9.0e12, or a tensor or array of  one-element tensor or array is a number; a larger loss
    other than one element, or on the   would not stay exact in the log)
    meta device
    a meta-device tensor in the state   UsageError, exit 2, naming the array
    or the ``gate``'s export
    ``end_early()`` outside a step, but UsageError, exit 2 (in a step it ends the loop there:
    before the loop of a resumed run     an early stop; the gate is due)
    a ``break`` out of the loop, or     UsageError, exit 2: the steps since the last checkpoint
    leaving without ``gate`` when due   are not saved, and a relaunch resumes
    ``gate`` before the last step       UsageError, exit 2
    a Run entered off the main thread   UsageError, exit 2 (signal handlers are the main thread's)

At W > 1, a launch that ends before its first step (a refused start, a rank that never answered,
a stop before every rank joined) ends the process at ``for step in run``, on every rank, with its
exit code: the rest of the block (the gate's collectives) could wait on a rank that is not there.

An early end (early stopping): ``run.end_early()`` in a step's body, on every rank at the same
step, ends the loop after that step: the step is saved (its checkpoint forced, holding the state
as it is now) and the gate is due, as after the last step. Called where the step was not trained
(no ``report`` yet: the framework's loop ended instead), the run ends at the step before it;
called before the loop (a resume whose state says the training had ended), at the step it resumed
from. A relaunch resumes from that checkpoint, and the script ends early again there.

Signals: SIGTERM and SIGINT are noted, the step finishes, its checkpoint is saved, exit 75. A
Run inside another's ``with`` block is allowed: the signal is passed on to the handler the
inner Run displaced (``StopFlag``), so every enclosing Run stops too, as does a script's own
handler; leaving puts every displaced handler back. Once the ``with`` block has ended, a SIGTERM
with its default action is ignored (the outcome is decided; see ``_after_the_run``): end the
script promptly with ``sys.exit(run.exit_code)``.

The ``with`` block ends every ``Exception`` in ``exit_code``: it prints the error in one line (a
bug's traceback in full) and does not re-raise it, because an uncaught exception would exit 1,
which here means an honest failure. ``raise_errors=True`` re-raises instead (the CLI maps it
itself); the BaseExceptions above end the process with SystemExit in either mode.

Must not: write a file or a log line itself (``Job``'s callbacks and the stores do), or decide
how a launch begins (the machine does, through ``decisions.py``).
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import TracebackType
from typing import Any

import attrs

from . import decisions, machine
from .completion import Completion, completed_job
from .config import DEFAULT_LOG, RunConfig, as_setting, from_python, idempotent_from
from .job import ARTIFACT_FORMATS, Job, StopFlag
from .progress import Narrated, Narrator, metric_verdict
from ..checkpoint.background import BackgroundSaver
from ..checkpoint.plan import Ref
from ..checkpoint.snapshot import Gathered, HostState
from ..checkpoint.store import Loaded, ShardWriter
from ..defaults import ASYNC_WRITE_TIMEOUT, BACKOFF_LIMIT
from ..errors import (InputError, PeerFailed, PeerRefused, Refused, ReplicasDisagree, StateMismatch, Superseded, TrainJobError,
                      TryAgainLater, UsageError, memory_errors, missing_extra, one_line, os_errors)
from ..exits import EXIT_INTERNAL, EXIT_RELAUNCH, EXIT_USAGE, exit_code_for, exit_code_for_state
from ..ranks.identity import resolve_rank
from ..ranks import connect, lost, torchrun
from ..ranks.peers import refused_by, stopped_before_joining
from ..records import Candidate, Metric, Refusal, Score, Session
from ..states import State as JobState
from ..storage.eventlog import check_writable
from ..storage.backend import Url, as_location
from ..storage.durable import check_path, make_dir, missing_dirs, remove_empty
from ..storage.pvc import Pvc
from ..trainers.protocol import State, Stateful, check_loss, check_resumable, restore

# A run that names no data: the empty input's hash, so a resume cannot tell other data apart.
NO_DATA_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

# How long a rank whose collective failed waits for the other survivors to say so, to name the
# rank that left (``ranks/store.py``'s ``absent``): survivors meet the failure within moments.
LOST_GRACE = 3.0


def resume_into(stateful: Stateful, host: HostState, loaded: Loaded, where: str, rank: int) -> None:
    """Hand a verified checkpoint to the live state, once it is known to hold exactly its arrays
    and plain values that fit (host arrays that were read in place are the state's own memory:
    its copy is a no-op); ``rank`` takes its own rank-local state."""
    assert host.specs is not None
    check_resumable(host.specs, loaded.manifest.tensors, where)
    dropped = loaded.manifest.resharded_from is not None  # `reshard --drop-rank-local` (the log says so)
    restore(stateful, host.live(loaded.tensors, *loaded.documents(rank), where=where, local_dropped=dropped))


class Run:
    """One launch of a training job around your own loop, with every guarantee `trainjob run` gives.

    ``state`` is the Stateful object a checkpoint holds (``state_dict()`` / ``load_state_dict()``:
    your model and optimizer; see docs/trainers.md). The settings are `trainjob run`'s flags:
    ``steps``, ``ckpt_every``, ``max_drop`` (the gate's percentage), ``backoff_limit``, ``keep``,
    ``rank_timeout``, ``die_at`` (the lab's kill hook). ``lr`` and ``data_sha256`` pin what an
    attempt trains on: a resume with another value is refused (exit 2); left out, they are not
    checked. ``name`` is recorded in the artifact and must match across ranks. ``rank`` and
    ``world_size`` default to torchrun's environment (one rank otherwise); ``log`` to
    ``<pvc>/log.jsonl``. ``idempotent``: a job that already completed, with an artifact that
    still verifies, ends at once with exit 0 (``completion`` says so) instead of exit 2; a
    missing or altered artifact is still exit 2. ``TRAINJOB_IDEMPOTENT=1`` in the environment
    turns it on too (what ``k8s render`` sets in an own loop's pods).
    ``async_checkpoint``: each checkpoint is copied into host staging buffers and written by a
    background thread while the loop trains on (docs/howto/async.md: when to choose it; overlap.py).
    ``progress``: rank 0 shows the run's progress on stderr (on a terminal, a line rewritten after
    every step; elsewhere, a line per checkpoint); False keeps only the line saying how the launch
    ended, which rank 0 always prints (``progress.py``). The decision log is the same either way.
    """

    def __init__(self, pvc: str | os.PathLike[str], *, state: Stateful, steps: int, ckpt_every: int,
                 lr: float | None = None, data_sha256: str | None = None, max_drop: int = 20,
                 backoff_limit: int = BACKOFF_LIMIT, keep: int = 3, log: str | os.PathLike[str] | None = None,
                 rank: int | None = None, world_size: int | None = None, rank_timeout: float = 60.0,
                 idempotent: bool = False, artifact_format: str = "safetensors", name: str = "own-loop",
                 die_at: int | None = None, progress: bool = True, raise_errors: bool = False,
                 stop: StopFlag | None = None, async_checkpoint: bool = False) -> None:
        """Nothing is checked or touched here: entering the ``with`` does it, so that every error
        ends in ``exit_code``. ``stop``: a StopFlag already installed (the CLI installs it before
        it builds the trainer); by default the run installs its own while it is entered."""
        self._pvc_given, self._log_given = pvc, log  # checked on entering, as locations: a directory or an s3:// prefix
        self.stateful, self.data_sha256 = state, data_sha256 or NO_DATA_SHA256
        self.lr_given = lr is not None
        self.cfg = RunConfig(steps=steps, ckpt_every=ckpt_every, lr=lr if lr is not None else 0.0, max_drop=max_drop,
                             backoff_limit=backoff_limit, die_at=die_at, keep=keep, rank_timeout=rank_timeout,
                             trainer=name, world_size=world_size or 1, async_checkpoint=async_checkpoint)
        self.rank, self.world_size = rank, world_size
        self.idempotent, self.artifact_format, self.progress = idempotent, artifact_format, progress
        self.raise_errors, self.stop = raise_errors, stop
        # What happened: ``final`` is the machine's state once the launch ended; ``error`` the
        # error that ended it instead; ``completion`` an idempotent start's finding.
        self.final: str | None = None
        self.error: BaseException | None = None
        self.completion: Completion | None = None
        self.from_step = 0
        self._stack = ExitStack()
        self._job: Job | None = None
        self._peers: Any = None  # a Coordinator on rank 0, a Follower on the others (ranks/connect.py)
        self._writer: ShardWriter | None = None
        self._session: Session | None = None
        self._skip: set[int] = set()  # generations a follower left (rank 0 relaunched)
        self._host = HostState()
        self._saver: BackgroundSaver[int] | None = None  # a follower's, with async_checkpoint (rank 0: the Job's)
        self._launch_open = False  # rank 0 leads a launch it has not finished (published or not)
        self._iterated = self._loop_over = self.gate_due = False
        self._entered = False  # the launch began (or found its outcome): no longer refusable untouched
        self._step: int | None = None  # the step the loop body is training
        self._narrator: Narrator | None = None  # rank 0's voice on stderr (progress.py)
        self._loss: int | None = None  # its reported loss, in thousandths
        self._early = False  # end_early(): the loop ends after this step
        self.last_step: int | None = None  # the step the loop ended at (the model the gate publishes)

    # --- entering ---------------------------------------------------------------------------

    def __enter__(self) -> Run:
        try:
            self._enter()
            self._entered = True
        except BaseException as exc:
            self._end_with(exc)
            if not isinstance(exc, Exception):
                raise SystemExit(self.exit_code) from exc
            if self.raise_errors:
                raise
        return self

    def _enter(self) -> None:
        if self.stop is None:
            if threading.current_thread() is not threading.main_thread():
                raise UsageError("trainjob.Run must be entered on the main thread: it catches SIGTERM and SIGINT "
                                 "there (Python's rule for signals) to checkpoint before a stop")
            self.stop = StopFlag()
            self._stack.callback(_after_the_run, self.stop.install())
        self.cfg = from_python(self.cfg)
        self.pvc_path = as_location(self._pvc_given, "pvc")
        self.log_path = (as_location(self._log_given, "log") if self._log_given is not None
                         else self.pvc_path / DEFAULT_LOG)
        spec = resolve_rank(*(None if v is None else as_setting(n, v, int)
                              for n, v in (("rank", self.rank), ("world_size", self.world_size))), os.environ)
        if spec.rank is None:
            raise UsageError(f"world size {spec.world_size} needs one process per rank: launch the script "
                             "with torchrun (it sets RANK and WORLD_SIZE), or pass rank=")
        self.rank, self.world_size = spec.rank, spec.world_size
        self.cfg = cfg = attrs.evolve(self.cfg, world_size=spec.world_size)
        cfg.check(lr_required=self.lr_given)
        if self.artifact_format not in ARTIFACT_FORMATS:
            raise UsageError(f"artifact_format is {self.artifact_format!r}; use one of {', '.join(ARTIFACT_FORMATS)}")
        # The environment can only turn it on: a rendered pod's own loop (k8s render sets it) is
        # idempotent without the script saying so; checked before the PVC is touched.
        self.idempotent = bool(self.idempotent) or idempotent_from(os.environ)
        connect.check_pvc(self.pvc_path, self.world_size, os.environ)
        check_path(self.pvc_path)
        if self.log_path.parent != self.pvc_path:  # a log of its own: a PVC that is a file is the PVC's error
            check_path(self.log_path)
        pvc = Pvc(self.pvc_path)
        if self.rank != 0:  # stopped already (a launcher ending a refused launch): take nothing, leave nothing
            stopped_before_joining(self.rank, self._signal)
        check_writable(self.log_path)
        # Stray tmp files are removed (and logged) by the start. A launch refused here, before it
        # began (a world-size mismatch, a peer's refusal, a signal before joining, a state that
        # cannot be checkpointed), takes away the lock file and the directories it created: the
        # PVC is left byte for byte as it was found, or not there at all if it was not.
        made = [] if isinstance(self.pvc_path, Url) else missing_dirs(self.pvc_path)
        if not isinstance(self.log_path, Url):
            made = sorted({*made, *missing_dirs(self.log_path.parent)}, key=lambda d: len(d.parts), reverse=True)
        self._stack.callback(lambda: None if self._entered else remove_empty(made))  # after the lock below
        pvc.create()
        if not isinstance(self.log_path, Url):
            with os_errors(self.log_path.parent, "cannot create the log's directory", InputError):
                make_dir(self.log_path.parent)
        self._stack.enter_context(pvc.lock(self.rank, tidy=lambda: not self._entered))
        if self.idempotent and (done := completed_job(pvc, self.log_path)) is not None:
            if self.rank == 0:
                # A kill the instant after `completed` was logged can leave a tmp file of the ranks'
                # outcome; no start will run to clear it, and its job's answer is already final.
                pvc.remove_stray_tmp()
            self.completion, self.final = done, JobState.completed
            return
        if self.rank == 0:
            self._lead(pvc)
        else:
            self._follow(pvc)

    def _signal(self) -> str | None:
        assert self.stop is not None
        return self.stop.signal

    def _lead(self, pvc: Pvc) -> None:
        """Rank 0: let the machine decide how this launch begins, then lead the other ranks."""
        cfg = self.cfg
        self._peers = peers = connect.coordinator(pvc, cfg.world_size, cfg.rank_timeout, self._signal)
        self._launch_open = True  # from here, an error ends the launch for every rank, with its code
        initial = self._host.snapshot(self.stateful.state_dict(), 0)  # checks the state; host views of it
        self._narrator = Narrator(sys.stderr, cfg.steps, str(self.pvc_path), progress=bool(self.progress))
        self._job = job = Job(cfg, pvc, Narrated(self.log_path, self._narrator), self.data_sha256, peers)
        if not peers.solo:  # which transport the ranks agree through, logged with the launch's first event
            job.notes.append(("ranks_coordinated", dict(transport=peers.transport, world_size=cfg.world_size)))
        # Before any write: a checkpoint holding other arrays than this state's, or a
        # load_state_dict that refuses it, ends the run here (exit 2) with the PVC untouched;
        # running out of memory on the way is 75.
        with memory_errors("loading the newest checkpoint"):
            job.read(into=initial, host=self._host)
            if job.loaded is not None and job.should_resume():
                resume_into(self.stateful, self._host, job.loaded, job.store.rel(job.store.path(job.loaded.ref)), 0)
        del initial  # the engine holds no reference to the state between checkpoints
        if job.saver is not None:
            job.saver.prepare(self.stateful.state_dict())  # the staging buffers, allocated before the loop
        job.start()
        loaded = job.loaded if job.state == JobState.resumed else None
        checkpoint, sha = (loaded.ref.name, loaded.manifest_sha256) if loaded else (None, None)
        job.loaded = loaded = None  # its arrays are the state's now (or were never used)
        if not peers.solo:
            peers.publish(lambda g: Session(
                generation=g, world_size=cfg.world_size, attempt=job.attempt, from_step=job.from_step,
                checkpoint=checkpoint, manifest_sha256=sha, settings=cfg.settings(self.data_sha256)))
        joined = peers.wait_joined()
        if job.state in machine.FINAL:  # out of retries, or a completion only left to announce
            return self._finish(job.state)
        if not joined:  # stopped before every rank was here: nothing trained, nothing to save
            job.kill(at_step=job.from_step, signal=self._signal() or peers.peer_signal())
            return self._finish(job.state)
        peers.begin()
        self.from_step = job.from_step

    def _follow(self, pvc: Pvc) -> None:
        """Ranks >= 1: join rank 0's newest launch and load the checkpoint it resumes from."""
        cfg = self.cfg
        if self._peers is None:
            self._peers = connect.follower(pvc, self.rank, cfg.world_size, cfg.rank_timeout, self._signal)
            self._writer = ShardWriter(pvc)
        peers, writer = self._peers, self._writer
        assert writer is not None
        initial = self._host.snapshot(self.stateful.state_dict(), 0)
        verified: list[Loaded] = []  # this rank's share of the last checkpoint it verified for rank 0

        def verify(candidate: Candidate) -> str | None:
            """Rank 0's verdict round (a sharded state): read and verify this rank's share."""
            verified.clear()
            ref = Ref.parse(candidate.checkpoint)
            assert ref is not None and self._host.specs is not None
            try:
                with memory_errors(f"verifying {candidate.checkpoint}"):
                    verified.append(writer.load_local(ref, self._host.specs, self._host.wanted(), self.rank,
                                                      candidate.manifest_sha256, initial if candidate.lend else None))
            except StateMismatch:
                raise  # another model's checkpoint is not damage: this rank ends as rank 0 does (2)
            except InputError as exc:
                return one_line(str(exc))
            return None

        self._session = session = peers.join(cfg.settings(self.data_sha256), self._skip,
                                             verify if self._host.sharded else None)
        if not peers.begun():  # rank 0 ended the launch before it began: end as it did
            self.final = peers.read_outcome().state
            return
        # Rank 0 began this generation, so it cannot commit (nor rotate this checkpoint away)
        # before this rank's first shard: a checkpoint that fails here really is damaged.
        if session.checkpoint:
            with memory_errors(f"loading {session.checkpoint}"):
                ref = Ref.parse(session.checkpoint)
                assert ref is not None and self._host.specs is not None
                if verified and (verified[0].ref, verified[0].manifest_sha256) == (ref, session.manifest_sha256):
                    loaded = verified.pop()  # read and verified in rank 0's verdict round
                elif self._host.sharded:
                    loaded = writer.load_local(ref, self._host.specs, self._host.wanted(), self.rank,
                                               session.manifest_sha256, initial)
                else:
                    loaded = writer.load(ref, session.manifest_sha256, into=initial)
                resume_into(self.stateful, self._host, loaded, session.checkpoint, self.rank)
            del loaded
        del initial, verified
        if cfg.async_checkpoint:
            self._saver = BackgroundSaver[int](ASYNC_WRITE_TIMEOUT)
            self._saver.prepare(self.stateful.state_dict())  # the staging buffers, allocated before the loop
        self.from_step = session.from_step

    # --- the loop -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        if self._iterated:
            raise UsageError("a Run is iterated once: one `for step in run` per `with`")
        self._iterated = True
        return self._steps()

    def _steps(self) -> Iterator[int]:
        if (self.final is not None or self.error is not None) and self._peers is not None and not self._peers.solo:
            # The launch ended before it began, at W > 1: nothing trains and the gate does nothing,
            # and the rest of the block could wait on a rank that is not there (a collective with a
            # stopped or dead peer waits out the process group's timeout). Every rank ends here.
            raise SystemExit(self.exit_code)
        while self.final is None and self.error is None:
            try:
                yield from self._train()
                break
            except Superseded:
                if self.rank == 0:
                    raise
                self._close_writes()  # a write for the old launch ends (it fails, or lands unused)
                assert self._session is not None
                self._skip.add(self._session.generation)  # rank 0 relaunched: follow its new launch
                self._follow(self._peers.pvc)
        self._step, self._loop_over = None, True

    def _train(self) -> Iterator[int]:
        """The step loop every rank runs: the same steps everywhere, saves at the same steps. A
        stop (a signal here or at any other rank) is agreed through the peers: every rank trains
        on to the largest step any rank had reached, saves it, and ends there."""
        cfg, peers = self.cfg, self._peers
        step = last_saved = self.from_step
        target, loss = None, 0
        peers.step = step
        while True:
            if target is None and peers.stop_wanted():
                target = peers.agree_stop()
            if self._early or step >= (cfg.steps if target is None else target):
                break
            step += 1
            self._step, self._loss = step, None
            yield step
            if self._loss is None:
                if self._early:  # the step was not trained: the run ends at the one before
                    step, self._step = step - 1, None
                    break
                raise UsageError(f"step {step} ended without run.report(loss); report every step's loss once")
            loss, self._step = self._loss, None
            peers.step = step
            if self._narrator is not None:
                self._narrator.step(step, loss)
            self._between()
            if decisions.should_checkpoint(step, cfg.ckpt_every, cfg.steps) or step == target:
                self._save(step, loss, step == target)
                last_saved = step
            if cfg.die_at == step:
                return self._end(step, stopped=False)
        if target is None and peers.stop_wanted():  # the stop came during the last step
            target = peers.agree_stop()
        if target is None:
            if self._early and step > last_saved:  # the early end's step, saved as it is now
                self._save(step, loss, True)
            self._settle(release=True)  # the last checkpoint lands (and is logged) before the gate
            self.gate_due, self.last_step = True, step
            return None
        if step > last_saved:  # save the step we finished before obeying the stop
            self._save(step, loss, True)
        return self._end(step, stopped=True)

    def end_early(self) -> None:
        """The training decided that the step it is at is its last (an early stop: Lightning's
        ``EarlyStopping``, the HF Trainer's ``EarlyStoppingCallback``), as every rank decides it.
        Called in the loop's body, the step is checkpointed when it ends (due or not), the loop
        ends and the gate is due, as after the last step; the artifact records that step. Called
        before the loop's first step, on a resume whose checkpoint holds that decision (the
        caller's state says so), the loop trains nothing and the gate is due. A stop (SIGTERM)
        during such a step saves it and ends the launch as any stop does: the relaunch resumes
        from the checkpoint that holds the decision. Called in a step that was not trained (no
        ``report`` yet: the framework's own loop ended instead), the run ends at the step before it."""
        if self.final is not None or self.error is not None or (
                self._step is None and (self._iterated or self.from_step == 0)):
            raise UsageError("run.end_early() belongs inside `for step in run`, or before it on a resume "
                             "(a run that stopped early at the step it resumed from)")
        self._early = True

    def report(self, loss: float) -> None:
        """The loss of the step being trained, once per step: a number >= 0 (``check_loss``: a
        Python or numpy number, a one-element tensor or array)."""
        if self._step is None:
            raise UsageError("run.report(loss) belongs inside `for step in run`, once per step")
        if self._loss is not None:
            raise UsageError(f"step {self._step}: run.report was called twice; report every step's loss once")
        self._loss = decisions.loss_milli(check_loss(loss, self._step))

    def _save(self, step: int, loss: int, force: bool) -> None:
        if self.cfg.async_checkpoint:  # copy into the staging buffers, and a thread writes
            self._settle()  # at most one in flight: wait for the previous one (back-pressure)
            if self.rank == 0:
                assert self._job is not None
                self._job.checkpoint(step=step, live=self.stateful.state_dict(), loss_milli=loss, force=force)
            else:
                assert self._saver is not None
                self._saver.hand_off(self.stateful.state_dict(), step, lambda arrays: self._write_shard(step, arrays))
            return
        arrays = self._host.snapshot(self.stateful.state_dict(), step)  # bad input writes nothing
        if self.rank == 0:
            assert self._job is not None
            with self._refusal_logged(step):
                self._job.checkpoint(step=step, state=arrays, specs=self._host.specs, loss_milli=loss, force=force)
            return
        self._write_shard(step, arrays)

    @contextmanager
    def _refusal_logged(self, step: int | None = None) -> Iterator[None]:
        """(rank 0) A checkpoint (of ``step``; by default the async write in flight) refused
        because the ranks' copies of replicated state disagree, raised by the save or, where an
        async write lands, by the writer thread: nothing was committed; said in the log
        (``refused``), so ``status`` says 2 as the run does."""
        try:
            yield
        except ReplicasDisagree as exc:
            job = self._job
            if job is not None and job.state in (*machine.TRAINING, JobState.snapshotted):
                at_step = job.in_flight["step"] if step is None else step
                job.refuse(at_step=at_step, reason=one_line(str(exc))[:400])
                raise refusal(exc, at_step) from exc
            raise

    def _write_shard(self, step: int, arrays: dict[str, Any]) -> int:
        """(ranks >= 1) This rank's shard of ``step`` and its receipt; with async_checkpoint, on
        the writer thread. Returns the shard's size."""
        session, writer, peers = self._session, self._writer, self._peers
        assert session is not None and writer is not None
        ref = Ref(attempt=session.attempt, step=step, world_size=self.cfg.world_size)
        staging = writer.staging(ref, session.generation)
        peers.wait_staging(staging, step)
        try:
            # The fsync left running: the transport's deliver waits for it (settle) before the
            # receipt (files) or after sending it (the store: rank 0 writes the manifest meanwhile).
            entry = writer.write_shard(staging, self.rank, self.cfg.world_size, step, arrays, fsync_later=True)
            peers.deliver(step, entry, lambda e: writer.write_receipt(staging, e), writer.settle)
        except TryAgainLater:
            peers.check_current()  # the staging directory went away with a stale generation
            raise
        return entry.size

    # --- async_checkpoint: where the loop meets the writer thread (overlap.py), main thread only

    def _between(self) -> None:
        """After every step: a write that ended lands (rank 0 logs `checkpointed`), or its error
        is raised here, at this step boundary."""
        if self.rank == 0:
            if self._job is not None and self._job.saver is not None:
                with self._refusal_logged():
                    self._job.at_boundary()
        elif self._saver is not None and self._saver.landed():
            self._saver.take()

    def _settle(self, release: bool = False) -> None:
        """Wait (bounded) for the write in flight and land it; ``release``: then drop the staging
        buffers, the run's last checkpoint being written."""
        saver = self._job.saver if self.rank == 0 and self._job is not None else self._saver
        if saver is None:
            return
        if self.rank == 0:
            assert self._job is not None
            with self._refusal_logged():
                self._job.settle()
        elif saver.in_flight:
            saver.wait()
            saver.take()
        if release:
            saver.release()

    def _close_writes(self) -> None:
        """On the way out with an error: let a write in flight end (bounded) before the PVC lock
        is let go, so no thread of this process writes to a PVC another process may own."""
        saver = self._job.saver if self.rank == 0 and self._job is not None else self._saver
        if saver is not None:
            saver.close(ASYNC_WRITE_TIMEOUT)

    def _end(self, step: int, stopped: bool) -> None:
        """The loop ended early: by the lab's kill hook, or an agreed stop (its step is saved)."""
        self._settle(release=True)  # a write in flight lands first: `killed` follows its `checkpointed`
        if self.rank != 0:
            self.final = self._peers.wait_outcome().state
            return
        assert self._job is not None
        if stopped:
            self._job.kill(at_step=step, signal=self._signal() or self._peers.peer_signal())
        else:
            self._job.kill(at_step=step)
        self._finish(self._job.state)

    # --- the gate and the end -------------------------------------------------------------------

    def gate(self, *, export: State, holdout: Score | None = None, baseline: Score | None = None,
             metric: Metric | None = None) -> None:
        """After the last step: publish ``export`` (the arrays a user of the model needs) as the
        attempt's artifact if the model holds up against its frozen baseline (completed, exit 0),
        else refuse it (drift_failed, exit 1); ``max_drop`` percent is the tolerance. The model's
        score is either ``holdout`` and ``baseline``, two ``Score``s (correct predictions out of
        a total), or ``metric``, a ``Metric`` (a validation loss, a perplexity, an accuracy
        against its frozen value; ``decisions.metric_counts`` says how it is judged). A metric
        that is not a finite number from 0 (its baseline above 0) is refused, exit 2. Does
        nothing when the run has already ended (a stop, out of retries, already completed);
        ranks >= 1 wait for rank 0's verdict instead."""
        if self.final is not None or self.error is not None:
            return
        if not self.gate_due:
            raise UsageError("run.gate(...) comes after `for step in run` has trained the last step")
        self.gate_due = False
        try:
            holdout, baseline = self._scores(holdout, baseline, metric)
            if metric is not None and self._narrator is not None:
                self._narrator.verdict = metric_verdict(metric, self.cfg.max_drop)
            self._gate(holdout, baseline, export)
        except UsageError as exc:  # the export cannot be published: said in the log, so `status` says 2
            if self.rank == 0 and self._job is not None and self._job.state in machine.TRAINING:
                self._job.refuse(at_step=self.cfg.steps, reason=one_line(str(exc))[:400])
                raise refusal(exc, self.cfg.steps) from exc
            raise

    def _scores(self, holdout: Score | None, baseline: Score | None, metric: Metric | None) -> tuple[Score, Score]:
        """The two Scores the machine's gate judges: given, or ``metric``'s (``metric_scores``)."""
        if metric is None:
            if not (isinstance(holdout, Score) and isinstance(baseline, Score)):
                raise UsageError("run.gate(...) takes holdout= and baseline=, two trainjob.Score, or metric=, a "
                                 f"trainjob.Metric; got holdout={holdout!r}, baseline={baseline!r}")
            return holdout, baseline
        if holdout is not None or baseline is not None:
            raise UsageError("run.gate(...) takes holdout= and baseline= or metric=, not both")
        return metric_scores(metric)

    def _gate(self, holdout: Score, baseline: Score, export: State) -> None:
        if Gathered.wanted(export):  # a sharded model: every rank joins the gathering, tensor by tensor
            if self.artifact_format != "safetensors":
                raise UsageError("a sharded model (DTensors) is published as safetensors only; leave "
                                 "artifact_format at its default")
            export = Gathered(export)
            # Rank 0 gathers only if the gate passes: the same pure decision, taken on the same
            # scores (a sharded model's gate must be given the same ones on every rank).
            if self.rank != 0 and decisions.drift_passes(holdout.correct, holdout.total, baseline.correct,
                                                         self.cfg.max_drop):
                export.drain()
        if self.rank != 0:
            self.final = self._peers.wait_outcome().state
            return
        assert self._job is not None
        self._job.gate(exported=export, format=self.artifact_format, holdout=holdout, baseline=baseline,
                       step=self.last_step)
        self._finish(self._job.state)

    def _finish(self, state: str) -> None:
        self.final = state
        if self._launch_open:
            self._launch_open = False
            self._peers.finish(state)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 _tb: TracebackType | None) -> bool:
        """Every way out of the ``with`` block ends here, in a code of ``exits.py``'s table. An
        exception (``Exception``) ends in ``exit_code``, suppressed (or re-raised with
        ``raise_errors``). Any other BaseException (``sys.exit()``, ``KeyboardInterrupt``,
        ``GeneratorExit``) is the process being ended: it becomes ``SystemExit(exit_code)``, so the
        process exits with a code of the table whatever the script asked for. Before the
        outcome that is the error's code (75, or 70); once it is decided (after ``gate``, a stop,
        an idempotent finding), the outcome's."""
        try:
            return self._leave(exc)
        finally:
            if self.final is not None or self.error is not None:
                torchrun.report(self.exit_code)  # under `trainjob torchrun`: the code decided, whatever comes next

    def _leave(self, exc: BaseException | None) -> bool:
        leaving = exc is not None and not isinstance(exc, Exception)
        after = exc if exc is not None and self._decided() else None
        if after is not None:
            # The outcome stands, as the log says it: the script ends the process with its code.
            # An error after it (the script's own code after ``gate``, a collective a peer that
            # already exited cannot join) is said, and changes neither.
            if not leaving:
                self._said_after_the_outcome(after)
            exc = None
        made: BaseException | None = None
        if exc is None and self.final is None and self.error is None:
            exc = made = self._unfinished()
        elif exc is not None and (lost := self._lost_peer(exc)) is not None:
            self._end_with(lost)  # the body's error was a peer leaving: 75, said in one line
            if self.raise_errors:
                raise lost from exc
            return True
        if exc is not None:
            self._end_with(exc)
        else:
            try:
                self._stack.close()
            except Exception as late:  # putting the signal handlers back, letting go of the lock
                if self._decided():
                    self._said_after_the_outcome(late)
                else:
                    self._end_with(late)
                    made = late
            if self.completion is not None and not self.raise_errors:
                _say(f"trainjob: {self.completion.line()}")
            if self._narrator is not None and self.final is not None and self.error is None:
                self._narrator.ending(self.final, self.exit_code)
        if leaving:
            raise SystemExit(self.exit_code) from None
        if made is not None and self.raise_errors:
            raise made
        return after is not None or (exc is not None and exc is not made and not self.raise_errors)

    def _decided(self) -> bool:
        """The launch's outcome is decided, and logged by rank 0: completed, drift_failed,
        job_failed, killed, or an idempotent finding."""
        return self.final is not None and self.error is None

    def _said_after_the_outcome(self, exc: BaseException) -> None:
        code = self.exit_code
        if not isinstance(exc, TrainJobError):  # a bug, here or in the script: all of it
            _say("".join(traceback.format_exception(exc)).rstrip())
        _say(f"trainjob: {one_line(str(exc)) or type(exc).__name__}: after the run's outcome ({self.final}), "
             f"which stands (exit {code})")

    def _lost_peer(self, exc: BaseException) -> PeerFailed | None:
        """A collective that failed because a peer went away (``ranks/lost.py``), escaping the
        body (a forward's all-gather, a backward's all-reduce, an optimizer's, the user's own)
        or a run's own collective: PeerFailed naming the rank that left, as the transport tells
        (within a grace of a few seconds), else None. Only with peers, only before an outcome or
        another error; anything else in the body stays what it is (a bug: 70)."""
        if (self.world_size or 1) < 2 or self.error is not None or not isinstance(exc, Exception) \
                or isinstance(exc, TrainJobError) or (failed := lost.collective_failure(exc)) is None:
            return None
        absent = None
        if self._peers is not None:
            absent = self._peers.absent(min(self.cfg.rank_timeout, LOST_GRACE))
        who = (f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}") if absent else "a peer"
        error = PeerFailed(f"{who} left the launch {self._where()}: a collective failed ({failed}); "
                           "nothing is wrong with the job, relaunch all ranks together")
        error.__cause__ = exc
        return error

    def _unfinished(self) -> UsageError:
        """The block ended with no outcome and no error: how the loop was misused."""
        if self.gate_due:
            return UsageError("the loop trained the last step but run.gate(...) was never called; "
                              "a relaunch resumes at the gate")
        if self._loop_over:  # a Superseded follower whose new launch ended unbegun
            return UsageError("the run ended without an outcome")
        return UsageError(f"the run's loop ended {self._where()} (a break, or no `for step in run`): it must run to "
                          "its end; the steps since the last checkpoint are not saved")

    def _where(self) -> str:
        if self._step is not None:  # the body of this step is running
            return f"at step {self._step}"
        return "between steps" if self._iterated else "before its first step"

    def _end_with(self, exc: BaseException) -> None:
        """End the launch with an error: tell the other ranks, let go of the PVC, say it."""
        if self.error is not None:
            return
        if self._narrator is not None:
            self._narrator.close()  # a progress line left open: what follows starts on its own line
        self.error = exc = missing_extra(exc) or exc  # an optional package not installed: 2, naming its extra
        if self.rank == 0 and self._launch_open and exit_code_for(type(exc)) == EXIT_RELAUNCH:
            self.error = exc = self._refused_by_a_peer(exc)
        try:
            self._close_writes()
            self._tell_rank_0(exc)
            self._log_refusal(exc)
            if self._launch_open:
                self._launch_open = False
                self._peers.finish("error", f"{type(exc).__name__}: {exc}", exit_code_for(type(exc)))
        except Exception as late:  # the first error decides the exit code; this one is said
            _say(f"trainjob: while ending the run: {one_line(str(late))}")
        finally:
            self._stack.close()
        code = self.exit_code
        if not isinstance(exc, Exception):  # the process is being ended: said in both modes
            if code == EXIT_INTERNAL:
                _say("".join(traceback.format_exception(exc)).rstrip())
            _say(f"trainjob: {_named(exc)} {self._where()}: the run stops here, the steps since its last "
                 f"checkpoint are not saved; a relaunch resumes (exit {code})")
        elif not self.raise_errors:
            if not isinstance(exc, TrainJobError):  # a bug, here or in the loop: all of it
                _say("".join(traceback.format_exception(exc)).rstrip())
            _say(f"trainjob: {one_line(str(exc))} (exit {code})")

    def _refused_by_a_peer(self, exc: BaseException) -> BaseException:
        """(rank 0, ending the launch with 75) A rank that refused the launch and left (a NaN
        only it saw) is why this rank found it gone: the launch is refused (2, logged) as the job's
        exit says, not a relaunch. ``exc`` when no rank refused, or the peers cannot say."""
        try:
            refusals = self._peers.refusals()
        except TrainJobError:  # the store went with the launcher: the peer's word is lost
            return exc
        if not refusals:
            return exc
        refused = refused_by(refusals[0])
        refused.__cause__ = exc
        return refused

    def _tell_rank_0(self, exc: BaseException) -> None:
        """(ranks >= 1) An exit 2 of this rank's own (not rank 0's word) in a joined launch: said
        to rank 0, which logs it and ends every rank with it."""
        if (self.rank != 0 and self._session is not None and exit_code_for(type(exc)) == EXIT_USAGE
                and not isinstance(exc, PeerRefused)):
            step = self._step if self._step is not None else self._peers.step
            self._peers.refuse(Refusal(rank=self.rank, step=step, message=one_line(str(exc))[:400]))

    def _log_refusal(self, exc: BaseException) -> None:
        """(rank 0) An error that ends a launch which began (``job_started`` or ``resumed`` is
        logged) with exit 2 is said in the log too, ``refused``, so that ``status`` says 2 as the
        process does: a loss that is not a number, a step without ``report``, a ``break``, a
        missing ``gate``, a state that cannot be checkpointed. The attempt stays in flight for the
        mended script, as every refusal leaves it."""
        job = self._job
        if (self.rank != 0 or job is None or exit_code_for(type(exc)) != EXIT_USAGE
                or job.state not in (*machine.TRAINING, JobState.snapshotted)):
            return
        step = self._step if self._step is not None else self._peers.step
        job.refuse(at_step=step, reason=one_line(str(exc))[:400])

    @property
    def exit_code(self) -> int:
        """What the process should exit with: the final state's code, or the error's."""
        if self.error is not None:
            return exit_code_for(type(self.error))
        if self.final is None:
            raise UsageError("run.exit_code is known once the `with Run(...)` block has ended")
        return exit_code_for_state(self.final)


def refusal(exc: Refused, step: int) -> Refused:
    """A refusal the log now holds (``refused``), said as the launch's one last line: what was
    refused, and what a relaunch does. The same class, so its exit code and its catchers stay."""
    return type(exc)(f"refused at step {step}: {exc}; a relaunch of the mended script resumes from the newest "
                     "checkpoint")


def metric_scores(metric: Metric) -> tuple[Score, Score]:
    """The holdout's and the baseline's Score for ``metric`` (``decisions.metric_counts``), or a
    UsageError (exit 2) saying what is wrong with it."""
    if not isinstance(metric, Metric):
        raise UsageError(f"metric= takes a trainjob.Metric, got {type(metric).__name__}")
    name = one_line(str(metric.name))[:80]
    largest = decisions.MAX_COUNT / decisions.METRIC_PARTS

    def number(what: str, given: object) -> float:
        if isinstance(given, bool) or not isinstance(given, numbers.Real):
            raise UsageError(f"the gate's {name}: {what} is a {type(given).__name__}, not a number (for a tensor, "
                             "pass its .item())")
        value = float(given)
        if not (math.isfinite(value) and 0 <= value <= largest):
            raise UsageError(f"the gate's {name}: {what} is {value!r}; a metric is a finite number from 0 to "
                             f"{largest:.4g}")
        return value

    value, baseline = number("its value", metric.value), number("its baseline", metric.baseline)
    if baseline == 0:
        raise UsageError(f"the gate's {name}: its baseline is 0; a baseline is above 0 (it scales the tolerance)")
    if not isinstance(metric.higher_is_better, bool):
        raise UsageError(f"the gate's {name}: higher_is_better is {metric.higher_is_better!r}, not True or False")
    correct, total, baseline_correct = decisions.metric_counts(value, baseline, metric.higher_is_better)
    return Score(correct=correct, total=total), Score(correct=baseline_correct, total=total)


def gate_arguments(verdict: Metric | tuple[Score, Score]) -> dict[str, Any]:
    """What an integration's ``gate`` callable returned (a Metric, or the holdout's and the
    baseline's Score), as ``Run.gate``'s keywords."""
    if isinstance(verdict, Metric):
        return {"metric": verdict}
    try:
        holdout, baseline = verdict
    except (TypeError, ValueError):
        raise UsageError(f"the gate returned {type(verdict).__name__}; return a trainjob.Metric, or the holdout's "
                         "and the baseline's trainjob.Score") from None
    return {"holdout": holdout, "baseline": baseline}


def _after_the_run(uninstall: Callable[[], None]) -> None:
    """Put the previous signal handlers back, except that a default SIGTERM becomes ignored: the
    outcome is decided (and logged), and a SIGTERM now, say torchrun stopping this rank because
    another already exited, or Kubernetes deleting the pod, would end the process as killed
    (143) instead of with ``exit_code``. Ignored, not handled: Python restores default handlers
    while it shuts down, but leaves an ignored signal ignored. (The CLI's ``entry`` does the same.)"""
    uninstall()
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _named(exc: BaseException) -> str:
    """A BaseException as the script wrote it, in one short line: ``sys.exit(0)``, ``KeyboardInterrupt``."""
    if isinstance(exc, SystemExit):
        return f"sys.exit({one_line(repr(exc.code))[:60]})"
    return one_line(f"{type(exc).__name__}{': ' if str(exc) else ''}{exc}")[:120]


def _say(text: str) -> None:
    """Print to stderr; a message that cannot be written must not change the exit code."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass
