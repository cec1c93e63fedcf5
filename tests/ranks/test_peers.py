"""Ranks: the W-rank run against the 1-rank run, locks, bounded waits, kills and signals.

Real processes and real signals throughout: ranks are separate ``trainjob`` processes that
share nothing but the PVC directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, events, trainjob, untouched
from trainjob.errors import PeerFailed
from trainjob.storage.pvc import Pvc
from trainjob.ranks.peers import PvcCoordinator, PvcFollower
from trainjob.records import Session

LONG = ("--steps", "20000", "--ckpt-every", "500")


def session(generation: int) -> Session:
    """What rank 0 publishes for a fresh two-rank launch with settings "s"."""
    return Session(generation=generation, world_size=2, attempt=1, from_step=0, checkpoint=None,
                   manifest_sha256=None, settings="s")


# --- the same job at every world size --------------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    pvc = tmp_path_factory.mktemp("w1") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    assert trainjob("run", "--pvc", pvc).returncode == 0
    return pvc


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.process
@pytest.mark.torchrun
def test_w_ranks_end_with_the_1_rank_bytes_events_and_verdict(tmp_path, one_rank, world):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--world-size", world, "--die-at", 4).returncode == 75
    assert trainjob("run", "--pvc", pvc, "--world-size", world).returncode == 0
    assert (pvc / "artifacts/model-v1.json").read_bytes() == (one_rank / "artifacts/model-v1.json").read_bytes()
    logged = events(pvc / "log.jsonl")
    # One note per launch says how its ranks agreed: the local launcher's ranks, through the PVC's files.
    assert [e for e in logged if e[0] == "ranks_coordinated"] == [("ranks_coordinated",
                                                                  f"transport=files world_size={world}")] * 2
    assert [e for e in logged if e[0] != "ranks_coordinated"] == events(one_rank / "log.jsonl")  # same numbers
    manifest = json.loads((pvc / f"checkpoints/step-00000010-a0001-w{world:03d}/manifest.json").read_text())
    assert [s["rank"] for s in manifest["shards"]] == list(range(world))


@pytest.mark.process
@pytest.mark.torchrun
def test_drift_failure_is_the_same_verdict_at_two_ranks(tmp_path):
    result = trainjob("run", "--pvc", tmp_path / "pvc", "--world-size", 2, "--force-weights", "0,0,0")
    assert result.returncode == 1
    assert events(tmp_path / "pvc/log.jsonl")[-1] == (
        "drift_failed", "holdout: 14/20 vs baseline 20/20 (max drop 20%); refusing artifact")


def rank_proc(pvc: Path, rank: int, *args: str, env: dict | None = None, killpoint: int | None = None):
    prefix = [sys.executable, str(ROOT / "tests/killpoint.py"), str(killpoint)] if killpoint is not None \
        else [sys.executable, "-m", "trainjob"]
    return subprocess.Popen([*prefix, "run", "--pvc", str(pvc), *map(str, args)], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.process
@pytest.mark.torchrun
def test_ranks_started_by_another_launcher_find_each_other_through_the_pvc(tmp_path, one_rank):
    pvc = tmp_path / "pvc"
    follower = rank_proc(pvc, 1, env={"RANK": "1", "WORLD_SIZE": "2"})  # torchrun style, started first
    time.sleep(0.3)
    coordinator = rank_proc(pvc, 0, "--world-size", "2", env={"JOB_COMPLETION_INDEX": "0"})  # Indexed Job style
    assert coordinator.wait(30) == 0 and follower.wait(30) == 0
    assert (pvc / "artifacts/model-v1.json").read_bytes() == (one_rank / "artifacts/model-v1.json").read_bytes()


@pytest.mark.process
@pytest.mark.torchrun
def test_a_second_process_for_the_same_rank_exits_75(tmp_path):
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    fd = os.open(pvc / ".lock.rank-00001", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        result = trainjob("run", "--pvc", pvc, "--rank", 1, "--world-size", 2)
    finally:
        os.close(fd)
    assert result.returncode == 75 and "rank-1" in result.stderr


@pytest.mark.process
@pytest.mark.torchrun
def test_a_rank_alone_waits_a_bounded_time_then_exits_75(tmp_path):
    started = time.monotonic()
    result = trainjob("run", "--pvc", tmp_path / "pvc", "--rank", 1, "--world-size", 2, "--rank-timeout", 1)
    assert result.returncode == 75 and "waited 1s for rank 0" in result.stderr
    assert time.monotonic() - started < 10


def test_a_rank_that_read_a_session_a_new_rank_0_then_removed_joins_the_new_one(tmp_path):
    """The race a relaunch runs: rank 1 reads the killed launch's session (generation 1), the new
    rank 0 publishes generation 2 and removes generation 1's directory, rank 1's join note then
    has nowhere to go. It must join generation 2, not exit 75."""
    pvc = Pvc(tmp_path / "pvc")
    pvc.create()
    stale = PvcCoordinator(pvc, 2, 5.0, lambda: None)
    stale.publish(session)  # generation 1, as a launch whose rank 0 was then killed left it
    shutil.rmtree(stale.gen_dir())  # ... and as the next rank 0 removed it, after its own publish

    def new_rank_0() -> None:
        time.sleep(0.3)
        fresh = PvcCoordinator(pvc, 2, 5.0, lambda: None)
        fresh.publish(session)
        assert fresh.wait_joined()
        fresh.begin()

    publisher = threading.Thread(target=new_rank_0)
    publisher.start()
    rank1 = PvcFollower(pvc, 1, 2, 5.0, lambda: None)
    joined = rank1.join("s", set())
    publisher.join()
    assert joined.generation == 2
    assert (pvc.root / "ranks/g00000002/join-00001.json").exists()


def test_a_peer_s_stop_note_counts_only_once_it_is_whole(tmp_path):
    """A peer's stop note is written to a tmp file, then renamed. Counted while still a tmp file,
    rank 0 stopped without the note's signal to read, and logged `killed at_step=0` without
    `signal=SIGTERM@rank1` (seen once in a loaded suite run)."""
    pvc = Pvc(tmp_path / "pvc")
    pvc.create()
    rank0 = PvcCoordinator(pvc, 2, 5.0, lambda: None)
    rank0.publish(session)
    (rank0.gen_dir() / "stop-00001.json.tmp.4242").write_text("")  # rank 1 mid-write
    assert not rank0.stop_wanted()
    rank1 = PvcFollower(pvc, 1, 2, 5.0, lambda: "SIGTERM")
    rank1.generation = rank0.generation
    rank1.poll()  # notes its stop, whole
    assert rank0.stop_wanted() and rank0.peer_signal() == "SIGTERM@rank1"


def test_rank_0s_poll_lists_the_generation_once_and_finds_both_a_stop_and_a_refusal(tmp_path, monkeypatch):
    """Each wait polls every few milliseconds, on a PVC that may be a network file system: rank 0
    asks two questions of the generation's notes (a peer's stop, a peer's refusal) from one listing."""
    from trainjob.errors import PeerRefused
    from trainjob.records import Refusal

    pvc = Pvc(tmp_path / "pvc")
    pvc.create()
    rank0 = PvcCoordinator(pvc, 3, 5.0, lambda: None)
    rank0.publish(session)
    listings = []
    real = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: listings.append(self) or real(self))
    rank0.poll()
    assert len(listings) == 1 and rank0.stopping_note is None
    stopped, refusing = PvcFollower(pvc, 1, 3, 5.0, lambda: "SIGTERM"), PvcFollower(pvc, 2, 3, 5.0, lambda: None)
    stopped.generation = refusing.generation = rank0.generation
    stopped.poll()  # notes its stop
    refusing.refuse(Refusal(rank=2, step=4, message="step 4: the loss is nan"))
    listings.clear()
    with pytest.raises(PeerRefused, match="rank 2: step 4: the loss is nan"):
        rank0.poll()
    assert len(listings) == 1 and rank0.stopping_note is not None, listings


