"""Ranks: how ranks coordinate through the PVC: ``coordination.py``'s interface, on files.

Ranks share nothing but the PVC (a ReadWriteMany volume in Kubernetes). Every wait is bounded by
``--rank-timeout`` and ends in RankTimeout (exit 75), never a hang. Files, under ``P/ranks/``:

    session.json                 Session: rank 0's word for this launch (generation, resume point)
    g00000003/join-00001.json    rank 1 joined generation 3
    g00000003/join-00000.json    rank 0 saw every rank join: generation 3 begins
    g00000003/stop-00001.json    rank 1 must stop (a signal, its own or a peer's): after which step
    g00000003/refused-00001.json rank 1 refused generation 3 and left (a Refusal: a NaN only it saw)
    g00000003/outcome.json       how rank 0 ended generation 3 (the other ranks exit with it)

The protocol, in short (docs/checkpoints.md has the long form):

1. Rank 0 takes the job lock, decides how this launch begins (the state machine), writes
   ``session.json`` with generation = previous + 1, and waits until every rank has joined.
2. A rank joins the newest generation that matches its settings and has neither begun nor
   ended, waits for rank 0 to begin it, loads the checkpoint the session names (verifying it),
   and trains the same steps as rank 0. So a rank that reads a killed launch's session follows
   the next one rather than training for (or, under torchrun, blocking in a collective with) a
   launch nobody leads.
3. At a checkpoint step rank 0 creates the staging directory; every other rank waits for it,
   writes its own shard, then a receipt with the shard's size and sha256. Rank 0 commits when all
   receipts are there. A rank that sees a newer generation drops what it was doing and rejoins.
4. A stop (SIGTERM at any rank) is agreed, not imposed: each rank notes the step it has reached,
   and all train on to the largest noted step, save it, and stop there.

``PvcCoordinator`` is rank 0's side, ``PvcFollower`` every other rank's, ``PvcPeers`` what both
do. This module decides nothing about training; ``engine/job.py`` drives it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import (InputError, PeerFailed, PeerRefused, RankTimeout, Superseded, TrainJobError, TryAgainLater,
                      os_errors)
from ..storage.durable import atomic_write, make_dir
from ..storage.pvc import Pvc
from ..records import Candidate, Outcome, RankNote, Refusal, Session, ShardEntry, dumps
from ..exits import exit_code_for_state
from .coordination import Follower

T = TypeVar("T")
POLL = 0.001  # first poll interval, grows by half each time up to POLL_MAX: a small checkpoint's
# receipts arrive within milliseconds, and a wait overshoots by at most half of what it waited
POLL_MAX = 0.1


# --- waiting, bounded ----------------------------------------------------------------------------

def wait_for(check: Callable[[], T | None], timeout: float, what: Callable[[], str],
             poll: Callable[[], None]) -> T:
    """Call ``poll`` then ``check`` until ``check`` returns something; RankTimeout after ``timeout`` s.

    ``what`` describes what was awaited, asked only when the wait runs out (so it can say what
    was still missing at that moment).
    """
    deadline, delay = time.monotonic() + timeout, POLL
    while True:
        poll()
        result = check()
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            raise RankTimeout(f"waited {timeout:g}s for {what()}; relaunch all ranks together "
                              "(or raise --rank-timeout)")
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX)


# --- joining, either transport (store.py's follower joins by the same rules) -----------------------

def joinable(session: Session | None, skip: set[int], over: Callable[[int], bool], world_size: int,
             settings: str, seen: list[str]) -> Session | None:
    """(ranks >= 1, joining) ``session`` if this rank can join it, else None to wait on: there is
    none yet, this rank left it (``skip``), it is ``over`` (ended, or begun without this process:
    rank 0 begins once every rank has joined, so a previous process of this rank was there, and it
    is a previous launch's), or it has other settings (said in ``seen``, for the timeout's message)."""
    if session is None or session.generation in skip or over(session.generation):
        return None
    if (session.world_size, session.settings) != (world_size, settings):
        seen[:] = [f"rank 0's session (generation {session.generation}) has other settings: {session.settings} "
                   f"world_size={session.world_size}, this rank: {settings} world_size={world_size}"]
        return None
    return session


def stopped_before_joining(rank: int, stop_signal: Callable[[], str | None]) -> None:
    """(ranks >= 1, while joining) A signal before this rank joined: nothing to save, just go (75)."""
    if stop_signal():
        raise TryAgainLater(f"rank {rank}: stopped by {stop_signal()} before joining a launch")


def begun_or_ended(follower: Follower) -> bool | None:
    """(ranks >= 1, after joining) True once rank 0 began the joined launch or ended it; PeerFailed
    if it ended in an error; None while neither."""
    if follower.begun():
        return True
    outcome = follower.read_outcome()
    raise_if_failed(outcome)
    return None if outcome is None else True


def refused_by(refusal: Refusal) -> PeerRefused:
    """(rank 0, either transport) The error rank 0 ends a launch with when another rank refused it."""
    return PeerRefused(f"rank {refusal.rank}: {refusal.message}")  # the log's `refused` says rank 0's step


def ended(generation: int, state: str, message: str, code: int | None) -> Outcome:
    """(rank 0, either transport) The Outcome of a launch: the state's exit code unless given."""
    return Outcome(generation=generation, state=state, message=message,
                   code=exit_code_for_state(state) if code is None else code)


