"""sha256 of a stream of buffers, hashed on a helper thread while the caller does the I/O.

Writing a shard and hashing it are both about one core's worth of work each (sha256 runs at
roughly 1.5 GB/s per core; copying into the page cache is as fast or faster). Done in series on
one thread, a save runs at about half the speed of a raw write. ``Sha256Pipe`` overlaps them:
``update(buf)`` waits for the previous buffer's hash, then hands ``buf`` to a helper thread and
returns at once, so the caller writes (or reads) the next chunk while this one is hashed.
hashlib releases the GIL for buffers over 2 KiB, so the two run in parallel when a second core
is free (on a host whose other core is busy it is no slower than doing both in series:
docs/benchmarks.md).

The hash is still of the very bytes written or read: the caller passes the same buffer to
``update`` and to ``os.write``/``readv``, and must not modify it until the next ``update`` or
``hexdigest`` (a load's reader reuses two buffers in turn, so it gets this rule).

A writer whose buffers stay unchanged until ``hexdigest`` (views of arrays nobody mutates during
a save) says so (``Sha256Pipe(buffers_kept=True)``): then ``update`` never waits, the buffers
queue up and the helper hashes them in order while the writer writes them all and starts the
fsync. A small save is bound by the hash alone, not by the hash plus the fsync (sha256 runs
slower than the page cache takes bytes: docs/benchmarks.md).

A shard is hashed in *parts* (``Sha256Pipe(parts=[...])``: its header, then each tensor slice's
bytes): each part gets a sha256 of its own, and ``hexdigest`` is the shard's root, the sha256 of
the parts' digests in order (``root``). One pass over the bytes, as before; a reader that needs
one slice of a shard can then verify just that slice's bytes against its digest in the manifest,
and a reader of the whole file checks the root (checkpoint/store.py).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

_INLINE = 256 << 10  # below this, handing off to a thread costs more than it saves
_AHEAD = 256 << 20  # (buffers_kept) at most this many bytes wait for the hash
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:  # one hashing thread per concurrent stream (check_files runs several)
            _pool = ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1), thread_name_prefix="sha256")
        return _pool


def root(parts: list[str]) -> str:
    """The root of a stream hashed in parts: sha256 of the parts' raw digests, in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(p) for p in parts)).hexdigest()


class Sha256Pipe:
    """``parts``: the byte length of each consecutive part of the stream (see the module
    docstring); None hashes the stream whole."""

    def __init__(self, buffers_kept: bool = False, parts: list[int] | None = None) -> None:
        self._digest = hashlib.sha256()
        self._sizes = list(parts) if parts is not None else None
        self._parts = [hashlib.sha256() for _ in self._sizes] if self._sizes is not None else []
        self._part, self._left = 0, self._sizes[0] if self._sizes else 0
        self._pending: Future[None] | None = None
        self._kept = buffers_kept
        self._queue: deque[memoryview] = deque()  # (buffers_kept) not hashed yet, in order
        self._queued = 0  # their bytes
        self._changed = threading.Condition()

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _drain(self) -> None:
        while True:
            with self._changed:
                if not self._queue:
                    self._pending = None
                    return
                buf = self._queue[0]
            self._hash(buf)
            with self._changed:
                self._queue.popleft()
                self._queued -= len(buf)
                self._changed.notify_all()

    def update(self, buf: memoryview) -> None:
        if not self._kept:
            self._wait()  # in order: sha256 is sequential
            if len(buf) >= _INLINE:
                self._pending = _executor().submit(self._hash, buf)
            else:
                self._hash(buf)
            return
        with self._changed:
            # Bounded: a stream that makes its chunks (a sharded model's artifact, gathered
            # tensor by tensor) must not pile up more than _AHEAD bytes waiting for the hash.
            while self._queued > _AHEAD and self._pending is not None:
                self._changed.wait()
            self._queue.append(buf)
            self._queued += len(buf)
            if self._pending is None:
                self._pending = _executor().submit(self._drain)

    def _hash(self, buf: memoryview) -> None:
        if self._sizes is None:
            self._digest.update(buf)
            return
        while buf:
            while self._left == 0:  # an empty part (a 0-row slice) is hashed as empty: skip past it
                self._part += 1
                if self._part == len(self._sizes):  # more bytes than announced (a file that grew):
                    self._sizes.append(sys.maxsize)  # one more part, so the root cannot match
                    self._parts.append(hashlib.sha256())
                self._left = self._sizes[self._part]
            take = min(self._left, len(buf))
            self._parts[self._part].update(buf[:take])
            buf, self._left = buf[take:], self._left - take

    def parts(self) -> list[str]:
        """Each part's sha256 (after ``hexdigest``); a part the stream never reached hashes as
        what it got (the caller compares sizes separately)."""
        return [p.hexdigest() for p in self._parts]

    def hexdigest(self) -> str:
        if self._kept:
            with self._changed:
                pending = self._pending
            if pending is not None:
                pending.result()  # the drain ends once the queue is empty (or raises what failed)
        else:
            self._wait()
        return self._digest.hexdigest() if self._sizes is None else root(self.parts())
