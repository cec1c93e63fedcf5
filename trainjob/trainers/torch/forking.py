"""A process that ``os.fork()`` starts never inherits the interpreter's thread-list lock held.

CPython 3.11 before 3.11.10 (Debian 12's 3.11.2 too) has a fork bug, gh-112275: in the child of
``os.fork()``, the interpreter deletes the parent's other thread states under its thread-list lock
(``HEAD_LOCK``) *before* it re-creates that lock. If another thread held the lock at the instant of
the fork, the child blocks forever inside ``os.fork()``: one thread, in a futex, no Python frame
past the call. A thread takes that lock without the GIL when it makes its first thread state (a C
or C++ thread calling into Python), so the GIL does not keep the fork out, and on a loaded machine
the holder can be descheduled inside that short section. A DataLoader worker forked then never
starts: its rank waits forever for the worker's first batch, and the other ranks wait in a
collective until gloo's timeout (issue 56: a W=2 Lightning DDP run, twice under load).

The remedy takes the lock across the fork. Python's before-fork hook (``os.register_at_fork``)
registers three handlers with glibc (``__register_atfork``, what ``pthread_atfork`` calls):
*prepare*, which runs inside ``fork()`` after all of Python's own before-fork work, takes the lock,
waiting for any other holder (who needs neither the GIL nor anything else to let go); *parent* and
*child* release it, the child's before the interpreter's after-fork code wants it. The parent's
after-fork hook removes them again (``__cxa_finalize`` on this module's handle, as glibc does for a
library it unloads), so a fork that does not go through ``os.fork()`` (C code calling ``fork()``)
does not run them. One set is registered at a time: when two threads fork at once, the first fork
runs it and the second goes unguarded, as without this module. A child leaves the set it inherited
registered, bound to a lock it has replaced, where taking and releasing it is harmless
(``__cxa_finalize`` would take glibc's exit-handler lock, which a thread gone with the fork may
hold). The handlers are C functions bound to the lock (``functools.partial`` of the interpreter's
own lock functions): no Python bytecode runs between the prepare step and the parent's or the
child's release, where a switch of thread could hand the GIL to a thread that wants the lock;
automatic collection, which runs finalizers, is off from the before-fork hook to the after-fork
ones for the same reason.

Reaching the lock means reading the runtime's layout, so this is done only on the interpreters
that have the bug (``affected``), and only once ``_lock_slot`` has checked that layout. Anywhere
else ``install`` does nothing and says so.

Owns: taking that lock across ``os.fork()``. Must not: hold it anywhere else, or run Python code
while it holds it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
import threading

# CPython 3.11's _PyRuntimeState: five ints, then `_finalizing` (a pointer), then `interpreters`,
# whose first fields are the lock, `head` and `main`. _lock_slot checks the last two before trusting it.
_LOCK_OFFSET = 32

_api = ctypes.pythonapi  # a PyDLL: the interpreter's own functions, called with the GIL held
_handle = ctypes.c_char()  # its address names this module's handlers to glibc
_state = threading.Lock()  # guards the three below; never held across a fork
_registered = False  # a set of handlers is registered for the next fork
_collecting = False  # automatic collection was on when that set was registered
_kept: list[object] = []  # every handler glibc may still call in this process, kept alive


def affected(version: tuple[int, ...] = tuple(sys.version_info[:3]),
             implementation: str = sys.implementation.name) -> bool:
    """Does this interpreter's fork delete the other threads' states before it re-creates their
    lock? CPython 3.12 re-creates it first, and 3.11.10 took that fix."""
    return implementation == "cpython" and (3, 11) <= tuple(version[:3]) < (3, 11, 10)


def _lock_slot() -> ctypes.c_void_p | None:
    """Where the runtime keeps the thread-list lock (a forked child re-creates the lock, so it is
    read at each fork), or None if the layout is not the one expected: the two pointers after it
    must both be the main interpreter (one interpreter: the list's head is the main one)."""
    try:
        base = ctypes.addressof(ctypes.c_char.in_dll(_api, "_PyRuntime"))
        main_interpreter = _api.PyInterpreterState_Main
    except (AttributeError, ValueError):
        return None
    main_interpreter.restype = ctypes.c_void_p
    lock, head, main = (ctypes.c_void_p * 3).from_address(base + _LOCK_OFFSET)
    if not lock or head != main_interpreter() or main != head:
        return None
    return ctypes.c_void_p.from_address(base + _LOCK_OFFSET)


@functools.cache
def install() -> bool:
    """Take the lock across every ``os.fork()`` from now on, where ``affected`` and the layout
    check allow it. Returns whether it will."""
    if not affected() or sys.platform != "linux":
        return False
    slot = _lock_slot()
    # Called holding the GIL (a PyDLL does not release it), as every os.fork() holds it from its
    # prepare step to its parent step: no set of handlers is added or removed in the middle of a
    # fork, where its prepare step would have run and its parent step would not.
    libc = ctypes.PyDLL(None)
    try:  # glibc's; another C library has other names, and is left alone
        register, unregister = getattr(libc, "__register_atfork"), getattr(libc, "__cxa_finalize")
    except AttributeError:
        return False
    if slot is None:
        return False
    acquire, release = _api.PyThread_acquire_lock, _api.PyThread_release_lock
    acquire.argtypes, acquire.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    release.argtypes, release.restype = [ctypes.c_void_p], None
    handler, handle = ctypes.CFUNCTYPE(None), ctypes.c_void_p(ctypes.addressof(_handle))

    def arm() -> None:  # the forking thread, holding the GIL and nothing else yet
        global _registered, _collecting
        lock = slot.value
        with _state:
            if _registered or not lock:  # another thread's fork registered a set: this fork runs it
                return
            # 1: wait. The holder makes a thread state without the GIL and lets go without needing anything.
            handlers = (handler(functools.partial(acquire, lock, 1)), handler(functools.partial(release, lock)),
                        handler(functools.partial(release, lock)))
            _kept.extend(handlers)
            if register(*handlers, handle) != 0:
                return
            _registered, _collecting = True, gc.isenabled()
            gc.disable()

    def after_in_parent() -> None:
        global _registered
        with _state:
            if _registered:  # removed once the first fork after it ran it, whichever thread's it was
                unregister(handle)
                _kept.clear()
                _registered = False
                if _collecting:
                    gc.enable()

    def after_in_child() -> None:
        # The set stays registered here, bound to the lock this process replaced (module docstring),
        # and _state may have been held by a thread that does not exist here.
        global _state, _registered
        if _registered and _collecting:  # collection back as it was before the set was registered
            gc.enable()
        _state, _registered = threading.Lock(), False

    os.register_at_fork(before=arm, after_in_parent=after_in_parent, after_in_child=after_in_child)
    return True
