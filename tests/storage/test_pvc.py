"""The PVC's files: strict readers, and writers that never overwrite what must not change
(storage/pvc.py)."""

from __future__ import annotations

import os

import pytest

from trainjob.errors import InputError
from trainjob.storage.pvc import Pvc


def test_corrupt_files_are_input_errors_not_absent(tmp_path):
    store = Pvc(tmp_path)
    assert store.read_checkpoint() is None and store.read_state() is None and store.read_attempts() == 0
    (tmp_path / "checkpoint.json").write_text('{"step": 4')
    with pytest.raises(InputError, match="checkpoint.json.*will not overwrite"):
        store.read_checkpoint()
    (tmp_path / "attempts").write_text("two")
    with pytest.raises(InputError, match="attempts"):
        store.read_attempts()


def test_symlinks_on_the_pvc_are_refused(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text('{"attempt":1,"step":1,"weights":[0,0,0],"bias":0,"loss_milli":0}')
    root = tmp_path / "pvc"
    root.mkdir()
    (root / "checkpoint.json").symlink_to(outside)
    with pytest.raises(InputError, match="symlink"):
        Pvc(root).read_checkpoint()


def test_artifact_is_never_overwritten_with_different_bytes(tmp_path):
    store = Pvc(tmp_path)
    store.write_artifact("model-v1.json", b"A")
    store.write_artifact("model-v1.json", b"A")  # identical: a relaunch after a kill may redo it
    with pytest.raises(InputError, match="refusing to overwrite"):
        store.write_artifact("model-v1.json", b"B")
    assert (tmp_path / "artifacts" / "model-v1.json").read_bytes() == b"A"


def test_stray_tmp_files_are_removed_and_nothing_else(tmp_path):
    store = Pvc(tmp_path)
    (tmp_path / "checkpoint.json.tmp.12345").write_text("half")
    (tmp_path / "checkpoint.json").write_text("{}")
    (tmp_path / "notes.tmp.txt").write_text("user file")
    removed = store.remove_stray_tmp()
    assert [p.name for p in removed] == ["checkpoint.json.tmp.12345"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.json", "notes.tmp.txt"]


def test_pvc_that_is_a_file_is_an_input_error(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(InputError, match="must be a directory"):
        Pvc(tmp_path / "f").create()
