"""Published artifacts: JSON for the lab's linear model (its model-v1.json, byte for byte),
safetensors for every other trainer, each hashed as written, verified, and re-announced truthfully."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from safetensors import safe_open

from conftest import ROOT, events, trainjob

EXAMPLES = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT / "tests/helpers")]),
            "OMP_NUM_THREADS": "1"}


def run(pvc, *flags, env=None):
    return trainjob("run", "--pvc", pvc, *flags, env={**EXAMPLES, **(env or {})}, timeout=120)


def logged(pvc) -> dict[str, str]:
    detail = [d for e, d in events(pvc / "log.jsonl") if e == "artifact_written"][-1]
    return dict(part.split("=", 1) for part in detail.split())


@pytest.mark.process
def test_a_trainer_other_than_the_lab_model_publishes_safetensors_hashed_as_written(tmp_path):
    pvc = tmp_path / "pvc"
    assert run(pvc, "--trainer", "minimal_trainer:make").returncode == 0
    path = pvc / "artifacts/model-v1.safetensors"
    assert logged(pvc) == {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                           "path": "artifacts/model-v1.safetensors"}
    with safe_open(path, "np") as f:  # the package's own reader: a standard file
        assert sorted(f.keys()) == ["b", "w"]
        record = json.loads(f.metadata()["trainjob.artifact"])
    assert record == {"arrays": [], "attempt": 1, "step": 10, "trainer": "minimal_trainer:make",
                      "holdout": {"correct": 98, "total": 100}, "baseline": {"correct": 89, "total": 100}}
    assert not (pvc / "artifacts/model-v1.json").exists()
    assert trainjob("verify", "--pvc", pvc).returncode == 0
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    assert "corrupt" in trainjob("verify", "--pvc", pvc).stdout


@pytest.mark.process
def test_a_completion_cut_short_before_its_log_lines_re_announces_the_safetensors_artifact(tmp_path):
    pvc = tmp_path / "pvc"
    assert run(pvc, "--trainer", "minimal_trainer:make").returncode == 0
    first = logged(pvc)
    log = pvc / "log.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:-2]))  # as if killed after state.json said completed, before the log did
    assert run(pvc, "--trainer", "minimal_trainer:make").returncode == 0
    assert logged(pvc) == first
    assert events(log)[-1] == ("completed", "holdout: 98/100 vs baseline 89/100")


@pytest.mark.process
def test_a_bfloat16_model_is_published_bit_for_bit(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    pvc = tmp_path / "pvc"
    result = run(pvc, "--trainer", "torch_trainers:make", "--steps", 3, env={"TRAINJOB_TEST_DTYPE": "bfloat16"})
    assert result.returncode == 0, result.stderr
    published = load_file(pvc / "artifacts/model-v1.safetensors")
    final = load_file(pvc / "checkpoints/step-00000003-a0001-w001/shard-00000-of-00001.safetensors")
    assert sorted(published) == sorted(k for k in final if k.startswith("model."))
    for name, tensor in published.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor.view(torch.int16), final[name].view(torch.int16))


@pytest.mark.process
def test_an_unknown_artifact_format_is_a_one_line_usage_error(tmp_path):
    helper = tmp_path / "odd_format.py"
    helper.write_text("from trainjob.trainers.linear import make as linear\n\n"
                      "def make(data, lr):\n    t = linear(data, lr)\n    t.artifact_format = 'pickle'\n    return t\n")
    result = run(tmp_path / "pvc", "--trainer", "odd_format:make", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2 and "artifact_format is 'pickle'; use one of json, safetensors" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
