"""Durable writing: a file or a directory of files put on disk so that a crash at any instant
leaves the old bytes or the new ones, never a mixture.

``atomic_write`` replaces one file (tmp file, write, fsync, rename, fsync the directory);
``write_staged`` writes a file into a staging directory that ``commit_dir`` then publishes with one
rename. Writeback starts as the bytes are written, and independent fsyncs run at once
on one small pool (``settle`` waits for them), which ext4 commits in one journal transaction.
Also here: the directories writes go to (``make_dir``, and ``missing_dirs``/``remove_empty`` to take
back what a refused launch made) and the checks on a path before anything is written there
(``check_path``, ``refuse_symlink``). Nothing here knows what a file means.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

from .backend import Url, Written
from .digest import Sha256Pipe
from ..errors import InputError, os_errors

FILE_MODE = 0o644  # never group- or world-writable, whatever the umask
DIR_MODE = 0o755


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Independent fsyncs run at once on this pool (``settle``): each durability point still
# happens, but ext4 commits concurrent ones in one journal transaction, where one after the
# other each paid a commit of its own (docs/checkpoints.md, "Durability points").
_sync_pool: ThreadPoolExecutor | None = None


def _syncer() -> ThreadPoolExecutor:
    global _sync_pool
    if _sync_pool is None:
        _sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fsync")
    return _sync_pool


def _forget_pool_in_child() -> None:
    global _sync_pool
    _sync_pool = None  # its threads do not exist in a forked child; their work is the parent's


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _fsync_and_close(fd: int, path: Path) -> None:
    try:
        with os_errors(path, "write failed"):  # named as a synchronous write's failure would be
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_parent(path: Path) -> None:
    """fsync the directory holding ``path`` (on the pool), failing as ``atomic_write`` would."""
    with os_errors(path, "write failed"):
        fsync_dir(path.parent)


def _fsync_soon(fd: int, path: Path) -> Future[None]:
    """Start fsyncing ``fd`` (the file at ``path``) on the pool, which closes it afterwards."""
    return _syncer().submit(_fsync_and_close, fd, path)


def settle(futures: Iterable[Future[None]]) -> None:
    """Wait for every one of ``futures`` (fsyncs on the pool), then raise the first error, if
    any: nothing that depends on them may start before all have returned, failed or not."""
    errors = []
    for future in futures:
        try:
            future.result()
        except Exception as exc:  # not only OSError: even a bug's error waits for the others
            errors.append(exc)
    if errors:
        raise errors[0]


def _writeback_starter() -> Callable[[int, int, int], object] | None:
    """Linux's sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE), or None without it.

    Python's os module does not expose it, hence ctypes (which releases the GIL for the call).
    """
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: function(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


_start_writeback = _writeback_starter()
_WRITEBACK_MIN = 256 << 10  # bytes written before their writeback starts; a smaller file is left to the one fsync


def _write_fsynced(path: Path, data: bytes | Iterable[bytes | memoryview], fsync: bool = True,
                   later: list[Future[None]] | None = None, parts: list[int] | None = None) -> Written:
    """Create or truncate ``path``, write ``data``, fsync (unless ``fsync`` is False); raises OSError.
    The bytes are hashed as written, never by reading the file back (on a helper thread, overlapped with the writes and
    the fsync: see digest.py). ``data`` may be an iterable of chunks, so a large shard streams through
    in bounded memory.

    The writeback of what was written is started as soon as 256 KiB or more of it have gone in
    (one large chunk, or several small ones: a sharded model's shard is many tensors of under a
    MiB), so the disk works while the next chunks are written and hashed, and the final fsync
    finds little left to do (docs/benchmarks.md: without this, a save was the hash's time plus the
    disk's, in series).
    Starting writeback is only a hint; the fsync is what makes the bytes durable and reports
    errors, so a failed hint is ignored.

    With ``later`` (a list), the fsync is started on the fsync pool as soon as the last byte is
    written and its future appended, instead of waited for here: whoever publishes the file
    (``commit_dir``) waits for it, beside the fsyncs it does not depend on.
    """
    # Every chunk is a view of bytes nobody changes until this returns (a trainer's arrays during
    # a save, async's staging copy, a record's bytes), so the writer never waits for the hash: it
    # writes every chunk and fsyncs while the helper thread hashes behind it (digest.py).
    digest, size, started = Sha256Pipe(buffers_kept=True, parts=parts), 0, 0  # started: bytes sent to the disk
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            view = memoryview(chunk).cast("B")
            digest.update(view)
            size += len(view)
            while view:
                view = view[os.write(fd, view):]
            if _start_writeback is not None and size - started >= _WRITEBACK_MIN:
                _start_writeback(fd, started, size - started)
                started = size
        if later is not None:
            later.append(_fsync_soon(fd, path))
            fd = -1  # the pool's now: it closes the descriptor after the fsync
        elif fsync:
            os.fsync(fd)
        sha256 = digest.hexdigest()  # the hash of the last chunks, overlapped with the fsync
    finally:
        if fd >= 0:
            os.close(fd)
    return Written(size=size, sha256=sha256, parts=tuple(digest.parts()))


def atomic_write(path: Path, data: bytes | Iterable[bytes | memoryview], durable: bool = True,
                 ready: Callable[[], object] | None = None, later: list[Future[None]] | None = None) -> Written:
    """Replace ``path`` with ``data`` so that a crash at any instant leaves old or new bytes.

    tmp file in the same directory -> write -> fsync -> rename over ``path`` -> fsync the
    directory (so the rename itself survives power loss, not only a killed process).
    Storage errors become TryAgainLater: the previous file is untouched, a relaunch is safe.

    ``durable=False`` skips both fsyncs and keeps the rename: for a message between the live
    processes of one launch (a rank's receipt), which a reader must see whole but no crash ever
    needs back, because what it announces is made durable by the commit that consumes it.

    ``ready``: called between the tmp file's fsync and its rename, to wait for a durability point
    the new bytes must not be visible before (the commit of the checkpoint a pointer names), so
    that point's fsync and this file's run at the same time instead of one after the other.

    ``later`` (a list): the directory's fsync after the rename is started on the fsync pool and
    its future appended, not waited for: whoever must not go on before the rename is durable
    waits for it (the pointer's: rotation's rename, ``LocalBackend.settle``), and the fsyncs
    that need not wait for it (the ``checkpointed`` line's) run beside it.
    """
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with os_errors(path, "write failed"):
        try:
            written = _write_fsynced(tmp, data, durable)
            if ready is not None:
                ready()
            os.replace(tmp, path)
            if durable and later is not None:
                later.append(_syncer().submit(_fsync_parent, path))
            elif durable:
                fsync_dir(path.parent)
        except OSError:
            _discard(tmp)
            raise
    return written


def _discard(path: Path) -> None:
    """Remove a partial file, best effort: on a read-only or failing disk the unlink fails too,
    and that must not hide the error being handled (the next run's cleanup removes it)."""
    with suppress(OSError):
        path.unlink(missing_ok=True)


def write_staged(path: Path, data: bytes | Iterable[bytes | memoryview],
                 later: list[Future[None]] | None = None, parts: list[int] | None = None) -> Written:
    """Write a file inside a staging directory that ``commit_dir`` will publish: write -> fsync.

    No tmp name and no rename of its own: the staging directory is the tmp, and its rename in
    ``commit_dir`` (after fsyncing the directory) is the atomic step for every file in it. A
    crash mid-write leaves a partial file in a directory nobody reads and cleanup deletes.
    This halves the fsyncs and renames of a checkpoint (docs/benchmarks.md).

    ``later``: leave the fsync running on the pool and append its future, for the process that
    commits this directory to pass to ``commit_dir`` (which waits for it before the rename).
    """
    with os_errors(path, "write failed"):
        try:
            return _write_fsynced(path, data, later=later, parts=parts)
        except OSError:
            _discard(path)
            raise


def commit_dir(staging: Path, final: Path, unsynced: Iterable[Future[None]] = (),
               then: Callable[[Callable[[], object]], object] | None = None,
               others: Callable[[], object] | None = None) -> None:
    """Publish the fully written directory ``staging`` as ``final``, all or nothing.

    Every file in ``staging`` was written with ``write_staged`` or ``atomic_write``: fsynced, or
    its fsync still running, its future in ``unsynced``. This fsyncs the directory itself beside
    those, waits for all of them, renames it into place and fsyncs the parent, so after a crash
    at any instant ``final`` either does not exist or is complete. Never replaces an existing
    ``final`` (``rename`` would silently replace an empty directory): callers hold the PVC lock,
    so the check cannot race another trainjob writer.

    ``then(ready)``: more work that needs the publication durable (the pointer's
    ``atomic_write``), run while the parent's fsync runs; ``ready`` waits for that fsync, and
    ``then`` calls it before anything of its own becomes visible.

    ``others()``: waits until the files other processes wrote into ``staging`` are durable (the
    other ranks' shards, fsynced by them), called while this process's fsyncs run: theirs are
    part of the same round, and the rename waits for all of it.
    """
    if os.path.lexists(final):
        raise InputError(f"{final}: already exists; trainjob never overwrites a committed checkpoint")
    with os_errors(final, "commit failed"):
        # The files' and the directory's fsyncs guard one thing, the rename below: none needs
        # another before it, so they run at once and ext4 commits them in one journal transaction.
        running = [*unsynced, _syncer().submit(fsync_dir, staging)]
        try:
            if others is not None:
                others()
        finally:
            settle(running)
        os.rename(staging, final)
        parent = _syncer().submit(fsync_dir, final.parent)
        try:
            if then is not None:
                then(parent.result)
        finally:
            settle([parent])


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and each of its parents that does not exist yet, deepest first: what ``make_dir``
    would create, so that a launch refused before it wrote anything can take them away again
    (``remove_empty``)."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    return missing


def remove_empty(dirs: list[Path]) -> None:
    """Remove each of ``dirs`` (deepest first) that is an empty directory; one that is not (written
    to after all, or in use by another process) stays, and so do its parents."""
    for directory in dirs:
        with suppress(OSError):
            os.rmdir(directory)


def make_dir(path: Path) -> None:
    """mkdir -p with DIR_MODE for every directory created (Path.mkdir leaves parents 0o777 & ~umask)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            # Another rank (or racer) made it between our look and our mkdir: fine if it is a
            # directory. os.path.isdir follows no link here: make_dir's callers refuse symlinks.
            if not directory.is_dir():
                raise


def check_path(path: Path) -> None:
    """A path given to trainjob, before any work: a name the OS refuses (a component longer than
    the file system allows, a file where a directory should be, a symlink loop) is bad input, one
    line and exit 2, not an OSError from deep inside. A path that does not exist yet is fine."""
    if isinstance(path, Url):
        return  # a bucket location: ``backend.location`` checked its form, ``Pvc.create`` probes it
    with os_errors(path, "unusable path", InputError):
        try:
            os.lstat(path)
        except FileNotFoundError:
            pass


def refuse_symlink(path: Path) -> None:
    if path.is_symlink():
        raise InputError(f"{path}: is a symlink; trainjob does not follow links on the PVC")
