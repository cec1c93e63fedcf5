"""A launch as a supervisor sees it: started in a session of its own, signalled whole, read from its PVC.

Shared by ``trainjob prove`` and the reliability campaign (scripts/chaos.py), so that both kill a
launch the same way a dying node does, and judge every launch by the same rule: the exit code and
the log it left agree (``disagreement``). Reads the PVC's files directly and never writes them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..exits import EXIT_INTERNAL, EXIT_RELAUNCH, TRAINJOBS, exit_code_for_state

POLL = 0.002  # how often a watcher looks at the log: a checkpoint of a small model takes milliseconds


def spawn(argv: Sequence[str], *, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new session, so that a signal to its group reaches every process of it."""
    return subprocess.Popen(list(argv), stdout=stdout, stderr=stderr, text=True, env=env, start_new_session=True)


def kill_launch(proc: subprocess.Popen, torchrun: bool = True, sig: int = signal.SIGKILL) -> None:
    """Signal a launch, every process of it at once, as a node or container dies. torchrun starts
    each worker in a session of its own, so its process group alone would leave them running:
    with ``torchrun``, every descendant is found (before any dies) and signalled too."""
    pids = [proc.pid]
    if torchrun:
        for pid in pids:  # grows while walked
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    pids += [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    pass
    for pid in pids:
        try:
            os.killpg(pid, sig) if pid == proc.pid else os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], sig: int = signal.SIGKILL,
              torchrun: bool = True) -> bool:
    """Signal the launch the first time ``ready()`` holds while it runs; True when the signal was
    delivered to a launch that had not ended by itself in between. SIGKILL goes to every process of
    the launch (a node dies); any other signal to its first process alone, as the kubelet sends
    SIGTERM: the launcher must pass it on."""
    while proc.poll() is None and not ready():
        time.sleep(POLL)
    if proc.poll() is not None:
        return False
    if sig == signal.SIGKILL:
        kill_launch(proc, torchrun, sig)
    else:
        proc.send_signal(sig)
    # A SIGKILL that found the launch already exiting shows as its own exit status, not -9.
    return sig != signal.SIGKILL or proc.wait() == -signal.SIGKILL


def events(pvc: Path) -> list[dict]:
    """The log's events, skipping any line a kill left torn."""
    log = pvc / "log.jsonl"
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            record = json.loads(line)
            found.append({"event": str(record["event"]), "detail": str(record["detail"])})
        except (ValueError, KeyError, TypeError):
            continue
    return found


def last_event(pvc: Path) -> str | None:
    found = events(pvc)
    return found[-1]["event"] if found else None


def artifact(pvc: Path) -> bytes | None:
    """The bytes of the first attempt's artifact: model-v1.json (the lab's), or .safetensors."""
    found = sorted((pvc / "artifacts").glob("model-v1.*")) if (pvc / "artifacts").is_dir() else []
    return found[0].read_bytes() if found else None


def artifacts(pvc: Path) -> dict[str, bytes]:
    """Every published artifact by name: a resume that cost an attempt publishes another name."""
    folder = pvc / "artifacts"
    return {p.name: p.read_bytes() for p in sorted(folder.glob("model-v*"))} if folder.is_dir() else {}


def disagreement(code: int, logged: Sequence[dict], before: int = 0) -> str | None:
    """Why a launch's exit status ``code`` and the log it left disagree, or None.

    ``trainjob status`` reads the log's last event as a code (``exits.exit_code_for_state``: a
    final event's, else 75, the attempt in flight); for every way a launch ends, that is the code
    the launch exited with. A crash (70) leaves the attempt in flight: status says 75. ``logged``:
    the log's events once the launch ended; ``before``: how many it held when the launch started.
    A launch that logged nothing left the job as it found it (refused before it began, a busy PVC,
    a signal before its start), so only its code is judged: one of trainjob's. A SIGKILL is never
    judged, since nothing can be said after it; any other signal must not end a launch, whose
    code is trainjob's (a SIGTERM is a stop: 75)."""
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return None
    if code not in TRAINJOBS:
        return f"exited {code}, not with one of trainjob's codes"
    if len(logged) <= before:
        return None
    last = logged[-1]["event"]
    said = exit_code_for_state(last)
    if said != (EXIT_RELAUNCH if code == EXIT_INTERNAL else code):
        return f"exited {code} but its log ends at {last!r}, for which `trainjob status` says {said}"
    return None
