"""The digits data set and trainer: real data, momentum, and every guarantee the toy model has."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load, load_file

from conftest import ROOT, events, io_calls, killpoint, skip_without, trainjob
from trainjob import cli
from trainjob.trainers.digits import DigitsTrainer

skip_without("sklearn", "scikit-learn (the digits extra) is not installed")

SHORT = ("--trainer", "digits", "--steps", "4", "--ckpt-every", "1", "--keep", "2")
HELPERS = {**os.environ, "PYTHONPATH": str(ROOT / "tests/helpers")}


@pytest.fixture(scope="module")
def data(digits_data: Path) -> Path:
    return digits_data


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> bytes:
    """The artifact of an uninterrupted short run at one rank."""
    pvc = tmp_path_factory.mktemp("ref") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--data", data, *SHORT).returncode == 0
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()


def artifact(pvc) -> bytes:
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()


@pytest.mark.process
def test_gen_is_repeatable_and_splits_by_index(tmp_path, data):
    assert trainjob("gen", "--dataset", "digits", tmp_path / "again").returncode == 0
    again = tmp_path / "again"
    assert {p.name: p.read_bytes() for p in data.iterdir()} == {p.name: p.read_bytes() for p in again.iterdir()}
    trainer = DigitsTrainer(data, 0.05)
    assert (len(trainer.y), len(trainer.hy)) == (1437, 360) and trainer.x.shape == (1437, 64)


@pytest.mark.process
def test_default_run_scores_in_the_90s_and_beats_the_frozen_baseline(tmp_path, data):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--data", data, "--trainer", "digits").returncode == 0
    record = json.loads(safe_open(pvc / "artifacts/model-v1.safetensors", "np").metadata()["trainjob.artifact"])
    correct, base = record["holdout"]["correct"], record["baseline"]["correct"]
    assert record["holdout"]["total"] == 360 and correct >= 324 and correct > base  # >= 90%
    published = load_file(pvc / "artifacts/model-v1.safetensors")
    assert sorted(published) == ["W", "b"] and published["W"].shape == (64, 10)  # not the momentum buffers
    assert events(pvc / "log.jsonl")[-1] == ("completed", f"holdout: {correct}/360 vs baseline {base}/360")


@pytest.mark.process
@pytest.mark.torchrun
def test_two_ranks_write_the_one_rank_bytes_and_split_every_array(tmp_path, data, reference):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--data", data, *SHORT, "--world-size", 2, "--die-at", 2).returncode == 75
    assert trainjob("run", "--pvc", pvc, "--data", data, *SHORT, "--world-size", 2).returncode == 0
    assert artifact(pvc) == reference
    manifest = json.loads((pvc / "checkpoints/step-00000004-a0001-w002/manifest.json").read_text())
    held = [{h["name"]: (h["start"], h["shape"][0]) for h in s["holds"]} for s in manifest["shards"]]
    assert held == [{"W": (0, 32), "b": (0, 5), "vW": (0, 32), "vb": (0, 5)},
                    {"W": (32, 32), "b": (5, 5), "vW": (32, 32), "vb": (5, 5)}]


@pytest.fixture(scope="module")
def short_run_io_calls(tmp_path_factory, data) -> int:
    return io_calls("run", "--pvc", tmp_path_factory.mktemp("count") / "pvc", "--data", data, *SHORT)


# SIGKILL just before I/O call N of a clean run, N spread over the whole run: while starting,
# writing a shard, the manifest, committing, pointing, rotating, publishing (the last calls,
# after "completed" is logged, are tests/engine/test_crash.py's). Every relaunch must end with the
# uninterrupted bytes, so the momentum buffers came back exactly too.
@pytest.mark.parametrize("fraction", [0.03, 0.15, 0.35, 0.5, 0.66, 0.82, 0.95])
@pytest.mark.process
@pytest.mark.killpoint
def test_sigkill_at_any_io_point_resumes_to_the_same_bytes(tmp_path, data, reference, short_run_io_calls, fraction):
    pvc, point = tmp_path / "pvc", int(fraction * short_run_io_calls)
    assert killpoint(point, "run", "--pvc", pvc, "--data", data, *SHORT).returncode == -signal.SIGKILL
    result = trainjob("run", "--pvc", pvc, "--data", data, *SHORT)
    assert result.returncode == 0, result.stderr
    assert artifact(pvc) == reference


@pytest.mark.parametrize("victim, point", [(1, 8), (0, 30), (0, 70)])
@pytest.mark.process
@pytest.mark.killpoint
@pytest.mark.torchrun
def test_sigkill_of_either_rank_at_two_ranks_resumes_to_the_same_bytes(tmp_path, data, reference, victim, point):
    pvc, flags = tmp_path / "pvc", (*SHORT, "--world-size", "2", "--rank-timeout", "2")
    procs = []
    for rank in (0, 1):
        prefix = [sys.executable, str(ROOT / "tests/killpoint.py"), str(point)] if rank == victim \
            else [sys.executable, "-m", "trainjob"]
        procs.append(subprocess.Popen([*prefix, "run", "--pvc", str(pvc), "--data", str(data), *flags,
                                       "--rank", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    codes = [p.wait(30) for p in procs]
    assert codes[victim] == -signal.SIGKILL and codes[1 - victim] == 75, codes
    assert trainjob("run", "--pvc", pvc, "--data", data, *flags).returncode == 0
    assert artifact(pvc) == reference


@pytest.mark.process
def test_a_trainer_that_keeps_momentum_out_of_the_checkpoint_resumes_to_other_weights(tmp_path, data, reference):
    """The control for the tests above: drop the momentum buffers from what is checkpointed and a
    kill changes the result. If the buffers did not matter, the kill tests would prove nothing."""
    flags = ("--data", str(data), *SHORT[2:], "--trainer", "user_trainers:forgetful")

    def run(pvc, *extra):
        return trainjob("run", "--pvc", pvc, *flags, *extra, env=HELPERS).returncode

    def arrays(blob):
        return load(blob)["W"].tobytes()

    assert run(tmp_path / "clean") == 0
    assert arrays(artifact(tmp_path / "clean")) == arrays(reference)  # uninterrupted, it trains like digits
    assert run(tmp_path / "killed", "--die-at", "2") == 75
    assert run(tmp_path / "killed") == 0
    assert arrays(artifact(tmp_path / "killed")) != arrays(reference)


@pytest.mark.process
def test_dropping_the_buffers_at_a_step_changes_the_weights(data):
    def after_three(drop: bool) -> np.ndarray:
        trainer = DigitsTrainer(data, 0.05)
        for step in (1, 2):
            trainer.step(step)
        if drop:
            trainer.vW[...], trainer.vb[...] = 0.0, 0.0
        trainer.step(3)
        return trainer.W

    kept = after_three(False)
    assert np.array_equal(kept, after_three(False))  # deterministic
    assert not np.array_equal(kept, after_three(True))


@pytest.mark.process
def test_a_checkpoint_of_other_arrays_is_refused_before_anything_is_written(tmp_path, data):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--data", data, *SHORT, "--die-at", 2).returncode == 75
    before = {p: p.read_bytes() for p in pvc.rglob("*") if p.is_file()}
    result = trainjob("run", "--pvc", pvc, "--data", data, *SHORT[2:], "--trainer", "user_trainers:forgetful",
                      env=HELPERS)
    assert result.returncode == 2 and "relaunch with the trainer that wrote it" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in pvc.rglob("*") if p.is_file()} == before


def test_gen_without_scikit_learn_is_a_one_line_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails as if not installed
    assert cli.main(["gen", "--dataset", "digits", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "trainjob[digits]" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()
