"""Everything trainjob keeps on the PVC, behind one narrow class (``Pvc``, over a ``backend.Backend``),
and the directory backend itself (``LocalBackend``: atomic writers, fsync, flock).

Layout of a PVC directory (all paths relative to it):

    .lock                      flock'd by rank 0 (the one coordinator allowed to write here), with
                               the PVC directory itself (which no unlink can take away); nothing
                               is written in it (the kernel names a holder: ``lock_holder``)
    .lock.rank-NNNNN           flock'd by rank N >= 1 (two rank-1 processes must not both run)
    state.json                 RunState: the machine's last state and the attempt number
    attempts                   the attempt counter as a plain integer (the lab's contract)
    checkpoint.json            pointer to the newest committed checkpoint (``.step`` and more)
    checkpoints/               one directory per committed checkpoint (see checkpoint/store.py)
    ranks/                     session.json (every launch); the files ranks coordinate through when no
                               launcher store is there (see ranks/peers.py, ranks/connect.py)
    artifacts/model-vN.json    the model published by attempt N (.safetensors: any trainer but linear)
    log.jsonl                  the decision log, unless ``--log`` points elsewhere

Every file write goes through ``atomic_write``, except the files of a checkpoint being built,
which go through ``write_staged`` into a staging directory that ``commit_dir`` then publishes
with one rename: either way a reader (or a relaunch after SIGKILL) sees the old state or the
new state, never a mixture. Readers are strict: a file that exists but does not parse is an
InputError, never mistaken for "no file". This module makes no decisions.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import fcntl
import hashlib
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from .backend import Backend, Data, Url, Written
from .digest import Sha256Pipe
from ..errors import InputError, PvcBusy, importing, one_line, open_regular, os_errors, read_regular
from ..records import CheckpointPointer, RunState, dumps, load

T = TypeVar("T")

FILE_MODE = 0o644  # never group- or world-writable, whatever the umask
MAX_RECORD = 16 << 20  # a JSON record (state, pointer, manifest, receipt): far above any trainjob writes
MAX_FILE = 4 << 30  # an artifact: read whole to check its sha256; a bound, not a size anyone needs
DIR_MODE = 0o755
_TMP = re.compile(r".+\.tmp\.\d+")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Independent fsyncs run at once on this pool (``_settle``): each durability point still
# happens, but ext4 commits concurrent ones in one journal transaction, where one after the
# other each paid a commit of its own (docs/checkpoints.md, "Durability points").
_sync_pool: ThreadPoolExecutor | None = None


def _syncer() -> ThreadPoolExecutor:
    global _sync_pool
    if _sync_pool is None:
        _sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fsync")
    return _sync_pool


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


def _settle(futures: Iterable[Future[None]]) -> None:
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
_WRITEBACK_MIN = 1 << 20  # small files are left to the one fsync


def _write_fsynced(path: Path, data: bytes | Iterable[bytes | memoryview], fsync: bool = True,
                   later: list[Future[None]] | None = None, parts: list[int] | None = None) -> Written:
    """Create or truncate ``path``, write ``data``, fsync (unless ``fsync`` is False); raises OSError.
    The bytes are hashed as written, never by reading the file back (on a helper thread, overlapped with the writes and
    the fsync: see digest.py). ``data`` may be an iterable of chunks, so a large shard streams through
    in bounded memory.

    Each large chunk's writeback to the disk is started as soon as it is written, so the disk
    works while the next chunks are written and hashed, and the final fsync finds little left to
    do (docs/benchmarks.md: without this, a save was the hash's time plus the disk's, in series).
    Starting writeback is only a hint; the fsync is what makes the bytes durable and reports
    errors, so a failed hint is ignored.

    With ``later`` (a list), the fsync is started on the fsync pool as soon as the last byte is
    written and its future appended, instead of waited for here: whoever publishes the file
    (``commit_dir``) waits for it, beside the fsyncs it does not depend on.
    """
    # Every chunk is a view of bytes nobody changes until this returns (a trainer's arrays during
    # a save, async's staging copy, a record's bytes), so the writer never waits for the hash: it
    # writes every chunk and fsyncs while the helper thread hashes behind it (digest.py).
    digest, size = Sha256Pipe(buffers_kept=True, parts=parts), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            view = memoryview(chunk).cast("B")
            digest.update(view)
            offset, size = size, size + len(view)
            while view:
                view = view[os.write(fd, view):]
            if _start_writeback is not None and size - offset >= _WRITEBACK_MIN:
                _start_writeback(fd, offset, size - offset)
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
            _settle(running)
        os.rename(staging, final)
        parent = _syncer().submit(fsync_dir, final.parent)
        try:
            if then is not None:
                then(parent.result)
        finally:
            _settle([parent])


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


def _flock(fd: int, unsupported_ok: bool = False) -> bool | None:
    """Take an exclusive flock without waiting: True, False when another holder has it, None
    when the file system cannot lock this kind of file and ``unsupported_ok`` (NFS emulates flock
    with byte-range locks, which a directory cannot take)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if unsupported_ok and exc.errno in (errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOLCK):
            return None
        raise
    return True


