"""Run the trainjob CLI, SIGKILLing itself just before its Nth write, fsync or rename.

    python tests/killpoint.py N run --pvc P ...     die before I/O call number N (0-based)
    python tests/killpoint.py -1 run --pvc P ...    never die; print the number of I/O calls
    KILLPOINT_RANK=R torchrun ... tests/killpoint.py N run ...    only the worker of rank R dies

This is the test-side harness for "a kill at any instant": with N enumerated over every I/O
call a clean run makes, every point where the PVC could be left half-updated gets hit. N equal
to that number is the exit path: the process dies once the CLI has returned, its outcome
decided and logged (an OOM kill or a lost node in the instant after ``completed``).
``arm`` is the harness itself, for tests/forked_killpoints.py too.
"""

import os
import signal
import sys
import threading
from collections.abc import Callable


def arm(target: int) -> Callable[[], int]:
    """SIGKILL this process just before its I/O call number ``target`` (never when negative);
    returns a function that says how many calls were made so far.

    The wrappers replace the ``os`` functions themselves, so they see every thread's calls (an
    --async-checkpoint writer thread's included); the lock makes each call count exactly once
    when two threads make one at the same instant."""
    calls = 0
    lock = threading.Lock()

    def deadly(real):
        def wrapper(*args, **kwargs):
            nonlocal calls
            with lock:
                if calls == target:
                    os.kill(os.getpid(), signal.SIGKILL)
                calls += 1
            return real(*args, **kwargs)

        return wrapper

    for name in ("write", "fsync", "replace", "rename"):
        setattr(os, name, deadly(getattr(os, name)))
    return lambda: calls


if __name__ == "__main__":
    from trainjob import cli

    target = int(sys.argv[1])
    if os.environ.get("KILLPOINT_RANK", os.environ.get("RANK")) != os.environ.get("RANK"):
        target = -1  # under torchrun every worker runs this script: only KILLPOINT_RANK dies
    counted = arm(target)
    code = cli.main(sys.argv[2:])
    if counted() == target:  # the exit path: the outcome is decided and logged
        os.kill(os.getpid(), signal.SIGKILL)
    if target < 0:
        print(counted(), file=sys.stderr)
    sys.exit(code)
