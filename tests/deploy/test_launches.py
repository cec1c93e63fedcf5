"""A launch as a supervisor sees it (trainjob/deploy/launches.py): the rule every launch of prove,
the campaign and the acceptance tests is judged by, that its exit code and its log agree."""

from __future__ import annotations

import pytest

from trainjob.deploy import launches
from trainjob.deploy.launches import disagreement


def logged(*names: str) -> list[dict[str, str]]:
    return [{"event": name, "detail": ""} for name in names]


@pytest.mark.parametrize("code, log", [
    (0, logged("job_started", "checkpointed", "artifact_written", "completed")),
    (1, logged("job_started", "checkpointed", "drift_failed")),
    (1, logged("job_failed")),
    (2, logged("job_started", "refused")),
    (75, logged("job_started", "checkpointed", "killed")),
    (75, logged("job_started", "checkpointed")),  # storage trouble: the attempt in flight
    (70, logged("job_started", "checkpointed")),  # a crash leaves it in flight too
    (-9, logged("job_started", "completed")),  # a SIGKILL after `completed` is never judged
    (137, logged("job_started")),
])
def test_a_launch_whose_code_its_log_says_agrees(code, log):
    assert disagreement(code, log) is None


@pytest.mark.parametrize("code, log, says", [
    (2, logged("job_started"), "ends at 'job_started', for which `trainjob status` says 75"),
    (70, logged("job_started", "completed"), "exited 70 but its log ends at 'completed'"),
    (0, logged("job_started", "checkpointed"), "says 75"),
    (75, logged("job_started", "refused"), "says 2"),
    (-15, logged("job_started", "completed"), "exited -15, not with one of trainjob's codes"),
    (143, logged(), "not with one of trainjob's codes"),
])
def test_a_launch_whose_log_says_another_code_disagrees(code, log, says):
    problem = disagreement(code, log)
    assert problem is not None and says in problem, problem


def test_a_launch_that_logged_nothing_left_the_job_as_it_was_and_only_its_code_is_judged():
    done = logged("job_started", "completed")
    assert disagreement(2, done, before=2) is None  # "already completed": refused before it began
    assert disagreement(75, done, before=2) is None  # a busy PVC
    assert disagreement(2, [*done, *logged("job_started", "refused")], before=2) is None
    assert disagreement(0, [*done, *logged("job_started", "refused")], before=2) is not None


# --- stopping a launch as a scheduler does: real processes, real signals ------------------------------

RECORDER = """
import os, signal, sys, time
record, leave = sys.argv[1], sys.argv[2] == "leave"
def noted(signum, frame):
    with open(record, "a") as out:
        out.write(f"{os.getpid()} {time.monotonic()}\\n")
    if leave:
        os._exit(75)
signal.signal(signal.SIGTERM, noted)
if os.fork() == 0:  # a child in the same process group, as a data loader's worker is
    signal.signal(signal.SIGTERM, noted)
    os.write(1, b"ready\\n")  # one write each: the two lines never interleave
    time.sleep(60)
    os._exit(0)
os.write(1, b"ready\\n")
time.sleep(60)
"""


def recorded(tmp_path, how, leave: bool = False) -> tuple[int, dict[int, list[float]]]:
    """Start the recorder (a process and its child) in a session of its own, stop it ``how``;
    its exit status and the SIGTERMs each of its processes noted."""
    import subprocess
    import sys
    import time

    script, record = tmp_path / "recorder.py", tmp_path / "record"
    script.write_text(RECORDER)
    proc = launches.spawn([sys.executable, str(script), str(record), "leave" if leave else "stay"],
                          stdout=subprocess.PIPE)
    try:
        assert [proc.stdout.readline() for _ in range(2)] == ["ready\n"] * 2  # each has its handler
        launches.stop_launch(proc, how, torchrun=False)
        time.sleep(0.3)  # the last SIGTERM's handler runs
    finally:
        launches.kill_launch(proc)  # whatever the stop left
    code = proc.wait()
    noted: dict[int, list[float]] = {}
    for line in record.read_text().splitlines() if record.exists() else []:
        pid, when = line.split()
        noted.setdefault(int(pid), []).append(float(when))
    return code, noted


@pytest.mark.process
def test_preempted_is_sigterm_to_every_process_twice_half_a_second_apart(tmp_path):
    """Slurm's preemption and scancel signal every process of the step, the data loader's
    workers included, and preemption does it twice."""
    code, noted = recorded(tmp_path, launches.PREEMPTED)
    assert code == -9 and len(noted) == 2, noted  # the recorder stays: only the test's own SIGKILL ended it
    for times in noted.values():
        assert len(times) == 2 and times[1] - times[0] >= 0.45, noted


@pytest.mark.process
def test_a_launch_that_stops_at_the_first_sigterm_gets_no_second_one(tmp_path):
    code, noted = recorded(tmp_path, launches.PREEMPTED, leave=True)
    assert code == 75 and all(len(times) == 1 for times in noted.values()), noted


@pytest.mark.process
def test_grace_ended_is_sigterm_to_the_first_process_then_sigkill_to_every_process(tmp_path):
    """The kubelet: SIGTERM to the container's first process, SIGKILL to all once the grace ends."""
    code, noted = recorded(tmp_path, launches.grace_ended(0.3))
    assert code == -9 and len(noted) == 1 and len(next(iter(noted.values()))) == 1, noted


def test_kill_when_keeps_its_old_meaning_for_a_bare_signal():
    assert launches.Stop("x", launches.signal.SIGTERM).everyone is False
    assert launches.NODE_DIES.everyone and launches.NODE_DIES.sig == launches.signal.SIGKILL


FORKER = """
import os, sys, time
os.setsid()  # as torchrun's workers: a session of their own, out of the launch's process group
while True:
    if os.fork() == 0:
        time.sleep(30)  # marker: {marker}
        os._exit(0)
"""


@pytest.mark.process
def test_a_sigkill_of_a_launch_leaves_no_process_that_was_forking_as_it_landed(tmp_path):
    """The walk of a launch's processes and the SIGKILL are two moments: a worker forked between
    them escaped (an orphan with no parent to notice its death). Each launch here forks without
    pause in a session of its own, so only the walk reaches its children."""
    import os
    import subprocess
    import sys
    import time

    marker = f"forker-{os.getpid()}-{time.monotonic_ns()}"
    code = FORKER.format(marker=marker)
    for _ in range(10):
        proc = launches.spawn([sys.executable, "-c", f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {code!r}])"])
        time.sleep(0.3)
        launches.kill_launch(proc)
        proc.wait()
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    subprocess.run(["pkill", "-KILL", "-f", marker])
    assert not left, f"{len(left)} forked processes outlived their launch"
