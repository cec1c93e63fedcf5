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
``hexdigest`` (the buffers here are views of arrays nobody mutates during a save, or distinct
regions of a load's destination).
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

_INLINE = 256 << 10  # below this, handing off to a thread costs more than it saves
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:  # one hashing thread per concurrent stream (check_files runs several)
            _pool = ThreadPoolExecutor(max_workers=max(4, os.cpu_count() or 1), thread_name_prefix="sha256")
        return _pool


class Sha256Pipe:
    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._pending: Future[None] | None = None

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def update(self, buf: memoryview) -> None:
        self._wait()  # in order: sha256 is sequential
        if len(buf) >= _INLINE:
            self._pending = _executor().submit(self._digest.update, buf)
        else:
            self._digest.update(buf)

    def hexdigest(self) -> str:
        self._wait()
        return self._digest.hexdigest()
