"""Ranks: the store transport (ranks/store.py) and the choice of transport (ranks/connect.py).

In process: every rank is a thread with its own client of a real torch TCPStore, as torchrun's
workers are clients of the store its agent hosts. Then whole launches under torchrun, with a kill
before an I/O call; the DDP trainer's kills, SIGTERMs and file-system counts under torchrun are in
tests/trainers/test_torch.py.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, events, trainjob
from trainjob.errors import PeerFailed, PeerRefused, RankTimeout, Superseded, TrainJobError, UsageError
from trainjob.exits import exit_code_for
from trainjob.ranks import connect
from trainjob.ranks.coordination import Coordinator, Follower
from trainjob.ranks.peers import PvcCoordinator
from trainjob.records import Refusal, ShardEntry, Session
from trainjob.storage.pvc import Pvc

dist = pytest.importorskip("torch.distributed", reason="torch is not installed (pip install 'trainjob[torch]')")

from trainjob.ranks.store import StoreCoordinator, StoreFollower  # noqa: E402


def session(generation: int, world: int = 2) -> Session:
    return Session(generation=generation, world_size=world, attempt=1, from_step=0, checkpoint=None,
                   manifest_sha256=None, settings="s")


@pytest.fixture
def server():
    """The agent's store: every rank below connects to it as a client."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def client(server, scope: str = "launch-1"):
    tcp = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore(scope, tcp)


@pytest.fixture
def pvc(tmp_path) -> Pvc:
    pvc = Pvc(tmp_path / "pvc")
    pvc.create()
    return pvc


def launch(server, pvc: Pvc, world: int, timeout: float = 5.0, signals: dict[int, str] | None = None,
           scope: str = "launch-1"):
    """Rank 0 and the followers of one launch, joined and begun."""
    signals = {} if signals is None else signals
    rank0 = StoreCoordinator(client(server, scope), pvc, world, timeout, lambda: signals.get(0))
    rank0.publish(lambda g: session(g, world))
    followers = [StoreFollower(client(server, scope), r, world, timeout, (lambda r=r: signals.get(r)), pvc)
                 for r in range(1, world)]
    joiners = [threading.Thread(target=f.join, args=("s", set())) for f in followers]
    for t in joiners:
        t.start()
    assert rank0.wait_joined()
    rank0.begin()
    for t in joiners:
        t.join(10)
    return rank0, followers


