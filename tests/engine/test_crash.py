"""Crash safety with real processes and real signals: SIGKILL anywhere, SIGTERM, torn logs, locks.

The strongest test here enumerates every write/fsync/rename a clean run makes and SIGKILLs the
process just before each one in turn, and once more on its exit path after ``completed`` is
logged: whatever instant a kill lands on, the relaunch (as the rendered Job and ``supervise`` run
it) must exit 0 with the same artifact bytes as an uninterrupted run, and the kill must not cost
an attempt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import events, io_calls, killpoint, snapshot, trainjob, untouched
from trainjob.checkpoint.store import CheckpointStore
from trainjob.deploy import k8s
from trainjob.storage.pvc import Pvc

pytestmark = pytest.mark.process  # every test here starts the CLI or another process

FLAGS = ["--steps", "3", "--ckpt-every", "2"]


def as_deployed(pvc: Path, *flags: str) -> subprocess.CompletedProcess:
    """One pod of the rendered Job: its container's very command line, with ``pvc`` mounted.
    (``supervise`` runs the same command: ``run ARGS --idempotent``.)"""
    args = k8s.Target(run_args=flags).container_args()
    return trainjob(*(str(pvc) if arg == k8s.MOUNT else arg for arg in args))


def finish(pvc: Path, *flags: str) -> int:
    """Relaunch like a Job controller until the run ends; return the final exit code."""
    for _ in range(3):
        result = as_deployed(pvc, *flags)
        if result.returncode != 75:
            return result.returncode
    return result.returncode


def problems_after_recovery(pvc: Path, reference: bytes) -> list[str]:
    found = []
    artifact = pvc / "artifacts" / "model-v1.json"
    if not artifact.exists() or artifact.read_bytes() != reference:
        found.append("artifact differs from the uninterrupted run")
    if (pvc / "attempts").read_text().strip() != "1":
        found.append(f"attempts={(pvc / 'attempts').read_text().strip()}: a kill cost an attempt")
    if events(pvc / "log.jsonl")[-1][0] != "completed":
        found.append("log does not end in completed")
    litter = [p.name for p in pvc.rglob("*.tmp.*")]
    if litter:
        found.append(f"tmp litter {litter}")
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    pvc = tmp_path_factory.mktemp("ref") / "pvc"
    assert trainjob("run", "--pvc", pvc, *FLAGS).returncode == 0
    return (pvc / "artifacts" / "model-v1.json").read_bytes()


ASYNC = ["--async-checkpoint"]


@pytest.mark.killpoint
def test_the_kill_harness_counts_the_background_writers_io_calls(tmp_path):
    """Without this, an async run's kill points would skip every write, fsync and rename the
    writer thread makes: the async run makes exactly the synchronous run's calls, plus one log
    write (no fsync: it claims nothing on disk) for each `snapshotted` (steps 2 and 3)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        sync, asynchronous = pool.map(lambda mode: io_calls("run", "--pvc", tmp_path / mode[0], *FLAGS, *mode[1:]),
                                      [["sync"], ["async", *ASYNC]])
    assert asynchronous == sync + 2


@pytest.mark.parametrize("mode", [[], ASYNC], ids=["sync", "async"])
@pytest.mark.killpoint
def test_kill_before_every_io_call_resumes_to_the_same_bytes(tmp_path, mode):
    """Every trial is a fork of one process that imported the CLI once (tests/forked_killpoints.py):
    the pod's command killed before I/O call N, then the pod's command again, for every N."""
    args = k8s.Target(run_args=[*FLAGS, *mode]).container_args()  # async: the writer thread's calls too
    at = args.index("--pvc")
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "forked_killpoints.py"), str(tmp_path),
                           *args[:at], *args[at + 2:]], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["clean"] == 0 and result["artifacts"] == ["model-v1.json"]
    assert result["count"] > 20  # the harness really intercepts the engine's I/O
    assert len(result["trials"]) == result["count"] + 1  # the last one kills the exit path
    failures = [t for t in result["trials"] if t["killed"] != -signal.SIGKILL or t["relaunch"] != 0
                or not t["same_bytes"] or t["attempts"] != "1" or t["last_event"] != "completed" or t["litter"]
                or (t["n"] == result["count"] and not t["logged_completed"])]
    assert failures == []


