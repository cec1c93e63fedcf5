"""Running an example script as a user does, for the tests that kill and resume it: launch it,
read the loss it prints per step, finish it, SIGKILL it at a printed step, read its artifact.

Shared by tests/engine/test_finetune_example.py and test_vision_example.py: each example prints
``step N loss L`` after a step and before that step's checkpoint. Every launch finished here is
checked to leave a log that says its exit code (``agrees_with_its_log``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import agrees_with_its_log, log_length

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(script: Path, pvc: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), "--pvc", str(pvc), *flags], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def losses(text: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) loss (\S+)$", text, re.M)}


def finish(script: Path, pvc: Path, *flags: str) -> dict[int, str]:
    before = log_length(pvc)
    proc = launch(script, pvc, *flags)
    out, err = proc.communicate(timeout=600)
    assert "completed" in (pvc / "log.jsonl").read_text(), err[-2000:]
    agrees_with_its_log(proc.returncode, pvc, before)
    return losses(out)


def killed(script: Path, pvc: Path, *flags: str, at_line: int, then: float = 0.0) -> None:
    """Run until the loss line of step ``at_line`` (or a later one) is printed, ``then`` seconds
    more, and SIGKILL (a loss line is printed before the step's checkpoint: a kill soon after one
    lands in it). "Or a later one": an earlier kill's delay may have let the run pass ``at_line``,
    so this launch resumes after it and never prints that line."""
    proc = launch(script, pvc, *flags)
    assert proc.stdout is not None
    for line in proc.stdout:
        if (step := losses(line)) and min(step) >= at_line:
            break
    time.sleep(then)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"not killed at step {at_line}: {err[-1000:]}"


def artifact(pvc: Path) -> bytes:
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()