def in_threads(ranks, work) -> list:
    """``work(rank)`` for every rank at once; what each returned (or raised)."""
    results: list = [None] * len(ranks)

    def run(i: int) -> None:
        try:
            results[i] = work(ranks[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_both_transports_implement_the_protocols(server, pvc):
    rank0, (rank1,) = launch(server, pvc, 2)
    assert isinstance(rank0, Coordinator) and isinstance(rank1, Follower)
    assert (rank0.transport, rank1.transport) == ("store", "store")
    assert PvcCoordinator(pvc, 2, 1.0, lambda: None).transport == "files"


def test_a_signal_at_any_rank_stops_every_rank_after_the_same_step(server, pvc):
    signals: dict[int, str] = {}
    rank0, followers = launch(server, pvc, 3, signals=signals)
    ranks = [rank0, *followers]

    def train(peers) -> tuple[int, int]:
        for step in range(1, 50):
            peers.step = step
            if peers.rank == 2 and step == 7:
                signals[2] = "SIGTERM"  # arrives while rank 2 is at step 7; the others may be anywhere
            if peers.stop_wanted():
                return step, peers.agree_stop()
        return 0, 0

    results = in_threads(ranks, train)
    assert results[0] == results[1] == results[2] == (7, 7), results
    assert rank0.peer_signal() == "SIGTERM@rank2"


def test_receipts_travel_through_the_store_not_as_files(server, pvc):
    rank0, followers = launch(server, pvc, 3)
    written = []
    entries = {r: ShardEntry(rank=r, file=f"shard-{r:05d}-of-00003.safetensors", size=10 * r, sha256="ab" * 32,
                           holds=())
               for r in (1, 2)}

    def checkpoint(step: int) -> list[ShardEntry]:
        def follower(f) -> None:
            f.wait_staging(pvc.root / "staging", step)
            f.deliver(step, entries[f.rank], written.append)

        threads = [threading.Thread(target=follower, args=(f,)) for f in followers]
        for t in threads:
            t.start()
        got = rank0.gather(lambda r: pytest.fail("polled a file"), lambda r: pytest.fail("read a file"), step)
        rank0.durable(step)
        for t in threads:
            t.join(10)
        return got

    assert checkpoint(4) == [entries[1], entries[2]] and written == []
    keys = [rank0.key(f"{kind}/4/{r}") for kind in ("receipt", "durable") for r in (1, 2)]
    assert all(rank0.has(k) for k in keys)
    assert checkpoint(6) == [entries[1], entries[2]]  # the next checkpoint drops the last one's keys
    assert not any(rank0.has(k) for k in keys) and rank0.has(rank0.key("receipt/6/1"))


class Recorded:
    """A store client that records the name of every call made on it (and on its clones)."""

    def __init__(self, kv, calls: list[str]) -> None:
        self.kv, self.calls = kv, calls

    def clone(self):
        return Recorded(self.kv.clone(), self.calls)

    def __getattr__(self, name: str):
        real = getattr(self.kv, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return real(*args, **kwargs)
        return call


def test_rank_0s_commit_waits_are_one_blocking_wait_each_and_never_poll(server, pvc):
    """The receipts come 0.3 s after rank 0 began waiting for them, the durable keys later still:
    rank 0 makes one store ``wait`` for each (no ``check`` loop, no growing sleep), one
    ``multi_get`` of the receipts, and nothing else; the next checkpoint adds the previous
    one's deletes, and still no poll."""
    rank0, (rank1,) = launch(server, pvc, 2, timeout=10.0)
    calls: list[str] = []
    rank0.kv, rank0._waits_kv = Recorded(rank0.kv, calls), Recorded(rank0._waits_kv, calls)
    entry = ShardEntry(rank=1, file="shard-00001-of-00002.safetensors", size=1, sha256="ab" * 32, holds=())

    def checkpoint(step: int) -> list[ShardEntry]:
        follower = threading.Timer(0.3, rank1.deliver, (step, entry, lambda e: None, lambda: time.sleep(0.3)))
        follower.start()
        got = rank0.gather(None, None, step)  # type: ignore[arg-type]
        rank0.durable(step)
        follower.join(10)
        return got

    assert checkpoint(2) == [entry]
    assert calls == ["wait", "multi_get", "wait"]
    calls.clear()
    assert checkpoint(4) == [entry]
    assert calls == ["wait", "multi_get", "delete_key", "delete_key", "wait"]


def test_a_follower_writes_its_shard_without_waiting_for_rank_0(server, pvc):
    """The staging directory's name is known to every rank: a follower makes it if rank 0 has
    not yet, so its shard need not wait for a word from rank 0 (one ordered round trip less
    per checkpoint); rank 0's own make of it, after, finds it there."""
    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.store import Committer

    rank0, (rank1,) = launch(server, pvc, 2, timeout=1.0)
    store = Committer(pvc)
    ref = Ref(attempt=1, step=4, world_size=2)
    staging = store.staging(ref, rank1.generation)
    started = time.monotonic()
    rank1.wait_staging(staging, 4)  # rank 0 has not reached step 4: no wait, and no RankTimeout
    assert staging.is_dir() and time.monotonic() - started < 0.5
    assert store.create_staging(ref, rank0.generation) == staging


def test_rank_0_writes_the_manifest_while_a_ranks_fsync_runs_and_renames_only_after_it(server, pvc, monkeypatch):
    """Through the store a rank's receipt comes as soon as its shard is written, then its word
    that the shard is durable: rank 0 (the engine's own ``Job.write_checkpoint``) writes and
    fsyncs the manifest while rank 1's fsync (slowed) runs, and renames the staging directory
    only once that fsync has returned. The follower's side is ``Run._write_shard``'s two calls."""
    import numpy as np

    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.store import ShardWriter
    from trainjob.engine.job import Job, RunConfig
    from trainjob.storage.eventlog import EventLog
    from trainjob.tensors import tensor_specs

    rank0, (rank1,) = launch(server, pvc, 2, timeout=10.0)
    job = Job(RunConfig(world_size=2), pvc, EventLog(pvc.root / "log.jsonl"), "0" * 64, rank0)
    state = {"w": np.arange(8, dtype=np.float64)}
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename
    manifest_begun = threading.Event()

    def fsync(fd: int) -> None:
        on = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        events.append(("fsync", on))
        if on == "manifest.json":
            manifest_begun.set()
        if on == "shard-00001-of-00002.safetensors":
            # Held until rank 0 fsyncs the manifest (a rank 0 that waited for this fsync first
            # never does: after 10 s the order check below fails), then slow, so that a rename
            # not waiting for it would come first. A fixed 0.3 s alone failed on a loaded CI
            # machine, where rank 0 took longer than that to reach the manifest.
            manifest_begun.wait(10)
            time.sleep(0.3)
        real_fsync(fd)
        events.append(("fsynced", on))

    def rename(src, dst, **kwargs):
        events.append(("rename", os.path.basename(src)))
        real_rename(src, dst, **kwargs)

    def follow() -> None:
        writer = ShardWriter(pvc)
        staging = writer.staging(Ref(attempt=1, step=2, world_size=2), rank1.generation)
        rank1.wait_staging(staging, 2)
        entry = writer.write_shard(staging, 1, 2, 2, state, fsync_later=True)
        rank1.deliver(2, entry, lambda e: writer.write_receipt(staging, e), writer.settle)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    follower = threading.Thread(target=follow)
    follower.start()
    job.write_checkpoint(2, 100, state, tensor_specs(state), 0)
    follower.join(10)
    monkeypatch.undo()
    shard_done = events.index(("fsynced", "shard-00001-of-00002.safetensors"))
    assert events.index(("fsync", "manifest.json")) < shard_done  # the manifest did not wait for it
    commit = next(i for i, (kind, on) in enumerate(events) if kind == "rename" and on.startswith(".tmp-step-"))
    assert shard_done < commit, events
    assert [r.step for r in job.store.committed()] == [2]


def test_a_checkpoint_writer_thread_is_not_held_up_by_a_round_in_progress(server, pvc):
    """Async checkpoints: a rank's writer thread sends its receipt, and rank 0's waits for it,
    while the main threads wait in a stop round; one client serves one call at a time."""
    rank0, (rank1,) = launch(server, pvc, 2, timeout=10.0)
    entry = ShardEntry(rank=1, file="shard-00001-of-00002.safetensors", size=1, sha256="ab" * 32, holds=())
    voted = threading.Thread(target=rank1.stop_wanted)
    voted.start()  # blocks until rank 0 votes
    time.sleep(0.2)
    started = time.monotonic()
    rank1.wait_staging(pvc.root / "staging", 2)
    rank1.deliver(2, entry, lambda e: None)
    assert rank0.gather(None, None, 2) == [entry]  # type: ignore[arg-type]
    rank0.durable(2)
    assert time.monotonic() - started < 2 and voted.is_alive()
    assert rank0.stop_wanted() is False
    voted.join(5)


def test_rank_0_blocked_waiting_for_receipts_does_not_hold_up_its_other_calls(server, pvc):
    """Rank 0's waits block in the store on a connection of their own: an async writer thread
    waiting for the receipts must not hold up the main thread's calls (a stop note), as one
    client serving one call at a time would, until the wait ran out (30 s here); and the wait
    ends the moment the last key is set, without polling for it."""
    rank0, (rank1,) = launch(server, pvc, 2, timeout=30.0)
    entry = ShardEntry(rank=1, file="shard-00001-of-00002.safetensors", size=1, sha256="ab" * 32, holds=())
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(rank0.gather(None, None, 6)))  # type: ignore[arg-type]
    waiter.start()
    time.sleep(0.3)  # blocked in the store's wait by now
    setter = threading.Thread(target=rank0.set, args=(rank0.key("stop/0"), "noted"))
    setter.start()
    setter.join(5)
    done_while_waiting = not setter.is_alive() and waiter.is_alive()
    rank1.deliver(6, entry, lambda e: None)
    waiter.join(35)
    setter.join(35)
    assert done_while_waiting and got == [[entry]]


def test_waits_for_keys_end_in_rank_timeout_naming_what_was_missing(server, pvc):
    rank0, (rank1,) = launch(server, pvc, 2, timeout=1.0)
    with pytest.raises(RankTimeout, match=r"waited 1s for ranks \[1\] to write their shards of step 4"):
        rank0.gather(None, None, 4)  # type: ignore[arg-type]
    rank1.set(rank1.key("receipt/4/1"), "not waited for")  # the connection is sound after a timed-out wait
    with pytest.raises(RankTimeout, match=r"waited 1s for ranks \[1\] to make their shards of step 4 durable"):
        rank0.durable(4)


def test_a_store_that_goes_away_during_a_wait_for_a_key_is_rank_timeout(pvc):
    host = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))]
    rank0, _ = launch(host[0], pvc, 2, timeout=20.0)
    threading.Timer(0.3, host.clear).start()  # the last reference: the agent's host is gone
    started = time.monotonic()
    with pytest.raises(RankTimeout, match="rendezvous store did not answer"):
        rank0.gather(None, None, 4)  # type: ignore[arg-type]
    assert time.monotonic() - started < 10  # not the 20 s timeout


