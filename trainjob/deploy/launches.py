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

import attrs

from ..exits import EXIT_INTERNAL, EXIT_RELAUNCH, TRAINJOBS, exit_code_for_state

POLL = 0.002  # how often a watcher looks at the log: a checkpoint of a small model takes milliseconds


def spawn(argv: Sequence[str], *, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new session, so that a signal to its group reaches every process of it."""
    return subprocess.Popen(list(argv), stdout=stdout, stderr=stderr, text=True, env=env, start_new_session=True)


def with_descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc's children lists), parents first."""
    pids = [root]
    for pid in pids:  # grows while walked
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def kill_launch(proc: subprocess.Popen, torchrun: bool = True, sig: int = signal.SIGKILL) -> None:
    """Signal a launch, every process of it at once, as a node or container dies. torchrun starts
    each worker in a session of its own, so its process group alone would leave them running:
    with ``torchrun``, every descendant is found (before any dies) and signalled too."""
    pids = with_descendants(proc.pid) if torchrun else [proc.pid]
    for pid in pids:
        try:
            os.killpg(pid, sig) if pid == proc.pid else os.kill(pid, sig)
        except ProcessLookupError:
            pass


@attrs.frozen
class Stop:
    """How a scheduler stops a launch: ``sig`` to every process of it (``everyone``: Slurm's
    ``scancel`` and preemption, systemd, a dying node) or to its first process alone (the kubelet,
    a supervisor), again after ``repeat`` seconds if it still runs (Slurm's preemption signals
    twice), and SIGKILL to every process after ``kill_after`` seconds if it still runs (the end of
    Kubernetes's grace period)."""

    name: str
    sig: int
    everyone: bool = False
    repeat: float | None = None
    kill_after: float | None = None


NODE_DIES = Stop("KILL", signal.SIGKILL, everyone=True)
KUBELET = Stop("TERM", signal.SIGTERM)  # to PID 1 alone; the launcher must pass it on
PREEMPTED = Stop("TERM all x2", signal.SIGTERM, everyone=True, repeat=0.5)


def grace_ended(seconds: float) -> Stop:
    """The kubelet's SIGTERM, then its SIGKILL of every process ``seconds`` later."""
    return Stop(f"TERM+KILL {seconds:.2f}s", signal.SIGTERM, kill_after=seconds)


def _exits_within(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=max(0.0, seconds))
        return True
    except subprocess.TimeoutExpired:
        return False


def stop_launch(proc: subprocess.Popen, how: Stop, torchrun: bool = True) -> None:
    """Deliver ``how`` to the launch, returning once its last signal is sent (a repeat or a
    SIGKILL after a grace waits for them, unless the launch exits first)."""
    started = time.monotonic()
    for n in range(2 if how.repeat is not None else 1):
        if n and _exits_within(proc, how.repeat or 0.0):
            return
        if how.everyone:
            kill_launch(proc, torchrun, how.sig)
        else:
            proc.send_signal(how.sig)
    if how.kill_after is not None and not _exits_within(proc, how.kill_after - (time.monotonic() - started)):
        kill_launch(proc, torchrun, signal.SIGKILL)


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], sig: int | Stop = signal.SIGKILL,
              torchrun: bool = True) -> bool:
    """Stop the launch the first time ``ready()`` holds while it runs; True when the signal was
    delivered to a launch that had not ended by itself in between. A bare signal: SIGKILL goes to
    every process of the launch (a node dies); any other signal to its first process alone, as the
    kubelet sends SIGTERM: the launcher must pass it on. A ``Stop``: as it says."""
    how = sig if isinstance(sig, Stop) else NODE_DIES if sig == signal.SIGKILL else attrs.evolve(KUBELET, sig=sig)
    while proc.poll() is None and not ready():
        time.sleep(POLL)
    if proc.poll() is not None:
        return False
    stop_launch(proc, how, torchrun)
    # A SIGKILL that found the launch already exiting shows as its own exit status, not -9.
    return how.sig != signal.SIGKILL or proc.wait() == -signal.SIGKILL


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
