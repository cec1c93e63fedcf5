"""The campaign's harness: how a trial starts trainjob, what an uninterrupted run produces, and the
checks every trial's recovery must pass (same artifact bytes, no attempt spent, no litter, status
and verify clean). Sections (the other modules) inject faults; they share this and nothing else.

Every ``trainjob run`` started through here is judged the moment its exit status is read (``AUDIT``):
its log must say its exit code (``launches.disagreement``: `trainjob status` of the log it left
equals the code), whatever the section did to it. Runs that shared a PVC at the same time (the
races) interleave their lines, so they are counted apart, not judged.
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainjob.deploy.launches import artifact, disagreement, events, last_event

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["--steps", "100", "--ckpt-every", "1"]
# Racers need a run long enough that none of them can arrive after the winner has finished.
RACE_STEPS = ["--steps", "1000", "--ckpt-every", "1"]
# Two ranks coordinate every checkpoint through the PVC, so a step costs more: fewer of them.
W2_STEPS = ["--steps", "60", "--ckpt-every", "1", "--world-size", "2"]
# Under torchrun a launch spends seconds starting up and far less per step (no directory polls):
# more steps, so that signals sent after the start land while it trains.
W2_TORCHRUN_STEPS = ["--steps", "600", "--ckpt-every", "1", "--world-size", "2"]
# --async-checkpoint: the same runs with every checkpoint written by a background thread.
ASYNC = "--async-checkpoint"
ASYNC_STEPS, W2_ASYNC_STEPS = [*STEPS, ASYNC], [*W2_STEPS, ASYNC]
# A real torch model written to the Stateful protocol (scripts/bench_torch.py: Linear + SGD momentum,
# float32 tensors, shards and a safetensors artifact), small enough for CI: every guarantee the
# storms check on the lab's model, on torch tensors.
TORCH_STEPS = ["--trainer", "bench_torch:make", "--steps", "40", "--ckpt-every", "1"]
TORCH_DIM = "64"
LITTER = ("*.tmp.*", ".tmp-*", ".trash-*")
AS_DEPLOYED = "--idempotent"  # what supervise and the rendered Job add to every `trainjob run`


def one_rank(flags: list[str]) -> list[str]:
    """The same run on one rank: every W-rank result must equal it byte for byte."""
    if "--world-size" not in flags:
        return flags
    i = flags.index("--world-size")
    return flags[:i] + flags[i + 2:]


def label(name: str, flags: list[str]) -> str:
    """A section's name: what it injects, at which world size, sync or async, which trainer."""
    world = flags[flags.index("--world-size") + 1] if "--world-size" in flags else "1"
    return f"{name} W={world}{' async' if ASYNC in flags else ''}{' torch' if '--trainer' in flags else ''}"


def command(args: tuple[str | Path, ...], prefix: tuple[str, ...] = (), torchrun: bool = False) -> list[str]:
    """``trainjob ARGS``; with ``torchrun``, one worker per rank of ARGS' --world-size under torchrun."""
    if torchrun:
        world = str(args[list(map(str, args)).index("--world-size") + 1])
        return [*prefix, sys.executable, "-B", "-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node",
                world, "--monitor-interval", "0.1", "-m", "trainjob", *map(str, args)]
    return [*prefix, sys.executable, "-B", "-m", "trainjob", *map(str, args)]


@dataclass
class Audit:
    """Whether each run's exit code is what its log says (module docstring), over the campaign."""

    judged: int = 0
    shared: int = 0  # runs that shared their PVC with another at the same moment: not judged
    problems: list[str] = field(default_factory=list)
    running: dict[Path, list[Launch]] = field(default_factory=dict)

    def judge(self, what: str, code: int, pvc: Path, before: int) -> None:
        self.judged += 1
        if (problem := disagreement(code, events(pvc), before)) is not None:
            self.problems.append(f"`{what}` {problem}")

    def section(self) -> Section:
        return Section("status == exit, every run", trials=self.judged, violations=self.problems,
                       note=f"{self.shared} runs sharing a PVC at once (races) not judged")


AUDIT = Audit()


def _pvc_of(args: tuple[str | Path, ...]) -> Path | None:
    """The PVC of a ``trainjob run`` command line (the runs the audit judges), else None."""
    words = list(map(str, args))
    return Path(words[words.index("--pvc") + 1]) if words[:1] == ["run"] and "--pvc" in words else None


class _KeptStderr:
    """A launch's stderr in a temporary file, not a pipe: a run writes a progress line per
    checkpoint off a terminal, and one of 1000 checkpoints fills a pipe's 64 KiB long before it
    exits, blocking there while the campaign waits for its exit (a race's winner timed out so).
    ``read`` returns all of it, as a pipe's would after the exit."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile("w+")

    def read(self) -> str:
        self.file.seek(0)
        return self.file.read()

    def close(self) -> None:
        self.file.close()


class Launch(subprocess.Popen):
    """A run (``argv``, on ``pvc``; ``what`` names it) started in a session of its own, so that a
    kill reaches every rank, and judged by ``AUDIT`` the first time its exit status is read."""

    def __init__(self, argv: list[str], pvc: Path | None, what: str, stderr=subprocess.PIPE) -> None:
        self.pvc, self.what, self.judged = pvc, what, False
        self.before = len(events(pvc)) if pvc is not None else 0
        if pvc is not None:
            others = [o for o in AUDIT.running.get(pvc, []) if o.returncode is None]
            self.shared = bool(others)
            for other in others:
                other.shared = True
            AUDIT.running[pvc] = [*others, self]
        kept = _KeptStderr() if stderr is subprocess.PIPE else None
        super().__init__(argv, stdout=subprocess.DEVNULL, stderr=kept.file if kept else stderr, text=True,
                         start_new_session=True)
        if kept is not None:
            self.stderr = kept  # type: ignore[assignment]

    def _judged(self, code: int | None) -> int | None:
        if code is not None and self.pvc is not None and not self.judged:
            self.judged = True
            if self.shared:
                AUDIT.shared += 1
            else:
                AUDIT.judge(self.what, code, self.pvc, self.before)
        return code

    def poll(self) -> int | None:
        return self._judged(super().poll())

    def wait(self, timeout: float | None = None) -> int:
        return self._judged(super().wait(timeout))  # type: ignore[return-value]

    def communicate(self, input=None, timeout: float | None = None) -> tuple[None, str | None]:  # noqa: A002
        """Popen's, for a launch whose stderr is kept in a file (nothing to drain: its exit, then all it wrote)."""
        if not isinstance(self.stderr, _KeptStderr):
            return super().communicate(input, timeout)
        self.wait(timeout)
        return None, self.stderr.read()