def test_a_rank_that_never_votes_ends_the_round_with_rank_timeout_in_bounded_time(server, pvc):
    rank0, (rank1,) = launch(server, pvc, 2, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(RankTimeout, match="waited 1s for every rank to finish step 0"):
        rank1.stop_wanted()  # rank 0 was killed mid-step: it never votes
    assert time.monotonic() - started < 5


def test_a_rank_signalled_while_a_dead_peer_keeps_its_round_open_exits_75_within_the_grace(server, pvc):
    """torchrun's agent SIGTERMs the survivors when a worker dies, then SIGKILLs them after 30 s,
    which loses their exit code: a signalled rank stops waiting for a round no live peer would
    leave open that long (STOP_GRACE here, its steps being instant), long before --rank-timeout."""
    signals: dict[int, str] = {}
    rank0, (rank1,) = launch(server, pvc, 2, timeout=30.0, signals=signals)
    threading.Timer(0.3, signals.__setitem__, (1, "SIGTERM")).start()  # rank 0 died mid-step: no vote
    started = time.monotonic()
    with pytest.raises(RankTimeout, match=r"SIGTERM reached rank 1 in stop round 1 .*within 3s: a peer is gone"):
        rank1.stop_wanted()
    assert exit_code_for(RankTimeout) == 75
    assert 3 <= time.monotonic() - started < 10  # the grace, not the 30 s round timeout


def test_a_signal_during_a_slow_peers_round_is_a_stop_not_a_timeout_when_the_peer_comes(server, pvc):
    """A live peer slower than usual (within the grace) ends the round the signalled rank waits
    in: that round's answer stands (its vote was cast), and the next round stops both ranks."""
    signals: dict[int, str] = {}
    rank0, (rank1,) = launch(server, pvc, 2, timeout=30.0, signals=signals)

    def train(peers) -> list[bool]:
        votes = []
        for step in range(1, 5):
            peers.step = step
            if peers.rank == 0 and step == 3:
                time.sleep(2.0)  # within rank 1's grace (3 s): a live peer, slower than usual
            if peers.rank == 1 and step == 3:
                threading.Timer(0.2, signals.__setitem__, (1, "SIGTERM")).start()
            votes.append(peers.stop_wanted())
            if votes[-1]:
                break
        return votes

    results = in_threads([rank0, rank1], train)
    assert results == [[False, False, False, True], [False, False, False, True]], results


def test_rank_0_failing_releases_a_rank_waiting_in_a_round(server, pvc):
    rank0, (rank1,) = launch(server, pvc, 2, timeout=30.0)
    threading.Timer(0.3, rank0.finish, ("error", "NoSpace: the PVC is full")).start()
    started = time.monotonic()
    with pytest.raises(PeerFailed, match="rank 0 stopped this launch: NoSpace"):
        rank1.stop_wanted()
    assert time.monotonic() - started < 5  # not the 30 s round timeout


@pytest.mark.parametrize("code, error", [(2, PeerRefused), (70, TrainJobError), (75, PeerFailed)])
def test_every_rank_ends_with_rank_0s_exit_code_and_rank_0_waits_until_they_read_it(server, pvc, code, error):
    """The store may die with rank 0's process: rank 0 returns from finish only once every other
    rank has read its outcome, unless the code is 75, which a rank that loses the store says anyway."""
    rank0, followers = launch(server, pvc, 3, timeout=30.0)
    finished: list[float] = []
    t = threading.Thread(target=lambda: (rank0.finish("error", "InputError: state.json is corrupt", code),
                                         finished.append(time.monotonic())))
    t.start()
    time.sleep(0.5)
    assert bool(finished) == (code == 75)  # nobody has read it yet
    read_at = time.monotonic()
    results = in_threads(followers, lambda f: f.stop_wanted())
    t.join(10)
    assert [type(r) for r in results] == [error, error]
    assert {exit_code_for(type(r)) for r in results} == {code}
    assert code == 75 or finished[0] >= read_at


def test_a_followers_refusal_reaches_rank_0_which_then_waits_only_for_the_ranks_still_there(server, pvc):
    """Rank 0 ends a launch with 2 waiting until every other rank has read its outcome: a rank
    that refused the launch and left never will, and rank 0 waited out --rank-timeout (30 s here)."""
    rank0, (rank1, rank2) = launch(server, pvc, 3, timeout=30.0)
    assert rank0.refusals() == []
    rank1.step = 7
    rank1.refuse(Refusal(rank=1, step=7, message="step 7: the loss is nan"))
    deadline = time.monotonic() + 5  # a TCPStore set is not acknowledged: another client sees it soon after
    while not rank0.refusals() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rank0.refusals() == [Refusal(rank=1, step=7, message="step 7: the loss is nan")]
    ended: list = []
    t = threading.Thread(target=lambda: ended.append(in_threads([rank2], lambda f: f.stop_wanted())[0]))
    t.start()  # rank 2 reads the outcome from its round
    started = time.monotonic()
    rank0.finish("error", "PeerRefused: rank 1: step 7: the loss is nan", 2)
    assert time.monotonic() - started < 10
    t.join(10)
    assert isinstance(ended[0], PeerRefused) and "rank 1: step 7" in str(ended[0])


def test_rank_0_failing_before_it_published_a_session_ends_every_joining_rank_with_its_code(server, pvc):
    rank0 = StoreCoordinator(client(server), pvc, 2, 30.0, lambda: None)
    rank1 = StoreFollower(client(server), 1, 2, 30.0, lambda: None)
    threading.Thread(target=rank0.finish, args=("error", "WorldSizeMismatch: reshard first", 2)).start()
    started = time.monotonic()
    with pytest.raises(PeerRefused, match="WorldSizeMismatch"):
        rank1.join("s", set())
    assert time.monotonic() - started < 5  # not the 30 s join timeout


def test_a_store_that_goes_away_is_rank_timeout(pvc):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=2))
    rank1 = StoreFollower(client(server), 1, 2, 2.0, lambda: None)
    del server  # the agent's host is gone
    with pytest.raises(RankTimeout, match="rendezvous store did not answer"):
        rank1.stop_wanted()


