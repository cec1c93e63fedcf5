"""Ranks: the coordination interface, what the engine asks of the other ranks, by role.

Three Protocols, no implementation: ``Coordination`` is what every rank does, ``Coordinator``
adds what only rank 0 does, ``Follower`` what only the other ranks do. Two transports implement
them: ``peers.py`` through files on the PVC (the local launcher, the lab), ``store.py`` through
the launcher's rendezvous store (torchrun); ``connect.py`` picks one, and ``engine/run.py``
drives either without knowing which. Each method's docstring says who calls it and when, in the
order a launch meets them:

    rank 0 (Coordinator)                 ranks >= 1 (Follower)
    verify_round(candidate) per          (join answers each: this rank's share verified)
      checkpoint tried (sharded state)
    publish(session)                     join(settings)        -> the session to follow
    wait_joined()                                                 (waits for begin, or the end)
    begin()
    ... every rank trains, checking stop_wanted() / agree_stop() after each step ...
    per checkpoint: the staging          wait_staging(), write a shard,
    directory, its own shard,            deliver(its receipt, its fsync)
    gather(receipts), the manifest,
    durable(), commit
    finish(state)                        wait_outcome()        -> rank 0's state

Must not: decide anything about training or write a checkpoint; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..records import Candidate, Outcome, Refusal, Session, ShardEntry


@runtime_checkable
class Coordination(Protocol):
    """(all ranks) What every rank does: keep its place, and agree on a stop with the others."""

    generation: int  # the launch this rank takes part in; 0 before it has one
    step: int  # the last step this rank completed: the train loop updates it after every step
    transport: str  # how the ranks reach each other, for the log: "files" or "store"
    stop_signal: Callable[[], str | None]  # the signal that reached this rank (SIGTERM...), or None

    @property
    def solo(self) -> bool:
        """True with a world of one rank, where every call is trivial."""

    def stop_wanted(self) -> bool:
        """(all ranks) After each step: did a signal reach this rank, or did any rank note a stop?
        Every rank calls it at the same points of the loop, the same number of times: a transport
        may make each call a collective (the store's stop round)."""

    def agree_stop(self) -> int:
        """(all ranks) Once a stop is wanted: the step every rank stops after, the largest step
        any rank had reached when it noted the stop. Each rank trains on to it and saves it."""

    def absent(self, grace: float) -> list[int] | None:
        """(all ranks, once a collective of the step failed: ``lost.py``) The other ranks that
        are gone, found within ``grace`` s; None when this transport cannot tell."""


@runtime_checkable
class Coordinator(Coordination, Protocol):
    """(rank 0) What only rank 0 does: it leads each launch (a generation) from start to end."""

    shares_verification: bool  # whether verify_round can ask the other ranks (the store: yes)

    def verify_round(self, checkpoint: str, manifest_sha256: str | None, lend: bool,
                     mine: Callable[[], str | None]) -> list[tuple[int, str | None]] | None:
        """(rank 0, resuming a sharded state, before ``publish``; only if ``shares_verification``)
        Ask every other rank to verify (and read) its share of ``checkpoint`` while this rank
        does its own (``mine``); each rank's verdict, by rank (None: verified; else the reason).
        PeerFailed when a rank could not say (it failed otherwise, and ends with its own code);
        None when a stop reached this rank before every verdict was in (the caller verifies alone)."""

    def publish(self, session_for: Callable[[int], Session]) -> Session:
        """(rank 0, under the job lock, once per launch, before any other call but ``verify_round``) Start a new
        generation with the session ``session_for(generation)``; older generations are dropped."""

    def wait_joined(self) -> bool:
        """(rank 0, after publish) Wait until every other rank has joined: True; False if a stop
        came first."""

    def begin(self) -> None:
        """(rank 0, once every rank joined and there is something to train) Let the others start."""

    def gather(self, ready: Callable[[int], bool], read: Callable[[int], ShardEntry], step: int) -> list[ShardEntry]:
        """(rank 0, at each checkpoint, after writing its own shard) Every other rank's receipt of
        ``step`` (its shard written: size and sha256), in rank order: files wait until
        ``ready(r)`` and return ``read(r)``; a transport that carries receipts itself ignores both."""

    def durable(self, step: int) -> None:
        """(rank 0, at each checkpoint, after ``gather``, before the commit's rename) Wait until
        every other rank's shard of ``step`` is durable. With files a receipt is only written
        once it is (nothing to wait for); a transport that sends it earlier waits here."""

    def peer_signal(self) -> str | None:
        """(rank 0, when a stop ends the launch) Which rank's signal started it, for the log."""

    def refusals(self) -> list[Refusal]:
        """(rank 0, ending the launch as a relaunch: a peer gone, a round never ended) The other
        ranks' refusals of this launch (``Follower.refuse``), by rank: the job refuses with them."""

    def finish(self, state: str, message: str = "", code: int | None = None) -> None:
        """(rank 0, last; also after an error before ``publish``) End the launch with the
        machine's final ``state`` (or ``"error"``, a message and the exit ``code`` rank 0 ends
        with); the other ranks exit as it says, with rank 0's code."""


@runtime_checkable
class Follower(Coordination, Protocol):
    """(ranks >= 1) What only the other ranks do: follow the launch rank 0 leads."""

    def join(self, settings: str, skip: set[int],
             verify: Callable[[Candidate], str | None] | None = None) -> Session:
        """(ranks >= 1, first) Join the newest launch with these ``settings`` (none in ``skip``)
        and wait until rank 0 begins it or ends it unbegun; return its session. Meanwhile, where
        the transport shares verification, answer each of rank 0's ``verify_round`` with
        ``verify(candidate)`` (None: this rank's share verified; else why not)."""

    def begun(self) -> bool:
        """(ranks >= 1, after join) Did rank 0 begin the joined launch? If not, it ended it
        unbegun, and ``read_outcome`` says how."""

    def read_outcome(self) -> Outcome | None:
        """(ranks >= 1) How rank 0 ended the joined launch; None while it runs."""

    def wait_staging(self, staging: Path, step: int) -> None:
        """(ranks >= 1, at each checkpoint, before writing a shard) Wait for rank 0's staging
        directory of ``step`` (files), or make it if rank 0 has not yet (the store)."""

    def deliver(self, step: int, entry: ShardEntry, write: Callable[[ShardEntry], None],
                sync: Callable[[], object] = lambda: None) -> None:
        """(ranks >= 1, at each checkpoint, once this rank's shard is written) Hand rank 0 its
        receipt and make the shard durable (``sync``, which waits for its fsync; a no-op when
        it already is). Files sync, then call ``write(entry)`` (a receipt file beside the shard:
        rank 0 reads it as durable). A transport that carries receipts itself sends it before
        ``sync`` and says when ``sync`` has returned (rank 0's ``durable``), so rank 0 writes
        the manifest while this rank's fsync runs."""

    def check_current(self) -> None:
        """(ranks >= 1, when a write fails) Raise Superseded if rank 0 started a newer launch."""

    def refuse(self, refusal: Refusal) -> None:
        """(ranks >= 1, ending a joined launch with exit 2 that rank 0 did not decide) Say why,
        before exiting: rank 0, which then finds this rank gone, refuses the launch with it."""

    def wait_outcome(self) -> Outcome:
        """(ranks >= 1, last) Wait for how rank 0 ended the launch; PeerFailed if it failed."""
