"""Loading trainers (`--trainer NAME | package.module:factory`), their one-line errors, progress."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, events, trainjob
from trainjob.engine.progress import Progress, line

HELPERS = {**os.environ, "PYTHONPATH": str(ROOT / "tests/helpers")}


def run_with_helpers(pvc, *flags):
    return trainjob("run", "--pvc", pvc, *flags, env=HELPERS)


@pytest.mark.parametrize("spec, says", [
    ("nosuch", "expected one of linear, digits or package.module:factory"),
    ("no_such_module_xyz:make", "cannot import no_such_module_xyz"),
    ("user_trainers:missing", "has no callable missing"),
    ("user_trainers:NOT_CALLABLE", "has no callable NOT_CALLABLE"),
    ("user_trainers:no_arguments", "the factory must accept (data, lr)"),
    ("user_trainers:not_a_trainer", "object does not fit the Trainer protocol; missing state_dict, load_state_dict, step"),
])
@pytest.mark.process
def test_a_bad_trainer_is_a_one_line_usage_error_before_the_pvc_is_touched(tmp_path, spec, says):
    result = run_with_helpers(tmp_path / "pvc", "--trainer", spec)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "pvc").exists()


@pytest.mark.process
def test_force_weights_is_a_linear_capability(tmp_path):
    data = tmp_path / "data"
    assert trainjob("gen", "--dataset", "digits", data).returncode == 0
    result = trainjob("run", "--pvc", tmp_path / "pvc", "--data", data, "--trainer", "digits",
                      "--force-weights", "0,0,0")
    assert result.returncode == 2 and "trainer 'digits' does not support it" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.process
def test_digits_without_data_says_how_to_make_it(tmp_path):
    result = trainjob("run", "--pvc", tmp_path / "pvc", "--trainer", "digits")
    assert result.returncode == 2 and "trainjob gen --dataset digits" in result.stderr


@pytest.mark.process
def test_linear_by_name_or_by_path_is_the_default(tmp_path, walkthrough_log):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4, "--steps", 10, "--trainer", "linear").returncode == 75
    assert trainjob("run", "--pvc", pvc, "--trainer", "linear").returncode == 0
    assert events(pvc / "log.jsonl") == events(walkthrough_log)  # same path, losses, hash, verdict
    by_path = tmp_path / "by-path"
    assert trainjob("run", "--pvc", by_path, "--trainer", "trainjob.trainers.linear:make").returncode == 0
    record = json.loads((by_path / "artifacts/model-v1.json").read_text())
    assert record["arrays"] == json.loads((pvc / "artifacts/model-v1.json").read_text())["arrays"]
    assert record["trainer"] == "trainjob.trainers.linear:make"


# --- progress -------------------------------------------------------------------------------------

class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_unless_stderr_is_a_terminal():
    assert Progress.for_stream(io.StringIO(), 10) is None
    assert isinstance(Progress.for_stream(Tty(), 10), Progress)


def test_progress_line_shows_step_loss_rate_and_eta():
    ticks = iter([100.0, 102.0, 104.0])
    stream = Tty()
    progress = Progress(stream, 4, clock=lambda: next(ticks))
    progress(3, 228)  # a resumed launch: the rate counts steps done here, not from step 0
    progress(4, 226)
    assert line(2, 10, 310, 2, 4.0) == "step 2/10  loss 0.310  0.50 steps/s  ETA 16s"
    assert stream.getvalue().endswith("step 4/4  loss 0.226  0.50 steps/s  ETA 0s\x1b[K\n")


@pytest.mark.process
def test_a_run_under_a_pipe_prints_no_progress_and_the_log_holds_none(tmp_path):
    result = trainjob("run", "--pvc", tmp_path / "pvc")
    assert result.returncode == 0 and result.stderr == ""
    assert not [e for e in events(tmp_path / "pvc/log.jsonl") if "steps/s" in e[1]]


@pytest.mark.process
def test_a_run_on_a_terminal_shows_progress_on_stderr_only(tmp_path):
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "trainjob", "run", "--pvc", str(tmp_path / "pvc")],
                            stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    out, _ = proc.communicate(timeout=60)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.returncode == 0
    assert b"step 10/10  loss 0.225" in seen and b"steps/s" not in out
    assert not [e for e in events(tmp_path / "pvc/log.jsonl") if "steps/s" in e[1]]
