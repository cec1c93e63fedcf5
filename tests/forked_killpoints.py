"""Kill ``trainjob run ARGS`` (or a script) before every one of its I/O calls, each in a fork.

    python tests/forked_killpoints.py PVC_ROOT run ARGS...          (ARGS without --pvc)
    python tests/forked_killpoints.py PVC_ROOT SCRIPT.py ARGS...    (a script taking --pvc: an own loop)

The same harness as tests/killpoint.py (SIGKILL just before the Nth write, fsync or rename), for
trainers whose import is slow (torch): this process imports trainjob and the trainer's modules
once (and the engine's lazily imported modules), and every trial is a fork: a clean run to count
the calls and keep its artifact, then for each N a run killed before call N and a relaunch; N
equal to the count is the exit path (killed once the run returned, its outcome logged), as in
tests/killpoint.py. Nothing is computed here before a fork, so no thread pool is inherited.
Prints one JSON object: the count and, per N, how the killed run ended, whether its log already
said ``completed``, the relaunch's exit code, whether the artifacts are then the clean run's
bytes, the attempt number the PVC then holds, the log's last event and any temporary file left.
"""

import json
import os
import runpy
import signal
import sys
from pathlib import Path

from killpoint import arm
from trainjob import cli

root, argv = Path(sys.argv[1]), sys.argv[2:]
# What a run imports on first use, paid once here rather than in every fork: the trainer's
# modules (TRAINJOB_PRELOAD), the engine's (the CLI imports them per command, trainjob/cli.py) and
# bfloat16's registration. Without this each fork spent most of a second importing them again.
RUN_MODULES = ("trainjob.engine.run", "trainjob.engine.completion", "trainjob.engine.overlap",
               "trainjob.checkpoint.store", "trainjob.checkpoint.background", "trainjob.ranks.torchrun",
               "trainjob.trainers.protocol", "ml_dtypes")
for module in [*os.environ.get("TRAINJOB_PRELOAD", "").split(","), *RUN_MODULES]:
    if module:
        __import__(module)


def forked(pvc: Path, kill_at: int | None) -> tuple[int, int]:
    """Run the CLI on ``pvc`` in a child; (exit code or -signal, I/O calls made)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        real_write = os.write
        counted = arm(-1 if kill_at is None else kill_at)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        code = 70
        try:
            if argv[0].endswith(".py"):  # a script: it ends with sys.exit(run.exit_code)
                sys.argv = [argv[0], "--pvc", str(pvc), *argv[1:]]
                try:
                    runpy.run_path(argv[0], run_name="__main__")
                except SystemExit as end:
                    code = end.code if isinstance(end.code, int) else 70
            else:
                code = cli.main([argv[0], "--pvc", str(pvc), *argv[1:]])
            if counted() == kill_at:  # the exit path: the outcome is decided and logged
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            real_write(write, str(counted()).encode())
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    counted = os.read(read, 64)
    os.close(read)
    return os.waitstatus_to_exitcode(status), int(counted or b"-1")


def artifacts(pvc: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((pvc / "artifacts").glob("*"))}


def attempts(pvc: Path) -> str | None:
    """The attempt counter the PVC holds; None when there is none (the test then shows the trial)."""
    path = pvc / "attempts"
    return path.read_text().strip() if path.is_file() else None


code, count = forked(root / "clean", None)
reference = artifacts(root / "clean")
trials = []
for n in range(count + 1):
    pvc = root / f"kill-{n:04d}"
    killed, _ = forked(pvc, n)
    log = pvc / "log.jsonl"
    logged_completed = log.is_file() and '"event":"completed"' in log.read_text(errors="replace")
    relaunch, _ = forked(pvc, None)
    trials.append({"n": n, "killed": killed, "relaunch": relaunch, "logged_completed": logged_completed,
                   "same_bytes": artifacts(pvc) == reference, "attempts": attempts(pvc),
                   "last_event": json.loads(log.read_text().splitlines()[-1])["event"] if log.is_file() else None,
                   "litter": sorted(p.name for p in pvc.rglob("*.tmp.*"))})
print(json.dumps({"clean": code, "count": count, "artifacts": sorted(reference), "trials": trials}))
