"""`trainjob slurm render`: the sbatch script's contract as text (fast), and `trainjob slurm after`
judging a real PVC. The real cluster's tests are in test_slurm_cluster.py."""

from __future__ import annotations

import io
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainjob.cli import main
from trainjob.deploy import slurm
from trainjob.errors import UsageError
from trainjob.exits import EXIT_OK, EXIT_RELAUNCH, job_exit, rank_exit

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([*argv])
        except SystemExit as exc:  # argparse's own error, in the run's parser
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def render(*argv: str) -> str:
    """The script; with a --grace unless one is given, so that no run is started to measure one."""
    code, text, err = run_cli("slurm", "render", *([] if "--grace" in argv else ["--grace", "60"]), *argv)
    assert code == 0, err
    return text


def srun_line(script: str) -> list[str]:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert line.endswith(" &"), "srun runs in the background, so the shell can wait through its own SIGTERM"
    return shlex.split(line[:-2])


def test_the_script_requeues_appends_and_warns_the_tasks_grace_seconds_before_the_limit(tmp_path):
    script = render("--pvc", str(tmp_path / "pvc"), "--time", "30", "--grace", "45", "--partition", "gpu")
    options = re.findall(r"^#SBATCH (\S+)$", script, re.M)
    assert {"--requeue", "--open-mode=append", "--signal=TERM@45", "--time=30", "--partition=gpu"} <= set(options)
    first_command = next(i for i, line in enumerate(script.splitlines()[1:], 1) if not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(script.splitlines()) if line.startswith("#SBATCH"))
    assert "export TRAINJOB_IDEMPOTENT=1" in script
    words = srun_line(script)
    assert words[:2] == ["srun", "--kill-on-bad-exit=1"]
    assert words[2:4] == ["trainjob", "run"] and "--idempotent" in words
    assert words[words.index("--pvc") + 1] == str(tmp_path / "pvc")


def test_the_batch_shell_traps_sigterm_and_never_forwards_it_to_srun(tmp_path):
    script = render("--pvc", str(tmp_path / "pvc"))
    traps = [line for line in script.splitlines() if line.startswith("trap ")]
    assert len(traps) == 1 and traps[0].endswith(" TERM")
    assert "trap '' TERM" not in script, "an ignored SIGTERM is inherited as ignored by the tasks"
    assert traps[0] and script.index(traps[0]) < script.index("slurm before") < script.index("\nsrun ")
    commands = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\bkill\b(?! -0)", commands.replace("--kill-on-bad-exit", "")), "no signal is sent"
    assert 'while kill -0 "$launch"' in script, "a wait cut short by the trap waits again"


def test_the_script_requeues_itself_array_aware_and_keeps_its_stall_count_in_the_comment(tmp_path):
    script = render("--pvc", str(tmp_path / "pvc"), "--max-stalls", "5")
    assert "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" in script
    assert 'scontrol requeue "$job"' in script
    assert 'Comment="trainjob-stalls=$stalls"' in script
    assert "--max-stalls 5" in script and "--backoff-limit 2" in script


@pytest.mark.parametrize("extra, message", [
    (["--", "run", "--steps", "x"], "invalid int value"),
    (["--", "run", "--pvc", "/elsewhere"], "sets the run's --pvc"),
    (["--", "run", "--backoff-limit", "9"], "sets the run's --pvc and --backoff-limit"),
    (["--", "run", "--world-size", "2"], "drop --world-size"),
    (["--", "python"], "got no script"),
    (["--", "status"], "expected `-- run ARGS...`"),
    (["--grace", "0"], "--grace must be at least 1"),
    (["--time", "soon"], "--time must be"),
    (["--nproc-per-node", "2", "--ntasks-per-node", "2"], "drop --ntasks-per-node"),
    (["--ntasks-per-node", "2", "--", "python", "loop.py", "--pvc", "{pvc}"], "own loop reads its rank"),
])
def test_a_bad_flag_exits_2_before_anything_is_printed(tmp_path, extra, message):
    code, out, err = run_cli("slurm", "render", "--pvc", str(tmp_path / "pvc"), *extra)
    assert code == 2 and out == "" and message in err


