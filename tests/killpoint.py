"""Run the trainjob CLI, SIGKILLing itself just before its Nth write, fsync or rename.

    python tests/killpoint.py N run --pvc P ...     die before I/O call number N (0-based)
    python tests/killpoint.py -1 run --pvc P ...    never die; print the number of I/O calls

This is the test-side harness for "a kill at any instant": with N enumerated over every I/O
call a clean run makes, every point where the PVC could be left half-updated gets hit. N equal
to that number is the exit path: the process dies once the CLI has returned, its outcome
decided and logged (an OOM kill or a lost node in the instant after ``completed``).
"""

import os
import signal
import sys

from trainjob import cli

target = int(sys.argv[1])
calls = 0


def deadly(real):
    def wrapper(*args, **kwargs):
        global calls
        if calls == target:
            os.kill(os.getpid(), signal.SIGKILL)
        calls += 1
        return real(*args, **kwargs)

    return wrapper


for name in ("write", "fsync", "replace", "rename"):
    setattr(os, name, deadly(getattr(os, name)))

code = cli.main(sys.argv[2:])
if calls == target:
    os.kill(os.getpid(), signal.SIGKILL)
if target < 0:
    print(calls, file=sys.stderr)
sys.exit(code)
