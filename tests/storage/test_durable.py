"""Durable writing: a crash at any instant leaves the old bytes or the new ones, and every fsync
and rename is where the protocol says (storage/durable.py)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import sys
from pathlib import Path

import pytest

from trainjob.errors import TryAgainLater
from trainjob.storage import durable
from trainjob.storage.durable import atomic_write, commit_dir, make_dir, write_staged


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
    monkeypatch.setattr(durable, "_start_writeback", lambda fd, offset, nbytes: started.append((offset, nbytes)))
    mib = 1 << 20
    chunks = [b"a" * mib, b"b" * 10, b"c" * (2 * mib)]
    written = write_staged(tmp_path / "shard", chunks)
    assert started == [(0, mib), (mib, 10 + 2 * mib)]  # every byte written is sent, in order
    assert (tmp_path / "shard").read_bytes() == b"".join(chunks)
    assert written.sha256 == hashlib.sha256(b"".join(chunks)).hexdigest()
    started.clear()
    atomic_write(tmp_path / "state.json", b"{}")
    assert started == []


def test_writeback_starts_for_a_stream_of_small_chunks_once_enough_of_them_are_written(tmp_path, monkeypatch):
    """A sharded model's shard is many tensors under 1 MiB each (a 4 MiB shard of an 8 MiB FSDP
    state: 0.7 MiB at most): their writeback must start while the rest is written, not all of it
    at the fsync (which then took 5 ms where a shard's writes took 4)."""
    started = []
    monkeypatch.setattr(durable, "_start_writeback", lambda fd, offset, nbytes: started.append((offset, nbytes)))
    kib = 1 << 10
    chunks = [bytes([i]) * (100 * kib) for i in range(8)] + [b"end"]
    write_staged(tmp_path / "shard", chunks)
    assert started == [(0, 300 * kib), (300 * kib, 300 * kib)]  # each 256 KiB or more as it is reached
    assert (tmp_path / "shard").read_bytes() == b"".join(chunks)  # the last 203 bytes: the fsync's


def test_the_writeback_hint_is_available_on_linux():
    if not sys.platform.startswith("linux"):
        pytest.skip("sync_file_range is Linux's")
    assert durable._start_writeback is not None


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

    monkeypatch.setattr(durable.os, "fsync", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(TryAgainLater, match="write failed: Read-only file system") as caught:
        atomic_write(tmp_path / "state.json", b"{}")
    assert caught.value.__cause__.errno == errno.EROFS
