"""World-size mismatch, then an explicit reshard, then a resume: bit-identical, and kill-safe."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from conftest import events, io_calls, killpoint, snapshot, trainjob
from trainjob.views.history import replay

# every test here starts the CLI, on a PVC a two-rank job left (a module fixture)
pytestmark = [pytest.mark.process, pytest.mark.torchrun]


@pytest.fixture(scope="module")
def two_ranks_killed_at_4(tmp_path_factory):
    pvc = tmp_path_factory.mktemp("w2") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--world-size", 2, "--die-at", 4).returncode == 75
    return pvc


@pytest.fixture(scope="module")
def clean_artifact(tmp_path_factory) -> bytes:
    pvc = tmp_path_factory.mktemp("clean") / "pvc"
    assert trainjob("run", "--pvc", pvc).returncode == 0
    return (pvc / "artifacts/model-v1.json").read_bytes()


@pytest.fixture
def pvc(tmp_path, two_ranks_killed_at_4):
    shutil.copytree(two_ranks_killed_at_4, tmp_path / "pvc")
    return tmp_path / "pvc"


SOURCE = "checkpoints/step-00000004-a0001-w002"


def test_world_size_mismatch_exits_2_naming_reshard_and_touches_nothing(pvc):
    before = snapshot(pvc)
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and "trainjob reshard" in result.stderr and "--world-size 1" in result.stderr
    assert snapshot(pvc) == before


def tree(directory):
    """Every name under ``directory``, a file's with its bytes, a directory's with None."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


def test_a_refused_launch_of_more_ranks_leaves_the_pvc_as_it_was_not_even_a_lock_file(pvc):
    """W=3 on a W=2 PVC: rank 0 refuses (2, naming reshard); ranks 1 and 2, stopped before they
    joined, take away the lock files they made (rank 2's did not exist), as rank 0 its own."""
    (pvc / ".lock.rank-00001").unlink()  # so that two ranks' lock files are new to the PVC
    before = tree(pvc)
    result = trainjob("run", "--pvc", pvc, "--world-size", 3)
    assert result.returncode == 2 and "trainjob reshard --pvc" in result.stderr, result.stderr
    assert tree(pvc) == before


def test_reshard_then_resume_ends_with_the_uninterrupted_bytes(pvc, clean_artifact):
    source_manifest = (pvc / SOURCE / "manifest.json").read_bytes()
    result = trainjob("reshard", "--pvc", pvc, "--world-size", 1)
    assert result.returncode == 0, result.stderr
    target = pvc / "checkpoints/step-00000004-a0001-w001"
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["step"] == 4 and manifest["loss_milli"] == 241
    assert manifest["resharded_from"] == hashlib.sha256(source_manifest).hexdigest()
    assert (pvc / SOURCE / "manifest.json").read_bytes() == source_manifest  # source left intact
    assert json.loads((pvc / "checkpoint.json").read_text())["dir"] == "checkpoints/step-00000004-a0001-w001"
    event, detail = events(pvc / "log.jsonl")[-1]
    assert event == "resharded" and "step=4 from_world_size=2 world_size=1" in detail
    assert trainjob("status", pvc / "log.jsonl").returncode == 75  # resharded is not finished: relaunch
    assert trainjob("run", "--pvc", pvc).returncode == 0
    assert (pvc / "artifacts/model-v1.json").read_bytes() == clean_artifact
    assert [e for e, _ in events(pvc / "log.jsonl")][-6:] == [
        "resumed", "checkpointed", "checkpointed", "checkpointed", "artifact_written", "completed"]
    assert replay(pvc / "log.jsonl").illegal is None  # the table knows a reshard between processes


def test_resharded_shards_are_byte_identical_to_a_native_save(pvc, tmp_path):
    assert trainjob("reshard", "--pvc", pvc, "--world-size", 3).returncode == 0
    native = tmp_path / "native"
    assert trainjob("run", "--pvc", native, "--world-size", 3, "--die-at", 4).returncode == 75
    name = "checkpoints/step-00000004-a0001-w003"
    for rank in range(3):
        shard = f"{name}/shard-{rank:05d}-of-00003.safetensors"
        assert (pvc / shard).read_bytes() == (native / shard).read_bytes()


def test_reshard_is_idempotent_and_refuses_what_cannot_work(pvc):
    assert trainjob("reshard", "--pvc", pvc, "--world-size", 4).returncode == 0
    again = trainjob("reshard", "--pvc", pvc, "--world-size", 4)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    same = trainjob("reshard", "--pvc", pvc, "--world-size", 2, "--step", 4)  # the source's own size
    assert same.returncode == 0 and "nothing to do" in same.stdout
    assert trainjob("reshard", "--pvc", pvc, "--world-size", 3, "--step", 3).returncode == 2  # no such step
    assert trainjob("reshard", "--pvc", pvc, "--world-size", 0).returncode == 2
    older = trainjob("reshard", "--pvc", pvc, "--world-size", 3, "--step", 2)
    assert older.returncode == 0 and (pvc / "checkpoints/step-00000002-a0001-w003").is_dir()
    # an older reshard does not move the pointer back
    assert json.loads((pvc / "checkpoint.json").read_text())["step"] == 4


def swap_starts(manifest_path) -> None:
    """Swap the ``start`` of the two ranks' slices: every shard and its sha256 untouched, the rows
    each holds put in the other's place (the forgery of issue 54, item 2)."""
    m = json.loads(manifest_path.read_text())
    a, b = (s["holds"][0] for s in m["shards"])
    a["start"], b["start"] = b["start"], a["start"]
    manifest_path.write_text(json.dumps(m))


def test_reshard_refuses_a_manifest_other_than_the_pointers_and_writes_nothing(pvc):
    """checkpoint.json recorded the newest manifest's sha256: reshard checks it as run and verify
    do, and a refused newest is not replaced by an older step behind the operator's back."""
    swap_starts(pvc / SOURCE / "manifest.json")
    before = snapshot(pvc)
    result = trainjob("reshard", "--pvc", pvc, "--world-size", 4)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "differs from the manifest checkpoint.json recorded" in result.stderr
    assert "--step" in result.stderr  # how to reshard an older one deliberately
    assert snapshot(pvc) == before  # nothing written, the pointer untouched
    assert trainjob("verify", "--pvc", pvc).returncode == 1


@pytest.mark.killpoint
def test_a_reshard_killed_at_any_instant_leaves_a_resumable_pvc(tmp_path, two_ranks_killed_at_4, clean_artifact):
    """SIGKILL just before each of the reshard's writes, fsyncs and renames in turn (the last ones
    logging); then do it again: it must complete and verify."""
    to_one = ("--world-size", "1")
    total = io_calls("reshard", "--pvc", shutil.copytree(two_ranks_killed_at_4, tmp_path / "count"), *to_one)
    assert total > 5  # the harness really intercepts the reshard's I/O
    for point in range(total):
        pvc = shutil.copytree(two_ranks_killed_at_4, tmp_path / f"k{point}")
        assert killpoint(point, "reshard", "--pvc", pvc, *to_one).returncode == -9, point
        assert (pvc / SOURCE / "manifest.json").exists(), point
        assert trainjob("reshard", "--pvc", pvc, *to_one).returncode == 0, point
        assert trainjob("verify", "--pvc", pvc).returncode == 0, point
        if point in (0, total // 2):  # the resume itself is tested above; two full runs prove the kill left nothing
            assert trainjob("run", "--pvc", pvc).returncode == 0, point
            assert (pvc / "artifacts/model-v1.json").read_bytes() == clean_artifact
