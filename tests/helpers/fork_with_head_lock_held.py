"""Fork while another thread holds the interpreter's thread-list lock; print how the child fared.

    python fork_with_head_lock_held.py bare|guard|raw

Two native timer threads (no Python, no GIL) take the lock 1 ms from now and release it 0.9 s from
now, as a thread making a thread state would if it were descheduled inside that section. The main
thread forks at 0.2 s; the child exits at once if it can. ``guard`` first installs
trainjob/trainers/torch/forking.py's fork handler (loaded from its file, so that nothing else of
the package, and no torch, comes in). ``raw`` installs it too and forks once through ``os.fork()`` with
the lock free, then, with the lock held, forks with libc's ``fork()`` called directly, as C code
would. Prints one JSON line: how long the fork took, and whether
the child "exited" or was "stuck" for 5 s (then it is killed).
"""

import ctypes
import json
import os
import sys
import time

from forking_alone import forking

if sys.argv[1] in ("guard", "raw"):
    assert forking.install(), "the fork handler was not installed"
lock = forking._lock_slot().value
libc = ctypes.CDLL(None, use_errno=True)


class SigEvent(ctypes.Structure):  # glibc's struct sigevent, for SIGEV_THREAD
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p), ("pad", ctypes.c_char * 32)]


class ITimerSpec(ctypes.Structure):
    _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long),
                ("value_s", ctypes.c_long), ("value_ns", ctypes.c_long)]


def call_later(function: str, after_ns: int) -> ctypes.c_void_p:
    """Call the interpreter's ``function(lock)`` on a new native thread after ``after_ns``."""
    address = ctypes.cast(getattr(ctypes.pythonapi, function), ctypes.c_void_p).value
    event, timer = SigEvent(value=lock, notify=2, function=address), ctypes.c_void_p()  # 2: SIGEV_THREAD
    assert libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer)) == 0, ctypes.get_errno()  # 1: MONOTONIC
    assert libc.timer_settime(timer, 0, ctypes.byref(ITimerSpec(0, 0, 0, after_ns)), None) == 0
    return timer


if sys.argv[1] == "raw":
    first = os.fork()
    if first == 0:
        os._exit(0)
    os.waitpid(first, 0)
timers = [call_later("PyThread_acquire_lock", 1_000_000), call_later("PyThread_release_lock", 900_000_000)]
time.sleep(0.2)
start = time.monotonic()
pid = libc.fork() if sys.argv[1] == "raw" else os.fork()
if pid == 0:
    os._exit(0)
forked = time.monotonic() - start
deadline, child = time.monotonic() + 5, "stuck"
while time.monotonic() < deadline:
    if os.waitpid(pid, os.WNOHANG)[0]:
        child = "exited"
        break
    time.sleep(0.02)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps({"fork_seconds": round(forked, 3), "child": child}))