def test_a_bucket_pvc_at_w_above_1_needs_torchrun():
    code, out, err = run_cli("slurm", "render", "--pvc", "s3://bucket/job", "--ntasks-per-node", "2")
    assert code == 2 and out == "" and "--nproc-per-node" in err


def test_w2_as_srun_tasks_gives_each_task_its_rank_from_slurm(tmp_path):
    words = srun_line(render("--pvc", str(tmp_path / "pvc"), "--ntasks-per-node", "2"))
    assert words[words.index("--world-size") + 1] == "2" and "--rank" not in words  # SLURM_PROCID: ranks/identity.py


# A rank's exit status as srun may see it: trainjob's codes, signals (negative, as Python reports
# them), 128 + N from a shell, and anything else a crashing rank exits with.
statuses = st.one_of(st.sampled_from([0, 1, 2, 70, 75, -15, -9, -2, -11, 137, 143, 139]), st.integers(-64, 255))


@given(codes=st.lists(statuses, min_size=1, max_size=8))
def test_srun_highest_task_status_is_the_job_code_by_trainjobs_precedence(codes):
    """srun exits with its tasks' highest code; under `trainjob slurm task` that is the most
    telling rank's (exits.job_exit), a 2 beside a 75 included, except that 0 is srun's least: a
    0 beside a 75 reads 75, and the log's `completed` ends the job (test_policy's after_launch)."""
    srun = max(slurm.task_status(code) for code in codes)  # no task dies by a signal: it reports one
    said = {rank_exit(code) for code in codes}
    expected = EXIT_RELAUNCH if said == {EXIT_OK, EXIT_RELAUNCH} else job_exit(codes)
    assert slurm.launch_code(srun) == expected


def test_a_task_killed_by_a_signal_reads_as_a_kill_and_srun_failing_as_itself():
    assert slurm.launch_code(128 + signal.SIGKILL) == EXIT_RELAUNCH  # KillWait ran out: srun's 137
    assert slurm.launch_code(1) == 1  # srun's own error (a step it could not create)


def test_several_tasks_each_run_under_slurm_task_and_after_reads_their_code(tmp_path):
    pvc = str(tmp_path / "pvc")
    for ranks in (["--ntasks-per-node", "2"], ["--nodes", "2"], ["--nodes", "2", "--nproc-per-node", "2"]):
        script = render("--pvc", pvc, *ranks)
        words = srun_line(script)
        task = words.index("task")
        assert words[task - 2:task + 3] == ["trainjob", "slurm", "task", "--", "trainjob"], ranks
        assert 'slurm after --code "$code" --from-tasks ' in script, ranks
    for ranks in ([], ["--nproc-per-node", "2"]):  # one task: srun's code is its own
        script = render("--pvc", pvc, *ranks)
        assert "slurm task" not in script and "--from-tasks" not in script, ranks


def test_slurm_after_reads_a_2_on_one_task_as_bad_input_though_srun_said_more(tmp_path):
    pvc = tmp_path / "pvc"
    judge = ["slurm", "after", "--pvc", str(pvc), "--backoff-limit", "2", "--before", "0"]
    rank1_bad, rank0_stopped = slurm.task_status(2), slurm.task_status(75)
    code, out, err = run_cli(*judge, "--code", str(max(rank1_bad, rank0_stopped)), "--from-tasks")
    assert (code, out) == (0, "fail 2 0\n") and "bad input (exit 2)" in err
    assert run_cli(*judge, "--code", str(slurm.task_status(75)), "--from-tasks")[1] == "requeue 75 1\n"