def test_a_follower_never_joins_a_launch_that_began_or_ended_in_a_store_that_outlived_it(server, pvc):
    """torchrun gives each launch fresh keys; a store that outlives a launch (a user's own) still
    holds its session. A follower must join the next launch, not the dead one."""
    dead, _ = launch(server, pvc, 2)  # generation 1 began; then its rank 0 was killed
    joined: list = []
    rank1 = StoreFollower(client(server), 1, 2, 5.0, lambda: None)
    t = threading.Thread(target=lambda: joined.append(rank1.join("s", set())))
    t.start()
    time.sleep(0.3)
    fresh = StoreCoordinator(client(server), pvc, 2, 5.0, lambda: None)
    fresh.publish(lambda g: session(g))
    assert fresh.wait_joined()
    fresh.begin()
    t.join(10)
    assert [s.generation for s in joined] == [2] and fresh.generation == 2


def test_a_relaunch_under_another_scope_sees_none_of_the_dead_launchs_keys(server, pvc):
    launch(server, pvc, 2, scope="run-a/0")
    rank1 = StoreFollower(client(server, "run-a/1"), 1, 2, 0.5, lambda: None)  # torchrun's restart 1
    with pytest.raises(RankTimeout, match="no session in the rendezvous store"):
        rank1.join("s", set())