# The lock descriptors this process holds. A forked child (a DataLoader worker, a
# multiprocessing "fork" process) gets copies of them, and a flock belongs to the open file
# description the copies share: were the parent SIGKILLed, the children would hold the PVC for
# as long as they live. So every child closes its copies at once (``os.register_at_fork``).
# POSIX record locks (fcntl F_SETLK) do stay with the process, but two Runs of one process would
# not exclude each other, and closing any descriptor of the file, even one opened only to read
# it, would drop the lock; OFD locks follow the description as flock does. The descriptors are
# O_CLOEXEC as well, for a child that execs (subprocess) without forking Python's way. A fork
# made outside Python (a C library calling fork()) runs no hook: ``lock_holder`` then names the
# holder that is gone.
_HELD: set[int] = set()


def _close_in_child() -> None:
    for fd in _HELD:
        with suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _hold(stack: ExitStack, fd: int) -> None:
    """Close ``fd`` (and so release its lock) when ``stack`` closes; no forked child keeps it."""
    _HELD.add(fd)

    def release() -> None:
        _HELD.discard(fd)
        os.close(fd)
    stack.callback(release)


def holder_of(proc_locks: str, device: int, inode: int) -> int | None:
    """The pid ``/proc/locks`` names as holding a granted lock on the file (``device``,
    ``inode``), or None. A line: ``1: FLOCK  ADVISORY  WRITE 15064 fe:00:2155453 0 EOF``; a
    waiter's line has ``->`` after its number, and is skipped."""
    wanted = f"{os.major(device):02x}:{os.minor(device):02x}:{inode}"
    for line in proc_locks.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == wanted and fields[4].isdigit():
            return int(fields[4])
    return None


