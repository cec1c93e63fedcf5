"""Run the trainjob CLI, sending itself SIGTERM the first time it sees a child process exit 0.

    python tests/latesignal.py supervise -- run --pvc P ...     a supervisor told to stop just
    python tests/latesignal.py run --pvc P --world-size 2 ...   after its child / rank 0 completed

A child (``supervise``'s start, the local launcher's rank) exits 0 only once ``completed`` is
logged, so this is the signal that arrives after the outcome was decided, delivered at the one
instant a test cannot hit by timing: between the child's exit and the parent's verdict.
"""

import os
import signal
import subprocess
import sys

from trainjob import cli

sent = False


def late(real):
    def wrapper(self, *args, **kwargs):
        global sent
        code = real(self, *args, **kwargs)
        if code == 0 and not sent:
            sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return code

    return wrapper


subprocess.Popen.wait = late(subprocess.Popen.wait)
subprocess.Popen.poll = late(subprocess.Popen.poll)
sys.exit(cli.main(sys.argv[1:]))