def test_the_generation_still_grows_on_the_pvc_across_launches(server, pvc):
    first, _ = launch(server, pvc, 2, scope="a")
    second, _ = launch(server, pvc, 2, scope="b")
    assert (first.generation, second.generation) == (1, 2)
    assert (pvc.root / "ranks/session.json").exists()


# --- the choice -------------------------------------------------------------------------------------

AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("world, env, expected", [
    (1, AGENT, "files"),  # one rank: nothing to agree on, and the lab's log stays as it was
    (2, {}, "files"),  # the local launcher
    (2, AGENT, "store"),  # torchrun
    (2, {**AGENT, "TRAINJOB_COORDINATION": "files"}, "files"),
    (2, {**AGENT, "TORCHELASTIC_USE_AGENT_STORE": "False"}, "files"),  # no server at MASTER_PORT yet
])
def test_the_transport_follows_the_launcher(world, env, expected):
    assert connect.transport(world, env) == expected


def test_a_forced_transport_that_cannot_work_is_a_usage_error():
    with pytest.raises(UsageError, match="TRAINJOB_COORDINATION must be one of files, store, got 'nfs'"):
        connect.transport(2, {"TRAINJOB_COORDINATION": "nfs"})
    with pytest.raises(UsageError, match="there is no store: launch with torchrun"):
        connect.transport(2, {"TRAINJOB_COORDINATION": "store"})


def test_torchruns_store_is_opened_under_the_run_id_and_restart_count(server, pvc):
    env = {**AGENT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "TORCHELASTIC_RUN_ID": "r1",
           "TORCHELASTIC_RESTART_COUNT": "3"}
    rank0 = connect.coordinator(pvc, 2, 5.0, lambda: None, env)
    assert isinstance(rank0, StoreCoordinator)
    rank0.publish(lambda g: session(g))
    assert server.check(["trainjob/r1/3/session"])


def test_a_rank_connects_within_its_own_budget_then_waits_at_most_rank_timeout(server, pvc, monkeypatch):
    """Connecting to the agent's store waits for no peer, and a client's connect here now and then
    stalls 5 s before it gets through: it gets CONNECT_SECONDS however short --rank-timeout is.
    Every connection the rank then uses is bounded by --rank-timeout again."""
    budgets = []
    real = dist.TCPStore

    def recorded(*args, **kwargs):
        budgets.append(kwargs["timeout"])
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", recorded)
    env = {**AGENT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}
    rank1 = connect.follower(pvc, 1, 2, 1.0, lambda: None, env)
    assert budgets == [datetime.timedelta(seconds=connect.CONNECT_SECONDS)]
    second = datetime.timedelta(seconds=1)
    assert (rank1.kv.timeout, rank1.rounds_kv.timeout, rank1._waits_kv.timeout) == (second, second, second)
    started = time.monotonic()
    with pytest.raises(RankTimeout, match="did not answer while reading g00000000/never-set"):
        rank1.get(rank1.key("never-set"))
    assert time.monotonic() - started < 5


