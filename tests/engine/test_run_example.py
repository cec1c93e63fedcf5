"""examples/own_loop.py, the README's (and the docs') own-loop example, as a user runs it: with python, killed
before every I/O call; with torchrun at W=2, a rank killed or sent SIGTERM. Every relaunch
reaches the uninterrupted run's artifact bytes on the same attempt."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, events

pytest.importorskip("torch")  # the example is a torch script (trainjob[torch])
pytestmark = pytest.mark.process

EXAMPLE = str(ROOT / "examples/own_loop.py")
SMALL = ("--steps", "4", "--ckpt-every", "2")  # the documented command, with fewer steps
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def artifact(pvc: Path) -> bytes:
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()


def test_the_example_runs_as_the_readme_shows_and_completes(tmp_path):
    done = subprocess.run([sys.executable, EXAMPLE, "--pvc", str(tmp_path / "pvc")], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    log = events(tmp_path / "pvc/log.jsonl")
    assert [e for e, _ in log].count("checkpointed") == 4 and log[-1][0] == "completed"
    holdout = re.fullmatch(r"holdout: (\d+)/100 vs baseline (\d+)/100", log[-1][1])
    assert holdout and int(holdout[1]) > int(holdout[2])  # it learned: better than always guessing one class


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.killpoint
def test_the_example_killed_before_every_io_call_resumes_to_the_same_bytes_and_attempt(tmp_path):
    """Slower than 20 s under load, though it uses about 10 s of CPU: over 20 trials, each a fork
    killed before one I/O call and a relaunch, every checkpoint's fsyncs waited for in turn."""
    env = {**ENV, "PYTHONPATH": str(ROOT / "tests"), "TRAINJOB_PRELOAD": "torch,torch._dynamo"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/forked_killpoints.py"), str(tmp_path), EXAMPLE, *SMALL],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["clean"] == 0 and result["artifacts"] == ["model-v1.safetensors"] and result["count"] > 20
    # A kill after "completed" reached the log leaves a finished job: its relaunch is refused (2).
    wrong = [t for t in result["trials"] if t["killed"] != -signal.SIGKILL or not t["same_bytes"]
             or t["attempts"] != "1" or t["relaunch"] not in ((0, 2) if t["logged_completed"] else (0,))]
    assert not wrong, wrong


def torchrun(pvc: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--monitor-interval", "0.1", EXAMPLE, "--pvc", str(pvc), *flags],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def rank_pid(launcher: int, rank: int) -> int:
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker for rank {rank}")


def newest_step(pvc: Path) -> int:
    names = [p.name for p in (pvc / "checkpoints").glob("step-*")] if (pvc / "checkpoints").is_dir() else []
    return max((int(n[5:13]) for n in names), default=0)


def interrupt(pvc: Path, victim: int, sig: signal.Signals, after_step: int, flags: tuple[str, ...]) -> str:
    """Launch, wait for a checkpoint past ``after_step``, send ``sig`` to rank ``victim``; torchrun's stderr."""
    launcher = torchrun(pvc, *flags)
    deadline = time.monotonic() + 120
    while newest_step(pvc) <= after_step and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.poll() is None, launcher.stderr.read().decode(errors="replace")[-2000:]
    os.kill(rank_pid(launcher.pid, victim), sig)
    launcher.wait(120)
    return launcher.stderr.read().decode(errors="replace")


W2 = ("--steps", "200", "--ckpt-every", "5")


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.torchrun
def test_torchrun_kill_either_rank_then_relaunch_resumes_to_the_same_bytes(tmp_path):
    """Slower than 20 s: four launches of two torch workers (the reference, a SIGKILL of rank 1, one
    of rank 0, the relaunch that completes); about 4 s each on a quiet machine."""
    reference = torchrun(tmp_path / "ref", *W2)
    assert reference.wait(300) == 0, reference.stderr.read()[-2000:]
    pvc = tmp_path / "pvc"
    for victim in (1, 0):  # SIGKILL rank 1 in one launch, rank 0 in the next
        interrupt(pvc, victim, signal.SIGKILL, newest_step(pvc), W2)
    final = torchrun(pvc, *W2)
    assert final.wait(300) == 0, final.stderr.read().decode()[-3000:]
    kinds = [e for e, _ in events(pvc / "log.jsonl")]
    assert kinds.count("job_started") == 1 and kinds.count("resumed") == 2 and kinds[-1] == "completed"
    assert artifact(pvc) == artifact(tmp_path / "ref")


def test_the_readme_shows_the_example_file_itself_in_30_to_60_lines_and_the_docs_include_it():
    block = re.search(r"### Bring your own loop.*?```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    # The README is read on GitHub, where nothing is included: it carries a copy, held to the file here.
    assert block is not None and block.group(1) == Path(EXAMPLE).read_text(), \
        "README.md, 'Bring your own loop': paste examples/own_loop.py into its python block"
    assert 30 <= len(block.group(1).splitlines()) <= 60
    assert '```python\n--8<-- "examples/own_loop.py"\n```' in (ROOT / "docs/howto/own-loop.md").read_text()


@pytest.mark.torchrun
def test_torchrun_sigterm_to_either_rank_saves_one_agreed_step_and_every_rank_exits_75(tmp_path):
    """Under torchrun the ranks agree through its store, once per step (a round every rank takes
    part in), so a rank that wants to stop never waits while its peer waits in the next step's
    allreduce: both save the same step. Slower than 20 s under load: two torchrun launches of two
    torch workers, each trained to a checkpoint, then one rank SIGTERMed."""
    pvc = tmp_path / "pvc"
    for victim in (1, 0):
        err = interrupt(pvc, victim, signal.SIGTERM, newest_step(pvc), W2)
        last, detail = events(pvc / "log.jsonl")[-1]
        assert last == "killed" and "signal=SIGTERM" in detail, events(pvc / "log.jsonl")[-3:]
        at = int(detail.split()[0].removeprefix("at_step="))
        assert newest_step(pvc) == at  # the agreed step is checkpointed, by both ranks
        manifest = next((pvc / "checkpoints").glob(f"step-{at:08d}-*/manifest.json"))
        assert [s["rank"] for s in json.loads(manifest.read_text())["shards"]] == [0, 1]
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
        assert codes and set(codes) == {"75"}, err[-2000:]  # torchrun's report of its ranks' exit codes


def lost_in_forward(example: str, pvc: Path, die_at: int, *flags: str) -> tuple[int, str]:
    """`trainjob torchrun` of ``example`` at W=2 whose rank 1 SIGKILLs itself in its ``die_at``-th
    module forward (tests/helpers/die_in_forward.py): the launch's code and its stderr."""
    env = {**ENV, "DIE_RANK": "1", "DIE_AT_FORWARD": str(die_at)}
    done = subprocess.run([sys.executable, "-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.1", str(ROOT / "tests/helpers/die_in_forward.py"), example,
                           "--pvc", str(pvc), *flags], env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def assert_lost_peer_is_75_in_one_line(code: int, err: str) -> None:
    """Every rank 75 (rank 1 killed, rank 0 by the Run's mapping): rank 0 names rank 1, in one line,
    no traceback, never 70."""
    said = [line for line in err.splitlines() if "left the launch" in line]
    assert code == 75 and "Traceback" not in err and "internal error" not in err, err[-3000:]
    assert len(said) == 1 and said[0].startswith("trainjob: rank 1 left the launch at step "), err[-3000:]
    assert "a collective failed (RuntimeError: " in said[0] and said[0].endswith("(exit 75)"), said
    assert "workers' codes {0: 75, 1: -9}; the job's is 75" in err, err[-2000:]


@pytest.mark.torchrun
def test_a_rank_killed_inside_the_forward_ends_the_launch_75_naming_it_and_a_relaunch_completes(tmp_path):
    """The example has no `try` around its collectives: rank 0, left in DDP's all-reduce when rank
    1 dies in its forward at step 13, ends 75 through trainjob.Run alone. Two torchrun launches."""
    pvc = tmp_path / "pvc"
    code, err = lost_in_forward(EXAMPLE, pvc, 5 * 12 + 1)  # 5 module forwards per step: step 13's first
    assert_lost_peer_is_75_in_one_line(code, err)
    assert newest_step(pvc) == 10
    final = subprocess.run([sys.executable, "-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node", "2",
                            EXAMPLE, "--pvc", str(pvc)], env=ENV, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    kinds = [e for e, _ in events(pvc / "log.jsonl")]
    assert kinds.count("job_started") == 1 and kinds.count("resumed") == 1 and kinds[-1] == "completed"
