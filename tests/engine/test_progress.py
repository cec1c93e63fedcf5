"""What a launch tells the person watching it (engine/progress.py): on a terminal a line rewritten
per step, off one a line per checkpoint, nothing but the last line with --quiet (or progress=False),
and always that last line saying how the launch ended; never a line in the decision log, never a
byte of the model changed."""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainjob
from conftest import events, trainjob as cli_run
from trainjob.engine.progress import Narrator, final_line, line, metric_verdict

SHA = "983aeb4b31e715b4d129cc2aa70f80c8dda23d5b631b10e700705943f091ad5f"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def clock(*ticks: float):
    it = iter(ticks)
    return lambda: next(it)


def test_on_a_terminal_the_line_is_rewritten_each_step_and_ended_before_the_last_line():
    stream = Tty()
    narrator = Narrator(stream, 10, "out/pvc", clock=clock(100.0, 102.0, 104.0))
    narrator.told("resumed", "from_step=2")  # a resumed launch: the rate counts the steps done here
    narrator.step(3, 228)
    narrator.step(4, 226)
    narrator.told("checkpointed", "step=4 loss_milli=226")
    narrator.told("killed", "at_step=4 signal=SIGTERM")
    narrator.ending("killed", 75)
    assert line(2, 10, 310, 2, 4.0) == "step 2/10  loss 0.310  0.50 steps/s  ETA 16s"
    assert stream.getvalue() == ("\rstep 3/10  loss 0.228  0.50 steps/s  ETA 14s\x1b[K"
                                 "\rstep 4/10  loss 0.226  0.50 steps/s  ETA 12s\x1b[K\n"
                                 "trainjob: killed at step 4 by SIGTERM (exit 75): a relaunch resumes from step 4\n")


def test_the_terminal_line_is_redrawn_at_most_ten_times_a_second_and_always_at_the_last_step():
    stream = Tty()
    narrator = Narrator(stream, 3, "out/pvc", clock=clock(0.0, 1.0, 1.05, 1.06))
    for step in (1, 2, 3):
        narrator.step(step, 100)
    assert [s.split("  ")[0] for s in stream.getvalue().split("\r")[1:]] == ["step 1/3", "step 3/3"]
    stopped = Tty()
    narrator = Narrator(stopped, 3, "out/pvc", clock=clock(0.0, 1.0, 1.05, 1.06))
    for step in (1, 2):
        narrator.step(step, 100)
    narrator.close()  # a stop (or an error) after a step not drawn yet: the line shows it before it ends
    assert [s.split("  ")[0] for s in stopped.getvalue().split("\r")[1:]] == ["step 1/3", "step 2/3"]
    assert stopped.getvalue().endswith("\x1b[K\n")


def test_off_a_terminal_a_line_per_checkpoint_and_without_progress_only_the_last_line():
    said = {}
    for progress in (True, False):
        stream = io.StringIO()
        narrator = Narrator(stream, 4, "out/pvc", progress=progress, clock=clock(10.0, 12.0, 14.0))
        narrator.told("job_started", "steps=4 attempt=2")
        for step in (1, 2):
            narrator.step(step, 300)
        narrator.told("checkpointed", "step=2 loss_milli=300")
        narrator.told("killed", "at_step=2")
        narrator.ending("killed", 75)
        said[progress] = stream.getvalue().splitlines()
    ending = "trainjob: killed at step 2 (exit 75): a relaunch resumes from step 2"
    assert said[True] == ["trainjob: attempt 2 started: 4 steps",
                          "trainjob: checkpointed step 2/4  loss 0.300  1.00 steps/s  ETA 2s", ending]
    assert said[False] == [ending]


def test_the_last_line_says_each_ending_with_what_to_know_next():
    completed = {"artifact_written": {"sha256": SHA, "path": "artifacts/model-v1.json"},
                 "completed": {"holdout.correct": 20, "holdout.total": 20, "baseline.correct": 20, "baseline.total": 20}}
    assert final_line("completed", completed, "out/pvc", 0) == (
        f"trainjob: completed (exit 0): published out/pvc/artifacts/model-v1.json, sha256 {SHA}; "
        "holdout 20/20 vs baseline 20/20")
    failed = {"drift_failed": {"holdout.correct": 14, "holdout.total": 20, "baseline.correct": 19,
                               "baseline.total": 20, "max_drop": 20}}
    assert final_line("drift_failed", failed, "out/pvc", 1) == (
        "trainjob: drift_failed (exit 1): holdout 14/20 vs baseline 19/20, below the 20% allowed drop "
        "(it needs 16/20); nothing published")  # 19 * 80 / 100 = 15.2: 16
    assert final_line("killed", {"killed": {"at_step": 1}}, "p", 75) == (
        "trainjob: killed at step 1 (exit 75): no checkpoint yet: a relaunch starts the attempt over")
    assert final_line("job_failed", {"job_failed": {"attempts": 3, "backoff_limit": 2}}, "p", 1) == (
        "trainjob: job_failed (exit 1): 3 attempts, the retry budget (backoff limit 2) is spent; "
        "no attempt will start on this job again")
    loss = trainjob.Metric(0.7, baseline=0.5, higher_is_better=False, name="val_loss")
    assert final_line("drift_failed", failed, "p", 1, verdict=metric_verdict(loss, 20)) == (
        "trainjob: drift_failed (exit 1): val_loss 0.7 vs baseline 0.5 (lower is better; at most 0.625 passes "
        "with max_drop 20%); nothing published")
    accuracy = trainjob.Metric(0.93, baseline=0.9, higher_is_better=True, name="accuracy")
    assert metric_verdict(accuracy, 100).endswith("(higher is better; at least 0 passes with max_drop 100%)")


