"""Ranks: ``trainjob torchrun``, the launcher in every W > 1 pod, exits with the job's code.

The W > 1 container command that ``k8s render`` prints, run as W local "pods": each its own
process group (the kubelet signals the container's first process; a dying pod takes all of its
processes), the rendezvous endpoint pointed at a free loopback port, the claim at a tmp dir. The
pure rule (``exits.job_exit``) and the ranks passing rank 0's code on are tested in process
(tests/test_errors.py, tests/ranks/test_store_transport.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, events, trainjob

pytest.importorskip("torch.distributed", reason="torch is not installed (pip install 'trainjob[torch]')")

RANK_TIMEOUT = 20  # long enough for W workers importing torch at once on a loaded 2-core machine
GRACE = 60  # the rendered terminationGracePeriodSeconds (k8s render's default)
RUN = ["--steps", "3000", "--ckpt-every", "100", "--rank-timeout", str(RANK_TIMEOUT)]


def rendered_command(world: int, pvc: Path) -> list[str]:
    """The rendered container's command and args, with the claim and index 0's name made local."""
    out = trainjob("k8s", "render", "--world-size", world, "--", "run", *RUN)
    assert out.returncode == 0, out.stderr
    job = list(yaml.safe_load_all(out.stdout))[2]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == GRACE
    command = [*container["command"], *container["args"]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        command[command.index("--rdzv-endpoint") + 1] = f"127.0.0.1:{s.getsockname()[1]}"
    command[command.index("/var/lib/trainjob")] = str(pvc)
    return command


class Pods:
    """One launch of the Job: W pods started at once, or ``only`` some of them."""

    def __init__(self, world: int, pvc: Path, only: list[int] | None = None) -> None:
        command = rendered_command(world, pvc)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "PYTHONUNBUFFERED": "1"}
        self.started = time.monotonic()
        self.procs = {i: subprocess.Popen(command, env={**env, "JOB_COMPLETION_INDEX": str(i)},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True)
                      for i in (range(world) if only is None else only)}
        self.ended: dict[int, float] = {}

    def wait(self, timeout: float = 240) -> dict[int, int]:
        """Every pod's exit code; when each ended is in ``ended``."""
        deadline = time.monotonic() + timeout
        while len(self.ended) < len(self.procs) and time.monotonic() < deadline:
            for i, p in self.procs.items():
                if i not in self.ended and p.poll() is not None:
                    self.ended[i] = time.monotonic()
            time.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                kill_pod(p)
        self.output = {i: p.communicate()[0] for i, p in self.procs.items()}
        return {i: p.returncode for i, p in self.procs.items()}

    def told(self) -> str:
        return "\n".join(f"--- pod {i}\n{out[-2000:]}" for i, out in self.output.items())


def kill_pod(proc: subprocess.Popen) -> None:
    """SIGKILL every process of a pod at once, as a lost node does: torchrun's workers live in
    sessions of their own, so the process group alone would miss them."""
    pids = [proc.pid]
    for pid in pids:  # grows while walked: every descendant, found before any dies
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_training(pvc: Path, pods: Pods, after: int) -> None:
    """Until this launch has committed a checkpoint (the log grew past ``after`` lines with one)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        lines = (pvc / "log.jsonl").read_text().splitlines() if (pvc / "log.jsonl").exists() else []
        if any(json.loads(line)["event"] == "checkpointed" for line in lines[after:]):
            return
        assert all(p.poll() is None for p in pods.procs.values()), "a pod ended before the launch trained"
        time.sleep(0.05)
    raise AssertionError("the launch never trained")


def log_lines(pvc: Path) -> int:
    return len((pvc / "log.jsonl").read_text().splitlines())


@pytest.mark.process
@pytest.mark.torchrun
@pytest.mark.parametrize("world", [2, 4])
def test_every_pod_of_a_w_rank_job_exits_with_the_jobs_code(tmp_path, world):
    """The contract of the rendered W > 1 Job, pod by pod: 2 on bad input, 75 when a pod is
    signalled (within the grace period) or lost (within --rank-timeout), 0 when it completes, and
    0 at once for a pod recreated alone after completion. Four launches of W torch agents each,
    about 2 to 5 minutes on the loaded 2-core machine: one launch per guarantee, each checked in
    every pod."""
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, *RUN, "--die-at", "100").returncode == 75  # a checkpoint for 1 rank

    # Bad input: the checkpoint is for 1 rank. Rank 0 finds it; every pod says 2 (FailJob), none 1.
    pods = Pods(world, pvc)
    codes = pods.wait()
    assert set(codes.values()) == {2}, pods.told()
    assert sum("WorldSizeMismatch" in out or "trainjob reshard" in out for out in pods.output.values()) == world
    assert trainjob("reshard", "--pvc", pvc, "--world-size", world).returncode == 0

    # SIGTERM to one pod's process group (what the kubelet sends): every pod saves and exits 75.
    before = log_lines(pvc)
    pods = Pods(world, pvc)
    wait_for_training(pvc, pods, before)
    signalled = time.monotonic()
    os.killpg(pods.procs[world - 1].pid, signal.SIGTERM)
    codes = pods.wait()
    assert set(codes.values()) == {75}, pods.told()
    assert max(pods.ended.values()) - signalled < GRACE, pods.told()
    assert events(pvc / "log.jsonl")[-1][0] == "killed" and "signal=SIGTERM" in events(pvc / "log.jsonl")[-1][1]

    # SIGKILL of one whole pod: every other pod exits 75 within --rank-timeout (plus the exit itself).
    before = log_lines(pvc)
    pods = Pods(world, pvc)
    wait_for_training(pvc, pods, before)
    killed = time.monotonic()
    kill_pod(pods.procs[1])
    codes = pods.wait()
    survivors = {i: c for i, c in codes.items() if i != 1}
    assert set(survivors.values()) == {75}, pods.told()
    assert max(t for i, t in pods.ended.items() if i != 1) - killed < RANK_TIMEOUT + 10, pods.told()

    # A happy launch: it resumes and completes; every pod exits 0.
    pods = Pods(world, pvc)
    codes = pods.wait()
    assert set(codes.values()) == {0}, pods.told()
    assert events(pvc / "log.jsonl")[-1][0] == "completed"

    # A pod recreated alone after completion: 0 at once, no peer awaited, nothing written.
    pods = Pods(world, pvc, only=[world - 1])
    codes = pods.wait()
    assert codes == {world - 1: 0}, pods.told()
    assert pods.ended[world - 1] - pods.started < 5, pods.told()
    assert "already completed (attempt 1)" in pods.output[world - 1]