@pytest.mark.killpoint
def test_a_kill_after_completed_is_logged_is_relaunched_to_exit_0_touching_nothing(pvc, reference):
    """The kill Kubernetes deals a pod in the instant after it published the model (an OOM kill,
    an eviction): the replacement pod, and a supervisor's next start, must report success."""
    died = killpoint(io_calls("run", "--pvc", pvc.parent / "count", *FLAGS), "run", "--pvc", pvc, *FLAGS)
    assert died.returncode == -signal.SIGKILL and events(pvc / "log.jsonl")[-1][0] == "completed"
    before, log_before = untouched(pvc), (pvc / "log.jsonl").read_text()

    pod = as_deployed(pvc, *FLAGS)
    assert pod.returncode == 0, pod.stderr
    assert pod.stdout.splitlines() == [
        "trainjob run: already completed (attempt 1): artifacts/model-v1.json verified, "
        f"sha256={hashlib.sha256(reference).hexdigest()}; nothing to do"]
    assert untouched(pvc) == before  # no file written, renamed, rotated or logged
    assert problems_after_recovery(pvc, reference) == []

    supervised = trainjob("supervise", "--backoff-base", "0.01", "--", "run", "--pvc", pvc, *FLAGS)
    assert supervised.returncode == 0, supervised.stderr
    added = (pvc / "log.jsonl").read_text().removeprefix(log_before).splitlines()
    assert [(line["event"], line.get("source")) for line in map(json.loads, added)] == [("stop", "supervisor")]
    assert "ending=completed reason=final outcome=completed" in json.loads(added[0])["detail"]
    assert trainjob("status", "--path", pvc / "log.jsonl").returncode == 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kills=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=3))
@pytest.mark.killpoint
def test_any_sequence_of_kills_resumes_to_the_same_bytes(tmp_path_factory, reference, kills):
    pvc = tmp_path_factory.mktemp("seq") / "pvc"
    for n in kills:  # each relaunch is killed again at its own n-th I/O call
        result = killpoint(n, "run", "--pvc", pvc, *FLAGS, "--idempotent")
        if result.returncode != -signal.SIGKILL:  # it got past its kill point: the job is over
            assert result.returncode == 0, result.stderr
            break
    assert finish(pvc, *FLAGS) == 0
    assert problems_after_recovery(pvc, reference) == []


