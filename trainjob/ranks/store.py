"""Ranks: ``coordination.py``'s interface on the launcher's rendezvous store (torchrun's c10d store).

The ranks agree through keys in a key-value store every rank reaches over the network (torch's
``TCPStore``, which torchrun's agent hosts, or the store of an initialized process group);
``connect.py`` opens it, under a prefix unique to the launch. The PVC keeps only data: shards,
manifests, the pointer, and ``ranks/session.json`` (rank 0 still allocates each launch's
generation there, under the job lock). Keys, for generation 3:

    session                    Session: rank 0's word for this launch (its generation: 3)
    g00000003/join/1           rank 1 joined (a RankNote)
    g00000003/begin            rank 0 saw every rank join: the launch begins
    g00000003/stopping         some rank noted a stop before the launch began
    g00000003/stop/1           rank 1's stop note: the signal it received
    g00000003/round/17         the 17th stop round: ranks arrived + STOP x ranks that want to stop
    g00000003/round/17/done    its total, set by the last rank to arrive (END if rank 0 finished)
    g00000003/receipt/8/1      rank 1's shard of step 8 is written: its ShardEntry (size, sha256)
    g00000003/durable/8/1      rank 1's shard of step 8 is durable (fsynced): rank 0 may commit
    verify                     Candidate: a checkpoint rank 0 asks every rank to verify its share of
    verify/NONCE/2/1           rank 1's verdict on rank 0's (process NONCE) 2nd candidate
    g00000003/refused/1        Refusal: rank 1 refused the launch and left (a NaN only it saw)
    g00000003/outcome          Outcome: how rank 0 ended generation 3, with its exit code
    g00000003/outcome/read     how many other ranks have read it
    aborted, aborted/read      the same, when rank 0 ended on an error before publishing a session

A resume of a sharded state (DTensors) is verified by every rank, each its own share, before
any session exists: rank 0 sets ``verify`` to each checkpoint it tries, newest first, and every
other rank, waiting to join, reads its share of it (``CheckpointStore.load_local``) and answers
``ok``, ``refused:`` and why (the checkpoint is damaged: every rank refuses it, rank 0 sets it
aside and tries the next), or ``failed:`` and why (the rank itself failed, and ends with its own
code; rank 0 ends with PeerFailed, 75). So no rank reads or hashes more than its share, and rank
0 publishes a session only for a checkpoint every rank verified (docs/checkpoints.md). A stop
reaching rank 0 before every answer is in ends the round (rank 0 sets the missing answers to
``stopped``, read by nobody): rank 0 verifies every shard itself, and the launch ends unbegun.

A checkpoint takes no word from rank 0 before the shards: every rank knows the staging
directory's name, and the first to get there makes it (``StoreFollower.wait_staging``). Rank 0
then waits, in one blocking store call each, for the receipts and for the word that the shards
are durable (``StorePeers.await_keys``): nothing in the commit polls.

Unlike the files, a stop is agreed in *rounds*: after every step every rank adds its vote to that
step's round key and waits until all have (``stop_wanted``), so all learn in the same round that
some rank wants to stop, at the same step: a collective, which is what ranks in lockstep (DDP)
need, and no file-system call. Every wait is bounded by ``--rank-timeout`` (RankTimeout, exit 75),
a signalled rank's wait in a round by a shorter grace (``_round_result``); a store that stops
answering is RankTimeout too.

The store lives as long as its host (torchrun's agent on rank 0's node, or rank 0's own process),
and a rank that loses it exits 75. So rank 0, ending with any other code, waits (bounded) until
every other rank has read its outcome before it exits: each pod, each launcher, ends with the
code rank 0 decided, whichever process ends first.

Must not import torch (``connect.py`` does, lazily): it drives any object with the store's
methods (``set``, ``get``, ``add``, ``check``, ``wait``, ``delete_key``, ``multi_get``, ``clone``).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ..checkpoint.plan import shard_file
from ..errors import InputError, PeerFailed, RankTimeout, Superseded
from ..exits import EXIT_RELAUNCH, exit_code_for
from ..records import Candidate, Outcome, RankNote, Refusal, Session, ShardEntry, dumps, load
from ..storage.durable import make_dir
from ..storage.pvc import Pvc
from .peers import (PvcCoordinator, begun_or_ended, ended, joinable, raise_if_failed, stopped_before_joining,
                    wait_for)

T = TypeVar("T")
STOP = 1 << 20  # a round's vote to stop; more than any world size, so arrivals = total % STOP
END = b"end"  # a round's result when rank 0 ended the launch instead of voting
CHECK_EVERY = 0.05  # how often a rank blocked in a store wait checks for a signal or news (seconds)
STOP_GRACE = 3.0  # the least a signalled rank waits for its round's other votes (seconds)


def wait_beside(kv: Any, keys: list[str], timeout: float, name: str, check: Callable[[], None],
                release: Callable[[], None] | None = None) -> BaseException | None:
    """The store's blocking wait for ``keys`` (answered the moment the last is set, no polling),
    on a daemon thread, while this thread calls ``check`` every CHECK_EVERY: a signal's handler
    runs only in the main thread, and never while it is inside the store's C++ wait. ``check``
    may raise, which abandons the wait (it ends with the process), unless ``release`` (setting
    the keys on another connection) ends it first. Returns the wait's error, or None once every
    key is set; ``kv`` serves nothing else meanwhile (a client serves one call at a time)."""
    waited: list[BaseException | None] = []

    def wait() -> None:
        try:
            kv.wait(keys, datetime.timedelta(seconds=timeout))
            waited.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            waited.append(exc)

    waiter = threading.Thread(target=wait, name=name, daemon=True)
    waiter.start()
    while waiter.join(CHECK_EVERY) or waiter.is_alive():
        try:
            check()
        except BaseException as exc:
            if release is not None:
                release()
                waiter.join(timeout)  # the keys are set: the wait returns at once, unless the store is gone
            if waiter.is_alive():
                _abandon(waiter, exc)
            raise
    return waited[0]


class _StopCame(Exception):
    """(``StoreCoordinator.verify_round``) A stop reached rank 0 before every verdict did."""


# Waits ``wait_beside`` left running, with the exit code of the error that abandoned each.
_abandoned: list[tuple[threading.Thread, int]] = []


def _abandon(waiter: threading.Thread, why: BaseException) -> None:
    if not _abandoned:
        atexit.register(_exit_before_abandoned_waits_end)
    _abandoned.append((waiter, exit_code_for(type(why))))


def _exit_before_abandoned_waits_end() -> None:
    """(atexit) End the process now if a wait it abandoned is still inside the store's C++ call.

    Once Python starts finalizing, a daemon thread that comes back from C++ is ended by a forced
    unwind, which torch's noexcept frames turn into std::terminate: the rank died of SIGABRT (-6)
    after it had decided to exit 75, as soon as --rank-timeout outlasted its way out. So it ends
    here, before finalizing, with the exit code of the error that abandoned the wait (the code the
    CLI and ``Run`` give that error); the streams are flushed first, and the log and checkpoints
    are fsynced as they are written."""
    codes = [code for waiter, code in _abandoned if waiter.is_alive()]
    if codes:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be said there
                pass
        os._exit(codes[0])


@contextmanager
def answering(what: str) -> Iterator[None]:
    """A store that fails (its host gone, the connection reset) is a lost peer: exit 75."""
    try:
        yield
    except RuntimeError as exc:  # torch's DistError and its kin (DistNetworkError, DistStoreError)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RankTimeout(f"the rendezvous store did not answer while {what} ({first}); "
                          "relaunch all ranks together") from None


class StorePeers:
    """(all ranks) This rank's view of the others through the store: ``Coordination`` on a store."""

    transport = "store"

    def __init__(self, kv: Any, rank: int, world_size: int, timeout: float,
                 stop_signal: Callable[[], str | None]) -> None:
        self.kv, self.rank, self.world_size, self.timeout = kv, rank, world_size, timeout
        # The stop rounds and ``await_keys`` get a connection each: a client serves one call at a
        # time, and a round's blocking wait must not hold up a checkpoint writer thread (async
        # checkpoints) sending a receipt meanwhile. Opened now, while ``kv`` has the longer budget
        # for connecting (``connect.CONNECT_SECONDS``); then every call on the three is bounded by
        # --rank-timeout.
        with answering("opening its connections"):
            self.rounds_kv, waits_kv = kv.clone(), kv.clone()
            for connection in (kv, self.rounds_kv, waits_kv):
                connection.set_timeout(datetime.timedelta(seconds=timeout))
        self.stop_signal = stop_signal
        self.generation = 0
        self.step = 0
        self.rounds = 0  # stop rounds this rank took part in this generation
        self.last_vote: float | None = None  # when this rank last voted (monotonic)
        self.longest_gap = 0.0  # the longest time between two of its votes: about a step of the slowest rank
        self.stopping = False  # a round said stop (or, before begin, this rank noted one)
        self.acked: set[str] = set()  # (ranks >= 1) the endings this rank has counted as read
        self.answered: set[tuple[str, int]] = set()  # (ranks >= 1) the verdict rounds it answered
        self._verify: Callable[[Candidate], str | None] | None = None
        self._waits_kv: Any = waits_kv  # ``await_keys``'s connection while no wait holds it; cloned when needed

    @property
    def solo(self) -> bool:
        return self.world_size == 1

    def key(self, name: str, generation: int | None = None) -> str:
        return f"g{self.generation if generation is None else generation:08d}/{name}"

    def has(self, *keys: str) -> bool:
        with answering(f"checking {keys[0]}"):
            return bool(self.kv.check(list(keys)))

    def get(self, key: str) -> bytes:
        with answering(f"reading {key}"):
            return bytes(self.kv.get(key))

    def set(self, key: str, value: str | bytes) -> None:
        with answering(f"writing {key}"):
            self.kv.set(key, value)

    def drop(self, *keys: str) -> None:
        """Keys nobody will read again: the store lives as long as the launch, so keep it small."""
        with answering(f"removing {keys[0]}"):
            for key in keys:
                self.kv.delete_key(key)

    def await_keys(self, keys: list[str], what: Callable[[], str]) -> None:
        """(rank 0) Wait until every one of ``keys`` is set, at most ``--rank-timeout``
        (RankTimeout naming ``what()``): in a checkpoint's commit, the others' receipts, then
        their word that their shards are durable.

        One blocking store ``wait`` on this thread, answered the moment the last key is set: no
        poll (a poll's interval grows, and it woke up to half the time waited after the key was
        set, at a small checkpoint a third of the ranks' whole wait), and no helper thread either
        (its start and its wake-up, then this thread's, each wait for a core when the ranks share
        them). Nothing needs checking meanwhile: rank 0 leads the launch, and a signal's handler
        (run once the wait returns) only sets a flag read after the checkpoint. It runs on a connection of its own (a client
        serves one call at a time: an async checkpoint's writer thread waiting here holds up no
        stop round), cloned when another wait holds it."""
        kv, self._waits_kv = self._waits_kv, None  # held by this wait until it returns
        if kv is None:
            with answering("opening a connection for waits"):
                kv = self.kv.clone()
        started = time.monotonic()
        try:
            kv.wait(keys, datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:  # the store's timeout (DistStoreError), or the store is gone
            if self.has(*keys):  # gone: this check says so (RankTimeout, "did not answer")
                self._waits_kv = kv
                return
            if time.monotonic() - started < 0.9 * self.timeout:  # the store rounds its timeout to milliseconds
                with answering(f"waiting for {keys[0]}"):
                    raise error from None
            raise RankTimeout(f"waited {self.timeout:g}s for {what()}; relaunch all ranks together "
                              "(or raise --rank-timeout)") from None
        self._waits_kv = kv

    def read(self, key: str, cls: type[T]) -> T:
        return load(self.get(key), cls, where=f"rendezvous store key {key}")

    def _note_stop(self) -> None:
        """Say which signal reached this rank, for rank 0's log (``peer_signal``)."""
        self.set(self.key(f"stop/{self.rank}"),
                 dumps(RankNote(rank=self.rank, step=self.step, signal=self.stop_signal() or "")))

    def stop_wanted(self) -> bool:
        """(all ranks, after each step: a collective) One stop round: vote, wait for every rank's
        vote, and say whether any rank wants to stop. Every rank calls it at the same points
        (``train`` does), so every rank gets the same answer after the same step."""
        if self.stopping:
            return True
        self.rounds += 1
        now = time.monotonic()
        if self.last_vote is not None:
            self.longest_gap = max(self.longest_gap, now - self.last_vote)
        self.last_vote = now
        mine = bool(self.stop_signal())
        if mine:
            self._note_stop()
        key = self.key(f"round/{self.rounds}")
        with answering(f"voting in stop round {self.rounds}"):
            total = int(self.rounds_kv.add(key, 1 + (STOP if mine else 0)))
            if total % STOP == self.world_size:  # the last to arrive announces the result
                self.rounds_kv.set(key + "/done", str(total))
                if self.rounds > 2:  # every rank has read round r - 2's result: it is past round r - 1
                    old = self.key(f"round/{self.rounds - 2}")
                    self.rounds_kv.delete_key(old)
                    self.rounds_kv.delete_key(old + "/done")
        if total % STOP != self.world_size:
            total = self._round_result(key + "/done")
        self.stopping = total >= STOP
        return self.stopping

    def _round_result(self, done: str) -> int:
        """Wait for the round's total: one blocking call, answered the moment the last rank
        arrives (no polling per step), beside this thread (``wait_beside``): once this rank is
        signalled (torchrun's agent sends SIGTERM when a peer died), a round that stays
        open longer than a live peer needs to finish its step means a dead peer, and this rank
        exits 75 now rather than being SIGKILLed at the end of torchrun's grace period, its exit
        code lost. The abandoned wait ends with the process (a daemon thread)."""
        started = time.monotonic()
        signalled_at: list[float] = []

        def check() -> None:
            now = time.monotonic()
            if not signalled_at and self.stop_signal():
                signalled_at.append(now)
            if signalled_at and now - signalled_at[0] >= self._stop_grace():
                raise RankTimeout(f"{self.stop_signal()} reached rank {self.rank} in stop round {self.rounds} "
                                  f"(after step {self.step}) and no peer ended that round within "
                                  f"{self._stop_grace():g}s: a peer is gone; relaunch all ranks together")

        error = wait_beside(self.rounds_kv, [done], self.timeout, "trainjob-round", check)
        if isinstance(error, RuntimeError):
            if time.monotonic() - started < self.timeout * 0.9:
                with answering(f"waiting for stop round {self.rounds}"):
                    raise error
            raise RankTimeout(f"waited {self.timeout:g}s for every rank to finish step {self.step} "
                              f"(stop round {self.rounds}); relaunch all ranks together (or raise "
                              "--rank-timeout)") from None
        if error is not None:
            raise error
        with answering(f"reading stop round {self.rounds}"):
            value = bytes(self.rounds_kv.get(done))
        if value == END:
            self._rank_0_ended()
        return int(value)

    def absent(self, grace: float) -> list[int] | None:
        """(all ranks, after a collective failed) Which other ranks are gone: each rank that
        survived says so under ``lost/RANK`` and waits at most ``grace`` s for the others; the
        ranks that never say so are named. None when the store itself is gone (its host died)."""
        mine, others = self.key(f"lost/{self.rank}"), [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + grace
        try:
            self.set(mine, b"1")
            while True:
                missing = [r for r in others if not self.has(self.key(f"lost/{r}"))]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(CHECK_EVERY)
        except RankTimeout:
            return None

    def _stop_grace(self) -> float:
        """How long a signalled rank waits for a round: a live peer reaches it within about one
        step of this rank (the longest gap between this rank's votes), so twice that, at least
        STOP_GRACE."""
        return min(self.timeout, max(STOP_GRACE, 2 * self.longest_gap))

    def _rank_0_ended(self) -> None:
        raise PeerFailed(f"rank 0 ended generation {self.generation} while rank {self.rank} trained")

    def agree_stop(self) -> int:
        """(all ranks, once a stop is wanted) The step to stop after: the rounds are collective,
        so every rank learnt of the stop after the same step, the one it is at."""
        return self.step


class StoreCoordinator(StorePeers):
    """(rank 0) Leads each launch through the store: ``Coordinator`` on a store. The generation
    is still allocated on the PVC (``ranks/session.json``, under the job lock or the bucket's
    lease), so it grows across launches whatever store each launch had. Nothing else here
    touches the PVC: this transport runs on a bucket too."""

    def __init__(self, kv: Any, pvc: Pvc, world_size: int, timeout: float,
                 stop_signal: Callable[[], str | None]) -> None:
        super().__init__(kv, 0, world_size, timeout, stop_signal)
        self.files = PvcCoordinator(pvc, world_size, timeout, stop_signal)
        self.spent: list[str] = []  # keys of the last checkpoint, read and not dropped yet
        self.receipts: list[str] = []  # this checkpoint's receipt keys, read by ``gather``
        self.nonce, self.verify_rounds = uuid.uuid4().hex, 0  # this process's verdict rounds

    shares_verification = True

    def verify_round(self, checkpoint: str, manifest_sha256: str | None, lend: bool,
                     mine: Callable[[], str | None]) -> list[tuple[int, str | None]] | None:
        """(rank 0, before ``publish``) One verdict round (module docstring): ``mine`` runs while
        the other ranks verify theirs. None when a stop (SIGTERM, SIGINT) reaches this rank before
        every verdict is in: the launch will not train, and a rank that never answers (stopped,
        dead, or itself stopping before it joins) must not hold the stop up for --rank-timeout."""
        self.verify_rounds += 1
        n = self.verify_rounds
        self.set("verify", dumps(Candidate(nonce=self.nonce, round=n, world_size=self.world_size,
                                           checkpoint=checkpoint, manifest_sha256=manifest_sha256, lend=lend)))
        verdicts: list[tuple[int, str | None]] = [(0, mine())]
        keys = {r: f"verify/{self.nonce}/{n}/{r}" for r in range(1, self.world_size)}
        try:
            self._await_verdicts(keys, checkpoint)
        except _StopCame:
            return None
        with answering(f"reading the verdicts on {checkpoint}"):
            values = [bytes(v).decode("utf-8", "replace") for v in self.kv.multi_get(list(keys.values()))]
        # Left in the store: W small keys once per launch, where dropping them costs W requests.
        for r, value in zip(keys, values):
            kind, _, why = value.partition(":")
            if kind == "failed":
                raise PeerFailed(f"rank {r} failed verifying its share of {checkpoint} ({why}); nothing is "
                                 "known to be wrong with the checkpoint: relaunch all ranks together")
            verdicts.append((r, None if kind == "ok" else why))
        return verdicts

    def _await_verdicts(self, keys: dict[int, str], checkpoint: str) -> None:
        """Wait for every other rank's verdict, at most --rank-timeout (RankTimeout), on a
        connection of its own beside this thread (``wait_beside``), which checks for a stop:
        _StopCame then, once every verdict still missing is set to ``stopped`` (nobody reads
        those: the wait returns, and no thread is left waiting in the store)."""
        with answering("opening a connection for the verdicts"):
            kv = self.kv.clone()
        started = time.monotonic()

        def check() -> None:
            if self.stop_signal():
                raise _StopCame

        def release() -> None:
            for key in keys.values():
                if not self.has(key):
                    self.set(key, "stopped")

        error = wait_beside(kv, list(keys.values()), self.timeout, "trainjob-verdicts", check, release)
        if isinstance(error, RuntimeError):
            if self.has(*keys.values()):  # every verdict came as the wait timed out
                return
            if time.monotonic() - started < 0.9 * self.timeout:  # the store rounds its timeout to milliseconds
                with answering(f"waiting for the verdicts on {checkpoint}"):
                    raise error from None
            raise RankTimeout(f"waited {self.timeout:g}s for ranks {[r for r, k in keys.items() if not self.has(k)]}"
                              f" to verify their share of {checkpoint}; relaunch all ranks together (or raise "
                              "--rank-timeout)") from None
        if error is not None:
            raise error

    def publish(self, session_for: Callable[[int], Session]) -> Session:
        """(rank 0, under the job lock, first but for ``verify_round``) Allocate the generation
        on the PVC, then tell the others through the store."""
        session = self.files.publish(session_for)
        if self.verify_rounds:  # the verdict rounds are over: no rank may take up a stale one
            self.set("verify", b"")  # emptied, not deleted: a rank may be between its check and its read
        self.generation, self.step, self.rounds, self.stopping = session.generation, session.from_step, 0, False
        self.set("session", dumps(session))
        return session

    def wait_joined(self) -> bool:
        """(rank 0, after publish) Every other rank joined: True; False if a stop came first."""
        if self.solo:
            return True
        joins = [self.key(f"join/{r}") for r in range(1, self.world_size)]

        def joined() -> bool | None:
            if self.has(*joins):
                return True
            return False if self.stop_signal() or self.has(self.key("stopping")) else None

        return wait_for(joined, self.timeout, lambda: f"ranks {[r for r, k in enumerate(joins, 1) if not self.has(k)]}"
                        f" to join generation {self.generation}", lambda: None)

    def begin(self) -> None:
        if not self.solo:
            self.set(self.key("begin"), str(self.step))

    def gather(self, ready: Callable[[int], bool], read: Callable[[int], Any], step: int) -> list[ShardEntry]:
        """(rank 0, at each checkpoint, after its own shard) Every other rank's receipt of
        ``step``, from the store (``ready`` and ``read``, the files' way, are not needed)."""
        keys = self._await_others("receipt", step, f"write their shards of step {step}")
        with answering(f"reading the receipts of step {step}"):
            values = self.kv.multi_get(list(keys.values()))
        entries = [load(bytes(v), ShardEntry, where=f"rendezvous store key {k}") for k, v in zip(keys.values(), values)]
        for r, entry in zip(keys, entries):
            if entry.rank != r or entry.file != shard_file(r, self.world_size):
                raise InputError(f"rendezvous store key {keys[r]}: not rank {r}'s receipt")
        self.receipts = list(keys.values())  # read: ``durable`` drops them at the next checkpoint
        return entries

    def durable(self, step: int) -> None:
        """(rank 0, after ``gather``, before the commit's rename) Every other rank's word that its
        shard of ``step`` is durable: its receipt came as soon as the shard was written, so this
        rank wrote the manifest and began the commit's fsyncs while the others' fsyncs ran.
        First the previous checkpoint's keys go (nobody reads them again): these round trips
        run beside this rank's own fsyncs of the commit, so they delay nothing there, where
        anywhere before the shards they delayed every rank's (the store's host shares the cores)."""
        if self.spent:
            self.drop(*self.spent)
        durable = self._await_others("durable", step, f"make their shards of step {step} durable")
        self.spent = [*self.receipts, *durable.values()]

    def _await_others(self, name: str, step: int, doing: str) -> dict[int, str]:
        """Wait for every other rank's key ``name/step/rank`` (RankTimeout: "ranks [...] to
        ``doing``"); return the keys by rank."""
        keys = {r: self.key(f"{name}/{step}/{r}") for r in range(1, self.world_size)}
        self.await_keys(list(keys.values()), lambda: f"ranks {[r for r, k in keys.items() if not self.has(k)]} to "
                        f"{doing}")
        return keys

    def peer_signal(self) -> str | None:
        for r in range(self.world_size):
            if self.has(self.key(f"stop/{r}")):
                note = self.read(self.key(f"stop/{r}"), RankNote)
                if note.signal:
                    return f"{note.signal}@rank{r}"
        return None

    def refusals(self) -> list[Refusal]:
        keys = [self.key(f"refused/{r}") for r in range(1, self.world_size)]
        return [self.read(key, Refusal) for key in keys if self.has(key)]

    def finish(self, state: str, message: str = "", code: int | None = None) -> None:
        """(rank 0, last) The outcome, and the end of the round the others may be waiting in; an
        error before any session was published ends the launch's wait for one (``aborted``). Then,
        unless the code is 75 (what a rank that loses the store exits with anyway), wait until
        every other rank has read it (but those that refused the launch and left), at most
        ``--rank-timeout``: the store may die with this process, and a rank that has not read the
        outcome by then could only say 75."""
        if self.solo:
            return
        outcome = ended(self.generation, state, message, code)
        if self.generation:
            key = self.key("outcome")
            self.set(key, dumps(outcome))
            # A rank still training waits in the next round, which rank 0 will never join.
            self.set(self.key(f"round/{self.rounds + 1}/done"), END)
        else:
            key = "aborted"
            self.set(key, dumps(outcome))
        if outcome.code != EXIT_RELAUNCH:
            readers = self.world_size - 1 - (len(self.refusals()) if self.generation else 0)
            try:
                wait_for(lambda: True if self.count(key + "/read") >= readers else None, self.timeout,
                         lambda: f"every rank to read how rank 0 ended ({outcome.state})", lambda: None)
            except RankTimeout:
                pass  # the outcome stands; a rank that never read it exits 75 on its own

    def count(self, key: str) -> int:
        with answering(f"reading {key}"):
            return int(self.kv.add(key, 0))


class StoreFollower(StorePeers):
    """(ranks >= 1) Follows the launch rank 0 leads through the store: ``Follower`` on a store.
    ``pvc``: where its shards go; the staging directory is all it makes there (``wait_staging``)."""

    def __init__(self, kv: Any, rank: int, world_size: int, timeout: float,
                 stop_signal: Callable[[], str | None], pvc: Pvc | None = None) -> None:
        super().__init__(kv, rank, world_size, timeout, stop_signal)
        self.pvc = pvc

    def begun(self, generation: int | None = None) -> bool:
        return self.has(self.key("begin", generation))

    def read_outcome(self, generation: int | None = None) -> Outcome | None:
        return self._read_ending(self.key("outcome", generation))

    def _read_ending(self, key: str) -> Outcome | None:
        """How rank 0 ended (``key``: a generation's outcome, or ``aborted``), counted as read once
        (rank 0 waits for that before it exits and the store may go with it)."""
        if not self.has(key):
            return None
        outcome = self.read(key, Outcome)
        if key not in self.acked:
            self.acked.add(key)
            with answering(f"acknowledging {key}"):
                self.kv.add(key + "/read", 1)
        return outcome

    def _session(self) -> Session | None:
        return self.read("session", Session) if self.has("session") else None

    def join(self, settings: str, skip: set[int], verify: Callable[[Candidate], str | None] | None = None) -> Session:
        """(ranks >= 1, first) Join the launch rank 0 published in this store; wait until it
        begins or ends unbegun. A store that outlived a launch (not torchrun's) may still hold its
        session: one already begun or ended is not joined, as with the files."""
        seen: list[str] = []
        self._verify = verify
        over = lambda g: self.has(self.key("outcome", g)) or self.begun(g)  # noqa: E731
        while True:
            session = wait_for(lambda: joinable(self._session(), skip, over, self.world_size, settings, seen),
                               self.timeout, lambda: "rank 0 to start a launch this rank can join "
                               f"({'; '.join(seen) or 'no session in the rendezvous store'})",
                               self._before_joining)
            self.generation, self.step, self.rounds, self.stopping = (session.generation, session.from_step, 0,
                                                                      False)
            self.set(self.key(f"join/{self.rank}"), dumps(RankNote(rank=self.rank, step=session.from_step)))
            try:
                wait_for(lambda: begun_or_ended(self), self.timeout,
                         lambda: f"rank 0 to begin generation {self.generation}", self.poll)
                return session
            except Superseded:
                skip.add(session.generation)

    def _before_joining(self) -> None:
        """(ranks >= 1, while joining) End with rank 0's error if it ended before publishing a
        session, or with a signal that came first."""
        raise_if_failed(self._read_ending("aborted"))
        stopped_before_joining(self.rank, self.stop_signal)
        self._answer_verification()

    def _answer_verification(self) -> None:
        """(ranks >= 1, while joining) Answer rank 0's newest verdict round once (module docstring)."""
        if self._verify is None or not self.has("verify"):
            return
        value = self.get("verify")
        if not value:  # the rounds are over (``StoreCoordinator.publish``)
            return
        candidate = load(value, Candidate, where="rendezvous store key verify")
        if (candidate.nonce, candidate.round) in self.answered or candidate.world_size != self.world_size:
            return
        self.answered.add((candidate.nonce, candidate.round))
        key = f"verify/{candidate.nonce}/{candidate.round}/{self.rank}"
        try:
            reason = self._verify(candidate)
        except BaseException as exc:
            self.set(key, f"failed:{type(exc).__name__}: {exc}"[:2000])
            raise
        self.set(key, "ok" if reason is None else f"refused:{reason}")

    def poll(self) -> None:
        """(ranks >= 1) Run during every wait: follow a newer launch, end with a failed rank 0, and
        pass on a stop that comes before the launch began."""
        self.check_current()
        raise_if_failed(self.read_outcome())
        if not self.stopping and self.stop_signal() and not self.begun():
            self._note_stop()
            self.set(self.key("stopping"), str(self.rank))
            self.stopping = True

    def refuse(self, refusal: Refusal) -> None:
        self.set(self.key(f"refused/{self.rank}"), dumps(refusal))

    def check_current(self) -> None:
        s = self._session()
        if s is None or s.generation != self.generation:
            raise Superseded(f"generation {self.generation} was superseded")

    def wait_staging(self, staging: Path, step: int) -> None:
        """(ranks >= 1, at each checkpoint) Nothing to wait for: on a directory PVC this rank
        makes the staging directory if rank 0 has not yet (``make_dir`` takes either order), on a
        bucket there is none. Its name is known to every rank (the step and the generation), so
        rank 0's word that it exists is one ordered round trip the shards need not wait for: every
        rank's shard starts at once. The ranks still meet after every step (the stop rounds)."""
        if self.pvc is not None and self.pvc.local:
            make_dir(staging)

    def deliver(self, step: int, entry: ShardEntry, write: Callable[[ShardEntry], None],
                sync: Callable[[], object] = lambda: None) -> None:
        """(ranks >= 1, once this rank's shard of ``step`` is written) Its receipt goes to rank 0
        through the store at once (no receipt file: ``write`` is the files' way), then ``sync``
        makes the shard durable, then its ``durable`` key says so: rank 0 builds and writes the
        manifest meanwhile, and renames nothing before every such key is set (``durable``)."""
        self.set(self.key(f"receipt/{step}/{self.rank}"), dumps(entry))
        sync()
        self.set(self.key(f"durable/{step}/{self.rank}"), "1")

    def wait_outcome(self) -> Outcome:
        outcome = wait_for(lambda: self.read_outcome(), self.timeout,
                           lambda: f"rank 0 to finish generation {self.generation}", lambda: None)
        raise_if_failed(outcome)
        return outcome

    def _rank_0_ended(self) -> None:
        raise_if_failed(self.read_outcome())
        super()._rank_0_ended()