@pytest.mark.parametrize("begun", [False, True])
def test_a_rank_never_trains_for_a_dead_rank_0s_session_but_follows_the_next_one(tmp_path, begun):
    """The relaunch races the other way round: rank 1 reads the killed launch's session (generation
    1, its directory still there) before the new rank 0 publishes generation 2. If generation 1 had
    not begun, rank 1 joins it but waits in vain for rank 0 to begin it; if it had begun (rank 0
    was killed mid-run, after its rank 1 had joined), its checkpoint may be rotated away, and rank 1
    must not join it at all. Either way rank 1 must end up in generation 2: under torchrun, training
    for generation 1 blocks in a collective while the new rank 0 waits for rank 1 to join."""
    pvc = Pvc(tmp_path / "pvc")
    pvc.create()
    killed = PvcCoordinator(pvc, 2, 5.0, lambda: None)
    killed.publish(session)  # generation 1; its rank 0 is then killed
    gen1 = pvc.root / "ranks/g00000001"
    if begun:
        (gen1 / "join-00001.json").write_text('{"rank": 1, "step": 0, "signal": ""}\n')
        assert killed.wait_joined()
        killed.begin()
    seen: list[int] = []

    def new_rank_0() -> None:
        deadline = time.monotonic() + 0.5  # long enough for rank 1 to read generation 1's session
        while not (gen1 / "join-00001.json").exists() or begun and time.monotonic() < deadline:
            time.sleep(0.01)
        fresh = PvcCoordinator(pvc, 2, 5.0, lambda: None)
        fresh.publish(session)
        assert fresh.wait_joined()
        fresh.begin()
        seen.append(fresh.generation)

    publisher = threading.Thread(target=new_rank_0)
    publisher.start()
    joined = PvcFollower(pvc, 1, 2, 5.0, lambda: None).join("s", set())
    publisher.join()
    assert joined.generation == 2 and seen == [2]