# --- every rank ------------------------------------------------------------------------------------

class PvcPeers:
    """(all ranks) This rank's view of the others through ``P/ranks/``: ``Coordination`` on a PVC.

    With one rank every call is trivial. Rank 0 uses ``PvcCoordinator``, the others ``PvcFollower``.
    """

    transport = "files"

    def __init__(self, pvc: Pvc, rank: int, world_size: int, timeout: float, stop_signal: Callable[[], str | None]):
        self.pvc, self.rank, self.world_size, self.timeout = pvc, rank, world_size, timeout
        self.root = pvc.root / "ranks"
        self.session_path = self.root / "session.json"
        self.generation = 0
        self.step = 0  # the last step this rank completed: what it notes when asked to stop
        self.stop_signal = stop_signal
        self.stopping_note: RankNote | None = None

    @property
    def solo(self) -> bool:
        return self.world_size == 1

    def gen_dir(self, generation: int | None = None) -> Path:
        """Where a generation's notes live (this rank's generation by default)."""
        return self.root / f"g{self.generation if generation is None else generation:08d}"

    def _note_path(self, kind: str, rank: int, generation: int | None = None) -> Path:
        return self.gen_dir(generation) / f"{kind}-{rank:05d}.json"

    def _write(self, path: Path, record: object) -> None:
        # Never creates directories: rank 0 creates each generation's, so a rank still working
        # for a generation rank 0 has removed fails here instead of leaving litter behind.
        atomic_write(path, (dumps(record) + "\n").encode())

    def _read_session(self) -> Session | None:
        return self.pvc.read_record(self.session_path, Session)

    def poll(self) -> None:
        """(all ranks) Run during every wait: pass on a stop."""
        self._pass_on_stop(None)

    def _pass_on_stop(self, notes: list[str] | None) -> None:
        """Note a stop if a signal reached this rank or another rank noted one (``notes``: this
        generation's notes, listed by the caller; listed here when needed if None)."""
        if self.stopping_note is None and (self.stop_signal() or self._peer_stopping(notes)):
            self._note_stop()

    def _peer_stopping(self, notes: list[str] | None = None) -> bool:
        return not self.solo and any(n.startswith("stop-") for n in (self._notes() if notes is None else notes))

    def _notes(self) -> list[str]:
        """The names of this generation's notes. A note counts once renamed into place: its tmp
        file (stop-00001.json.tmp.PID) seen here had rank 0 stop before the note's signal could
        be read, and log a kill without it."""
        try:
            return [p.name for p in self.gen_dir().iterdir() if p.name.endswith(".json")]
        except FileNotFoundError:
            return []

    def _note_stop(self) -> None:
        self.stopping_note = RankNote(rank=self.rank, step=self.step, signal=self.stop_signal() or "")
        if not self.solo:
            self._write(self._note_path("stop", self.rank), self.stopping_note)

    def stop_wanted(self) -> bool:
        """(all ranks, after each step) Did a signal reach this rank, or did any rank note a stop?"""
        return self.stopping_note is not None or bool(self.stop_signal()) or self._peer_stopping()

    def agree_stop(self) -> int:
        """(all ranks, once a stop is wanted) The step every rank stops after: the largest step any
        rank had reached when it noted the stop."""
        if self.stopping_note is None:
            self._note_stop()
        if self.solo:
            return self.step
        notes = wait_for(self._all_stop_notes, self.timeout, lambda: "every rank to note the stop", self.poll)
        return max(n.step for n in notes)

    def absent(self, grace: float) -> list[int] | None:
        """(all ranks, after a collective failed) Which ranks are gone: the files cannot tell
        within a step's time (a rank writes nothing between checkpoints), so None."""
        return None

    def _all_stop_notes(self) -> list[RankNote] | None:
        notes = [self.pvc.read_record(self._note_path("stop", r), RankNote) for r in range(self.world_size)]
        return None if any(n is None for n in notes) else notes  # type: ignore[return-value]