class Full(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("stream", [None, Full()], ids=["stderr-closed", "stderr-full"])
def test_a_stderr_that_is_closed_or_cannot_be_written_changes_nothing(stream):
    narrator = Narrator(stream, 2, "p")
    narrator.told("job_started", "steps=2 attempt=1")
    narrator.step(1, 100)
    narrator.told("checkpointed", "step=1 loss_milli=100")
    narrator.ending("killed", 75)


class Vector:
    def __init__(self) -> None:
        self.w = np.zeros(3)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"w": self.w}

    def load_state_dict(self, arrays) -> None:
        self.w[...] = arrays["w"]


def own_loop(pvc: Path, **options) -> int:
    state = Vector()
    with trainjob.Run(pvc, state=state, steps=4, ckpt_every=2, **options) as run:
        for step in run:
            state.w += step
            run.report(float(state.w.sum()) / 100)
        run.gate(metric=trainjob.Metric(0.4, baseline=0.5, higher_is_better=False, name="val_loss"),
                 export=state.state_dict())
    return run.exit_code


def test_an_own_loop_shows_its_progress_unless_told_not_to_and_trains_the_same_bytes(tmp_path, capsys):
    assert own_loop(tmp_path / "shown") == 0
    shown = capsys.readouterr().err.splitlines()
    assert own_loop(tmp_path / "quiet", progress=False) == 0
    quiet = capsys.readouterr().err.splitlines()
    assert [re.sub(r"  [0-9.]+ steps/s  ETA \S+$", "", s) for s in shown[:-1]] == [
        "trainjob: attempt 1 started: 4 steps", "trainjob: checkpointed step 2/4  loss 0.090",
        "trainjob: checkpointed step 4/4  loss 0.300"]
    assert len(quiet) == 1 and quiet[0].replace("quiet", "shown") == shown[-1]
    assert shown[-1].startswith(f"trainjob: completed (exit 0): published {tmp_path / 'shown'}/artifacts/model-v1"
                                ".safetensors, sha256 ")
    assert shown[-1].endswith("; val_loss 0.4 vs baseline 0.5 (lower is better; at most 0.625 passes with "
                              "max_drop 20%)")
    assert events(tmp_path / "shown/log.jsonl") == events(tmp_path / "quiet/log.jsonl")
    artifact = "artifacts/model-v1.safetensors"
    assert (tmp_path / "shown" / artifact).read_bytes() == (tmp_path / "quiet" / artifact).read_bytes()


def on_a_terminal(*argv: str | Path) -> tuple[int, str, str]:
    """``trainjob ARGV`` with its stderr on a pseudo-terminal: (exit code, stdout, what the terminal got)."""
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "trainjob", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=follower)
    os.close(follower)
    out, _ = proc.communicate(timeout=120)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed: everything is read
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    return proc.returncode, out.decode(), seen.decode().replace("\r\n", "\n")


@pytest.mark.process
def test_the_cli_talks_on_a_terminal_in_a_log_and_under_quiet_and_trains_the_same_bytes(tmp_path):
    """`trainjob run`, killed at step 4 then resumed, three ways: stderr on a terminal (the line
    rewritten per step), a pipe (a pod's log: a line per checkpoint) and --quiet (none). Each
    launch ends with the line saying how; the logs, less their times, and the artifacts are the
    same bytes (the walkthrough's sha256); no progress reaches stdout or the log."""
    runs = {}
    for way in ("terminal", "pipe", "quiet"):
        pvc = tmp_path / way
        launches = []
        for flags in (("--die-at", 4), ()):
            argv = ("run", "--pvc", pvc, *flags, *(("--quiet",) if way == "quiet" else ()))
            if way == "terminal":
                launches.append(on_a_terminal(*argv))
            else:
                done = cli_run(*argv)
                launches.append((done.returncode, done.stdout, done.stderr))
        assert [code for code, _, _ in launches] == [75, 0] and all(out == "" for _, out, _ in launches), launches
        runs[way] = [err for _, _, err in launches]
        assert hashlib.sha256((pvc / "artifacts/model-v1.json").read_bytes()).hexdigest() == SHA
        assert not [e for e in events(pvc / "log.jsonl") if "steps/s" in e[1]]
    assert events(tmp_path / "terminal/log.jsonl") == events(tmp_path / "pipe/log.jsonl") == \
        events(tmp_path / "quiet/log.jsonl")

    def ending(way: str) -> list[str]:
        return ["trainjob: killed at step 4 (exit 75): a relaunch resumes from step 4",
                f"trainjob: completed (exit 0): published {tmp_path / way}/artifacts/model-v1.json, sha256 {SHA}; "
                "holdout 20/20 vs baseline 20/20"]

    killed, completed = runs["terminal"]
    assert "\rstep 4/10  loss 0.241  " in killed and killed.endswith(f"\x1b[K\n{ending('terminal')[0]}\n")
    assert "\rstep 10/10  loss 0.225  " in completed and completed.endswith(f"\x1b[K\n{ending('terminal')[1]}\n")
    pipe = [[re.sub(r"  [0-9.]+ steps/s  ETA \S+$", "", s) for s in err.splitlines()] for err in runs["pipe"]]
    assert pipe == [["trainjob: attempt 1 started: 10 steps", "trainjob: checkpointed step 2/10  loss 0.310",
                     "trainjob: checkpointed step 4/10  loss 0.241", ending("pipe")[0]],
                    ["trainjob: resumed from step 4 of 10", "trainjob: checkpointed step 6/10  loss 0.228",
                     "trainjob: checkpointed step 8/10  loss 0.226", "trainjob: checkpointed step 10/10  loss 0.225",
                     ending("pipe")[1]]]
    assert [err.splitlines() for err in runs["quiet"]] == [[line] for line in ending("quiet")]
