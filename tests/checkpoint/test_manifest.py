"""Loading verifies before touching state: every corruption is caught, with the right exit code.

Each case damages a real checkpoint left by a killed run, then relaunches the real CLI. With an
older sound checkpoint to fall back to, the run resumes from it, logs ``checkpoint_rejected``
and ends with the very bytes of an uninterrupted run; with none, it exits 2 naming
``trainjob verify`` and leaves the PVC exactly as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import events, snapshot, trainjob
from trainjob.views.history import replay

pytestmark = pytest.mark.process  # every test here starts the CLI or another process


@pytest.fixture(scope="module")
def clean_artifact(tmp_path_factory) -> bytes:
    pvc = tmp_path_factory.mktemp("clean") / "pvc"
    assert trainjob("run", "--pvc", pvc).returncode == 0
    return (pvc / "artifacts/model-v1.json").read_bytes()


@pytest.fixture(scope="module")
def killed_at(tmp_path_factory):
    """PVC templates: world size 2, killed at step 2 (one checkpoint) or 4 (checkpoints 2 and 4)."""
    made = {}
    for step in (2, 4):
        pvc = tmp_path_factory.mktemp(f"killed{step}") / "pvc"
        assert trainjob("run", "--pvc", pvc, "--world-size", 2, "--die-at", step).returncode == 75
        made[step] = pvc
    return made


def newest(pvc: Path) -> Path:
    return pvc / json.loads((pvc / "checkpoint.json").read_text())["dir"]


def shard(pvc: Path, rank: int = 1) -> Path:
    return newest(pvc) / f"shard-{rank:05d}-of-00002.safetensors"


def edit_manifest(pvc: Path, change) -> None:
    path = newest(pvc) / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


def truncate(pvc):
    os.truncate(shard(pvc), shard(pvc).stat().st_size - 3)


def flip_a_byte(pvc):
    data = bytearray(shard(pvc).read_bytes())
    data[len(data) // 2 + 5] ^= 0x10
    shard(pvc).write_bytes(bytes(data))


def delete_a_shard(pvc):
    shard(pvc, 0).unlink()


def add_a_shard(pvc):
    shutil.copy(shard(pvc), newest(pvc) / "shard-00002-of-00002.safetensors")


def edit_a_size(pvc):
    edit_manifest(pvc, lambda m: m["shards"][1].update(size=m["shards"][1]["size"] + 8))


def edit_the_loss(pvc):  # caught because checkpoint.json recorded the manifest's sha256
    edit_manifest(pvc, lambda m: m.update(loss_milli=1))


def unknown_key(pvc):
    edit_manifest(pvc, lambda m: m.update(comment="hi"))


def path_traversal(pvc):
    (pvc / "outside.safetensors").write_bytes(shard(pvc).read_bytes())
    edit_manifest(pvc, lambda m: m["shards"][1].update(file="../../outside.safetensors"))


def symlinked_shard(pvc):
    target = pvc / "elsewhere.safetensors"
    shutil.copy(shard(pvc), target)  # the very same good bytes, behind a link
    shard(pvc).unlink()
    shard(pvc).symlink_to(target)


def no_manifest(pvc):
    (newest(pvc) / "manifest.json").unlink()


CORRUPTIONS = [truncate, flip_a_byte, delete_a_shard, add_a_shard, edit_a_size, edit_the_loss, unknown_key,
               path_traversal, symlinked_shard, no_manifest]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
@pytest.mark.torchrun
def test_the_only_checkpoint_corrupt_exits_2_naming_verify_and_touches_nothing(tmp_path, killed_at, corrupt):
    pvc = tmp_path / "pvc"
    shutil.copytree(killed_at[2], pvc, symlinks=True)
    corrupt(pvc)
    before = snapshot(pvc)
    result = trainjob("run", "--pvc", pvc, "--world-size", 2, "--rank-timeout", 5)
    assert result.returncode == 2, result.stderr
    assert "trainjob verify" in result.stderr and "starting over would discard" in result.stderr
    assert snapshot(pvc) == before  # never started over, never overwrote, never "fixed" it
    assert trainjob("verify", "--pvc", pvc).returncode == 1


@pytest.mark.parametrize("corrupt", [flip_a_byte, add_a_shard, path_traversal],
                         ids=lambda f: f.__name__)
@pytest.mark.torchrun
def test_a_corrupt_newest_falls_back_logs_the_rejection_and_ends_bit_identical(tmp_path, killed_at,
                                                                               clean_artifact, corrupt):
    pvc = tmp_path / "pvc"
    shutil.copytree(killed_at[4], pvc, symlinks=True)
    bad = newest(pvc).name
    corrupt(pvc)
    result = trainjob("run", "--pvc", pvc, "--world-size", 2, "--rank-timeout", 5)
    assert result.returncode == 0, result.stderr
    log = events(pvc / "log.jsonl")
    rejected = [d for e, d in log if e == "checkpoint_rejected"]
    assert len(rejected) == 1 and f"path=checkpoints/{bad}" in rejected[0]
    assert log[log.index(next(x for x in log if x[0] == "checkpoint_rejected")) + 1] == ("resumed", "from_step=2")
    assert (pvc / "checkpoints" / f"rejected-{bad}").is_dir()  # kept for inspection, out of the way
    assert (pvc / "artifacts/model-v1.json").read_bytes() == clean_artifact
    assert replay(pvc / "log.jsonl").illegal is None  # checkpoint_rejected is a note the table knows


@pytest.mark.torchrun
def test_a_forged_older_manifest_is_never_fallen_back_to(tmp_path, killed_at):
    """The newest shard damaged and the older checkpoint's manifest edited so that its two slices
    trade places (every shard and digest untouched, nothing vouching for an older manifest in
    checkpoint.json): the shards' headers say where each slice sits, so the forged one is refused
    too, and the run exits 2 with nothing published, rather than resuming other weights."""
    pvc = tmp_path / "pvc"
    shutil.copytree(killed_at[4], pvc, symlinks=True)
    older = pvc / "checkpoints/step-00000002-a0001-w002/manifest.json"
    m = json.loads(older.read_text())
    a, b = (s["holds"][0] for s in m["shards"])
    a["start"], b["start"] = b["start"], a["start"]
    older.write_text(json.dumps(m))
    flip_a_byte(pvc)
    before = snapshot(pvc)
    result = trainjob("run", "--pvc", pvc, "--world-size", 2, "--rank-timeout", 5)
    assert result.returncode == 2, result.stderr
    assert "step-00000002-a0001-w002" in result.stderr and "its header puts params" in result.stderr
    assert snapshot(pvc) == before and not (pvc / "artifacts").exists()
    verdicts = trainjob("verify", "--pvc", pvc).stdout
    assert "corrupt   checkpoint checkpoints/step-00000002-a0001-w002" in verdicts
