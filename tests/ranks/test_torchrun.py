"""Ranks: ``trainjob torchrun``, the launcher in every W > 1 pod, exits with the job's code.

The W > 1 container command that ``k8s render`` prints, run as W local "pods": each its own
process group (the kubelet signals the container's first process; a dying pod takes all of its
processes), the rendezvous endpoint pointed at a free loopback port, the claim at a tmp dir. The
pure rule (``exits.job_exit``) and the ranks passing rank 0's code on are tested in process
(tests/test_errors.py, tests/ranks/test_store_transport.py).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from conftest import events, trainjob
from trainjob import cli
from trainjob.deploy.launches import kill_launch
from trainjob.ranks import torchrun

RENDERED = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            "trainjob-0.trainjob:29400", "--rdzv-id", "trainjob", "--max-restarts", "0", "-m", "trainjob"]
RANK_TIMEOUT = 20  # long enough for W workers importing torch at once on a loaded 2-core machine
GRACE = 60  # the rendered terminationGracePeriodSeconds (k8s render's default)
RUN = ["--steps", "3000", "--ckpt-every", "100", "--rank-timeout", str(RANK_TIMEOUT)]


# --- in process: the launcher's decisions ------------------------------------------------------------

def test_the_run_arguments_are_found_in_a_torchrun_command_line_without_torchs_parser():
    assert torchrun.run_args([*RENDERED, "run", "--pvc", "p", "--idempotent"]) == ["--pvc", "p", "--idempotent"]
    assert torchrun.run_args(["--rdzv-id", "trainjob", "-m", "trainjob", "run"]) == []  # the id is no script
    assert torchrun.run_args(["--nproc-per-node", "2", "own_loop.py", "--pvc", "p"]) is None  # a loop of your own
    assert torchrun.run_args(["--nnodes", "2", "trainjob", "run"]) is None  # no -m: a file called trainjob


def test_a_worker_reports_its_code_only_under_trainjob_torchrun(tmp_path):
    torchrun.report(2, {})  # no directory named: a no-op
    assert list(tmp_path.iterdir()) == []
    torchrun.report(75, {torchrun.REPORT_DIR: str(tmp_path), "LOCAL_RANK": "1"})
    torchrun.report(0, {torchrun.REPORT_DIR: str(tmp_path)})
    (tmp_path / "local-rank-2").write_text("")  # torn: the status speaks for it
    assert torchrun._reported(tmp_path) == {0: 0, 1: 75}


@pytest.mark.parametrize("succeeded, statuses, reported, job", [
    (True, {}, {}, 0),                    # every worker exited 0, none reported (a script of your own)
    (False, {0: 1}, {0: 1}, 1),           # an honest failure, reported
    (False, {0: 1}, {}, 70),              # an unreported 1: Python's exit on an uncaught exception
    (False, {0: -15}, {0: 75}, 75),       # the agent stopped it after it decided 75: the report wins
    (False, {0: -15}, {}, 75),            # stopped by the agent before it decided anything
    (False, {}, {}, 75),                  # a signal or a lost rendezvous before any worker decided
    (False, {}, {0: 0}, 0),               # signalled after it completed: it stays completed
    (False, {1: -15}, {0: 0}, 0),         # rank 0 completed, then a peer was stopped
    (False, {0: 2, 1: -15}, {0: 2}, 2),   # the worker that met the cause says it
])
def test_the_launchs_code_is_the_job_rule_over_what_each_worker_decided(succeeded, statuses, reported, job):
    assert torchrun.launch_code(succeeded, statuses, reported) == job


@pytest.fixture
def no_torch_launch(monkeypatch):
    """``trainjob torchrun`` up to the launch: what it would have launched, nothing started."""
    launched: list = []
    monkeypatch.setattr(torchrun, "launch", lambda argv: launched.append(argv) or 99)
    monkeypatch.setattr(torchrun, "stop_on_signals", lambda: None)
    return launched


def test_a_launch_on_an_ended_job_exits_with_its_code_before_any_rendezvous(tmp_path, no_torch_launch, capsys):
    pvc, failed = tmp_path / "pvc", tmp_path / "failed"
    assert cli.main(["run", "--pvc", str(pvc), "--steps", "4"]) == 0
    command = ["torchrun", *RENDERED, "run", "--pvc", str(pvc), "--steps", "4", "--world-size", "2"]
    capsys.readouterr()
    assert cli.main([*command, "--idempotent"]) == 0
    assert capsys.readouterr().out.startswith("trainjob run: already completed (attempt 1): artifacts/model-v1.json")
    assert cli.main(command) == 2  # the lab's refusal, as at W = 1
    for attempt in range(2):  # the gate says no, then the budget of 0 is spent
        assert cli.main(["run", "--pvc", str(failed), "--backoff-limit", "0", "--force-weights", "0,0,0"]) == 1
    capsys.readouterr()
    failing = ["torchrun", *RENDERED, "run", "--pvc", str(failed), "--world-size", "2", "--force-weights", "0,0,0"]
    assert cli.main([*failing, "--backoff-limit", "0", "--idempotent"]) == 1
    assert "the job failed: attempts=1 backoffLimit=0" in capsys.readouterr().out
    assert cli.main(["torchrun", *RENDERED, "run", "--pvc", str(pvc), "--steps", "0"]) == 2  # a bad flag
    assert no_torch_launch == []
    assert cli.main([*failing, "--backoff-limit", "1"]) == 99  # a budget left: the launch goes ahead
    assert cli.main(["torchrun", "--standalone", "own_loop.py", "--pvc", str(pvc)]) == 99  # not trainjob run
    assert len(no_torch_launch) == 2


# --- the rendered pods, as processes --------------------------------------------------------------------

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
    """SIGKILL every process of a pod at once, as a lost node does (torchrun's workers live in
    sessions of their own): the chaos campaign's way."""
    kill_launch(proc, torchrun=True)


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


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.process
@pytest.mark.torchrun
def test_every_pod_of_a_w_rank_job_exits_with_the_jobs_code(tmp_path):
    """The contract of the rendered W > 1 Job, pod by pod: 2 on bad input, 75 when a pod is
    signalled (within the grace period) or lost (within --rank-timeout), 0 when it completes, and
    0 at once for a pod recreated alone after completion. Slow (about a minute here) because it
    launches the Job five times, W torch agents each: one launch per guarantee, each checked in
    every pod. W=3 rather than 2 and 4: the lost pod then leaves a coordinator and a
    non-coordinator behind, which is all that 4 added to 2, at one launch's cost."""
    pytest.importorskip("torch.distributed", reason="torch is not installed (pip install 'trainjob[torch]')")
    world = 3
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, *RUN, "--die-at", "100").returncode == 75  # a checkpoint for 1 rank

    # Bad input: the checkpoint is for 1 rank. Rank 0 finds it; every pod says 2 (FailJob), none 1,
    # and the PVC is as it was: not even the lock files of ranks 1 and 2, new to it, stay.
    before = {str(p.relative_to(pvc)): p.read_bytes() if p.is_file() else None for p in sorted(pvc.rglob("*"))}
    pods = Pods(world, pvc)
    codes = pods.wait()
    assert set(codes.values()) == {2}, pods.told()
    assert sum("WorldSizeMismatch" in out or "trainjob reshard" in out for out in pods.output.values()) == world
    assert {str(p.relative_to(pvc)): p.read_bytes() if p.is_file() else None for p in sorted(pvc.rglob("*"))} == before
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


