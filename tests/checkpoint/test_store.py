"""The checkpoint store in a real run: rotation bounds, the free-space check, cleanup, --keep.

In-process runs (``cli.main``) with a wrapped commit, so every commit is observed as it happens.
"""

from __future__ import annotations

import shutil
from collections import namedtuple

import numpy as np
import pytest

from conftest import events, snapshot, trainjob
from trainjob import cli
from trainjob.checkpoint import store as checkpoints
from trainjob.storage import pvc as pvc_module
from trainjob.checkpoint.plan import Ref
from trainjob.views.history import replay
from trainjob.storage.pvc import Pvc
from trainjob.records import MANIFEST_SCHEMA, Manifest


def committed(pvc):
    return sorted(p.name for p in (pvc / "checkpoints").iterdir() if Ref.parse(p.name))


@pytest.mark.parametrize("keep", [1, 3])
def test_rotation_never_exceeds_k_plus_one_and_never_loses_the_newest(tmp_path, monkeypatch, keep):
    pvc, seen = tmp_path / "pvc", []
    real_commit = pvc_module.commit_dir

    def observed(staging, final):  # at every commit: K committed at most, plus this one in flight
        on_disk = [p.name for p in (pvc / "checkpoints").iterdir()]
        seen.append(len([n for n in on_disk if Ref.parse(n) or n.startswith(".tmp-")]))
        real_commit(staging, final)
        assert final.name == committed(pvc)[-1]  # the newest is the one just committed

    monkeypatch.setattr(pvc_module, "commit_dir", observed)
    assert cli.main(["run", "--pvc", str(pvc), "--ckpt-every", "1", "--keep", str(keep)]) == 0
    assert len(seen) == 10 and max(seen) == keep + 1
    assert committed(pvc) == [f"step-{s:08d}-a0001-w001" for s in range(11 - keep, 11)]


@pytest.mark.process
def test_keep_below_one_is_a_usage_error_saying_what_to_change(tmp_path):
    result = trainjob("run", "--pvc", tmp_path / "pvc", "--keep", 0)
    assert result.returncode == 2 and "--keep must be at least 1" in result.stderr


@pytest.mark.process
def test_a_save_that_cannot_fit_exits_75_and_keeps_every_checkpoint(tmp_path, monkeypatch, capsys):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    before = snapshot(pvc / "checkpoints")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(pvc_module.shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 100, 100))
    assert cli.main(["run", "--pvc", str(pvc)]) == 75
    assert "bytes free, but the next checkpoint needs about" in capsys.readouterr().err
    assert snapshot(pvc / "checkpoints") == before
    monkeypatch.undo()
    assert cli.main(["run", "--pvc", str(pvc)]) == 0  # with room again, it simply goes on


@pytest.mark.process
def test_abandoned_staging_and_trash_are_removed_on_the_next_start_and_logged(tmp_path):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    for name in (".tmp-step-00000006-a0001-w001.g00000000", ".trash-step-00000002-a0001-w001"):
        (pvc / "checkpoints" / name).mkdir()
        (pvc / "checkpoints" / name / "shard-00000-of-00001.safetensors").write_bytes(b"half")
    assert trainjob("run", "--pvc", pvc).returncode == 0
    assert not [p for p in (pvc / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    log = events(pvc / "log.jsonl")
    cleaned = [d for e, d in log if e == "cleaned_up"]
    assert cleaned == ["removed=2 paths=checkpoints/.tmp-step-00000006-a0001-w001.g00000000,"
                       "checkpoints/.trash-step-00000002-a0001-w001"]
    assert log[log.index(("cleaned_up", cleaned[0])) + 1] == ("resumed", "from_step=4")
    assert replay(pvc / "log.jsonl").illegal is None  # cleaned_up is a note the table knows


@pytest.mark.process
def test_an_old_format_checkpoint_json_is_refused_not_loaded(tmp_path):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    (pvc / "checkpoint.json").write_text('{"step":4,"weights":[0,0,0],"bias":0,"loss_milli":241}\n')
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and "checkpoint.json" in result.stderr and "weights" in result.stderr


@pytest.mark.process
def test_a_vanished_newest_checkpoint_is_not_mistaken_for_no_checkpoint(tmp_path):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 2).returncode == 75
    shutil.rmtree(pvc / "checkpoints")
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and "missing, but checkpoint.json names it" in result.stderr


# --- loading in place ------------------------------------------------------------------------------

def saved(tmp_path, state) -> tuple[checkpoints.Committer, Ref]:
    store = checkpoints.Committer(Pvc(tmp_path / "pvc"))
    store.pvc.create()
    ref = Ref(attempt=1, step=1, world_size=1)
    staging = store.create_staging(ref, 1)
    entry = store.write_shard(staging, 0, 1, 1, state)
    store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=1, attempt=1, world_size=1, loss_milli=0,
                                        tensors=checkpoints.tensor_specs(state), shards=[entry]))
    return store, ref


def test_a_resume_reads_into_the_trainers_own_arrays_where_they_fit(tmp_path):
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(3, dtype=np.float64)}
    store, ref = saved(tmp_path, state)
    fits = np.zeros((3, 4), dtype=np.float32)
    wrong_dtype = np.zeros(3, dtype=np.float32)
    loaded = store.load(ref, into={"w": fits, "b": wrong_dtype})
    assert loaded.tensors["w"] is fits and np.array_equal(fits, state["w"])  # read in place
    assert loaded.tensors["b"] is not wrong_dtype and np.array_equal(loaded.tensors["b"], state["b"])
    assert not wrong_dtype.any()  # an array that does not fit is left alone


def test_arrays_that_share_memory_are_never_both_read_into(tmp_path):
    state = {"a": np.ones(4, dtype=np.float32), "b": np.full(4, 2, dtype=np.float32)}
    store, ref = saved(tmp_path, state)
    shared = np.zeros(4, dtype=np.float32)  # a trainer that hands out one buffer under two names
    loaded = store.load(ref, into={"a": shared, "b": shared[:]})
    assert np.array_equal(loaded.tensors["a"], state["a"]) and np.array_equal(loaded.tensors["b"], state["b"])
    assert not np.may_share_memory(loaded.tensors["a"], loaded.tensors["b"])
