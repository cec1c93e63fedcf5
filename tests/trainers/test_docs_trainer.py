"""The docs' trainer to copy (docs/trainers.md) is the file the tests run, fits in 60 lines, and keeps every guarantee."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT, events, trainjob

EXAMPLE = ROOT / "examples/minimal_trainer.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "examples")}


def run(pvc, *flags):
    return trainjob("run", "--pvc", pvc, "--trainer", "minimal_trainer:make", *flags, env=ENV)


def test_the_documented_trainer_is_the_tested_file_and_under_60_lines():
    """The how-to page includes the file itself (pymdownx.snippets; the site's build fails on a missing one)."""
    assert '```python\n--8<-- "examples/minimal_trainer.py"\n```' in (ROOT / "docs/trainers.md").read_text()
    assert len(EXAMPLE.read_text().splitlines()) < 60


@pytest.mark.process
@pytest.mark.torchrun
def test_the_documented_trainer_resumes_after_a_kill_to_the_same_bytes(tmp_path):
    assert run(tmp_path / "clean").returncode == 0
    assert run(tmp_path / "killed", "--die-at", 3, "--world-size", 2).returncode == 75
    assert run(tmp_path / "killed", "--world-size", 2).returncode == 0
    clean, killed = (tmp_path / p / "artifacts/model-v1.safetensors" for p in ("clean", "killed"))
    assert killed.read_bytes() == clean.read_bytes()
    assert events(tmp_path / "clean/log.jsonl")[-1][1].startswith("holdout: 98/100")
