"""`trainjob plot`: what a run's picture shows, read from its log, and the PNG it makes."""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys

import pytest

from conftest import trainjob
from trainjob.views.history import legal_path
from trainjob.views.plot import Marker, GateVerdict, story

pytestmark = pytest.mark.process  # every test here starts the CLI or another process

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None and not os.environ.get("CI"),
    reason="matplotlib not installed (CI installs it)")


def test_walkthrough_story_keeps_losing_loss_across_the_kill(walkthrough_log):
    told = story(legal_path(walkthrough_log))
    assert told.losses == {1: [(2, 310), (4, 241), (6, 228), (8, 226), (10, 225)]}
    assert [(m.event, m.attempt, m.step) for m in told.markers] == [
        ("job_started", 1, 0), ("killed", 1, 4), ("resumed", 1, 4),
        ("artifact_written", 1, 10), ("completed", 1, 10)]
    assert told.verdicts == [GateVerdict(1, "completed", 20, 20, 20, 20, None)]
    assert told.verdicts[0].threshold(max_drop=None) is None  # completed does not log max_drop
    assert told.verdicts[0].threshold(max_drop=20) == 16


def test_drift_failures_and_the_refusal_are_each_an_attempt(pvc):
    for _ in range(3):
        trainjob("run", "--pvc", pvc, "--backoff-limit", 1, "--force-weights", "0,0,0")
    told = story(legal_path(pvc / "log.jsonl"))
    assert set(told.losses) == {1, 2}
    assert told.verdicts == [GateVerdict(1, "drift_failed", 14, 20, 20, 20, 20),
                             GateVerdict(2, "drift_failed", 14, 20, 20, 20, 20)]
    assert told.verdicts[0].threshold(max_drop=None) == 16  # logged by drift_failed itself
    assert told.markers[-1] == Marker(line=15, event="job_failed", attempt=2, step=10)


@needs_matplotlib
def test_plot_writes_a_png_of_the_figure_size(tmp_path, walkthrough_log):
    result = trainjob("plot", walkthrough_log, "-o", tmp_path / "run.png", "--max-drop", 20)
    assert result.returncode == 0, result.stderr
    png = (tmp_path / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1100, 450)  # IHDR: 11 x 4.5 inches at 100 dpi


def test_plot_without_matplotlib_exits_2_and_says_how_to_get_it(tmp_path, walkthrough_log):
    code = "import sys; sys.modules['matplotlib'] = None; from trainjob.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", code, "plot", str(walkthrough_log), "-o", str(tmp_path / "x.png")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "pip install 'trainjob[plot]'" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_a_legal_path_with_a_broken_detail_is_an_input_error_not_a_crash(tmp_path, walkthrough_log):
    log = tmp_path / "log.jsonl"
    log.write_text(walkthrough_log.read_text().replace("loss_milli=241", "loss=0.241"))
    result = trainjob("plot", log, "-o", tmp_path / "x.png")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"trainjob plot: {log}:3: checkpointed detail has no loss_milli=<number>: 'step=4 loss=0.241'"]


@pytest.mark.parametrize("args, message", [
    (["--max-drop", "101"], "--max-drop is a percentage"),
    pytest.param(["-o", "nowhere/x.png"], "cannot write", marks=needs_matplotlib),
])
def test_bad_flags_and_unwritable_output_exit_2(tmp_path, walkthrough_log, args, message):
    result = trainjob("plot", walkthrough_log, "-o", tmp_path / "x.png", *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.splitlines()) == 1
