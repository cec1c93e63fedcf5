"""`trainjob slurm render`: the sbatch script's contract as text (fast), and `trainjob slurm after`
judging a real PVC. The real cluster's tests are in test_slurm_cluster.py."""

from __future__ import annotations

import io
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from trainjob.cli import main

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
    code, text, err = run_cli("slurm", "render", *argv)
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


def test_w2_as_one_torchrun_per_node_meets_on_the_first_host_and_outlasts_the_grace(tmp_path):
    script = render("--pvc", str(tmp_path / "pvc"), "--nodes", "2", "--nproc-per-node", "2", "--grace", "90")
    words = srun_line(script)
    assert words[:5] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "trainjob", "torchrun"]
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