def start_long_run(pvc: Path, steps: int = 100_000, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc),
                             "--steps", str(steps), "--ckpt-every", "1", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoints(pvc: Path, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = pvc / "log.jsonl"
        if log.exists() and log.read_text().count('"checkpointed"') >= count:
            return
        time.sleep(0.02)
    raise AssertionError("run made no progress")


@pytest.mark.parametrize("mode", [[], ASYNC], ids=["sync", "async"])
def test_sigterm_checkpoints_and_exits_75(pvc, mode):
    """Async: the write in flight lands, then the step reached is saved and lands, then killed."""
    proc = start_long_run(pvc, 100_000, *mode)
    wait_for_checkpoints(pvc, 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 75
    *_, (saved, saved_detail), (last_event, detail) = events(pvc / "log.jsonl")
    assert last_event == "killed" and detail.endswith(" signal=SIGTERM")
    at_step = int(detail.split()[0].removeprefix("at_step="))
    assert saved == "checkpointed" and saved_detail.startswith(f"step={at_step} ")
    assert json.loads((pvc / "checkpoint.json").read_text())["step"] == at_step


@pytest.mark.parametrize("mode", [[], ASYNC], ids=["sync", "async"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_mid_run_then_relaunch_gives_the_uninterrupted_bytes(tmp_path, sig, mode):
    steps = "400"
    ref, pvc = tmp_path / "ref", tmp_path / "pvc"
    assert trainjob("run", "--pvc", ref, "--steps", steps, "--ckpt-every", "1").returncode == 0
    proc = start_long_run(pvc, int(steps), *mode)
    wait_for_checkpoints(pvc, 3)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == (75 if sig == signal.SIGTERM else -sig)
    assert trainjob("run", "--pvc", pvc, "--steps", steps, "--ckpt-every", "1", *mode).returncode == 0
    assert snapshot(ref / "artifacts") == snapshot(pvc / "artifacts")
    assert (pvc / "attempts").read_text().strip() == "1"


def test_torn_log_line_is_skipped_and_reported(pvc):
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    with open(pvc / "log.jsonl", "a") as f:
        f.write('{"ts":"2026-11-30T00:00:00Z","event":"checkpoi')
    assert trainjob("run", "--pvc", pvc).returncode == 0
    status = trainjob("status", pvc / "log.jsonl")
    assert status.returncode == 0
    assert "last_event: completed" in status.stdout and "skipped: line 5" in status.stdout


def test_a_pointer_lagging_the_logged_step_resumes_from_the_logged_step(tmp_path):
    """What a power loss inside round 5 of a checkpoint can leave (docs/checkpoints.md,
    "Durability points"): the checkpoint and its `checkpointed` line durable, the pointer's rename
    lost, so checkpoint.json still names the checkpoint before. `verify` accepts that PVC; a
    relaunch resumes from the logged step (a resume that followed the pointer would redo steps
    the log says were saved) and ends with the uninterrupted run's bytes."""
    flags = ["--steps", "6", "--ckpt-every", "2", "--keep", "2"]
    ref, pvc = tmp_path / "ref", tmp_path / "pvc"
    assert trainjob("run", "--pvc", ref, *flags).returncode == 0
    assert trainjob("run", "--pvc", pvc, *flags, "--die-at", "4").returncode == 75
    store = CheckpointStore(Pvc(pvc))
    (step2,) = [r for r in store.committed() if r.step == 2]
    manifest, sha = store.read_manifest(step2)
    Pvc(pvc).write_checkpoint(store.pointer(manifest, step2, sha))  # the pointer before step 4's rename
    assert [d for e, d in events(pvc / "log.jsonl") if e == "checkpointed"][-1].startswith("step=4 ")
    assert trainjob("verify", "--pvc", pvc).returncode == 0
    lines = len(events(pvc / "log.jsonl"))
    relaunch = trainjob("run", "--pvc", pvc, *flags)
    assert relaunch.returncode == 0, relaunch.stderr
    assert events(pvc / "log.jsonl")[lines] == ("resumed", "from_step=4")
    assert snapshot(ref / "artifacts") == snapshot(pvc / "artifacts")
    assert json.loads((pvc / "checkpoint.json").read_text())["step"] == 6


def test_second_run_on_a_locked_pvc_exits_75_and_touches_nothing(pvc):
    assert trainjob("run", "--pvc", pvc, "--die-at", 2).returncode == 75
    before = snapshot(pvc)
    fd = os.open(pvc / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        result = trainjob("run", "--pvc", pvc)
    finally:
        os.close(fd)
    assert result.returncode == 75 and "another trainjob run holds this PVC" in result.stderr
    assert snapshot(pvc) == before


def test_concurrent_runs_one_proceeds_the_other_exits_75(pvc):
    first = start_long_run(pvc, 2000)
    wait_for_checkpoints(pvc, 1)
    second = trainjob("run", "--pvc", pvc, "--steps", "2000", "--ckpt-every", "1")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 75
    assert second.returncode == 75
    # The job then finishes (checkpointing rarely: 2000 durable checkpoints would be most of a minute).
    assert trainjob("run", "--pvc", pvc, "--steps", "2000", "--ckpt-every", "500").returncode == 0
