"""The PVC's locks and who holds them.

``lock_dir`` takes rank 0's exclusive lock on a PVC directory (the ``.lock`` file and the directory
itself) or rank N's own ``.lock.rank-NNNNN``, with flock, never waiting: a second holder gets
PvcBusy at once, naming the holder the kernel reports (``lock_holder``, from /proc/locks). The lock
descriptors are closed in every forked child, so no child keeps a dead parent's PVC locked.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from .durable import FILE_MODE, refuse_symlink
from ..errors import InputError, PvcBusy, one_line, open_regular, os_errors


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


def no_trace() -> bool:
    return False


@contextmanager
def lock_dir(root: Path, rank: int = 0, tidy: Callable[[], bool] = no_trace) -> Iterator[None]:
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
