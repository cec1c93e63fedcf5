"""The local backend: a PVC that is a directory (``LocalBackend``), the reference implementation of
``backend.Backend``, built from the rooms beside it: durable writing (``durable.py``), the locks
(``locks.py``) and deferred deletion (``deletion.py``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from .backend import Data, Written
from .deletion import TMP, TRASH, delete_tree, settle_deletions, start_deletions
from .durable import atomic_write, commit_dir, fsync_dir, make_dir, settle, write_staged
from .locks import lock_dir, no_trace
from ..errors import InputError, os_errors, read_regular


class LocalBackend:
    """A PVC directory: atomic renames, fsync, flock. The reference implementation:
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
        return delete_tree(self.path(prefix), wait)  # deletion.py: hidden by a rename, freed later

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
        settle(pending)

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

    def lock(self, rank: int = 0, tidy: Callable[[], bool] = no_trace) -> AbstractContextManager[None]:
        return lock_dir(self.root, rank, tidy)
