"""`trainjob slurm render` on a real Slurm cluster (scripts/slurm.sh, one node on loopback): the
rendered scripts submitted with sbatch, interrupted the ways a cluster interrupts jobs, and read
back with `scontrol show job`. A requeued job waits about 7 s (cred_expire, then a scheduling
cycle) before it runs again, and every launch starts Python (and torch) processes: most of these
tests' time. So each interrupts one job several times, or runs several jobs at once (the node has
CPUs enough), rather than submitting one after another; tests whose preemption needs every CPU
have the cluster alone (``slurm_alone``), the others share it (``slurm``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, snapshot, trainjob

pytestmark = [pytest.mark.process, pytest.mark.slurm]

# The lab's linear model, each step 0.05 s longer (tests/helpers/user_trainers.py) until the test's
# FAST file exists: up to 50 s of training, time for every signal to land mid-run however slowly
# the jobs start; the test touches the file once its last signal has landed, and the rest runs at
# full speed.
SLOW = ["--trainer", "user_trainers:slow", "--steps", "1000", "--ckpt-every", "20"]
FAST = "TRAINJOB_TEST_FAST_FILE"


def render(env: dict[str, str], *argv: str | Path) -> str:
    result = trainjob("slurm", "render", *map(str, argv), env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def submit(env: dict[str, str], tmp_path: Path, script: str, *sbatch: str) -> str:
    path = tmp_path / "job.sh"
    path.write_text(script)
    done = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", *sbatch, str(path)],
                          env=env, capture_output=True, text=True, cwd=tmp_path, check=True)
    return done.stdout.strip().split(";")[0]


def show(env: dict[str, str], job: str) -> dict[str, str]:
    """`scontrol show job -o`'s fields (Comment and Command may hold spaces; not read here)."""
    line = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                          check=True).stdout
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


def wait_for(what: str, check, timeout: float = 120):  # noqa: ANN001 (a predicate)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (found := check()):
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def logged(pvc: Path) -> list[str]:
    try:
        return [json.loads(line)["event"] for line in (pvc / "log.jsonl").read_text().splitlines() if line]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def ended(env: dict[str, str], job: str, timeout: float = 180) -> dict[str, str]:
    return wait_for(f"job {job} to end", lambda: (f := show(env, job))["JobState"] in
                    ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL") and f, timeout)


def output(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in sorted(tmp_path.glob("job-*.out")))


def reference(tmp_path: Path, *run_args: str) -> dict[str, bytes]:
    """The artifacts of the same run, uninterrupted and without Slurm."""
    pvc = tmp_path / "reference"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests/helpers")]),
           "TRAINJOB_TEST_STEP_SECONDS": "0"}
    result = trainjob("run", "--pvc", pvc, *run_args, env=env)
    assert result.returncode == 0, result.stderr
    return snapshot(pvc / "artifacts")


def resumes(pvc: Path) -> int:
    return logged(pvc).count("resumed")


