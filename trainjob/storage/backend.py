"""Where a job's files live: the one narrow interface every backend implements, and the PVC's.

``Backend`` is the *whole* surface the parts above use to keep bytes (as torchtitan's checkpointer
keeps its storage behind four methods): read, replace, create-if-absent, list, delete, a staged
write and its one-step publish, the single-writer lock. Keys are relative POSIX names
(``state.json``, ``checkpoints/step-.../manifest.json``), the same on every backend, so a bucket
prefix holds the same layout as a PVC directory. Retention, discovery and what a file means stay
above, written once (``checkpoint/store.py``, ``checkpoint/plan.py``, ``pvc.Pvc``).

Two implementations: ``local.LocalBackend`` (a directory, through ``durable.py``'s atomic writers and
``locks.py``'s flock: exactly what trainjob did before there was an interface) and ``s3.S3Backend`` (a bucket,
through conditional writes; imported only when a ``--pvc s3://`` asks for it). ``pvc.open_backend``
picks one for a ``--pvc``.

Must not decide anything, and must not import an object-store client at module level
(tests/test_startup.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, runtime_checkable

import attrs

from ..errors import UsageError

Data = bytes | Iterable[bytes | memoryview]


class ByteSource(Protocol):
    """A stored object read front to back once, or by offsets (what ``reading`` yields on a
    store that has no local file for it): ``size`` is -1 when the object is absent."""

    name: str
    size: int

    def readinto(self, view: memoryview) -> int:
        """Fill the start of ``view``; the count, 0 at the end."""

    def read_at(self, view: memoryview, offset: int) -> int:
        """Fill the start of ``view`` from byte ``offset``, without moving where ``readinto``
        reads (a slice read by offset); the count, 0 at the end."""

    def close(self) -> None: ...


@attrs.frozen
class Written:
    """What a write put in storage: its size and sha256, computed from the bytes as written;
    written in ``parts`` (``write_part``), the sha256 is their root and ``parts`` each one's
    (storage/digest.py)."""

    size: int
    sha256: str
    parts: tuple[str, ...] = ()


SCHEME = "s3://"


class Url(str):
    """A bucket location (``s3://BUCKET/PREFIX/...``) that joins like a Path (``url / "state.json"``),
    so messages name bucket objects as they name PVC files. It has no file-system methods: nothing
    can mistake it for a local path."""

    def __truediv__(self, other: str) -> Url:
        return Url(f"{self.rstrip('/')}/{other}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Url:
        return Url(self.rstrip("/").rsplit("/", 1)[0])


def location(text: str) -> Path | Url:
    """A ``--pvc`` (or ``--log``) argument: ``s3://BUCKET[/PREFIX]`` or a local path. A malformed
    URL is a UsageError naming what is wrong (exit 2)."""
    if not text:  # pathlib reads "" as ".", the current directory: never what was meant
        raise UsageError("an empty path is no storage location; name a directory (. for the current one)")
    if not text.startswith(SCHEME):
        if "://" in text:
            raise UsageError(f"{text}: only s3:// URLs and local paths are storage locations")
        return Path(text)
    bucket, _, prefix = text[len(SCHEME):].partition("/")
    if not bucket or not _bucket_name_ok(bucket):
        raise UsageError(f"{text}: not a valid S3 bucket name {bucket!r} (3-63 characters: a-z, 0-9, '.', '-')")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UsageError(f"{text}: a prefix may not hold '.' or '..'")
    return Url(SCHEME + "/".join([bucket, *parts]))


def as_location(value: object, name: str) -> Path | Url:
    """What ``trainjob.Run(pvc=...)`` (``name``) accepts: a Url, an ``s3://`` string, or a path;
    anything else is a UsageError naming it."""
    if isinstance(value, Url):
        return value
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise UsageError(f"{name}= must be a directory's path or an s3:// URL, got {value!r:.60}")
    return location(text)


def _bucket_name_ok(name: str) -> bool:
    return 3 <= len(name) <= 63 and all(c.islower() or c.isdigit() or c in ".-" for c in name) \
        and name[0].isalnum() and name[-1].isalnum()


@runtime_checkable
class Backend(Protocol):
    """The whole storage surface trainjob uses. ``key``: a relative POSIX name. Every method is
    called by the process holding ``lock()`` unless it says "(any process)"."""

    root: Path | Url  # how messages name the root; ``root / key`` names a key

    def read(self, key: str, limit: int) -> bytes | None:
        """(any process) The bytes, None when absent; InputError when not a readable object."""

    def write(self, key: str, data: Data, durable: bool = True) -> Written:
        """Replace (or create) ``key``: a reader sees the old bytes or the new, never a mixture.
        Two writers cannot both win: the loser gets PvcBusy (on a PVC the lock rules it out).
        ``durable=False``: a message the live ranks of one launch exchange (a receipt), which
        need not survive a power loss (on a PVC: no fsync; a bucket's write is durable anyway)."""

    def create(self, key: str, data: bytes) -> Written | None:
        """Create ``key`` only if absent, in one step; None (nothing written) when it exists."""

    def size(self, key: str) -> int | None:
        """(any process) The size in bytes, None when absent."""

    def list(self, prefix: str) -> list[str]:
        """(any process) Sorted names one level below ``prefix`` (files and 'directories')."""

    def delete_tree(self, prefix: str, wait: bool = True) -> bool:
        """Delete ``prefix`` and all below it so that it never looks whole while half-deleted;
        False when it could not (the next start's cleanup tries again). ``wait=False``: once it
        no longer looks whole, the rest may be left for ``start_deletions`` (then in the background)."""

    def start_deletions(self) -> None:
        """Start what ``delete_tree(wait=False)`` left to delete (rotation's, once the checkpoint
        that caused it is announced durably); a no-op where nothing was left."""

    def move(self, src: str, dest: str) -> bool:
        """Move a tree aside (``rejected-...``), keeping its bytes; False when ``src`` is absent."""

    def stage(self, final: str, staging: str) -> str:
        """The prefix a new tree's parts are written under, before ``publish`` makes ``final`` visible."""

    def write_part(self, key: str, data: Data, sync: bool = True, parts: list[int] | None = None) -> Written:
        """Write one part of a staged tree (no atomic step of its own: ``publish`` is that step).
        ``parts``: hash the bytes in parts of these lengths (``Written.parts``). ``sync=False``: the part need not be durable when this returns: this process publishes
        the tree itself (``publish`` waits for it, beside its own durability points), or calls
        ``settle`` before it says the part is durable."""

    def publish(self, staged: str, final: str, marker: str, data: bytes,
                then: tuple[str, bytes] | None = None, others: Callable[[], object] | None = None) -> Written:
        """Write ``marker`` (the manifest) last and make ``final`` visible in one step; never over a
        published ``final`` (InputError). ``then``: a record ``(key, bytes)`` replaced as ``write``
        would, visible only once the publication is durable (the pointer naming it); the last
        durability point of its replacement may still be running when this returns (``settle``).
        ``others()``: waits until the parts other processes wrote are durable; called before the
        step that makes ``final`` visible."""

    def settle(self) -> None:
        """Wait for every durability point this process left running (parts written with
        ``sync=False`` and not published; on a PVC, the fsync that makes ``publish``'s ``then``
        record's rename durable) and raise the first error; a no-op where nothing was left."""

    def published(self, prefix: str, marker: str) -> list[str]:
        """(any process) The names below ``prefix`` that a ``publish`` made visible (or that sit
        where only a publish could put them), sorted."""

    def unpublished(self, prefix: str, marker: str) -> list[str]:
        """Names below ``prefix`` that killed writers left: staged, half-deleted."""

    def reading(self, key: str) -> AbstractContextManager[Path | ByteSource]:
        """(any process) ``key``'s bytes for the shard reader: a local file, or a ByteSource."""

    def free_space(self) -> int | None:
        """Bytes free for the next checkpoint; None when the store has no such limit."""

    def lock(self, rank: int = 0, tidy: Callable[[], bool] = ...) -> AbstractContextManager[None]:
        """Hold the single-writer lock (rank 0's job lock, or rank ``rank``'s own); PvcBusy at once
        when another holder has it. When ``tidy()`` is true as it is let go (a launch refused
        before it wrote anything), a lock object this holder created is removed, not left behind."""
