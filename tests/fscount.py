"""Run the trainjob CLI, counting the file-system calls trainjob makes after each training step.

    python tests/fscount.py OUT run --pvc P ...      writes OUT-rank<R>.json (R from $RANK, else 0)

Also a torchrun script: each worker writes its own file. The JSON maps each step N to the calls
made between the end of the trainer's step N and the start of step N + 1: everything trainjob
does after step N (the stop agreement, a checkpoint when one is due). The trainer's own step is
not counted: what a user's model does is not trainjob's cost.

Counted: every audit event of a file-system operation (``open``, ``os.listdir``, ``os.scandir``,
``os.mkdir``, ``os.rename``, ``os.remove``...) and, as they raise no audit event, every call of
``os.stat``, ``os.lstat``, ``os.fstat``, ``os.access``, ``os.fsync``, ``os.read`` and ``os.write``.
"""

import json
import os
import sys
from collections import defaultdict

AUDITED = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chmod",
           "os.chown", "os.link", "os.symlink", "os.truncate", "os.utime", "os.chdir", "shutil.rmtree",
           "shutil.copyfile", "shutil.move", "glob.glob", "os.listxattr", "os.getxattr", "os.setxattr"}
PATCHED = ("stat", "lstat", "fstat", "access", "fsync", "read", "write")

current: list = [None]  # the step whose aftermath is running; None before step 1 and inside a step
calls: dict = defaultdict(list)


def count(name: str) -> None:
    if current[0] is not None:
        calls[current[0]].append(name)


def hook(event: str, _args: tuple) -> None:
    if event in AUDITED:
        count(event)


def counted(name: str, real):
    def wrapper(*args, **kwargs):
        count(f"os.{name}")
        return real(*args, **kwargs)
    return wrapper


if __name__ == "__main__":
    from trainjob import cli
    from trainjob.trainers import protocol

    out = f"{sys.argv[1]}-rank{os.environ.get('RANK', '0')}.json"
    real_build = protocol.build

    def build(*args, **kwargs):
        trainer = real_build(*args, **kwargs)
        real_step = trainer.step

        def step(n):
            current[0] = None
            try:
                return real_step(n)
            finally:
                current[0] = n
        trainer.step = step
        return trainer

    protocol.build = build
    for name in PATCHED:
        setattr(os, name, counted(name, getattr(os, name)))
    sys.addaudithook(hook)
    code = cli.main(sys.argv[2:])
    current[0] = None
    with open(out, "w") as f:
        json.dump({str(k): v for k, v in sorted(calls.items())}, f)
    sys.exit(code)