def preempt(env: dict[str, str], tmp_path: Path, spare: int = 0) -> str:
    """A job of the high partition that needs every CPU of the node but ``spare``: it preempts the
    low ones (each holding more than ``spare``), whether or not a job of the debug partition,
    which nothing preempts, holds the spare ones."""
    cpus = subprocess.run(["sinfo", "-h", "-o", "%c"], env=env, capture_output=True, text=True, check=True).stdout
    return subprocess.run(["sbatch", "--parsable", "--partition=high", f"--cpus-per-task={int(cpus) - spare}",
                           f"--output={tmp_path}/preemptor.out", "--wrap", "sleep 1"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
def test_requeue_scancel_and_preemption_each_resume_to_the_uninterrupted_bytes(slurm_alone, tmp_path):
    """One lab job, interrupted three ways in turn: `scontrol requeue` mid-run, `scancel
    --signal=TERM` (the tasks only: the script requeues itself on 75), and a preemption by a job in
    a higher-priority partition (PreemptMode=REQUEUE, GraceTime 20 s). About a minute: three
    requeues, each waited out."""
    pvc = tmp_path / "pvc"
    env = {**slurm_alone, FAST: str(tmp_path / "fast")}
    job = submit(env, tmp_path, render(env, "--pvc", pvc, "--partition", "low", "--grace", "20", "--", "run", *SLOW))

    def interrupt(how: list[str], n: int) -> None:
        wait_for(f"a checkpoint after resume {n}", lambda: resumes(pvc) == n and logged(pvc)[-1:] == ["checkpointed"])
        subprocess.run(how, env=env, check=True, capture_output=True)
        wait_for(f"resume {n + 1}", lambda: resumes(pvc) == n + 1)

    interrupt(["scontrol", "requeue", job], 0)
    interrupt(["scancel", "--signal=TERM", job], 1)
    assert show(env, job)["NumCPUs"] == "1"
    preemptor = preempt(env, tmp_path)
    wait_for("resume 3", lambda: resumes(pvc) == 3)
    (tmp_path / "fast").touch()  # the last signal landed: the rest at full speed
    fields = ended(env, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output(tmp_path)
    assert int(fields["Restarts"]) >= 3
    assert show(env, preemptor)["JobState"] == "COMPLETED"
    events = logged(pvc)
    assert events.count("killed") == 3 and events.count("job_started") == 1, events  # no attempt spent
    assert events[-1] == "completed"
    assert snapshot(pvc / "artifacts") == reference(tmp_path, *SLOW)


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    """A 256 KiB tmpfs, filled: every write fails with ENOSPC. Needs root (the cluster does too)."""
    where = tmp_path / "full-tmpfs"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], check=True)
    try:
        with open(where / "fill", "wb") as fill:
            try:
                fill.write(b"\0" * (1 << 20))
            except OSError:
                pass
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_bad_input_a_spent_budget_and_storage_that_always_fails_each_end_the_job_failed(slurm, tmp_path, full_tmpfs):
    """Five jobs at once, each ending FAILED as its code says: bad data (exit 2, never requeued);
    bad input on rank 1 alone of two srun tasks (2, though rank 0, stopped by srun, exits 75: the
    job's code is trainjob's, not srun's highest); a gate that fails with --backoff-limit 0 (exit 1,
    never requeued) and with --backoff-limit 1 (exactly one requeue, a fresh attempt, then FAILED:
    the script reads that the budget is spent, so no launch is spent only to log job_failed); a PVC
    on a full tmpfs, where every launch exits 75 with no checkpoint (with --max-stalls 2: requeued
    once, then FAILED with one line naming the storage, no endless requeue). The lab's quick model;
    two requeues waited out side by side."""
    bad = tmp_path / "bad-data"
    bad.mkdir()
    for name in ("train.jsonl", "holdout.jsonl", "baseline.json"):
        (bad / name).write_text("not json\n")
    pvcs = {name: tmp_path / name / "pvc" for name in ("bad", "rank1", "budget0", "budget1")}
    pvcs["full"] = full_tmpfs / "pvc"
    jobs = {}
    for name, args in {"bad": ["--", "run", "--data", str(bad)],
                       "rank1": ["--ntasks-per-node", "2", "--", "run", "--trainer", "user_trainers:refused_at_rank_1"],
                       "budget0": ["--backoff-limit", "0", "--", "run", "--force-weights", "0,0,0"],
                       "budget1": ["--backoff-limit", "1", "--", "run", "--force-weights", "0,0,0"],
                       "full": ["--max-stalls", "2", "--", "run"]}.items():
        (tmp_path / name).mkdir()
        # --grace given: render need not time a run of each to size it
        jobs[name] = submit(slurm, tmp_path / name, render(slurm, "--pvc", pvcs[name], "--grace", "30", *args))
    expected = {"bad": ("2:0", 0, []), "rank1": ("2:0", 0, None),
                "budget0": ("1:0", 0, ["job_started", "drift_failed"]),
                "budget1": ("1:0", 1, ["job_started", "drift_failed", "job_started", "drift_failed"]),
                "full": ("1:0", 1, [])}
    for name, job in jobs.items():
        fields = ended(slurm, job)
        code, restarts, events = expected[name]
        said = output(tmp_path / name)
        assert (fields["JobState"], fields["ExitCode"], int(fields["Restarts"])) == ("FAILED", code, restarts), said
        if events is not None:  # rank 0 of "rank1" may or may not have started an attempt when srun stopped it
            assert [e for e in logged(pvcs[name]) if e in ("job_started", "drift_failed", "job_failed")] \
                == events, name
    assert "bad input (exit 2): not requeued" in output(tmp_path / "bad")
    assert "rank 1 exited 2" in output(tmp_path / "rank1") and "bad input (exit 2)" in output(tmp_path / "rank1")
    assert "retry budget is spent" in output(tmp_path / "budget0")
    assert "requeued for a fresh attempt" in output(tmp_path / "budget1")
    said = output(tmp_path / "full")
    assert said.count("No space left on device") == 2
    (stop,) = [line for line in said.splitlines() if "no new checkpoint" in line]
    assert f"storage at {pvcs['full']}" in stop and "2 launches in a row" in stop


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.torchrun  # torchrun, and examples/own_loop.py imports torch
def test_w2_both_ways_preempted_and_an_own_loop_scancelled_each_resume_and_complete(slurm_alone, tmp_path):
    """Three jobs that start torch, at once, so that their slow starts overlap. W=2 as two srun tasks
    (ranks from SLURM_PROCID, agreeing through files on the PVC) and as one `trainjob torchrun
    --nproc-per-node 2` (its store), in the low partition: once both have checkpointed, a job of the
    high partition that needs all CPUs but one preempts both (the one is the own loop's, whose debug
    partition no job preempts); each is requeued and completes with the bytes of one uninterrupted
    W=2 run (the high job waits for the own loop's CPU too). examples/own_loop.py rendered with `-- python ... --pvc {pvc}`: `scancel --signal=TERM`
    after its first checkpoint, requeued by the script on 75, resumed, completed (its Run idempotent
    from the script's TRAINJOB_IDEMPOTENT=1). About a minute and a half: torch starting, one requeue."""
    env = {**slurm_alone, FAST: str(tmp_path / "fast")}
    ways = {"srun-tasks": ["--ntasks-per-node", "2"], "torchrun": ["--nproc-per-node", "2"]}
    pvcs = {way: tmp_path / way / "pvc" for way in [*ways, "own-loop"]}
    jobs = {}
    for way, ranks in ways.items():
        (tmp_path / way).mkdir()
        jobs[way] = submit(env, tmp_path / way, render(env, "--pvc", pvcs[way], "--partition", "low", "--grace", "20",
                                                       *ranks, "--", "run", *SLOW))
    # 2000 quick steps, a checkpoint every 50: seconds of training after the first, for the signal to land in.
    loop = [sys.executable, str(ROOT / "examples/own_loop.py"), "--pvc", "{pvc}", "--steps", "2000",
            "--ckpt-every", "50"]
    (tmp_path / "own-loop").mkdir()
    own = submit(env, tmp_path / "own-loop", render(env, "--pvc", pvcs["own-loop"], "--", *loop))
    signalled: set[str] = set()

    def signal_each_once_checkpointed() -> bool:
        if "own-loop" not in signalled and "checkpointed" in logged(pvcs["own-loop"]):
            subprocess.run(["scancel", "--signal=TERM", own], env=env, check=True)
            signalled.add("own-loop")
        if "w2" not in signalled and all("checkpointed" in logged(pvcs[way]) for way in ways):
            # Every CPU: the own loop's, in the debug partition that nothing preempts, comes free
            # when it ends (it runs seconds), and both low jobs must go whatever it does meanwhile.
            # spare=1 raced with the own loop's requeue: the preemptor then fit by preempting one.
            preempt(env, tmp_path)
            signalled.add("w2")
        return len(signalled) == 2

    wait_for("a checkpoint of each job, then its signal", signal_each_once_checkpointed, timeout=180)
    wait_for("each W=2 job to resume", lambda: all(resumes(pvcs[way]) == 1 for way in ways), timeout=180)
    (tmp_path / "fast").touch()
    expected = reference(tmp_path, *SLOW, "--world-size", "2")
    for way, job in {**jobs, "own-loop": own}.items():
        fields = ended(env, job)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (way, output(tmp_path / way))
        assert int(fields["Restarts"]) >= 1, way
        events = logged(pvcs[way])
        assert "killed" in events and "resumed" in events and events.count("job_started") == 1, (way, events)
        assert events[-1] == "completed", (way, events)
        if way in ways:
            assert snapshot(pvcs[way] / "artifacts") == expected, way


@pytest.mark.acceptance
def test_a_one_minute_time_limit_runs_the_job_in_chunks_to_the_uninterrupted_bytes(slurm, tmp_path):
    """`--time 1` with the grace render sizes itself (a measured stop, cut to half of what one
    minute leaves after slurmctld's 30 s timer): each launch is signalled 15 to 45 s in, checkpoints,
    exits 75 and requeues itself before the limit would end it (TIMEOUT, not requeued). 100 s of
    training cannot fit in two such launches: at least two requeues, no attempt spent, and the bytes
    of an uninterrupted run. About three minutes of one-minute chunks: the acceptance step."""
    pvc = tmp_path / "pvc"
    env = {**slurm, "TRAINJOB_TEST_STEP_SECONDS": "0.25"}
    args = ["--trainer", "user_trainers:slow", "--steps", "400", "--ckpt-every", "10"]
    script = render(env, "--pvc", pvc, "--time", "1", "--", "run", *args)
    grace = int(re.search(r"^#SBATCH --signal=TERM@(\d+)$", script, re.M)[1])
    assert grace <= 15 and "a step and a checkpoint took at render" in script
    job = submit(env, tmp_path, script)
    fields = ended(env, job, timeout=900)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output(tmp_path)
    assert int(fields["Restarts"]) >= 2 and fields["TimeLimit"] == "00:01:00"
    events = logged(pvc)
    assert events.count("killed") >= 2 and events.count("resumed") >= 2 and events.count("job_started") == 1, events
    assert "TIME LIMIT" not in output(tmp_path), "every launch stopped on the grace's signal, none at the limit"
    assert snapshot(pvc / "artifacts") == reference(tmp_path, *args)