@pytest.mark.process
def test_slurm_task_outlives_the_steps_sigterm_and_reports_its_ranks_code(tmp_path):
    """Slurm signals every process of a step: the task's rank gets SIGTERM and stops as it chooses
    (here: exit 75 after a moment, as a rank that checkpoints does); the task survives its own
    SIGTERM, waits, and exits with the rank's code's place in the precedence."""
    ready = tmp_path / "ready"
    rank = ("import pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(75)))\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURM_PROCID": "1"}
    task = subprocess.Popen([sys.executable, "-m", "trainjob", "slurm", "task", "--", sys.executable, "-c", rank],
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert task.poll() is None and time.monotonic() < deadline, "the rank did not start"
            time.sleep(0.05)
        os.killpg(task.pid, signal.SIGTERM)  # what slurmstepd does: the whole step
        _, err = task.communicate(timeout=30)
    finally:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
    assert task.returncode == slurm.task_status(75) == 96
    assert "rank 1 exited 75" in err


def test_w2_as_one_torchrun_per_node_meets_on_the_first_host_and_outlasts_the_grace(tmp_path):
    script = render("--pvc", str(tmp_path / "pvc"), "--nodes", "2", "--nproc-per-node", "2", "--grace", "90")
    words = srun_line(script)
    assert words[:3] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    assert words[3:9] == ["trainjob", "slurm", "task", "--", "trainjob", "torchrun"]  # two nodes: two tasks
    assert words[words.index("--rdzv-endpoint") + 1] == "$head:$port"
    assert words[words.index("--rdzv-id") + 1] == "$SLURM_JOB_ID"
    assert int(words[words.index("--shutdown-timeout") + 1]) >= 90
    assert words[words.index("--nnodes") + 1] == "2" and words[words.index("--world-size") + 1] == "4"
    assert words[words.index("--max-restarts") + 1] == "0"
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "#SBATCH --ntasks-per-node=1" in script


def test_an_own_loop_runs_its_script_idempotent_on_the_pvc_it_names(tmp_path):
    pvc = str(tmp_path / "pvc")
    words = srun_line(render("--pvc", pvc, "--", "python3", "examples/own_loop.py", "--pvc", "{pvc}", "--steps", "8"))
    assert words[2:] == ["python3", "examples/own_loop.py", "--pvc", pvc, "--steps", "8"]
    script = render("--", "python", "loop.py", "--pvc", pvc)
    assert "--backoff-limit" not in script.split("\nsrun ")[0], "an own loop's budget is its script's own"
    code, out, err = run_cli("slurm", "render", "--pvc", str(tmp_path / "other"), "--", "python", "loop.py",
                             "--pvc", pvc)
    assert code == 2 and out == "" and "is not slurm render's --pvc" in err


def test_slurm_after_counts_progress_from_the_log_and_stops_a_stalled_requeue(tmp_path):
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    line = '{"ts": "2026-01-01T00:00:00Z", "event": "checkpointed", "detail": "step=%d loss_milli=5"}\n'
    (pvc / "log.jsonl").write_text(line % 10 + line % 20)
    assert run_cli("slurm", "before", "--pvc", str(pvc))[:2] == (0, "2\n")
    assert run_cli("slurm", "before", "--pvc", str(tmp_path / "fresh"))[:2] == (0, "0\n")  # no log yet
    judge = ["slurm", "after", "--pvc", str(pvc), "--backoff-limit", "2", "--code", "75", "--max-stalls", "3"]
    assert run_cli(*judge, "--before", "1", "--stalls", "2")[1] == "requeue 75 0\n"  # a checkpoint: progress
    code, out, err = run_cli(*judge, "--before", "2", "--stalls", "2")  # none: the third stall in a row
    assert (code, out) == (0, "fail 1 3\n") and f"storage at {pvc}" in err
    assert run_cli(*judge, "--before", "-", "--stalls", "0")[1] == "requeue 75 1\n"  # unreadable before: no progress


@pytest.mark.parametrize("time, seconds", [("1", 60), ("90", 5400), ("1:30", 90), ("4:00:00", 14400), ("2-0", 172800),
                                           ("1-2:3", 93780), ("1-2:3:4", 93784)])
def test_time_is_read_as_sbatch_reads_it(time, seconds):
    assert slurm.time_seconds(time) == seconds


@given(stop=st.floats(0, 3600), limit=st.one_of(st.none(), st.integers(1, 10 * 86400)))
def test_a_sized_grace_covers_twice_the_measured_stop_and_leaves_each_launch_time_to_train(stop, limit):
    try:
        grace, why = slurm.grace_for(stop, limit)
    except UsageError:
        assert limit is not None and (limit - slurm.SLURMCTLD_PERIOD) // 2 < max(1, math.ceil(stop))
        return
    shown = float(re.search(r"twice the ([0-9.]+) s", why)[1])  # what a reader of the script sees
    assert stop - 1e-6 <= shown < stop + 0.1  # up to the tenth, float noise aside
    assert grace >= math.ceil(stop) and grace >= 1
    if limit is None or grace < (limit - slurm.SLURMCTLD_PERIOD) // 2:  # not cut: the reason's arithmetic
        assert grace == max(slurm.MIN_GRACE, math.ceil(2 * shown) + slurm.SCRIPT_SECONDS)
    if limit is not None:  # signalled up to 30 s early, a launch still trains at least as long as it stops
        assert limit - grace - slurm.SLURMCTLD_PERIOD >= grace


def test_an_unmeasured_grace_is_the_default_cut_to_the_time_limit():
    assert slurm.grace_for(None, None, "an own loop's is not")[0] == slurm.DEFAULT_GRACE
    assert slurm.grace_for(None, 60)[0] == 15  # 1 minute: signalled 15 to 45 s in
    with pytest.raises(UsageError, match="ask for more --time"):
        slurm.grace_for(None, 31)


def test_a_given_grace_that_the_time_limit_cannot_hold_exits_2(tmp_path):
    code, out, err = run_cli("slurm", "render", "--pvc", str(tmp_path / "pvc"), "--time", "1", "--grace", "30")
    assert code == 2 and out == "" and "Slurm may signal up to 30 s before the grace" in err
    assert "#SBATCH --signal=TERM@29" in render("--pvc", str(tmp_path / "pvc"), "--time", "1:00", "--grace", "29")


@pytest.mark.process
def test_without_grace_render_times_a_one_step_run_beside_the_pvc_and_sizes_the_grace_from_it(tmp_path):
    """The run's own flags, for one step, on a scratch PVC beside the job's, timed and removed:
    the grace is twice that plus the script's own seconds, and the job's PVC is not touched."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests/helpers")]),
           "TRAINJOB_TEST_STEP_SECONDS": "3"}  # the one step takes 3 s: the grace must see it
    done = subprocess.run([sys.executable, "-m", "trainjob", "slurm", "render", "--pvc", str(tmp_path / "pvc"),
                           "--", "run", "--trainer", "user_trainers:slow"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (comment,) = [line for line in done.stdout.splitlines() if line.startswith("# The grace")]
    took = float(re.search(r"twice the ([0-9.]+) s a step and a checkpoint took", comment)[1])
    grace = int(re.search(r"#SBATCH --signal=TERM@(\d+)", done.stdout)[1])
    assert took >= 3 and grace == math.ceil(2 * took) + slurm.SCRIPT_SECONDS
    assert list(tmp_path.iterdir()) == [], "the scratch PVC is removed, the job's never made"
    own = run_cli("slurm", "render", "--pvc", str(tmp_path / "pvc"), "--", "python", "loop.py", "--pvc", "{pvc}")[1]
    assert f"#SBATCH --signal=TERM@{slurm.DEFAULT_GRACE}" in own and "own loop's checkpoint is not measured" in own
