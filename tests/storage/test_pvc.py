"""The PVC's one atomic writer, its lock and its strict readers."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import fcntl
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainjob.storage import pvc
from trainjob.errors import InputError, PvcBusy, TryAgainLater
from trainjob.storage.pvc import Pvc, atomic_write, commit_dir, make_dir, write_staged


def record_fsyncs_and_renames(monkeypatch) -> list[str]:
    calls: list[str] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        calls.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def rename(real):
        def call(src, dst):
            calls.append(f"rename {os.path.basename(src)}")
            real(src, dst)
        return call

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", rename(real_replace))
    monkeypatch.setattr(os, "rename", rename(real_rename))
    return calls


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    calls = record_fsyncs_and_renames(monkeypatch)
    atomic_write(tmp_path / "f", b"new")
    assert calls == ["fsync file", f"rename f.tmp.{os.getpid()}", "fsync dir"]
    assert (tmp_path / "f").read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["f"]


def test_a_staged_directory_is_fsynced_file_by_file_then_as_a_whole_before_its_one_rename(tmp_path, monkeypatch):
    staging, final = tmp_path / ".tmp-x", tmp_path / "x"
    staging.mkdir()
    calls = record_fsyncs_and_renames(monkeypatch)
    written = write_staged(staging / "a", [b"he", b"llo"])
    write_staged(staging / "b", b"!")
    commit_dir(staging, final)
    assert calls == ["fsync file", "fsync file", "fsync dir", "rename .tmp-x", "fsync dir"]
    assert written.size == 5 and written.sha256 == hashlib.sha256(b"hello").hexdigest()
    assert sorted(os.listdir(final)) == ["a", "b"] and not staging.exists()


def test_writeback_of_each_large_chunk_starts_as_soon_as_it_is_written(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(pvc, "_start_writeback", lambda fd, offset, nbytes: started.append((offset, nbytes)))
    mib = 1 << 20
    chunks = [b"a" * mib, b"b" * 10, b"c" * (2 * mib)]
    written = write_staged(tmp_path / "shard", chunks)
    assert started == [(0, mib), (mib + 10, 2 * mib)]  # the 10-byte chunk is left to the fsync
    assert (tmp_path / "shard").read_bytes() == b"".join(chunks)
    assert written.sha256 == hashlib.sha256(b"".join(chunks)).hexdigest()
    started.clear()
    atomic_write(tmp_path / "state.json", b"{}")
    assert started == []


def test_the_writeback_hint_is_available_on_linux():
    if not sys.platform.startswith("linux"):
        pytest.skip("sync_file_range is Linux's")
    assert pvc._start_writeback is not None


def test_a_failed_staged_write_leaves_no_partial_file(tmp_path, monkeypatch):
    real_write = os.write
    writes = []

    def full_on_second(fd, data):
        writes.append(len(data))
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_on_second)
    with pytest.raises(TryAgainLater, match="No space left"):
        write_staged(tmp_path / "shard", [b"first", b"second"])
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_old_bytes_and_leaves_no_tmp(tmp_path, monkeypatch):
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(TryAgainLater, match="No space left"):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]


def test_written_files_are_not_group_or_world_writable(tmp_path):
    old = os.umask(0)
    try:
        atomic_write(tmp_path / "f", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) & 0o022 == 0


def test_second_lock_holder_is_told_to_relaunch(tmp_path):
    store = Pvc(tmp_path)
    with store.lock():
        with pytest.raises(PvcBusy, match="another trainjob run"):
            with Pvc(tmp_path).lock():
                pass
    with store.lock():  # released on exit
        pass


def test_lock_is_released_when_the_holder_dies(tmp_path):
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.close(fd)
    with Pvc(tmp_path).lock():
        pass


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



def test_make_dir_tolerates_a_racer_creating_the_same_directory(tmp_path, monkeypatch):
    real_mkdir = os.mkdir

    def racer_first(path, mode=0o777):
        real_mkdir(path, mode)  # the other rank wins the race...
        real_mkdir(path, mode)  # ...so ours finds it there

    monkeypatch.setattr(os, "mkdir", racer_first)
    make_dir(tmp_path / "a" / "pvc")
    assert (tmp_path / "a" / "pvc").is_dir()


def test_a_failed_cleanup_does_not_hide_the_retryable_write_error(tmp_path, monkeypatch):
    # ext4 remounted read-only after a disk error: the write fails, and so does removing its tmp.
    def read_only(*_args, **_kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(pvc.os, "fsync", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(TryAgainLater, match="write failed: Read-only file system") as caught:
        atomic_write(tmp_path / "state.json", b"{}")
    assert caught.value.__cause__.errno == errno.EROFS


# --- issue 31: a lock no forked child keeps, and a busy lock that names its holder -------------

def test_a_busy_lock_names_its_holder_pid_host_and_since_when(tmp_path):
    with Pvc(tmp_path).lock():
        with pytest.raises(PvcBusy) as busy:
            with Pvc(tmp_path).lock():
                pass
    text = str(busy.value)
    assert f"pid {os.getpid()} on {socket.gethostname()} (" in text and "running since 20" in text, text
    assert "\n" not in text and text.endswith("; relaunch when it has exited")
    with Pvc(tmp_path).lock(1):
        with pytest.raises(PvcBusy, match=f"rank-1 process .* pid {os.getpid()} on "):
            with Pvc(tmp_path).lock(1):
                pass


def test_proc_locks_names_the_granted_holder_not_a_waiter():
    device = os.makedev(0xfe, 0)
    text = ("1: POSIX  ADVISORY  WRITE 700 08:01:55 0 EOF\n"
            "2: FLOCK  ADVISORY  WRITE 15064 fe:00:2155453 0 EOF\n"
            "2: -> FLOCK  ADVISORY  WRITE 999 fe:00:2155453 0 EOF\n")
    assert pvc.holder_of(text, device, 2155453) == 15064
    assert pvc.holder_of(text, device, 55) is None  # another device's inode 55


def test_lock_descriptors_are_close_on_exec(tmp_path):
    with Pvc(tmp_path).lock():
        held = [fd for fd in pvc._HELD]
        assert len(held) == 2 and all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in held)
    assert not pvc._HELD


HOLDER = '''
import multiprocessing, sys, time
from pathlib import Path
from trainjob.storage.pvc import Pvc

class Slow:
    def __len__(self): return 100
    def __getitem__(self, i): time.sleep(120); return i

(pvc := Pvc(Path(sys.argv[1]))).create()
with pvc.lock():
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    child.start()
    pids = [child.pid]
    if sys.argv[2] == "dataloader":
        from torch.utils.data import DataLoader
        workers = iter(DataLoader(Slow(), num_workers=2, multiprocessing_context="fork"))
        pids += [w.pid for w in workers._workers]
    print(*pids, flush=True)
    time.sleep(120)
'''


@pytest.mark.process
@pytest.mark.parametrize("children", ["fork", "dataloader"])
def test_a_sigkilled_holders_forked_children_do_not_keep_the_pvc_locked(tmp_path, children):
    """A multiprocessing fork, and DataLoader(num_workers=2) workers busy in a slow item: the
    holder is SIGKILLed, and the lock is free at once while its children live on."""
    if children == "dataloader":
        pytest.importorskip("torch")
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(tmp_path / "pvc"), children],
                              stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in holder.stdout.readline().split()]
    try:
        assert len(pids) == (3 if children == "dataloader" else 1), pids
        # A child closes its copies in Python's after-fork hook, which runs once the child is
        # scheduled: on a loaded machine that can be after the parent printed its pid.
        locked = {str(tmp_path / "pvc"), str(tmp_path / "pvc" / ".lock")}
        deadline = time.monotonic() + 30
        while any(open_paths(pid) & locked for pid in pids):
            assert time.monotonic() < deadline, "a forked child still holds the PVC's lock descriptors"
            time.sleep(0.05)
        holder.kill()
        holder.wait(30)
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)  # the children still run
        with Pvc(tmp_path / "pvc").lock():
            pass
    finally:
        holder.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def open_paths(pid: int) -> set[str]:
    """What the process's file descriptors point at."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            found.add(os.readlink(fd))
    return found


