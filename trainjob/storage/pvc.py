"""``Pvc``: the files trainjob keeps on a PVC (a directory, or a bucket prefix), each with a strict
reader and an atomic writer, over any ``backend.Backend`` (``open_backend`` picks one for a ``--pvc``).

Layout of a PVC directory (all paths relative to it):

    .lock                      flock'd by rank 0 (the one coordinator allowed to write here), with
                               the PVC directory itself (which no unlink can take away); nothing
                               is written in it (the kernel names a holder: ``locks.lock_holder``)
    .lock.rank-NNNNN           flock'd by rank N >= 1 (two rank-1 processes must not both run)
    state.json                 RunState: the machine's last state and the attempt number
    attempts                   the attempt counter as a plain integer (the lab's contract)
    checkpoint.json            pointer to the newest committed checkpoint (``.step`` and more)
    checkpoints/               one directory per committed checkpoint (see checkpoint/store.py)
    ranks/                     session.json (every launch); the files ranks coordinate through when no
                               launcher store is there (see ranks/peers.py, ranks/connect.py)
    artifacts/model-vN.json    the model published by attempt N (.safetensors: any trainer but linear)
    log.jsonl                  the decision log, unless ``--log`` points elsewhere

Every file write goes through ``durable.atomic_write``, except the files of a checkpoint being
built, which go through ``durable.write_staged`` into a staging directory that
``durable.commit_dir`` then publishes with one rename: either way a reader (or a relaunch after
SIGKILL) sees the old state or the new state, never a mixture. Readers are strict: a file that
exists but does not parse is an InputError, never mistaken for "no file". This module makes no
decisions.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from .backend import Backend, Url
from .durable import make_dir, refuse_symlink
from .local import LocalBackend
from .locks import no_trace
from ..errors import InputError, importing, os_errors
from ..records import CheckpointPointer, RunState, dumps, load

T = TypeVar("T")

MAX_RECORD = 16 << 20  # a JSON record (state, pointer, manifest, receipt): far above any trainjob writes
MAX_FILE = 4 << 30  # an artifact: read whole to check its sha256; a bound, not a size anyone needs
_TMP = re.compile(r".+\.tmp\.\d+")


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

    def lock(self, rank: int = 0, tidy: Callable[[], bool] = no_trace) -> AbstractContextManager[None]:
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
