"""Everything trainjob keeps on the PVC, behind one narrow class.

Layout of a PVC directory (all paths relative to it):

    .lock                      flock'd by the one run allowed to write here
    state.json                 RunState: the machine's last state and the attempt number
    attempts                   the attempt counter as a plain integer (the lab's contract)
    checkpoint.json            the newest checkpoint (step, weights, bias, loss_milli)
    artifacts/model-vN.json    the model published by attempt N
    log.jsonl                  the decision log, unless ``--log`` points elsewhere

Every write goes through ``atomic_write``: a reader (or a relaunch after SIGKILL) sees the old
bytes or the new bytes, never a mixture. Readers are strict: a file that exists but does not
parse is an InputError, never mistaken for "no file". This module makes no decisions.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from .errors import InputError, PvcBusy, TryAgainLater
from .records import Checkpoint, RunState, dumps, load

T = TypeVar("T")

FILE_MODE = 0o644  # never group- or world-writable, whatever the umask
DIR_MODE = 0o755
_TMP = re.compile(r".+\.tmp\.\d+")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash at any instant leaves old or new bytes.

    tmp file in the same directory -> write -> fsync -> rename over ``path`` -> fsync the
    directory (so the rename itself survives power loss, not only a killed process).
    Storage errors become TryAgainLater: the previous file is untouched, a relaunch is safe.
    """
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TryAgainLater(f"{path}: write failed: {exc.strerror or exc}") from None


def make_dir(path: Path) -> None:
    """mkdir -p with DIR_MODE for every directory created (Path.mkdir leaves parents 0o777 & ~umask)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        os.mkdir(directory, DIR_MODE)


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
        try:
            make_dir(self.root)
        except OSError as exc:
            raise InputError(f"{self.root}: cannot create PVC directory: {exc.strerror}") from None
        # Refuse links before anything is written, not when the run reaches them.
        for entry in (self.state_path, self.attempts_path, self.checkpoint_path, self.artifacts):
            refuse_symlink(entry)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the PVC's exclusive lock; a second writer gets PvcBusy at once, never waits."""
        path = self.root / ".lock"
        refuse_symlink(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            raise InputError(f"{path}: cannot open the PVC's lock file: {exc.strerror}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PvcBusy(
                    f"{self.root}: another trainjob run holds this PVC; relaunch when it has exited"
                ) from None
            yield
        finally:
            os.close(fd)  # closing releases the lock, also when the process is killed

    def remove_stray_tmp(self) -> list[Path]:
        """Delete tmp files left by writers that were killed mid-write (call under the lock)."""
        removed = []
        for directory in (self.root, self.artifacts):
            if directory.is_dir():
                for path in directory.iterdir():
                    if _TMP.fullmatch(path.name) and path.is_file():
                        path.unlink()
                        removed.append(path)
        return removed

    # --- readers: None when absent, InputError when present but wrong ------------------------

    def _read(self, path: Path) -> bytes | None:
        refuse_symlink(path)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise InputError(f"{path}: cannot read: {exc.strerror}") from None

    def _read_record(self, path: Path, cls: type[T]) -> T | None:
        raw = self._read(path)
        if raw is None:
            return None
        return load(raw, cls, where=f"{path} (fix or move it aside; trainjob will not overwrite it)")

    def read_state(self) -> RunState | None:
        return self._read_record(self.state_path, RunState)

    def read_checkpoint(self) -> Checkpoint | None:
        return self._read_record(self.checkpoint_path, Checkpoint)

    def read_attempts(self) -> int:
        raw = self._read(self.attempts_path)
        if raw is None:
            return 0
        text = raw.decode("ascii", errors="replace").strip()
        if not text.isdigit() or len(text) > 9:
            raise InputError(f"{self.attempts_path}: expected a small non-negative integer, got {text[:40]!r}")
        return int(text)

    def read_artifact(self, name: str) -> bytes:
        data = self._read(self.artifacts / name)
        if data is None:
            raise InputError(f"{self.artifacts / name}: missing, but state.json says the job completed")
        return data

    # --- writers -------------------------------------------------------------------------------

    def write_state(self, state: RunState) -> None:
        atomic_write(self.state_path, (dumps(state) + "\n").encode())

    def write_attempts(self, attempts: int) -> None:
        atomic_write(self.attempts_path, f"{attempts}\n".encode())

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        atomic_write(self.checkpoint_path, (dumps(checkpoint) + "\n").encode())

    def write_artifact(self, name: str, data: bytes) -> Path:
        """Publish an artifact; identical bytes already there are fine, different ones are not."""
        refuse_symlink(self.artifacts)
        path = self.artifacts / name
        existing = self._read(path)
        if existing is not None and existing != data:
            raise InputError(f"{path}: already exists with different bytes; refusing to overwrite it")
        if existing is None:
            try:
                make_dir(self.artifacts)
            except OSError as exc:
                raise TryAgainLater(f"{self.artifacts}: cannot create: {exc.strerror}") from None
            atomic_write(path, data)
        return path
