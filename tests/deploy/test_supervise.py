"""`trainjob supervise` end to end: real child processes, real signals, millisecond back-offs."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT
from trainjob.cli import EXIT_FOR_ENDING
from trainjob.deploy.policy import SOURCE
from trainjob.storage.eventlog import read_log

pytestmark = pytest.mark.process  # every test here starts the CLI or another process

TRAINJOB = [sys.executable, "-m", "trainjob"]
FAST = ["--backoff-base", "0.01", "--backoff-cap", "0.05"]
LONG_RUN = ["--steps", "10000000", "--ckpt-every", "10000000"]  # minutes of training if left alone


@pytest.fixture
def spawn():
    """Popen whose process group (supervisor and child) never outlives its test, even when an
    assertion fails mid-way. Signals in the tests go to the supervisor's pid alone."""
    procs: list[subprocess.Popen[str]] = []

    def start(argv: list[str], **kwargs) -> subprocess.Popen[str]:
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True, **kwargs))
        return procs[-1]

    yield start
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def supervise(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRAINJOB, "supervise", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def lines(log: Path) -> list[dict]:
    return [json.loads(raw) for raw in log.read_text().splitlines()]


def run_events(log: Path) -> list[str]:
    return [line["event"] for line in lines(log) if "source" not in line]


def decisions(log: Path) -> list[dict[str, str]]:
    """The supervisor's lines as {"event": ..., key: value, ...}."""
    out = []
    for line in lines(log):
        if line.get("source") == SOURCE:
            out.append({"event": line["event"], **dict(tok.split("=", 1) for tok in line["detail"].split())})
    return out


def status(log: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRAINJOB, "status", str(log)], cwd=cwd, capture_output=True, text=True)


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def logged(log: Path, event: str) -> bool:
    return log.exists() and f'"event":"{event}"' in log.read_text()


# --- the seed's scenarios, through the supervisor ------------------------------------------------