# --- a launcher SIGKILLed alone: its workers do not outlive it (ranks/parent.py) ---------------------

def workers_of(launcher: int) -> list[int]:
    """The launcher's children that are rank processes (torchrun sets RANK in each worker)."""
    found = []
    for task in Path(f"/proc/{launcher}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return [pid for pid in found if any(v.startswith(b"RANK=") for v in _environ(pid))]


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.process
@pytest.mark.torchrun
@pytest.mark.parametrize("launcher", [["-m", "trainjob", "torchrun"], ["-m", "torch.distributed.run"]],
                         ids=["trainjob-torchrun", "torchrun"])
def test_workers_die_with_a_launcher_sigkilled_alone_during_start_up_and_a_relaunch_resumes(tmp_path, launcher):
    """The launcher alone is SIGKILLed the moment both workers exist (importing, no step run):
    they are in sessions of their own, so only the parent-death signal (or, when it came too late
    to set, the check that the launcher is still there) ends them; none is alive 5 s later (a
    bound on a kernel signal, not a timing), and the relaunch finds the PVC free: 0 at once, no
    "busy", no wait for --rank-timeout. Two launches, the first ended early: about 15 s."""
    pvc = tmp_path / "pvc"
    args = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", "-m", "trainjob", "run",
            "--pvc", str(pvc), "--steps", "20", "--ckpt-every", "5", "--rank-timeout", str(RANK_TIMEOUT)]
    first = subprocess.Popen([sys.executable, *launcher, *args], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(workers := workers_of(first.pid)) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(workers) == 2, "the launcher never started two workers"
    os.kill(first.pid, signal.SIGKILL)  # the launcher alone: the workers are in sessions of their own
    first.wait()
    gone = time.monotonic() + 5
    while any(map(alive, workers)) and time.monotonic() < gone:
        time.sleep(0.05)
    assert not any(map(alive, workers)), f"workers {[w for w in workers if alive(w)]} outlived their launcher"
    assert not (pvc / "checkpoints").is_dir() or not any((pvc / "checkpoints").glob("step-*"))  # no step ran
    relaunch = subprocess.run([sys.executable, "-m", "trainjob", "torchrun", *args], capture_output=True, text=True,
                              timeout=300)
    assert relaunch.returncode == 0 and "busy" not in relaunch.stderr, relaunch.stderr[-2000:]
    assert events(pvc / "log.jsonl")[-1][0] == "completed"


def test_a_rendered_own_loop_pod_on_a_completed_job_exits_0_before_any_rendezvous(tmp_path, no_torch_launch,
                                                                                   capsys, monkeypatch):
    """An own loop's pod at W > 1 recreated alone after its job completed: the rendered TRAINJOB_PVC
    and TRAINJOB_IDEMPOTENT let `trainjob torchrun` find it over (0), a damaged artifact 2, without
    waiting at the rendezvous for peers that finished; a job not over, or no TRAINJOB_PVC, launches."""
    from trainjob.deploy import k8s

    pvc = tmp_path / "pvc"
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["k8s", "render", "--world-size", "2", "--", "python", "loop.py", "--pvc", "{pvc}"]) == 0
    docs = list(yaml.safe_load_all(out.getvalue()))
    (container,) = docs[-1]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env == {"TRAINJOB_IDEMPOTENT": "1", k8s.PVC_ENV: k8s.MOUNT}
    for name, value in {**env, k8s.PVC_ENV: str(pvc)}.items():
        monkeypatch.setenv(name, value)
    command = ["torchrun", *RENDERED, "loop.py", "--pvc", str(pvc)]
    assert cli.main(command) == 99  # nothing there yet: the launch goes ahead
    assert cli.main(["run", "--pvc", str(pvc), "--steps", "2"]) == 0
    capsys.readouterr()
    assert cli.main(command) == 0
    assert capsys.readouterr().out.startswith("trainjob: already completed (attempt 1): artifacts/model-v1.json")
    monkeypatch.setenv("TRAINJOB_IDEMPOTENT", "0")
    assert cli.main(command) == 99  # not idempotent: the Run decides (the lab's refusal), after the rendezvous
    monkeypatch.setenv("TRAINJOB_IDEMPOTENT", "1")
    (pvc / "artifacts/model-v1.json").write_text("{}\n")
    assert cli.main(command) == 2
    monkeypatch.delenv(k8s.PVC_ENV)
    assert cli.main(command) == 99
    assert len(no_torch_launch) == 3