# --- rank 0 ----------------------------------------------------------------------------------------

class PvcCoordinator(PvcPeers):
    """(rank 0) Leads each launch: publishes it, begins it once every rank joined, commits what
    they wrote, and ends it with an outcome the others follow. ``Coordinator`` on a PVC."""

    def __init__(self, pvc: Pvc, world_size: int, timeout: float, stop_signal: Callable[[], str | None]):
        super().__init__(pvc, 0, world_size, timeout, stop_signal)

    shares_verification = False  # rank 0 verifies every checkpoint whole itself (Job._discover)

    def verify_round(self, checkpoint: str, manifest_sha256: str | None, lend: bool,
                     mine: Callable[[], str | None]) -> list[tuple[int, str | None]]:
        raise NotImplementedError("the files transport does not share verification")

    def publish(self, session_for: Callable[[int], Session]) -> Session:
        """(rank 0, under the job lock, first) Start a new generation; older ones are removed."""
        last = self._read_session()
        self.generation = (last.generation if last else 0) + 1
        session = session_for(self.generation)
        self.step = session.from_step
        if not self.pvc.local:  # a bucket: only the store transport runs there, and it needs the number alone
            self.pvc.write_record(self.session_path, session)
            return session
        with os_errors(self.gen_dir(), "cannot create", InputError):
            make_dir(self.gen_dir())
        self._write(self.session_path, session)
        self._remove_stale()
        return session

    def _remove_stale(self) -> None:
        """Generation directories other than the current one: a killed launch's, nobody's now."""
        for path in sorted(self.root.glob("g*")) if self.root.is_dir() else []:
            if path.name != self.gen_dir().name and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)

    def wait_joined(self) -> bool:
        """(rank 0, after publish) Wait until every other rank has joined: True; False if a stop
        came first.

        Nothing has been trained yet, so there is nothing to save and no reason to wait on."""
        missing = lambda: [r for r in range(1, self.world_size) if not self._note_path("join", r).exists()]

        def joined() -> bool | None:
            if not missing():
                return True
            return False if self.stopping_note is not None else None  # poll() notes a stop

        return self.solo or wait_for(joined, self.timeout,
                                     lambda: f"ranks {missing()} to join generation {self.generation}", self.poll)

    def begin(self) -> None:
        """(rank 0, once every rank has joined) Its own join note lets them start training."""
        if not self.solo:
            self._write(self._note_path("join", 0), RankNote(rank=0, step=self.step))

    def durable(self, step: int) -> None:
        """(rank 0, before the commit's rename) Nothing to wait for: a receipt file is written
        only once its shard is durable (``PvcFollower.deliver``)."""

    def gather(self, ready: Callable[[int], bool], read: Callable[[int], T], step: int) -> list[T]:
        """(rank 0, at each checkpoint, after its own shard) Wait until every other rank's shard
        of ``step`` is durable (``ready``: its receipt exists); ``read`` them."""
        others = range(1, self.world_size)
        missing = lambda: [r for r in others if not ready(r)]
        wait_for(lambda: True if not missing() else None, self.timeout,
                 lambda: f"ranks {missing()} to write their shards of step {step}", self.poll)
        return [read(r) for r in others]

    def peer_signal(self) -> str | None:
        """(rank 0, when a stop ends the launch) Which rank's signal started a stop this rank did
        not receive itself (for the log)."""
        for r in range(self.world_size):
            note = self.pvc.read_record(self._note_path("stop", r), RankNote)
            if note is not None and note.signal:
                return f"{note.signal}@rank{r}"
        return None

    def refusals(self) -> list[Refusal]:
        notes = [self.pvc.read_record(self._note_path("refused", r), Refusal) for r in range(1, self.world_size)]
        return [n for n in notes if n is not None]

    def poll(self) -> None:
        """(rank 0) Run during every wait: pass on a stop; a rank that refused the launch and left
        will never deliver what is waited for, so the launch is refused now, not at the timeout."""
        notes = [] if self.solo else self._notes()  # one listing per poll, for both questions
        self._pass_on_stop(notes)
        if any(n.startswith("refused-") for n in notes):
            raise refused_by(self.refusals()[0])

    def finish(self, state: str, message: str = "", code: int | None = None) -> None:
        """(rank 0, last) How this launch ended (the machine's state, or "error" and its exit
        ``code``): the others exit with it. Before a launch was published there is nothing to
        write: the other ranks wait for a session, bounded, and the launcher reads the codes."""
        if not self.solo and self.generation:
            self._write(self.gen_dir() / "outcome.json", ended(self.generation, state, message, code))


