"""A Python that has imported trainjob once and forks a child for each command a test runs.

    python tests/prefork.py REQUESTS REPLIES    (started by ``Prefork`` below, one per pytest process)

The suite runs the CLI in a few hundred processes, mostly a lab run that takes 0.03 s of CPU once
started; starting Python and importing numpy and trainjob cost it 0.16 s more each time. Here
that is paid once: this process imports what a `trainjob run` imports (never torch: its threads
do not survive a fork), then, for each request, forks a child that becomes the command as
``python ARGV`` would (``-m module``, ``-c code`` or a script: its ``sys.argv`` and
``sys.path[0]``, cwd, environment, stdin from /dev/null, stdout and stderr to pipes) and leaves
through the interpreter's normal exit (atexit handlers, non-daemon threads joined, an uncaught
exception printed and exit 1). The parent reads both pipes to their end, waits, and replies with
the code (negative: the signal that ended it), as ``subprocess.run(capture_output=True)`` does;
past the timeout it SIGKILLs the child.

It must stay a launcher: nothing of trainjob runs in this process, so every child starts from
the state a fresh interpreter would reach by importing the same modules. A command that depends
on what is imported at start-up is tested with a real interpreter (tests/test_startup.py).
"""

from __future__ import annotations

import io
import os
import pickle
import runpy
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

HEADER = struct.Struct("!I")


def read_message(fd: int) -> object | None:
    head = _read_exactly(fd, HEADER.size)
    if head is None:
        return None
    body = _read_exactly(fd, HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def write_message(fd: int, message: object) -> None:
    body = pickle.dumps(message)
    data = memoryview(HEADER.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None  # the test process is gone
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def serve(requests: int, replies: int) -> dict:
    """Answer requests until the channel closes; returns only in a child, with its request."""
    while (request := read_message(requests)) is not None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(err_r)
            os.close(requests)
            os.close(replies)
            devnull = os.open(os.devnull, os.O_RDONLY)
            for fd, target in ((devnull, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, target)
                os.close(fd)
            return request
        os.close(out_w)
        os.close(err_w)
        write_message(replies, wait(pid, out_r, err_r, request["timeout"]))
    sys.exit(0)


def wait(pid: int, out_r: int, err_r: int, timeout: float | None) -> dict:
    """Read the child's output to its end (as ``communicate`` does), then its exit status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    output = {out_r: bytearray(), err_r: bytearray()}
    open_fds, timed_out = [out_r, err_r], False
    while open_fds:
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        ready, _, _ = select.select(open_fds, [], [], left)
        if not ready and not timed_out:
            timed_out = True
            deadline = None
            os.kill(pid, signal.SIGKILL)
            continue
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                output[fd] += chunk
            else:
                open_fds.remove(fd)
                os.close(fd)
    _, status = os.waitpid(pid, 0)
    return {"code": os.waitstatus_to_exitcode(status), "stdout": bytes(output[out_r]),
            "stderr": bytes(output[err_r]), "timed_out": timed_out}


def become(request: dict) -> None:
    """Turn this child into ``python *argv`` run in ``cwd`` with ``env``."""
    started_with = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # What a fresh interpreter would have put on its path from a PYTHONPATH of the test's own.
    sys.path[1:1] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in started_with]
    argv = request["argv"]
    if argv[0] == "-c":  # `python -c code`: the current directory ('') first on the path
        sys.path[0] = ""
        sys.argv = ["-c", *argv[2:]]
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":  # `python -m module`: the current directory first on the path
        sys.path[0] = os.getcwd()
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # `python script`: the script's directory first on the path
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


# --- the test process's side ------------------------------------------------------------------------

# Read when an interpreter starts (or numpy is imported): a command that asks for other values than
# this launcher started with gets a real interpreter instead. PYTHONPATH is not among them: a
# child puts on its path what a new one would have added (``become``).
STARTUP_ENV = ("PYTHON", "OPENBLAS_", "OMP_", "MKL_")


def startup_differs(ours: dict[str, str], theirs: dict[str, str]) -> bool:
    return any(ours.get(k) != theirs.get(k) for k in {*ours, *theirs}
               if k.startswith(STARTUP_ENV) and k != "PYTHONPATH")


class Prefork:
    """This pytest process's launcher, started at its first command. One command at a time: a
    command asked for while another thread's runs (or with other start-up settings, or with
    TRAINJOB_TEST_PREFORK=0) gets a real interpreter, ``subprocess.run``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.starting: Callable[[list[str]], None] = lambda cmd: None  # told of each command first

    def run(self, argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``."""
        env = dict(os.environ if env is None else env)
        cmd = [sys.executable, *argv]
        self.starting(cmd)
        forkable = os.environ.get("TRAINJOB_TEST_PREFORK") != "0" and \
            not startup_differs(self.env if self.proc is not None else dict(os.environ), env)
        if not (forkable and self.lock.acquire(blocking=False)):
            return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        try:
            if self.proc is None:
                self._start()
            write_message(self.requests, {"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()),
                                          "env": env, "timeout": timeout})
            reply = read_message(self.replies)
        finally:
            self.lock.release()
        if reply is None:
            raise RuntimeError(f"tests/prefork.py ended (code {self.proc.wait()}); see its stderr above")
        out, err = (io.TextIOWrapper(io.BytesIO(reply[k])).read() for k in ("stdout", "stderr"))  # as text=True
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, out, err)
        return subprocess.CompletedProcess(cmd, reply["code"], out, err)

    def _start(self) -> None:
        requests_r, self.requests = os.pipe()
        self.replies, replies_w = os.pipe()
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__, str(requests_r), str(replies_w)],
                                     pass_fds=(requests_r, replies_w), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        os.close(requests_r)
        os.close(replies_w)

    def close(self) -> None:
        if self.proc is not None:
            os.close(self.requests)  # its end of file: the launcher exits
            self.proc.wait(timeout=30)
            os.close(self.replies)
            self.proc = None


if __name__ == "__main__":
    # What a lab `trainjob run` imports (and `status`, `verify`, `k8s render`): numpy and trainjob.
    import numpy  # noqa: F401

    import trainjob.cli  # noqa: F401
    import trainjob.deploy.k8s  # noqa: F401
    import trainjob.engine.run  # noqa: F401
    import trainjob.trainers.builtin  # noqa: F401
    import trainjob.views.history  # noqa: F401

    become(serve(int(sys.argv[1]), int(sys.argv[2])))
