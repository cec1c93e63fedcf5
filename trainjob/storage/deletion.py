"""Deferred deletion: a directory taken off the PVC by one rename, its files freed later.

``delete_tree`` renames a directory to ``.trash-*`` (so a half-deleted checkpoint never looks
committed), then deletes it, or with ``wait=False`` (rotation) only hides it: ``start_deletions``
frees the hidden trees one at a time on a helper thread, and ``settle_deletions`` waits for them.
A kill before or mid-delete leaves a ``.trash-`` directory for the next start's cleanup.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

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



def delete_tree(path: Path, wait: bool = True) -> bool:
    """Rename ``path`` to .trash-* first (atomic: a half-deleted checkpoint never looks committed),
    then delete. ``wait=False`` (rotation) only hides it: the delete runs on a helper thread once
    ``start_deletions`` is called (the engine calls it once the ``checkpointed`` line is
    durable): freeing a large file's blocks costs more than writing a small checkpoint
    (docs/benchmarks.md), and nothing waits for it but the next free-space check. A kill
    before or mid-delete leaves a ``.trash-`` directory for the next start's cleanup, as a
    kill mid-rmtree always did."""
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


def _forget_helpers_in_child() -> None:
    global _pool
    _pool = None  # the thread does not exist in a forked child; its work is the parent's
    _deleting.clear()
    _hidden.clear()


os.register_at_fork(after_in_child=_forget_helpers_in_child)