def trainjob(*args: str | Path, prefix: tuple[str, ...] = (), torchrun: bool = False,
             **kw) -> subprocess.CompletedProcess:
    pvc = _pvc_of(args)
    before = len(events(pvc)) if pvc is not None else 0
    done = subprocess.run(command(args, prefix, torchrun), capture_output=True, text=True, timeout=120, **kw)
    if pvc is not None:
        if any(o.returncode is None for o in AUDIT.running.get(pvc, [])):
            AUDIT.shared += 1
        else:
            AUDIT.judge(f"trainjob {' '.join(map(str, args))}", done.returncode, pvc, before)
    return done


def spawn(*args: str | Path, prefix: tuple[str, ...] = (), torchrun: bool = False) -> Launch:
    return Launch(command(args, prefix, torchrun), _pvc_of(args), f"trainjob {' '.join(map(str, args))}")


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@dataclass
class Section:
    name: str
    trials: int = 0
    injected: int = 0  # kills, signals, faults, inputs or racers actually delivered
    late: int = 0  # of those, kills that landed after the run had logged `completed`
    bytes_lost: int = 0
    violations: list[str] = field(default_factory=list)
    note: str = ""

    def violation(self, trial: int, what: str) -> None:
        self.violations.append(f"{self.name} #{trial}: {what}")


class Campaign:
    def __init__(self, work: Path, seed: int, launcher: str = "local") -> None:
        self.work, self.rng = work, random.Random(seed)
        self.launcher = launcher
        self.references: dict[tuple[str, ...], bytes] = {}
        self.seconds: dict[tuple[str, ...], float] = {}
        self.reference = self.reference_for(STEPS)
        self.run_seconds = self.seconds_for(STEPS)

    def seconds_for(self, flags: list[str]) -> float:
        """How long an uninterrupted run with ``flags`` takes here: the window kills land in."""
        if tuple(flags) not in self.seconds:
            pvc = self.pvc("timing")
            started = time.monotonic()
            if trainjob("run", "--pvc", pvc, *flags, torchrun=self.torchrun(flags)).returncode != 0:
                raise SystemExit(f"an uninterrupted run with {flags} failed")
            self.seconds[tuple(flags)] = time.monotonic() - started
        return self.seconds[tuple(flags)]

    def reference_for(self, flags: list[str]) -> bytes:
        """The artifact of an uninterrupted one-rank run: what every recovery must reach."""
        flags = one_rank(flags)
        if tuple(flags) not in self.references:
            ref = self.pvc("reference")
            assert trainjob("run", "--pvc", ref, *flags).returncode == 0, "the uninterrupted run failed"
            self.references[tuple(flags)] = artifact(ref)  # type: ignore[assignment]
        return self.references[tuple(flags)]

    def torchrun(self, flags: list[str]) -> bool:
        """Whether a run with ``flags`` goes through torchrun (``--launcher torchrun``, W > 1)."""
        return self.launcher == "torchrun" and "--world-size" in flags

    def pvc(self, label: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{label}-", dir=self.work)) / "pvc"

    def recover(self, section: Section, trial: int, pvc: Path, flags: list[str] = STEPS) -> None:
        """Relaunch without faults until done; the result must equal the uninterrupted run."""
        reference = self.reference_for(flags)
        for _ in range(5):
            result = trainjob("run", "--pvc", pvc, *flags, AS_DEPLOYED, torchrun=self.torchrun(flags))
            if result.returncode != 75:
                break
        if result.returncode != 0 or last_event(pvc) != "completed":
            section.violation(trial, f"clean relaunch ended {result.returncode}: {result.stderr.strip()[-200:]}")
            return
        if artifact(pvc) != reference:
            section.violation(trial, "artifact differs from the uninterrupted run")
            section.bytes_lost += len(reference)
        attempts = (pvc / "attempts").read_text().strip()
        if attempts != "1":
            section.violation(trial, f"attempts={attempts}: an interruption cost an attempt")
        litter = [p.name for pattern in LITTER for p in pvc.rglob(pattern)]
        if litter:
            section.violation(trial, f"tmp litter left: {litter}")
        status = trainjob("status", pvc / "log.jsonl")
        if status.returncode != 0:
            section.violation(trial, f"status exited {status.returncode}")
        verify = trainjob("verify", "--pvc", pvc)
        if verify.returncode != 0:
            section.violation(trial, f"verify exited {verify.returncode}: {verify.stdout.strip()[-300:]}")