def test_kill_at_step_4_is_relaunched_and_resumed_to_model_v1(tmp_path):
    done = supervise(*FAST, "--", "run", "--pvc", "P", "--die-at", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    log = tmp_path / "P/log.jsonl"
    events = run_events(log)
    # --die-at 4 would kill every fresh start at step 4; the relaunch resumes from 4 and goes on.
    assert events.count("killed") == 1 and events.count("resumed") == 1 and events[-1] == "completed"
    assert "resumed" in events[events.index("killed"):]
    assert [(d["event"], d["exit"], d["ending"]) for d in decisions(log)] == [
        ("relaunch", "75", "killed"), ("stop", "0", "completed")]
    assert (tmp_path / "P/attempts").read_text().strip() == "1"
    # The resumed model is the very one an uninterrupted run publishes.
    subprocess.run([*TRAINJOB, "run", "--pvc", "U"], cwd=tmp_path, check=True, capture_output=True)
    model = "artifacts/model-v1.json"
    assert (tmp_path / "P" / model).read_bytes() == (tmp_path / "U" / model).read_bytes()
    shown = status(log, tmp_path)
    assert shown.returncode == 0 and "last_event: completed" in shown.stdout
    assert "supervisor: stop | start=2 exit=0 ending=completed" in shown.stdout


def test_spent_retry_budget_stops_with_exit_1(tmp_path):
    done = supervise(*FAST, "--", "run", "--pvc", "B", "--backoff-limit", "1", "--force-weights", "0,0,0",
                     cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    log = tmp_path / "B/log.jsonl"
    assert [d["exit"] for d in decisions(log)] == ["1", "1", "1"]  # child exits 1,1,1
    assert [d["ending"] for d in decisions(log)] == ["drift_failed", "drift_failed", "job_failed"]
    events = run_events(log)
    assert events.count("drift_failed") == 2 and events.count("job_failed") == 1
    assert (tmp_path / "B/attempts").read_text().strip() == "2"
    assert "attempts=2 backoffLimit=1" in log.read_text()
    shown = status(log, tmp_path)
    assert shown.returncode == 1 and "last_event: job_failed" in shown.stdout


def test_input_error_in_the_child_stops_at_once_with_exit_2(tmp_path):
    (tmp_path / "P").mkdir()
    done = supervise(*FAST, "--", "run", "--pvc", "P", "--data", "no-such-dir", cwd=tmp_path)
    assert done.returncode == 2
    assert decisions(tmp_path / "P/log.jsonl") == [
        {"event": "stop", "start": "1", "exit": "2", "ending": "input_error", "reason": "final",
         "outcome": "input_error"}]


def test_bad_run_flags_exit_2_before_any_start(tmp_path):
    done = supervise("--", "run", "--pvc", "P", "--steps", "0", cwd=tmp_path)
    assert done.returncode == 2 and "--steps must be at least 1" in done.stderr
    assert not (tmp_path / "P").exists()


@pytest.mark.parametrize("args", [["--max-starts", "0", "--", "run", "--pvc", "P"],
                                  ["--backoff-base", "5", "--backoff-cap", "1", "--", "run", "--pvc", "P"],
                                  ["--", "gen", "P"], []])
def test_bad_supervisor_flags_are_one_line_usage_errors(tmp_path, args):
    done = supervise(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "P").exists()


def test_relaunchable_exits_still_stop_at_max_starts(tmp_path):
    # Another writer holds the PVC: each child exits 75 at once. A kill is no failed attempt, but
    # --max-starts bounds every start, so this can never loop forever.
    pvc = tmp_path / "P"
    pvc.mkdir()
    with open(pvc / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = supervise("--max-starts", "3", *FAST, "--", "run", "--pvc", "P", cwd=tmp_path)
    assert done.returncode == 75
    ds = decisions(pvc / "log.jsonl")
    assert [(d["event"], d["start"], d["exit"]) for d in ds] == [
        ("relaunch", "1", "75"), ("relaunch", "2", "75"), ("stop", "3", "75")]
    assert ds[-1]["reason"] == "max_starts" and ds[-1]["outcome"] == "killed"
    assert not (pvc / "checkpoint.json").exists()


# --- the process side, with children other than `trainjob run` ----------------------------------

HARNESS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from trainjob.deploy import policy
    from trainjob.cli import SAID_BY_EXIT
    from trainjob.storage.eventlog import EventLog
    from trainjob.engine.job import StopFlag
    from trainjob.deploy.supervise import SuperviseSettings, supervise
    stop = StopFlag()
    stop.install()
    settings = SuperviseSettings(max_starts=int(sys.argv[2]), backoff_base=float(sys.argv[3]),
                                 backoff_cap=10.0, grace=float(sys.argv[4]))
    log = EventLog(Path(sys.argv[1]), source=policy.SOURCE)
    print(supervise([sys.executable, "-c", sys.argv[5]], log, settings, SAID_BY_EXIT.get, stop))
""")


def harness(spawn, log: Path, child: str, *, max_starts: int = 3, base: float = 0.01, grace: float = 5.0):
    return spawn([sys.executable, "-c", HARNESS, str(log), str(max_starts), str(base), str(grace), child])


def test_crashing_child_is_relaunched_with_growing_backoff_then_reported_as_70(tmp_path, spawn):
    log = tmp_path / "log.jsonl"
    started = time.monotonic()
    proc = harness(spawn, log, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", max_starts=4, base=0.05)
    out, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - started
    assert out.strip() == "crashed" and EXIT_FOR_ENDING["crashed"] == 70, err
    ds = decisions(log)
    assert [d["exit"] for d in ds] == ["-9"] * 4
    # No progress between starts: the back-off doubles (0.05, 0.1, 0.2) and is really waited.
    assert [float(d["delay_s"]) for d in ds[:-1]] == [0.05, 0.1, 0.2]
    assert elapsed >= 0.35
    assert ds[-1]["event"] == "stop" and ds[-1]["reason"] == "max_starts"


def test_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, spawn):
    log = tmp_path / "log.jsonl"
    ready = tmp_path / "ready"
    child = (f"import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    proc = harness(spawn, log, child, grace=0.3)
    wait_for(ready.exists)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert out.strip() == "killed", err
    assert 0.3 <= time.monotonic() - sent < 10
    (stop,) = decisions(log)
    assert stop == {"event": "stop", "start": "1", "exit": "-9", "ending": "crashed", "reason": "signal",
                    "signal": "SIGTERM", "outcome": "killed"}


# --- signals to the supervisor -------------------------------------------------------------------

def test_sigterm_is_forwarded_the_child_checkpoints_and_the_supervisor_exits_75(tmp_path, spawn):
    log = tmp_path / "P/log.jsonl"
    proc = spawn([*TRAINJOB, "supervise", *FAST, "--", "run", "--pvc", "P", *LONG_RUN], cwd=tmp_path)
    wait_for(lambda: logged(log, "job_started"))
    time.sleep(0.2)  # let it train a while
    proc.send_signal(signal.SIGTERM)  # to the supervisor only: the child hears it by forwarding
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 75, err
    events = run_events(log)
    assert events == ["job_started", "checkpointed", "killed"]  # one start, cut short, saved
    killed = [line for line in lines(log) if line["event"] == "killed"][0]
    step = json.loads((tmp_path / "P/checkpoint.json").read_text())["step"]
    assert step > 0 and killed["detail"] == f"at_step={step} signal=SIGTERM"
    assert decisions(log) == [{"event": "stop", "start": "1", "exit": "75", "ending": "killed",
                               "reason": "signal", "signal": "SIGTERM", "outcome": "killed"}]
    assert status(log, tmp_path).returncode == 75


@pytest.mark.killpoint
def test_a_sigterm_after_the_child_completed_keeps_exit_0_and_is_noted_as_late(tmp_path):
    # tests/latesignal.py signals the supervisor just after its child exited 0, before the verdict.
    done = subprocess.run([sys.executable, ROOT / "tests/latesignal.py", "supervise", *FAST, "--", "run", "--pvc", "P"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = tmp_path / "P/log.jsonl"
    assert run_events(log)[-1] == "completed"
    assert decisions(log) == [{"event": "stop", "start": "1", "exit": "0", "ending": "completed", "reason": "final",
                               "outcome": "completed", "late_signal": "SIGTERM"}]
    path = subprocess.run([*TRAINJOB, "status", "--path", str(log)], capture_output=True, text=True)
    assert path.returncode == 0 and "(supervisor)  stop | start=1 exit=0" in path.stdout


def test_a_start_after_the_job_completed_verifies_it_and_stops_with_exit_0(tmp_path):
    assert subprocess.run([*TRAINJOB, "run", "--pvc", "P"], cwd=tmp_path, capture_output=True).returncode == 0
    done = supervise(*FAST, "--", "run", "--pvc", "P", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "already completed (attempt 1): artifacts/model-v1.json verified" in done.stdout
    assert run_events(tmp_path / "P/log.jsonl").count("completed") == 1  # the start logged nothing
    assert [(d["exit"], d["ending"], d["outcome"]) for d in decisions(tmp_path / "P/log.jsonl")] == [
        ("0", "completed", "completed")]


def test_sigint_during_the_backoff_stops_without_another_start(tmp_path, spawn):
    log = tmp_path / "P/log.jsonl"
    proc = spawn([*TRAINJOB, "supervise", "--backoff-base", "60", "--", "run", "--pvc", "P", "--die-at", "2"],
                 cwd=tmp_path)
    wait_for(lambda: logged(log, "relaunch"))
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 75, err
    assert time.monotonic() - sent < 5  # the 60 s back-off did not hold the shutdown
    assert [d["event"] for d in decisions(log)] == ["relaunch", "stop"]
    assert decisions(log)[-1]["signal"] == "SIGINT"
    assert run_events(log).count("job_started") == 1 and "resumed" not in run_events(log)


# --- the log stays one readable story ------------------------------------------------------------

def test_run_lines_keep_their_bytes_and_supervisor_lines_are_marked(tmp_path):
    supervise(*FAST, "--", "run", "--pvc", "P", "--die-at", "4", cwd=tmp_path)
    for line in lines(tmp_path / "P/log.jsonl"):
        if line["event"] in ("relaunch", "stop"):
            assert line["source"] == SOURCE
        else:
            assert list(line) == ["ts", "event", "detail"]  # no source key: old readers see old bytes
    assert all(entry.event is not None for entry in read_log(tmp_path / "P/log.jsonl"))


def test_supervisor_lines_never_pass_for_the_runs_last_event(tmp_path):
    # The run asks its log whether a completion was announced; the supervisor's `stop` line after
    # `completed` must not make it announce the completion a second time.
    assert supervise(*FAST, "--", "run", "--pvc", "P", cwd=tmp_path).returncode == 0
    log = tmp_path / "P/log.jsonl"
    assert lines(log)[-1]["source"] == SOURCE
    again = subprocess.run([*TRAINJOB, "run", "--pvc", "P"], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 2 and "already completed" in again.stderr
    assert run_events(log).count("completed") == 1


def test_a_log_with_only_supervisor_lines_is_not_a_run_outcome(tmp_path):
    (tmp_path / "P").mkdir()
    supervise(*FAST, "--", "run", "--pvc", "P", "--data", "no-such-dir", cwd=tmp_path)
    shown = status(tmp_path / "P/log.jsonl", tmp_path)
    assert shown.returncode == 2 and "holds no events from trainjob run" in shown.stderr


@pytest.mark.torchrun
def test_a_w_rank_child_whose_rank_1_meets_bad_input_first_stops_the_supervisor_with_2(tmp_path):
    """supervise reads a W-rank child by the product's rule (exits.job_exit, in the local launcher):
    rank 1 refuses its input and rank 0, stopped for it, says 75; the launch is 2, not relaunched."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests/helpers")}
    done = subprocess.run([*TRAINJOB, "supervise", "--max-starts", "3", *FAST, "--", "run",
                           "--pvc", str(tmp_path / "pvc"), "--trainer", "user_trainers:refused_at_rank_1", "--world-size", "2", *LONG_RUN],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "rank 1: its data cannot be read" in done.stderr
    assert "stop | start=1 exit=2 ending=input_error reason=final" in done.stderr