# --- ranks >= 1 ------------------------------------------------------------------------------------

class PvcFollower(PvcPeers):
    """(ranks >= 1) Follows the launch rank 0 leads: joins it, writes its shards into rank 0's
    staging directories, and ends as rank 0 says. ``Follower`` on a PVC."""

    def begun(self, generation: int | None = None) -> bool:
        """(ranks >= 1, after join) Did rank 0 begin the launch? If not, it ended it unbegun."""
        return self._note_path("join", 0, generation).exists()

    def read_outcome(self, generation: int | None = None) -> Outcome | None:
        """(ranks >= 1) How rank 0 ended the launch; None while it runs."""
        return self.pvc.read_record(self.gen_dir(generation) / "outcome.json", Outcome)

    def join(self, settings: str, skip: set[int], verify: Callable[[Candidate], str | None] | None = None) -> Session:
        """(ranks >= 1, first) Wait for the newest generation this rank can join, join it, and wait
        until rank 0 begins it or ends it unbegun (a stop before every rank joined, or nothing to
        train)."""
        seen: list[str] = []
        over = lambda g: self.read_outcome(g) is not None or self.begun(g)  # noqa: E731
        while True:
            session = wait_for(lambda: joinable(self._read_session(), skip, over, self.world_size, settings, seen),
                               self.timeout, lambda: "rank 0 to start a launch this rank can join "
                               f"({'; '.join(seen) or 'no live session in ' + str(self.session_path)})",
                               lambda: stopped_before_joining(self.rank, self.stop_signal))
            self.generation, self.stopping_note, self.step = session.generation, None, session.from_step
            try:
                self._write(self._note_path("join", self.rank), RankNote(rank=self.rank, step=session.from_step))
            except TryAgainLater:
                if self.gen_dir().is_dir():
                    raise  # the storage failed, not the session
                # A killed launch's session, which a new rank 0 replaced and removed as stale
                # between our read and our write: join the new one instead.
                skip.add(session.generation)
                continue
            try:
                wait_for(lambda: begun_or_ended(self), self.timeout,
                         lambda: f"rank 0 to begin generation {self.generation}", self.poll)
                return session
            except Superseded:  # a killed launch's session: its rank 0 will never begin it
                skip.add(session.generation)


    def poll(self) -> None:
        """(ranks >= 1) Run during every wait: follow newer generations, and pass on a stop."""
        self.check_current()
        super().poll()

    def check_current(self) -> None:
        """(ranks >= 1, during every wait and when a write fails) Superseded if rank 0 started a
        newer generation: this rank drops what it was doing and rejoins."""
        s = self._read_session()
        if s is None or s.generation != self.generation:
            raise Superseded(f"generation {self.generation} was superseded")

    def refuse(self, refusal: Refusal) -> None:
        self._write(self._note_path("refused", self.rank), refusal)

    def wait_staging(self, staging: Path, step: int) -> None:
        """(ranks >= 1, at each checkpoint, before writing a shard) Rank 0 creates each
        checkpoint's staging directory; the others write into it."""
        wait_for(lambda: True if staging.is_dir() else None, self.timeout,
                 lambda: f"rank 0 to start checkpoint step {step} ({staging.name})", self.poll)

    def deliver(self, step: int, entry: ShardEntry, write: Callable[[ShardEntry], None],
                sync: Callable[[], object] = lambda: None) -> None:
        """(ranks >= 1, once its shard is written) The shard made durable, then the receipt file
        rank 0 polls for: a file rank 0 finds says the shard is durable (no second file)."""
        sync()
        write(entry)

    def wait_outcome(self) -> Outcome:
        """(ranks >= 1, last) How rank 0 ended the launch; PeerFailed if it failed."""
        outcome = wait_for(lambda: self.read_outcome(), self.timeout,
                           lambda: f"rank 0 to finish generation {self.generation}", self.poll)
        raise_if_failed(outcome)
        return outcome


def raise_if_failed(outcome: Outcome | None) -> None:
    """(ranks >= 1, either transport) When rank 0 ended the launch in an error, the error that
    ends this rank with rank 0's exit code: 2 (PeerRefused), 70 (a bug there), else PeerFailed (75)."""
    if outcome is not None and outcome.state == "error":
        kind = {2: PeerRefused, 70: TrainJobError}.get(outcome.code, PeerFailed)
        raise kind(f"rank 0 stopped this launch: {outcome.message}")