def test_a_rank_waiting_for_rank_0_to_begin_exits_with_rank_0s_error(tmp_path):
    pvc = Pvc(tmp_path / "pvc")
    pvc.create()
    rank0 = PvcCoordinator(pvc, 2, 5.0, lambda: None)
    rank0.publish(session)
    threading.Timer(0.3, rank0.finish, ("error", "RankTimeout: waited")).start()
    with pytest.raises(PeerFailed, match="rank 0 stopped this launch: RankTimeout"):
        PvcFollower(pvc, 1, 2, 5.0, lambda: None).join("s", set())


# --- kills and signals ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_reference(tmp_path_factory) -> bytes:
    pvc = tmp_path_factory.mktemp("ref") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--steps", 6, "--ckpt-every", 1).returncode == 0
    return (pvc / "artifacts/model-v1.json").read_bytes()


# Kill one rank (SIGKILL, from inside, just before its Nth write/fsync/rename) at points spread
# over a run: while joining, while writing a shard or receipt, while rank 0 stages, writes the
# manifest, renames the directory, writes the pointer, rotates. The survivor must give up within
# its bounded wait (75), and a relaunch of all ranks must finish with the uninterrupted bytes. The
# wait is 5 s, not 1: on a loaded machine a rank can take over a second to start, and a peer that
# gives up on it before the kill point tests nothing.
@pytest.mark.parametrize("victim, point", [(1, 0), (1, 10), (0, 5), (0, 33), (0, 60)])
@pytest.mark.process
@pytest.mark.killpoint
@pytest.mark.torchrun
def test_sigkill_of_one_rank_at_any_point_leaves_a_resumable_pvc(tmp_path, short_reference, victim, point):
    pvc, flags = tmp_path / "pvc", ("--steps", "6", "--ckpt-every", "1", "--keep", "2", "--world-size", "2",
                                     "--rank-timeout", "5")
    procs = [rank_proc(pvc, r, *flags, "--rank", str(r), killpoint=point if r == victim else None)
             for r in (0, 1)]
    codes = [p.wait(30) for p in procs]
    assert codes[victim] == -signal.SIGKILL and codes[1 - victim] == 75, [p.stderr.read() for p in procs]
    result = trainjob("run", "--pvc", pvc, *flags[:-1], "30")  # the ranks only have to meet: no short wait
    assert result.returncode == 0, result.stderr
    assert (pvc / "artifacts/model-v1.json").read_bytes() == short_reference
    assert trainjob("verify", "--pvc", pvc).returncode == 0
    assert not [p for p in (pvc / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_until(check, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.01)


def wait_for_checkpoint(pvc: Path) -> None:
    wait_until((pvc / "checkpoint.json").exists, "a checkpoint")


def wait_for_start(pvc: Path) -> None:
    log = pvc / "log.jsonl"
    wait_until(lambda: log.exists() and log.read_text() != "", "the run's start")


@pytest.mark.process
@pytest.mark.torchrun
def test_the_launcher_forwards_sigterm_every_rank_checkpoints_and_it_exits_75(tmp_path):
    pvc = tmp_path / "pvc"
    launcher = subprocess.Popen([sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc), "--world-size", "2",
                                 *LONG], stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(pvc)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(30) == 75
    event, detail = events(pvc / "log.jsonl")[-1]
    at_step = int(detail.split()[0].removeprefix("at_step="))
    assert event == "killed" and "signal=SIGTERM" in detail
    assert json.loads((pvc / "checkpoint.json").read_text())["step"] == at_step  # saved where it stopped


@pytest.mark.process
@pytest.mark.torchrun
def test_sigterm_to_one_rank_stops_all_at_an_agreed_step_with_a_checkpoint(tmp_path):
    pvc = tmp_path / "pvc"
    procs = [rank_proc(pvc, r, *LONG, "--rank", str(r), "--world-size", "2") for r in (0, 1)]
    wait_for_checkpoint(pvc)
    procs[1].send_signal(signal.SIGTERM)  # as when Kubernetes evicts one pod of an Indexed Job
    assert [p.wait(30) for p in procs] == [75, 75]
    event, detail = events(pvc / "log.jsonl")[-1]
    assert event == "killed" and "signal=SIGTERM@rank1" in detail
    step = json.loads((pvc / "checkpoint.json").read_text())["step"]
    assert detail.startswith(f"at_step={step} ") and trainjob("verify", "--pvc", pvc).returncode == 0


@pytest.mark.process
@pytest.mark.torchrun
def test_when_a_rank_dies_the_launcher_stops_the_others_and_exits_75(tmp_path):
    pvc = tmp_path / "pvc"
    launcher = subprocess.Popen([sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc), "--world-size", "3",
                                 *LONG], stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(pvc)
    os.kill(children(launcher.pid)[2], signal.SIGKILL)
    assert launcher.wait(30) == 75
    assert not children(launcher.pid) if Path(f"/proc/{launcher.pid}").exists() else True
    assert trainjob("verify", "--pvc", pvc).returncode == 0


@pytest.mark.process
@pytest.mark.torchrun
def test_sigterm_before_every_rank_joined_logs_the_kill_at_once_and_a_relaunch_finishes(tmp_path, short_reference):
    """Rank 0 stopped while waiting for a rank that never came: nothing was trained, so it must not
    sit out --rank-timeout and exit with the log still at job_started; it logs the kill and exits 75."""
    pvc, flags = tmp_path / "pvc", ("--steps", "6", "--ckpt-every", "1", "--world-size", "2")
    rank0 = rank_proc(pvc, 0, *flags, "--rank", "0", "--rank-timeout", "60")
    wait_for_start(pvc)
    started = time.monotonic()
    rank0.send_signal(signal.SIGTERM)
    assert rank0.wait(30) == 75, rank0.stderr.read()
    assert time.monotonic() - started < 10  # not the 60 s wait for rank 1
    assert events(pvc / "log.jsonl")[-1] == ("killed", "at_step=0 signal=SIGTERM")
    late = trainjob("run", "--pvc", pvc, *flags, "--rank", 1, "--rank-timeout", 1)  # the launch has ended
    assert late.returncode == 75 and "waited 1s for rank 0 to start a launch" in late.stderr
    assert trainjob("run", "--pvc", pvc, *flags).returncode == 0
    assert (pvc / "artifacts/model-v1.json").read_bytes() == short_reference


@pytest.mark.process
@pytest.mark.torchrun
def test_a_rank_waiting_for_the_begin_exits_as_rank_0_ended_the_unbegun_launch(tmp_path):
    pvc, flags = tmp_path / "pvc", ("--steps", "6", "--ckpt-every", "1", "--world-size", "3")
    rank0 = rank_proc(pvc, 0, *flags, "--rank", "0")
    rank1 = rank_proc(pvc, 1, *flags, "--rank", "1")  # rank 2 never comes
    wait_for_start(pvc)
    wait_until((pvc / "ranks/g00000001/join-00001.json").exists, "rank 1's join")
    rank1.send_signal(signal.SIGTERM)  # a stop at a rank waiting for the begin, passed on to rank 0
    assert [rank0.wait(30), rank1.wait(30)] == [75, 75], [rank0.stderr.read(), rank1.stderr.read()]
    assert events(pvc / "log.jsonl")[-1] == ("killed", "at_step=0 signal=SIGTERM@rank1")


@pytest.mark.process
@pytest.mark.killpoint
@pytest.mark.torchrun
def test_a_sigterm_after_rank_0_completed_leaves_the_launch_completed(tmp_path, short_reference):
    # tests/latesignal.py signals the launcher just after a rank exited 0, which a rank does only
    # once rank 0 has logged `completed`: the launch reports what happened, not the signal.
    pvc = tmp_path / "pvc"
    done = subprocess.run([sys.executable, ROOT / "tests/latesignal.py", "run", "--pvc", pvc, "--steps", "6",
                           "--ckpt-every", "1", "--world-size", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "SIGTERM arrived after the job completed; it stays completed" in done.stderr
    assert events(pvc / "log.jsonl")[-1][0] == "completed"
    assert (pvc / "artifacts/model-v1.json").read_bytes() == short_reference


@pytest.mark.process
@pytest.mark.torchrun
def test_each_rank_relaunched_after_its_launch_completed_exits_0_at_once(tmp_path):
    """An Indexed Job recreates one index (its pod was evicted after the launch completed): that
    rank must exit 0 on its own, not wait for a rank 0 that will never lead another launch."""
    pvc, flags = tmp_path / "pvc", ["--steps", "6", "--ckpt-every", "1", "--world-size", "2", "--idempotent"]
    assert trainjob("run", "--pvc", pvc, *flags).returncode == 0
    before = untouched(pvc)
    relaunch = [sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc), *flags, "--rank-timeout", "1"]
    for how, env in [(["--rank", "1"], {}), ([], {"JOB_COMPLETION_INDEX": "1"}), (["--rank", "0"], {}), ([], {})]:
        done = subprocess.run([*relaunch, *how], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (how, env, done.stderr)
        assert "already completed (attempt 1): artifacts/model-v1.json verified" in done.stdout
    assert untouched(pvc) == before


# --- a refusal only one rank saw ---------------------------------------------------------------------

@pytest.mark.process
@pytest.mark.parametrize("transport", ["files", pytest.param("store", marks=pytest.mark.torchrun)])
def test_a_refusal_only_rank_1_saw_is_logged_by_rank_0_and_every_rank_exits_2(tmp_path, transport):
    """Rank 1 alone reports a NaN at step 7 (tests/helpers/refuse_on_one_rank.py). It used to exit 2
    with rank 0 logging nothing: the launch ended 2 while `status` said 75 (relaunch), and with
    files rank 0 first waited out --rank-timeout (20 s here) at the next checkpoint. Rank 0 now
    logs `refused`, naming rank 1 and its reason, and every rank exits 2, at once."""
    from conftest import agrees_with_its_log

    pvc, script = tmp_path / "pvc", str(ROOT / "tests/helpers/refuse_on_one_rank.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    if transport == "files":
        ranks = [subprocess.Popen([sys.executable, script, str(pvc), str(r), "2"], env=env, stderr=subprocess.PIPE,
                                  text=True) for r in (1, 0)]
        codes = [p.wait(60) for p in ranks]
    else:
        launch = subprocess.run([sys.executable, "-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node", "2",
                                 "--monitor-interval", "0.1", script, str(pvc)], env=env, capture_output=True,
                                text=True, timeout=120)
        codes = [launch.returncode]
        assert "workers' codes {0: 2, 1: 2}" in launch.stderr, launch.stderr[-2000:]
    assert codes == [2] * len(codes)
    assert time.monotonic() - started < 15  # not after --rank-timeout (20 s)
    last = json.loads((pvc / "log.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "refused" and "reason=rank 1: step 7: the loss is nan" in last["detail"], last
    agrees_with_its_log(codes[0], pvc)