# --- whole launches under torchrun, through its store ----------------------------------------------

@pytest.fixture(scope="module")
def short_reference(tmp_path_factory) -> bytes:
    pvc = tmp_path_factory.mktemp("ref") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--steps", 6, "--ckpt-every", 1).returncode == 0
    return (pvc / "artifacts/model-v1.json").read_bytes()


def torchrun(pvc: Path, *script: str, env: dict[str, str] | None = None,
             rank_timeout: float = 5) -> subprocess.CompletedProcess:
    """``rank_timeout``: short where a survivor must give up on a killed peer soon, but not
    shorter than a loaded machine takes to start rank 0 (1 s once failed a join: rank 1 gave up
    waiting for rank 0's session before reaching its kill point, with the machine 6x
    oversubscribed); long where the ranks only have to meet."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.1", *script, "run", "--pvc", str(pvc), "--steps", "6",
                           "--ckpt-every", "1", "--keep", "2", "--rank-timeout", str(rank_timeout)],
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True, text=True,
                          timeout=120)


# As tests/ranks/test_peers.py does for the files: SIGKILL one rank just before its Nth write, fsync
# or rename (joining, writing its shard, staging, the manifest, the rename, the pointer, rotating),
# here with torchrun's workers agreeing through its store. The survivor gives up within its bounded
# wait (75) and a relaunch under torchrun ends with the uninterrupted bytes.
@pytest.mark.parametrize("victim, point", [(1, 0), (1, 6), (0, 5), (0, 33)])
@pytest.mark.process
@pytest.mark.killpoint
@pytest.mark.torchrun
def test_torchrun_sigkill_of_one_rank_at_an_io_call_leaves_a_resumable_pvc(tmp_path, short_reference, victim, point):
    pvc = tmp_path / "pvc"
    killed = torchrun(pvc, str(ROOT / "tests/killpoint.py"), str(point), env={"KILLPOINT_RANK": str(victim)})
    assert killed.returncode != 0
    assert "exitcode  : -9" in killed.stderr and "exitcode  : 75" in killed.stderr, killed.stderr[-3000:]
    relaunch = torchrun(pvc, "-m", "trainjob", rank_timeout=30)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert "transport=store world_size=2" in (pvc / "log.jsonl").read_text()
    assert (pvc / "artifacts/model-v1.json").read_bytes() == short_reference
    assert trainjob("verify", "--pvc", pvc).returncode == 0
    assert not [p for p in (pvc / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]


ABANDONS_A_WAIT = """
import datetime, sys, time
import torch.distributed as dist
from trainjob.errors import RankTimeout
from trainjob.ranks.store import wait_beside

class SlowTeardown:  # as torch's own objects can be: Python is still finalizing when the wait ends
    def __del__(self):
        time.sleep(4)


slow = SlowTeardown()
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
started = time.monotonic()

def check():  # a signalled rank whose stop round no peer ends
    if time.monotonic() - started > 0.2:
        raise RankTimeout("a peer is gone")

try:
    wait_beside(store, ["never set"], 3.0, "trainjob-round", check)
except RankTimeout:
    sys.exit(75)
"""


@pytest.mark.process  # a process of its own: what is tested is how it exits
def test_a_rank_that_abandons_a_store_wait_exits_with_its_code_not_sigabrt():
    """The abandoned wait's thread is still in the store's C++ call when the rank exits; had it
    come back while Python finalized, the rank would die of SIGABRT (seen: -6 instead of 75 in a
    torchrun launch with --rank-timeout 5). It exits 75 at once: the store's client never reports
    the wait timing out."""
    done = subprocess.run([sys.executable, "-c", ABANDONS_A_WAIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr[-2000:]
    assert "terminate called" not in done.stderr and "timed out after 3000ms" not in done.stderr, done.stderr


def test_a_verdict_round_asks_every_rank_before_any_session_and_a_refusal_names_the_rank(server, pvc):
    """Rank 0 tries candidates newest first; the followers, still waiting to join, answer each
    round once with their own verdict; a refusal comes back with its reason, by rank; once a
    session is published the round's key is gone, so no late rank takes up a stale round."""
    world = 3
    rank0 = StoreCoordinator(client(server), pvc, world, 5.0, lambda: None)
    followers = [StoreFollower(client(server), r, world, 5.0, lambda: None) for r in (1, 2)]
    asked: dict[int, list[str]] = {1: [], 2: []}

    def verify_as(rank: int):
        def verify(candidate) -> str | None:
            asked[rank].append(candidate.checkpoint)
            return "shard-00002: tensor w: sha256 differs" if rank == 2 and candidate.round == 1 else None
        return verify

    joiners = [threading.Thread(target=f.join, args=("s", set(), verify_as(f.rank))) for f in followers]
    for t in joiners:
        t.start()
    mine: list[str] = []
    first = rank0.verify_round("step-00000008-a0001-w003", None, True, lambda: mine.append("8") or None)
    second = rank0.verify_round("step-00000004-a0001-w003", "ab" * 32, True, lambda: mine.append("4") or None)
    assert first == [(0, None), (1, None), (2, "shard-00002: tensor w: sha256 differs")]
    assert second == [(0, None), (1, None), (2, None)]
    assert mine == ["8", "4"] and asked == {r: ["step-00000008-a0001-w003", "step-00000004-a0001-w003"]
                                             for r in (1, 2)}
    rank0.publish(lambda g: session(g, world))
    assert rank0.get("verify") == b""  # emptied, never deleted under a rank about to read it
    assert rank0.wait_joined()
    rank0.begin()
    for t in joiners:
        t.join(10)
    assert asked == {r: ["step-00000008-a0001-w003", "step-00000004-a0001-w003"] for r in (1, 2)}  # once each