def describe_process(pid: int, host: str) -> str:
    """``pid N on HOST (COMMAND, running since TIME)``, read from /proc; a pid with no /proc entry
    has exited, so a process it forked (outside Python) still holds the file open."""
    try:
        stat_fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return (f"pid {pid} on {host}, which has exited: a process it forked still holds the lock file open "
                "(stop that process, or wait for it to end)")
    started = boot + int(stat_fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat, 20th after ")"
    since = datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"pid {pid} on {host} ({one_line(command)[:80] or '?'}, running since {since})"


def lock_holder(path: Path) -> str:
    """Who holds the lock on ``path``, as the kernel says (Linux's /proc/locks: this host's
    holders only; a holder on another host of a network file system is not listed)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        pid = holder_of(Path("/proc/locks").read_text(), st.st_dev, st.st_ino)
    except OSError:
        pid = None
    if pid is None or pid == 0:  # 0: a holder in another pid namespace (another container)
        return "its holder is not visible from here (another host or container)"
    return describe_process(pid, socket.gethostname())


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


def _no_trace() -> bool:
    return False


@contextmanager
def lock_dir(root: Path, rank: int = 0, tidy: Callable[[], bool] = _no_trace) -> Iterator[None]:
    """Hold the PVC's exclusive lock (rank 0) or rank ``rank``'s own lock.

    A second holder gets PvcBusy at once, never waits. Rank 0's lock is the job lock that
    ``run``, ``reshard`` and the coordinator take; each other rank has its own, so two
    rank-1 processes cannot both write rank 1's shards.

    A lock on a file binds to its inode, not its name: unlink ``.lock`` under a running job
    and a second run would create and lock a new one. So rank 0 also locks the PVC
    directory itself, which no unlink can replace (where the file system cannot lock a
    directory, e.g. NFS, the file lock stands alone), and every lock checks, once held,
    that its path still names the inode it locked.

    ``tidy``, asked as the lock is let go: when true (a launch refused before it wrote anything),
    a lock file this holder created is unlinked first, while still locked, so the PVC is left as
    it was found. Safe while held: a process that opened the file meanwhile finds, once it has the
    lock, that the path no longer names its inode, and says so (PvcBusy or TryAgainLater, 75).
    """
    path = root / (".lock" if rank == 0 else f".lock.rank-{rank:05d}")

    def busy(locked: Path) -> PvcBusy:
        holder = lock_holder(locked)
        return PvcBusy(f"{root}: another trainjob run holds this PVC: {holder}; relaunch when it has exited"
                       if rank == 0 else
                       f"{path}: another rank-{rank} process of this job holds this rank's lock: {holder}; "
                       "relaunch when it has exited")
    refuse_symlink(path)
    with ExitStack() as held:  # closing a descriptor releases its lock, also on a kill
        with os_errors(path, "cannot open the lock file", InputError):
            try:  # O_EXCL first, only to know whether this holder made the file (``tidy``)
                fd, created = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=FILE_MODE), True
            except FileExistsError:
                fd, created = open_regular(path, os.O_RDWR | os.O_CREAT, mode=FILE_MODE), False  # O_CLOEXEC
        _hold(held, fd)
        with os_errors(path, "cannot lock"):
            if not _flock(fd) or os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                raise busy(path)  # or replaced between our open and our lock: whoever did holds it
        if rank == 0:
            with os_errors(root, "cannot lock the PVC directory"):
                directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                _hold(held, directory)
                if _flock(directory, unsupported_ok=True) is False:
                    raise busy(root)  # .lock was unlinked under a run that still holds the PVC
        if created:  # runs first when ``held`` closes: while every lock above is still held
            held.callback(lambda: tidy() and path.unlink(missing_ok=True))
        yield


TMP, TRASH = ".tmp-", ".trash-"  # a checkpoint being built, or being deleted (checkpoint/store.py)


def _rmtree(trash: Path) -> bool:
    for _ in range(5):  # a stale rank may still be adding a file; it fails and gives up soon
        try:
            shutil.rmtree(trash)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)
    return False  # left for the next start's cleanup


# Rotation's deletions, one at a time in order, on a thread of their own. It is not a daemon:
# the interpreter finishes them before the process exits (a SIGKILL leaves the rest to cleanup).
# A deletion hidden by rotation waits in ``_hidden`` until ``start_deletions``: the engine starts
# them once the checkpoint's ``checkpointed`` line is durable, so that freeing the old blocks
# (journal work of its own) never lands in that line's fsync (docs/checkpoints.md).
_pool: ThreadPoolExecutor | None = None
_deleting: list[Future[bool]] = []
_hidden: list[Path] = []


def _deleter() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trash")
    return _pool


def start_deletions() -> None:
    """Start deleting, on the helper thread, every tree ``delete_tree(wait=False)`` hid."""
    _deleting[:] = [f for f in _deleting if not f.done()]  # bounded by what is still pending
    while _hidden:
        _deleting.append(_deleter().submit(_rmtree, _hidden.pop(0)))


def settle_deletions() -> None:
    """Start every hidden deletion and wait for all of them (``delete_tree(wait=False)``)."""
    start_deletions()
    while _deleting:
        _deleting.pop(0).result()


def _forget_helpers_in_child() -> None:
    global _pool, _sync_pool
    _pool = _sync_pool = None  # the threads do not exist in a forked child; their work is the parent's
    _deleting.clear()
    _hidden.clear()


os.register_at_fork(after_in_child=_forget_helpers_in_child)


class LocalBackend:
    """A PVC directory: atomic renames, fsync, flock (``pvc.py``). The reference implementation:
    every method is what trainjob did on a PVC before the interface existed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._unsynced: dict[str, list[Future[None]]] = {}  # staged key -> its parts' running fsyncs
        self._pending: list[Future[None]] = []  # what ``publish`` left running for ``settle``

    def path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def read(self, key: str, limit: int) -> bytes | None:
        path = self.path(key)
        with os_errors(path, "cannot read", InputError):
            try:
                return read_regular(path, limit)
            except FileNotFoundError:
                return None

    def write(self, key: str, data: Data, durable: bool = True) -> Written:
        return atomic_write(self.path(key), data, durable)

    def create(self, key: str, data: bytes) -> Written | None:
        # A hard link is create-if-absent in one step: it fails when the name exists.
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        with os_errors(path, "write failed"):
            written = write_staged(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return None
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(path.parent)
        return written

    def size(self, key: str) -> int | None:
        try:
            return os.lstat(self.path(key)).st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[str]:
        path = self.path(prefix)
        if path.is_symlink():
            raise InputError(f"{path}: is a symlink; trainjob does not follow links on the PVC")
        with os_errors(path, "cannot list", InputError):
            try:
                return sorted(os.listdir(path))
            except FileNotFoundError:
                return []

    def delete_tree(self, prefix: str, wait: bool = True) -> bool:
        """Rename to .trash-* first (atomic: a half-deleted checkpoint never looks committed), then
        delete. ``wait=False`` (rotation) only hides it: the delete runs on a helper thread once
        ``start_deletions`` is called (the engine calls it once the ``checkpointed`` line is
        durable): freeing a large file's blocks costs more than writing a small checkpoint
        (docs/benchmarks.md), and nothing waits for it but the next free-space check. A kill
        before or mid-delete leaves a ``.trash-`` directory for the next start's cleanup, as a
        kill mid-rmtree always did."""
        path = self.path(prefix)
        trash = path if path.name.startswith(TRASH) else path.with_name(f"{TRASH}{path.name.removeprefix(TMP)}")
        try:
            # No fsync after this rename: it hides a half-deleted directory from a relaunch after
            # SIGKILL, which needs none. After a power loss the directory may come back; journalling
            # filesystems keep the rename ahead of the deletes, and where one did not, the half-
            # deleted copy is older than the committed, fsynced checkpoint that caused its
            # rotation (a resume tries that first), and fails verification if it is ever reached.
            if trash != path:
                os.rename(path, trash)
        except OSError:
            return False  # left for the next start's cleanup
        if wait:
            return _rmtree(trash)
        _hidden.append(trash)
        return True

    def start_deletions(self) -> None:
        start_deletions()

    def move(self, src: str, dest: str) -> bool:
        path = self.path(src)
        with os_errors(path, "cannot set aside"):
            try:
                os.rename(path, self.path(dest))
                fsync_dir(self.path(dest).parent)
            except FileNotFoundError:
                return False
        return True

    def stage(self, final: str, staging: str) -> str:
        # No fsync here: the staging directory need not survive a power loss, and commit_dir
        # fsyncs it and its parent before the checkpoint counts.
        with os_errors(self.path(staging), "cannot create"):
            make_dir(self.path(staging))
        return staging

    def write_part(self, key: str, data: Data, sync: bool = True, parts: list[int] | None = None) -> Written:
        later = None if sync else self._unsynced.setdefault(key.rpartition("/")[0], [])
        return write_staged(self.path(key), data, later, parts)

    def publish(self, staged: str, final: str, marker: str, data: bytes,
                then: tuple[str, bytes] | None = None, others: Callable[[], object] | None = None) -> Written:
        unsynced = self._unsynced.pop(staged, [])  # parts written with sync=False: fsyncs still running
        written = write_staged(self.path(f"{staged}/{marker}"), data, unsynced)
        point = None if then is None else lambda ready: atomic_write(self.path(then[0]), then[1], ready=ready,
                                                                     later=self._pending)
        commit_dir(self.path(staged), self.path(final), unsynced, point, others)
        return written

    def settle(self) -> None:
        pending = [*self._pending, *(f for parts in self._unsynced.values() for f in parts)]
        self._pending, self._unsynced = [], {}
        _settle(pending)

    def published(self, prefix: str, marker: str) -> list[str]:
        # On a PVC only commit_dir's rename puts a checkpoint's name in place: every name there was
        # published (one with a missing marker is damage, which verification reports).
        return self.list(prefix)

    def unpublished(self, prefix: str, marker: str) -> list[str]:
        return [name for name in self.list(prefix) if name.startswith((TMP, TRASH))]

    @contextmanager
    def reading(self, key: str) -> Iterator[Path]:
        yield self.path(key)

    def free_space(self) -> int | None:
        settle_deletions()  # a rotation's blocks count as free once they are
        root = self.path("checkpoints")
        with os_errors(root, "cannot check free space"):
            return shutil.disk_usage(root if root.is_dir() else self.root).free

    def lock(self, rank: int = 0, tidy: Callable[[], bool] = _no_trace) -> AbstractContextManager[None]:
        return lock_dir(self.root, rank, tidy)


def open_backend(root: Path | Url) -> Backend:
    """The backend for a ``--pvc``: a bucket for ``s3://``, else the directory."""
    if isinstance(root, Url):
        with importing("the S3 backend"):
            from .s3 import S3Backend  # only here: a local run never imports an object-store client
        return S3Backend(root)
    return LocalBackend(Path(root))


def record_bytes(record: object) -> bytes:
    """A record (state, pointer, manifest) as its file holds it: one line of JSON."""
    return (dumps(record) + "\n").encode()


class Pvc:
    """The PVC (a directory, or a bucket prefix): strict readers and atomic writers for each file
    it holds, all through one ``backend.Backend``. What each file means is decided above."""

    def __init__(self, root: Path | str, backend: Backend | None = None) -> None:
        self.root: Path = root if isinstance(root, Url) else Path(root)  # a Url joins like a Path
        self.backend = backend if backend is not None else open_backend(self.root)
        self.local = not isinstance(self.root, Url)
        self.state_path = self.root / "state.json"
        self.attempts_path = self.root / "attempts"
        self.checkpoint_path = self.root / "checkpoint.json"
        self.artifacts = self.root / "artifacts"

    def key(self, path: Path | str) -> str:
        """``path`` (under ``root``) as the backend's key."""
        if self.local:  # not by slicing: a root of "." vanishes from the paths joined to it
            return Path(path).relative_to(self.root).as_posix()
        return str(path)[len(str(self.root)):].lstrip("/")

    def create(self) -> None:
        if not self.local:
            self.backend.create_root()  # type: ignore[attr-defined]  # probes the bucket (s3.py)
            return
        if self.root.exists() and not self.root.is_dir():
            raise InputError(f"{self.root}: --pvc must be a directory, but this is a file")
        with os_errors(self.root, "cannot create PVC directory", InputError):
            make_dir(self.root)
        # Refuse links before anything is written, not when the run reaches them.
        for entry in (self.state_path, self.attempts_path, self.checkpoint_path, self.artifacts):
            refuse_symlink(entry)

    def lock(self, rank: int = 0, tidy: Callable[[], bool] = _no_trace) -> AbstractContextManager[None]:
        """Hold the PVC's exclusive lock (rank 0) or rank ``rank``'s own lock (``lock_dir`` on a
        directory, a lease on a bucket: ``s3.py``). A second holder gets PvcBusy at once.
        ``tidy()`` true when it is let go: the lock file (or lease) this holder created goes too."""
        return self.backend.lock(rank, tidy)

    def remove_stray_tmp(self) -> list[Path]:
        """Delete tmp files left by writers that were killed mid-write (call under the lock)."""
        if not self.local:
            return []  # a bucket's objects appear whole or not at all: no tmp files
        removed = []
        ranks = self.root / "ranks"
        generations = sorted(p for p in ranks.iterdir() if p.is_dir() and not p.is_symlink()) if ranks.is_dir() else []
        for directory in (self.root, self.artifacts, ranks, *generations):
            if directory.is_dir():
                for path in directory.iterdir():
                    if _TMP.fullmatch(path.name) and path.is_file():
                        path.unlink()
                        removed.append(path)
        return removed

    # --- readers: None when absent, InputError when present but wrong ------------------------

    def read_bytes(self, path: Path, limit: int = MAX_FILE) -> bytes | None:
        """The file's bytes if it exists; a symlink, FIFO, device or a file over ``limit`` bytes
        is an InputError, found without reading it (``errors.read_regular``)."""
        return self.backend.read(self.key(path), limit)

    def read_record(self, path: Path, cls: type[T]) -> T | None:
        raw = self.read_bytes(path, MAX_RECORD)
        if raw is None:
            return None
        return load(raw, cls, where=f"{path} (fix or move it aside; trainjob will not overwrite it)")

    def read_state(self) -> RunState | None:
        return self.read_record(self.state_path, RunState)

    def read_checkpoint(self) -> CheckpointPointer | None:
        """The pointer ``checkpoint.json``; the checkpoint itself is read by checkpoint/store.py."""
        return self.read_record(self.checkpoint_path, CheckpointPointer)

    def read_attempts(self) -> int:
        raw = self.read_bytes(self.attempts_path)
        if raw is None:
            return 0
        text = raw.decode("ascii", errors="replace").strip()
        if not text.isdigit() or len(text) > 9:
            raise InputError(f"{self.attempts_path}: expected a small non-negative integer, got {text[:40]!r}")
        return int(text)

    def read_artifact(self, name: str) -> bytes:
        data = self.read_bytes(self.artifacts / name)
        if data is None:
            raise InputError(f"{self.artifacts / name}: missing, but state.json says the job completed")
        return data

    def artifact_names(self) -> list[str]:
        """The names under ``artifacts/``."""
        return self.backend.list("artifacts")

    # --- writers -------------------------------------------------------------------------------

    def write_record(self, path: Path, record: object) -> None:
        self.backend.write(self.key(path), record_bytes(record))

    def write_state(self, state: RunState) -> None:
        self.write_record(self.state_path, state)

    def write_attempts(self, attempts: int) -> None:
        self.backend.write(self.key(self.attempts_path), f"{attempts}\n".encode())

    def write_checkpoint(self, pointer: CheckpointPointer) -> None:
        self.write_record(self.checkpoint_path, pointer)

    def write_artifact(self, name: str, data: bytes | Iterable[bytes | memoryview]) -> str:
        """Publish an artifact; identical bytes already there are fine, different ones are not.
        ``data`` may be a stream of chunks (a sharded model's, gathered tensor by tensor): it is
        then consumed whole either way, and compared by sha256."""
        path = self.artifacts / name
        if self.local:
            refuse_symlink(self.artifacts)
        existing = self.read_bytes(path)
        if existing is not None and not isinstance(data, bytes):
            digest = hashlib.sha256()
            for chunk in data:
                digest.update(chunk)
            if digest.hexdigest() != hashlib.sha256(existing).hexdigest():
                raise InputError(f"{path}: already exists with different bytes; refusing to overwrite it")
            return digest.hexdigest()
        if existing is not None and existing != data:
            raise InputError(f"{path}: already exists with different bytes; refusing to overwrite it")
        if existing is None:
            if self.local:
                with os_errors(self.artifacts, "cannot create"):
                    make_dir(self.artifacts)
            return self.backend.write(self.key(path), data).sha256
        return hashlib.sha256(existing).hexdigest()
