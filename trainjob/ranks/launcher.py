"""Ranks: the local launcher, which starts W rank processes on this machine and supervises them.

It only starts, watches, signals and stops processes; the ranks agree among themselves through
the PVC (peers.py: with no torchrun store around, connect.py picks the files), and the exit codes
it reads are cli.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence

from .parent import LAUNCHER_PID


def launch_local(world_size: int, argv: Sequence[str], *, finished: Collection[int], published: Collection[int],
                 grace: float = 10.0, stop_grace: float = 2.0) -> tuple[str | None, list[int]]:
    """Start ``world_size`` rank processes running ``trainjob <argv> --rank r`` and supervise them.

    Returns (the signal the launcher received or None, every rank's exit status; negative is
    killed by that signal). Exit codes are cli.py's: ``finished`` are the codes a rank other
    than 0 exits with when the job has ended; any other end while rank 0 runs means the job
    cannot go on, so the others are stopped (SIGTERM, then SIGKILL after ``stop_grace`` s: they
    cannot agree on a last checkpoint without the dead rank, so there is little to wait for).
    ``published`` are rank 0's codes after which the others have an outcome to follow: they get
    ``grace`` s to do so; after any other code they are stopped at once.
    SIGTERM/SIGINT to the launcher are forwarded to every rank.
    """
    env = {**os.environ, LAUNCHER_PID: str(os.getpid())}  # each rank dies with this process (parent.py)
    procs = [subprocess.Popen([sys.executable, "-m", "trainjob", *argv, "--rank", str(r),
                               "--world-size", str(world_size)], env=env) for r in range(world_size)]
    received: list[str] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)

    def stop_all(deadline: float) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    while True:
        codes = [p.poll() for p in procs]
        if codes[0] is not None:  # rank 0 ended the job; give the others time to follow its outcome
            deadline = time.monotonic() + (grace if codes[0] in published else 0)
            while any(c is None for c in (p.poll() for p in procs)) and time.monotonic() < deadline:
                time.sleep(0.02)
            stop_all(time.monotonic() + 1.0)
            break
        if any(c is not None and c not in finished for c in codes[1:]):
            stop_all(time.monotonic() + stop_grace)  # a rank died: the job cannot go on without it
            break
        time.sleep(0.02)
    return (received[0] if received else None), [p.returncode for p in procs]
