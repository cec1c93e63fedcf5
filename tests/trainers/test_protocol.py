"""Loading trainers (`--trainer NAME | package.module:factory`) and their one-line errors."""

from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT, events, trainjob

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