STALE = '''
import ctypes, os, sys, time
from pathlib import Path
from trainjob.storage.pvc import Pvc

(pvc := Pvc(Path(sys.argv[1]))).create()
with pvc.lock():
    child = ctypes.CDLL(None).fork()  # fork() from C, as a native library may: no Python at-fork hook runs
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    time.sleep(120)
'''


@pytest.mark.process
def test_a_lock_kept_by_a_child_forked_outside_python_names_the_holder_that_is_gone(tmp_path):
    script = tmp_path / "stale.py"
    script.write_text(STALE)
    holder = subprocess.Popen([sys.executable, str(script), str(tmp_path / "pvc")], stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        holder.kill()
        holder.wait(30)
        with pytest.raises(PvcBusy, match=f"pid {holder.pid} on .*, which has exited: a process it forked"):
            with Pvc(tmp_path / "pvc").lock():
                pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_rotation_hides_a_checkpoint_at_once_and_deletes_it_on_the_helper_thread_once_started(tmp_path, monkeypatch):
    """``delete_tree(wait=False)``: the name is gone when the call returns (a relaunch never sees a
    half-deleted checkpoint); the bytes are not touched until ``start_deletions`` (the engine calls
    it once the checkpoint's log line is durable), then go on the helper thread; a free-space check
    starts and waits for them, so the space a rotation frees counts before the next checkpoint is
    refused for room."""
    import threading

    backend = pvc.LocalBackend(tmp_path)
    (tmp_path / "checkpoints" / "step-1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-1" / "shard").write_bytes(b"x" * 4096)
    release, started = threading.Event(), threading.Event()
    real = pvc._rmtree

    def held(trash):
        started.set()
        assert release.wait(10)
        return real(trash)

    monkeypatch.setattr(pvc, "_rmtree", held)
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
    pvc.settle_deletions()
    assert backend.list("checkpoints") == []


@pytest.mark.parametrize("rank", [0, 2])
def test_a_tidy_release_takes_away_only_the_lock_file_it_created(tmp_path, rank):
    """A refused launch (``tidy`` true) leaves the PVC as it found it: its own new lock file
    goes, one that was there before stays, and an untidy release keeps what it made."""
    name = ".lock" if rank == 0 else f".lock.rank-{rank:05d}"
    with Pvc(tmp_path).lock(rank, tidy=lambda: True):
        assert (tmp_path / name).is_file()
    assert list(tmp_path.iterdir()) == []
    with Pvc(tmp_path).lock(rank, tidy=lambda: False):
        pass
    inode = (tmp_path / name).stat().st_ino
    with Pvc(tmp_path).lock(rank, tidy=lambda: True):
        pass
    assert [p.name for p in tmp_path.iterdir()] == [name] and (tmp_path / name).stat().st_ino == inode
