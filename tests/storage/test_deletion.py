"""Deferred deletion: a rotated checkpoint is hidden at once and freed later (storage/deletion.py)."""

from __future__ import annotations

from trainjob.storage import deletion
from trainjob.storage.local import LocalBackend


def test_rotation_hides_a_checkpoint_at_once_and_deletes_it_on_the_helper_thread_once_started(tmp_path, monkeypatch):
    """``delete_tree(wait=False)``: the name is gone when the call returns (a relaunch never sees a
    half-deleted checkpoint); the bytes are not touched until ``start_deletions`` (the engine calls
    it once the checkpoint's log line is durable), then go on the helper thread; a free-space check
    starts and waits for them, so the space a rotation frees counts before the next checkpoint is
    refused for room."""
    import threading

    backend = LocalBackend(tmp_path)
    (tmp_path / "checkpoints" / "step-1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-1" / "shard").write_bytes(b"x" * 4096)
    release, started = threading.Event(), threading.Event()
    real = deletion._rmtree

    def held(trash):
        started.set()
        assert release.wait(10)
        return real(trash)

    monkeypatch.setattr(deletion, "_rmtree", held)
    assert backend.delete_tree("checkpoints/step-1", wait=False)
    assert backend.list("checkpoints") == [".trash-step-1"]
    assert not started.wait(0.2)  # hidden, not being deleted: nothing started it
    backend.start_deletions()
    assert started.wait(10)  # the deletion runs while the caller has already returned
    freed = threading.Thread(target=backend.free_space)
    freed.start()
    freed.join(0.2)
    assert freed.is_alive()  # free_space waits for the pending deletion
    release.set()
    freed.join(10)
    deletion.settle_deletions()
    assert backend.list("checkpoints") == []
