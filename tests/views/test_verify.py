"""`trainjob verify`: one line per item with its verdict; exit 0 only when what matters verifies."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import trainjob

# every test here starts the CLI; the module's PVC is a two-rank job's
pytestmark = [pytest.mark.process, pytest.mark.torchrun]


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    pvc = tmp_path_factory.mktemp("done") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--world-size", 2, "--keep", 2).returncode == 0
    return pvc


@pytest.fixture
def pvc(tmp_path, completed):
    shutil.copytree(completed, tmp_path / "pvc")
    return tmp_path / "pvc"


def lines(result):
    return result.stdout.splitlines()


def test_a_sound_pvc_verifies_item_by_item(pvc):
    result = trainjob("verify", "--pvc", pvc)
    assert result.returncode == 0
    assert lines(result) == [
        "ok        checkpoint checkpoints/step-00000008-a0001-w002  step=8 attempt=1 world_size=2 loss_milli=226",
        "ok        checkpoint checkpoints/step-00000010-a0001-w002  step=10 attempt=1 world_size=2 loss_milli=225",
        "ok        pointer    checkpoint.json  names checkpoints/step-00000010-a0001-w002 (step 10)",
        f"ok        artifact   artifacts/model-v1.json  sha256={json.loads(open(pvc / 'log.jsonl').readlines()[-2])['detail'].split()[0][7:]}",
        "verdict: ok",
    ]
    report = json.loads(trainjob("verify", "--pvc", pvc, "--json").stdout)
    assert report["ok"] is True and {i["verdict"] for i in report["items"]} == {"ok"}


def test_a_tampered_artifact_fails(pvc):
    (pvc / "artifacts/model-v1.json").write_text("{}\n")
    result = trainjob("verify", "--pvc", pvc)
    assert result.returncode == 1 and any(l.startswith("corrupt   artifact") for l in lines(result))


def test_an_artifact_the_log_never_mentioned_fails(pvc):
    (pvc / "artifacts/model-v9.json").write_text("{}\n")
    result = trainjob("verify", "--pvc", pvc)
    assert result.returncode == 1 and "unlogged  artifact   artifacts/model-v9.json" in result.stdout


def test_a_corrupt_newest_checkpoint_fails_an_older_one_is_only_reported(pvc):
    older = pvc / "checkpoints/step-00000008-a0001-w002/shard-00001-of-00002.safetensors"
    older.write_bytes(older.read_bytes()[:-1])
    result = trainjob("verify", "--pvc", pvc)
    assert result.returncode == 0 and lines(result)[0].startswith("corrupt   checkpoint checkpoints/step-00000008")
    newest = pvc / "checkpoints/step-00000010-a0001-w002/shard-00000-of-00002.safetensors"
    newest.write_bytes(newest.read_bytes()[:-1])
    result = trainjob("verify", "--pvc", pvc)
    assert result.returncode == 1 and "does not" not in result.stdout and lines(result)[-1] == "verdict: FAILED"


def test_partial_and_in_flight_directories_are_reported_never_loaded(pvc):
    (pvc / "checkpoints/.tmp-step-00000012-a0001-w002.g00000009").mkdir()
    (pvc / "checkpoints/step-00000012-a0001-w002").mkdir()  # no manifest: never committed
    result = trainjob("verify", "--pvc", pvc)
    assert "in-flight checkpoint checkpoints/.tmp-step-00000012-a0001-w002.g00000009" in result.stdout
    assert "partial   checkpoint checkpoints/step-00000012-a0001-w002" in result.stdout
    assert result.returncode == 1  # the newest-named checkpoint does not verify


def test_the_pointer_must_name_a_checkpoint_that_is_there(pvc):
    shutil.rmtree(pvc / "checkpoints/step-00000010-a0001-w002")
    result = trainjob("verify", "--pvc", pvc)
    assert result.returncode == 1 and "missing   pointer" in result.stdout


def test_a_missing_pvc_is_an_input_error(tmp_path):
    assert trainjob("verify", "--pvc", tmp_path / "nope").returncode == 2
