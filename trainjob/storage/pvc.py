"""Everything trainjob keeps on the PVC, behind one narrow class.

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
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import attrs

from .digest import Sha256Pipe
from ..errors import InputError, PvcBusy, one_line, open_regular, os_errors, read_regular
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


@attrs.frozen
class Written:
    """What ``atomic_write`` put on disk: its size and sha256, computed from the bytes as written."""

    size: int
    sha256: str


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


def _write_fsynced(path: Path, data: bytes | Iterable[bytes | memoryview]) -> Written:
    """Create or truncate ``path``, write ``data``, fsync; raises OSError. The bytes are hashed as
    written, never by reading the file back (on a helper thread, overlapped with writing the next
    chunk: see digest.py). ``data`` may be an iterable of chunks, so a large shard streams through
    in bounded memory.

    Each large chunk's writeback to the disk is started as soon as it is written, so the disk
    works while the next chunks are written and hashed, and the final fsync finds little left to
    do (docs/benchmarks.md: without this, a save was the hash's time plus the disk's, in series).
    Starting writeback is only a hint; the fsync is what makes the bytes durable and reports
    errors, so a failed hint is ignored.
    """
    digest, size = Sha256Pipe(), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            view = memoryview(chunk).cast("B")
            digest.update(view)  # hashed on a helper thread while this chunk is written
            offset, size = size, size + len(view)
            while view:
                view = view[os.write(fd, view):]
            if _start_writeback is not None and size - offset >= _WRITEBACK_MIN:
                _start_writeback(fd, offset, size - offset)
        sha256 = digest.hexdigest()  # waits for the last chunk's hash
        os.fsync(fd)
    finally:
        os.close(fd)
    return Written(size=size, sha256=sha256)


def atomic_write(path: Path, data: bytes | Iterable[bytes | memoryview]) -> Written:
    """Replace ``path`` with ``data`` so that a crash at any instant leaves old or new bytes.

    tmp file in the same directory -> write -> fsync -> rename over ``path`` -> fsync the
    directory (so the rename itself survives power loss, not only a killed process).
    Storage errors become TryAgainLater: the previous file is untouched, a relaunch is safe.
    """
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with os_errors(path, "write failed"):
        try:
            written = _write_fsynced(tmp, data)
            os.replace(tmp, path)
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


def write_staged(path: Path, data: bytes | Iterable[bytes | memoryview]) -> Written:
    """Write a file inside a staging directory that ``commit_dir`` will publish: write -> fsync.

    No tmp name and no rename of its own: the staging directory is the tmp, and its rename in
    ``commit_dir`` (after fsyncing the directory) is the atomic step for every file in it. A
    crash mid-write leaves a partial file in a directory nobody reads and cleanup deletes.
    This halves the fsyncs and renames of a checkpoint (docs/benchmarks.md).
    """
    with os_errors(path, "write failed"):
        try:
            return _write_fsynced(path, data)
        except OSError:
            _discard(path)
            raise


def commit_dir(staging: Path, final: Path) -> None:
    """Publish the fully written directory ``staging`` as ``final``, all or nothing.

    Every file in ``staging`` was written with ``write_staged`` or ``atomic_write`` (so it is
    fsynced); this fsyncs the directory itself, renames it into place and fsyncs the parent, so after a crash at any
    instant ``final`` either does not exist or is complete. Never replaces an existing ``final``
    (``rename`` would silently replace an empty directory): callers hold the PVC lock, so the
    check cannot race another trainjob writer.
    """
    if os.path.lexists(final):
        raise InputError(f"{final}: already exists; trainjob never overwrites a committed checkpoint")
    with os_errors(final, "commit failed"):
        fsync_dir(staging)
        os.rename(staging, final)
        fsync_dir(final.parent)


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
    with os_errors(path, "unusable path", InputError):
        try:
            os.lstat(path)
        except FileNotFoundError:
            pass


def refuse_symlink(path: Path) -> None:
    if path.is_symlink():
        raise InputError(f"{path}: is a symlink; trainjob does not follow links on the PVC")


class Pvc:
    """The PVC directory: strict readers and atomic writers for each file it holds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_path = root / "state.json"
        self.attempts_path = root / "attempts"
        self.checkpoint_path = root / "checkpoint.json"
        self.artifacts = root / "artifacts"

    def create(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise InputError(f"{self.root}: --pvc must be a directory, but this is a file")
        with os_errors(self.root, "cannot create PVC directory", InputError):
            make_dir(self.root)
        # Refuse links before anything is written, not when the run reaches them.
        for entry in (self.state_path, self.attempts_path, self.checkpoint_path, self.artifacts):
            refuse_symlink(entry)

    @contextmanager
    def lock(self, rank: int = 0) -> Iterator[None]:
        """Hold the PVC's exclusive lock (rank 0) or rank ``rank``'s own lock.

        A second holder gets PvcBusy at once, never waits. Rank 0's lock is the job lock that
        ``run``, ``reshard`` and the coordinator take; each other rank has its own, so two
        rank-1 processes cannot both write rank 1's shards.

        A lock on a file binds to its inode, not its name: unlink ``.lock`` under a running job
        and a second run would create and lock a new one. So rank 0 also locks the PVC
        directory itself, which no unlink can replace (where the file system cannot lock a
        directory, e.g. NFS, the file lock stands alone), and every lock checks, once held,
        that its path still names the inode it locked.
        """
        path = self.root / (".lock" if rank == 0 else f".lock.rank-{rank:05d}")

        def busy(locked: Path) -> PvcBusy:
            holder = lock_holder(locked)
            return PvcBusy(f"{self.root}: another trainjob run holds this PVC: {holder}; relaunch when it has exited"
                           if rank == 0 else
                           f"{path}: another rank-{rank} process of this job holds this rank's lock: {holder}; "
                           "relaunch when it has exited")
        refuse_symlink(path)
        with ExitStack() as held:  # closing a descriptor releases its lock, also on a kill
            with os_errors(path, "cannot open the lock file", InputError):
                fd = open_regular(path, os.O_RDWR | os.O_CREAT, mode=FILE_MODE)  # O_CLOEXEC
            _hold(held, fd)
            with os_errors(path, "cannot lock"):
                if not _flock(fd) or os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                    raise busy(path)  # or replaced between our open and our lock: whoever did holds it
            if rank == 0:
                with os_errors(self.root, "cannot lock the PVC directory"):
                    directory = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    _hold(held, directory)
                    if _flock(directory, unsupported_ok=True) is False:
                        raise busy(self.root)  # .lock was unlinked under a run that still holds the PVC
            yield

    def remove_stray_tmp(self) -> list[Path]:
        """Delete tmp files left by writers that were killed mid-write (call under the lock)."""
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
        with os_errors(path, "cannot read", InputError):
            try:
                return read_regular(path, limit)
            except FileNotFoundError:
                return None

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

    # --- writers -------------------------------------------------------------------------------

    def write_state(self, state: RunState) -> None:
        atomic_write(self.state_path, (dumps(state) + "\n").encode())

    def write_attempts(self, attempts: int) -> None:
        atomic_write(self.attempts_path, f"{attempts}\n".encode())

    def write_checkpoint(self, pointer: CheckpointPointer) -> None:
        atomic_write(self.checkpoint_path, (dumps(pointer) + "\n").encode())

    def write_artifact(self, name: str, data: bytes | Iterable[bytes | memoryview]) -> str:
        """Publish an artifact; identical bytes already there are fine, different ones are not.
        ``data`` may be a stream of chunks (a sharded model's, gathered tensor by tensor): it is
        then consumed whole either way, and compared by sha256."""
        refuse_symlink(self.artifacts)
        path = self.artifacts / name
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
            with os_errors(self.artifacts, "cannot create"):
                make_dir(self.artifacts)
            return atomic_write(path, data).sha256
        return hashlib.sha256(existing).hexdigest()