def test_a_stop_reaching_rank_0_in_a_verdict_round_no_rank_answers_ends_the_round_at_once(server, pvc):
    """A rank that never answers (SIGSTOPped, dead, or itself stopping before it joins) must not
    hold rank 0's SIGTERM up for --rank-timeout (30 s here): the round ends with None (rank 0
    then verifies alone) moments after the signal, and leaves no thread in the store's wait."""
    signals: dict[int, str] = {}
    rank0 = StoreCoordinator(client(server), pvc, 2, 30.0, lambda: signals.get(0))
    threading.Timer(0.3, signals.__setitem__, (0, "SIGTERM")).start()
    started = time.monotonic()
    assert rank0.verify_round("step-00000004-a0001-w002", None, False, lambda: None) is None
    assert time.monotonic() - started < 10
    time.sleep(0.2)  # the store's wait, answered by the keys rank 0 set, has returned
    assert not [t for t in threading.enumerate() if t.name == "trainjob-verdicts"]
    rank0.publish(lambda g: session(g))  # the same connections serve the rest of the launch
    assert rank0.get("session")


def test_a_verdict_round_no_rank_answers_ends_in_rank_timeout_naming_the_rank(server, pvc):
    rank0 = StoreCoordinator(client(server), pvc, 3, 1.0, lambda: None)
    follower = StoreFollower(client(server), 1, 3, 1.0, lambda: None)
    answering = threading.Thread(target=lambda: in_threads([follower], lambda f: f.join("s", set(), lambda c: None)))
    answering.start()  # rank 1 answers, rank 2 never does
    with pytest.raises(RankTimeout, match=r"waited 1s for ranks \[2\] to verify their share of step-00000004"):
        rank0.verify_round("step-00000004-a0001-w003", None, False, lambda: None)
    answering.join(10)


def test_a_rank_that_fails_verifying_ends_the_round_with_peer_failed_not_a_refusal(server, pvc):
    rank0 = StoreCoordinator(client(server), pvc, 2, 5.0, lambda: None)
    follower = StoreFollower(client(server), 1, 2, 5.0, lambda: None)
    raised: list[BaseException] = []

    def join() -> None:
        def verify(candidate):
            raise MemoryError("out of memory reading its share")
        try:
            follower.join("s", set(), verify)
        except BaseException as exc:  # noqa: BLE001 - the follower ends with its own error
            raised.append(exc)

    t = threading.Thread(target=join)
    t.start()
    with pytest.raises(PeerFailed, match=r"rank 1 failed verifying its share of step-00000004-a0001-w002 "
                                         r"\(MemoryError: out of memory reading its share\)"):
        rank0.verify_round("step-00000004-a0001-w002", None, False, lambda: None)
    t.join(10)
    assert len(raised) == 1 and isinstance(raised[0], MemoryError)


# A sharded (FSDP2) state resumed under torchrun: rank 0 asks rank 1 to verify its share in a
# verdict round, and rank 1, SIGSTOPped before it joins, never answers. The process group's
# timeout is far longer than any wait tested, so a rank 0 that reached the gate's collectives
# would still be waiting when the test gives up.
SHARDED = '''
import argparse, datetime, os, signal, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import trainjob
from trainjob.torch import TrainingState

cli = argparse.ArgumentParser()
cli.add_argument("--pvc")
cli.add_argument("--rank-timeout", type=float)
cli.add_argument("--die-at", type=int)
cli.add_argument("--stop-rank-1", action="store_true")
args = cli.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if args.stop_rank_1 and rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
with trainjob.Run(args.pvc, state=TrainingState(model=model, optimizer=opt, rng=False), steps=4, ckpt_every=2,
                  rank_timeout=args.rank_timeout, die_at=args.die_at) as run:
    for step in run:
        loss = model(torch.ones(2, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        run.report(float(total) / world)
    with torch.no_grad():  # the gate's collectives, as examples/fsdp.py's
        counts = torch.tensor([1, 1])
        dist.all_reduce(counts)
        run.gate(holdout=trainjob.Score(correct=1, total=1), baseline=trainjob.Score(correct=1, total=1),
                 export=dict(model.state_dict()))
dist.destroy_process_group()
sys.exit(run.exit_code)
'''


def sharded_launch(script: Path, pvc: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node", "2",
                             "--monitor-interval", "0.1", str(script), "--pvc", str(pvc), *flags],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def workers(launcher: int) -> dict[int, int]:
    """The launcher's worker processes, by the RANK in their environment."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(process_state(int(entry.name), 3)) == launcher:
                env = (entry / "environ").read_bytes().split(b"\0")
                found.update((int(e[5:]), int(entry.name)) for e in env if e.startswith(b"RANK="))
        except (OSError, ValueError):
            pass  # gone meanwhile
    return found


def process_state(pid: int, field: int = 2) -> str:
    """A field of /proc/PID/stat, counted from 0 (2: the state, T when stopped; 3: the parent);
    "gone" once the process is (a zombie is gone too)."""
    try:
        fields = [*Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()]
    except OSError:
        return "gone"
    return "gone" if field == 2 and fields[0] in "ZX" else fields[field - 2]


def holds(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cut_short_sharded(tmp_path_factory) -> Path:
    """A W=2 FSDP run that exited 75 after its step-2 checkpoint (``die_at``): an attempt to resume."""
    pvc = tmp_path_factory.mktemp("sharded") / "pvc"
    (pvc.parent / "sharded.py").write_text(SHARDED)
    launch = sharded_launch(pvc.parent / "sharded.py", pvc, "--rank-timeout", "60", "--die-at", "2")
    _, err = launch.communicate(timeout=300)
    assert launch.returncode == 75, err[-3000:]
    assert events(pvc / "log.jsonl")[-1] == ("killed", "at_step=2")
    return pvc


@pytest.mark.process
@pytest.mark.torchrun
@pytest.mark.parametrize("sigterm", [True, False], ids=["sigterm", "rank-timeout"])
def test_rank_0_waiting_for_a_stopped_ranks_verdict_ends_75_without_reaching_the_gates_collectives(
        tmp_path, cut_short_sharded, sigterm):
    """Rank 1 is SIGSTOPped before it joins, so rank 0's verdict round never hears from it. A
    SIGTERM to rank 0 (--rank-timeout 600) ends the round at once: rank 0 verifies every shard
    itself, logs ``resumed`` and ``killed ... signal=SIGTERM`` and exits 75, with rank 1 still
    stopped (before: ignored until --rank-timeout, then torchrun's SIGKILL). Unsignalled, with
    --rank-timeout 5, rank 0 exits 75 once the round times out, without the script's gate
    collectives (before: they waited out the process group's timeout). Each: two torchrun
    launches (the fixture's, shared) of torch's start-up, hence over 20 s here."""
    pvc = tmp_path / "pvc"
    shutil.copytree(cut_short_sharded, pvc)
    before = events(pvc / "log.jsonl")
    launch = sharded_launch(cut_short_sharded.parent / "sharded.py", pvc, "--rank-timeout", "600" if sigterm else "5",
                            "--stop-rank-1")
    try:
        until(lambda: len(ranks := workers(launch.pid)) == 2 and process_state(ranks[1]) == "T"
              and holds(ranks[0], pvc / ".lock"), 120, "rank 0 never entered its Run beside a stopped rank 1")
        ranks = workers(launch.pid)
        if sigterm:
            time.sleep(1)  # rank 0 is in the verdict round by now (a SIGTERM before it is noted all the same)
            os.kill(ranks[0], signal.SIGTERM)
        until(lambda: process_state(ranks[0]) == "gone", 60 if sigterm else 90, "rank 0 is still waiting")
        assert process_state(ranks[1]) == "T"  # rank 1 never answered: the round did not end on its word
        os.kill(ranks[1], signal.SIGCONT)  # torchrun's agent has SIGTERMed it meanwhile: it ends now
        _, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
    assert launch.returncode == 75, err[-3000:]
    added = events(pvc / "log.jsonl")[len(before):]
    if sigterm:
        assert added[-2:] == [("resumed", "from_step=2"), ("killed", "at_step=2 signal=SIGTERM")], added
    else:
        assert added == []  # nothing began: the start is not logged, and status still says 75
        assert "waited 5s for ranks [1] to verify their share of step-00000002-a0001-w002" in err, err[-3000:]
