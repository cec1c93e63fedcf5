#!/usr/bin/env python3
"""Reliability campaign: inject real faults into real trainjob processes, many times, and count.

    python scripts/chaos.py [--kills N] [--sigterms N] [--faults N] [--inputs N] [--races N] [--seed S]
                            [--launcher local|torchrun]

Sections (each trial is a fresh PVC; everything is seeded, so a failure can be replayed):

  kill storm      SIGKILL the run at uniformly random instants, relaunch until done; one more
                  launch per trial (the first in even trials, so it has a run to chase; else
                  the last) is killed the instant `completed` is logged (a late kill); also on
                  a torch trainer (``--torch``: scripts/bench_torch.py's model, sync and async)
  sigterm storm   SIGTERM at random instants: each must checkpoint and exit 75
  io faults       libfiu (fiu-run/fiu-ctrl) makes write/fsync/rename/open fail mid-run
  full disk       a real tiny tmpfs as the PVC (skipped, with the reason, if it cannot mount)
  hostile inputs  corrupted data, baseline, state, attempts, log and checkpoint files, or, in half
                  the trials, special files in their place (FIFOs, sockets, devices, links to
                  /dev/zero, sparse gigabytes), absurd manifest sizes, hostile log lines
  races           several runs started at once on one PVC
  security        no unpickling or eval, no group/world-writable files, no forged log lines

``--launcher torchrun`` runs the two-rank kill and SIGTERM sections (launches and recoveries)
under torchrun, whose ranks agree through its store, as a W > 1 pod runs it: ``trainjob torchrun``,
which exits with the job's code (the product's rule, ``trainjob.exits.job_exit``).

Kill-storm launches and every recovery are ``run ... --idempotent``, as ``supervise`` and the
rendered Job run them. After every trial the PVC must recover: a clean relaunch exits 0 with the same artifact bytes as
an uninterrupted run, the kill cost no attempt, and no tmp litter remains. Prints one summary table
and exits 1 on any violation. The defaults are CI-sized; see the README for the full run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainjob.deploy import launches
from trainjob.deploy.launches import artifact, kill_when, last_event

ROOT = Path(__file__).resolve().parent.parent
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


def trainjob(*args: str | Path, prefix: tuple[str, ...] = (), torchrun: bool = False,
             **kw) -> subprocess.CompletedProcess:
    return subprocess.run(command(args, prefix, torchrun), capture_output=True, text=True, timeout=120, **kw)


def spawn(*args: str | Path, prefix: tuple[str, ...] = (), torchrun: bool = False) -> subprocess.Popen:
    return launches.spawn(command(args, prefix, torchrun))  # its own session: a kill reaches every rank


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

    # --- sections ----------------------------------------------------------------------------------

    def kill_storm(self, trials: int, flags: list[str] = STEPS, kills_per_trial: int = 3) -> Section:
        section = Section(label("kill storm", flags), note="under torchrun" if self.torchrun(flags) else "")
        seconds = self.seconds_for(flags) if trials else 0.0  # none: no timing run (torch may be absent)
        for trial in range(trials):
            section.trials += 1
            pvc = self.pvc("kill")
            chase_at = 0 if trial % 2 == 0 else kills_per_trial
            for launch in range(kills_per_trial + 1):
                done = last_event(pvc) == "completed"
                proc = spawn("run", "--pvc", pvc, *flags, AS_DEPLOYED, torchrun=self.torchrun(flags))
                # A random instant; or, chasing, the instant `completed` is logged (if still to come).
                deadline = time.monotonic() + self.rng.uniform(0, seconds)
                ready = (lambda: not done and last_event(pvc) == "completed") if launch == chase_at \
                    else (lambda: time.monotonic() >= deadline)
                if kill_when(proc, ready, torchrun=self.torchrun(flags)):
                    section.injected += 1
                    section.late += last_event(pvc) == "completed"
                    continue
                stderr, code = proc.stderr.read(), proc.wait()
                if code not in ((0,) if done else (0, 75)):
                    section.violation(trial, f"a launch exited {code}: {stderr.strip()[-300:]}")
            self.recover(section, trial, pvc, flags)
        return section

    def sigterm_storm(self, trials: int, flags: list[str] = STEPS) -> Section:
        section = Section(label("sigterm", flags), note="signal sent once the run has logged its start"
                          + (", under torchrun" if self.torchrun(flags) else ""))
        seconds = self.seconds_for(flags) if trials else 0.0
        for trial in range(trials):
            section.trials += 1
            pvc = self.pvc("term")
            proc = spawn("run", "--pvc", pvc, *flags, torchrun=self.torchrun(flags))
            # Before the interpreter has installed trainjob's handler, SIGTERM's default action
            # ends the process with nothing written; the storm targets the run itself.
            while last_event(pvc) is None and proc.poll() is None:
                time.sleep(0.005)
            time.sleep(self.rng.uniform(0, seconds / 2))
            proc.send_signal(signal.SIGTERM)  # to the launcher alone: it must pass it on
            section.injected += 1
            code = proc.wait(timeout=60)
            event = last_event(pvc)
            if code == 75:
                log = (pvc / "log.jsonl").read_text().splitlines()
                if event != "killed" or "signal=SIGTERM" not in log[-1]:
                    section.violation(trial, f"exit 75 but the log ends with {event}")
            elif not (code == 0 and event == "completed"):  # 0 only if it had finished already
                section.violation(trial, f"SIGTERM ended the run with exit {code}, log at {event}")
            self.recover(section, trial, pvc, flags)
        return section

    def io_faults(self, trials: int, flags: list[str] = STEPS) -> Section:
        """With ``ASYNC`` in ``flags``, a fault in a checkpoint's write, fsync or rename lands in
        the writer thread (libfiu fails the call whichever thread makes it): it must still end the
        run with exit 75 and one line, and never a torn checkpoint. The note counts those."""
        section = Section("io faults" + (" async" if ASYNC in flags else ""))
        in_writer = 0
        if not shutil.which("fiu-run") or not shutil.which("fiu-ctrl"):
            section.note = "skipped: fiu-run/fiu-ctrl not installed (apt-get install fiu-utils)"
            return section
        points = ["posix/io/sync/fsync", "posix/io/dir/rename", "posix/io/rw/write", "posix/io/oc/open"]
        for trial in range(trials):
            section.trials += 1
            point = points[trial % len(points)]
            pvc = self.pvc("fiu")
            ctrl = self.work / f"fiu-{trial}"
            proc = spawn("run", "--pvc", pvc, *flags, prefix=("fiu-run", "-x", "-f", str(ctrl)))
            # Arm the fault only once the run is under way: failing the interpreter's own imports
            # would test Python, not trainjob.
            while last_event(pvc) is None and proc.poll() is None:
                time.sleep(0.005)
            probability = self.rng.choice([0.05, 0.2, 1.0])
            armed = subprocess.run(["fiu-ctrl", "-f", str(ctrl), "-c",
                                    f"enable_random name={point},probability={probability}", str(proc.pid)],
                                   capture_output=True)
            code = proc.wait(timeout=120)
            stderr = proc.stderr.read()
            if armed.returncode == 0:
                section.injected += 1
            if ASYNC in flags and code == 75 and "checkpoints/" in stderr:
                in_writer += 1  # the failed call was the writer thread's: a shard, a commit, a rotation
            if code not in (0, 75):
                section.violation(trial, f"{point} p={probability}: exit {code}: {stderr.strip()[-200:]}")
            elif code == 75 and point in ("posix/io/sync/fsync", "posix/io/dir/rename"):
                lines = stderr.strip().splitlines()
                if len(lines) != 1 or not lines[0].startswith("trainjob run: "):
                    section.violation(trial, f"{point}: expected a one-line error, got {stderr.strip()[-200:]!r}")
            checkpoint = pvc / "checkpoint.json"
            if checkpoint.exists():
                try:
                    json.loads(checkpoint.read_text())
                except ValueError:
                    section.violation(trial, "checkpoint.json no longer parses after a fault")
            self.recover(section, trial, pvc, flags)
        if ASYNC in flags:
            section.note = f"{in_writer} of the faults ended the run from the writer thread's checkpoint I/O"
        return section

    def full_disk(self) -> Section:
        section = Section("full disk")
        mount = self.work / "tiny"
        mount.mkdir()
        tried = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                               capture_output=True, text=True)
        if tried.returncode != 0:
            section.note = f"skipped: cannot mount a tmpfs here ({tried.stderr.strip() or 'not root'})"
            return section
        try:
            section.trials = 1
            pvc = mount / "pvc"
            trainjob("run", "--pvc", pvc, *STEPS, "--die-at", "5")
            before = snapshot(pvc)
            filler = mount / "filler"
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
            try:  # fill every last block
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
            section.injected = 1
            result = trainjob("run", "--pvc", pvc, *STEPS)
            after = snapshot(pvc)
            if result.returncode != 75 or "No space left" not in result.stderr:
                section.violation(0, f"full disk gave exit {result.returncode}: {result.stderr.strip()[-200:]}")
            for name in ("checkpoint.json", "state.json", "attempts"):
                if after.get(name) != before.get(name) and name == "checkpoint.json":
                    json.loads(after[name])  # a newer checkpoint may have fit; it must still parse
                elif name != "checkpoint.json" and after.get(name) is None:
                    section.violation(0, f"{name} lost on a full disk")
                    section.bytes_lost += len(before.get(name, b""))
            filler.unlink()
            self.recover(section, 0, pvc)
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)
        return section

    def hostile_inputs(self, trials: int) -> Section:
        """Damage one file a run reads: its bytes (a seeded corruption), or what it is (issue 19's
        classes: a FIFO, socket or device in its place, a link to /dev/zero, a sparse file of a
        gigabyte, a manifest whose sizes and world size are absurd but whose hashes agree, a log
        line holding escape sequences or a 5000-digit number). Every run must end in bounded time
        with exit 2 and one line (the PVC unchanged) or exit 0 with the undamaged artifact."""
        section = Section("hostile inputs")
        base = self.pvc("base")
        data = base.parent / "data"
        trainjob("gen", data)
        trainjob("run", "--pvc", base, "--data", data, *STEPS, "--die-at", "7")
        # The newest checkpoint is step 7; steps 5 and 6 are older ones that still verify.
        targets = ["data/train.jsonl", "data/holdout.jsonl", "data/baseline.json",
                   "pvc/state.json", "pvc/attempts", "pvc/log.jsonl", "pvc/checkpoint.json",
                   "pvc/checkpoints/step-00000007-*/manifest.json",
                   "pvc/checkpoints/step-00000007-*/shard-*.safetensors"]
        for trial in range(trials):
            section.trials += 1
            work = Path(tempfile.mkdtemp(prefix="hostile-", dir=self.work))
            shutil.copytree(base, work / "pvc")
            shutil.copytree(data, work / "data")
            target = next(work.glob(self.rng.choice(targets)))
            original = target.read_bytes()
            if self.rng.random() < 0.5:
                kind, corrupted = corrupt(original, self.rng)
                if corrupted == original:
                    continue
                target.write_bytes(corrupted)
            else:
                kind = make_hostile(work, target, self.rng)
            section.injected += 1
            before = snapshot(work / "pvc")
            where = f"{target.relative_to(work)} ({kind})"
            try:
                result = trainjob("run", "--pvc", work / "pvc", "--data", work / "data", *STEPS)
            except subprocess.TimeoutExpired:
                section.violation(trial, f"{where}: run hung")
                continue
            if "Traceback" in result.stderr or result.returncode == 70:
                section.violation(trial, f"{where}: crashed: {result.stderr.strip()[-300:]}")
            elif target.name == "log.jsonl":
                # The log is only appended to: a damaged log must not stop the job.
                if result.returncode != 0:
                    section.violation(trial, f"{where}: run exited {result.returncode}: {result.stderr.strip()}")
                for flags in ([], ["--path"]):
                    status = trainjob("status", work / "pvc" / "log.jsonl", *flags)
                    if "Traceback" in status.stderr or status.returncode not in (0, 1, 2):
                        section.violation(trial, f"{where}: status {flags} exited {status.returncode}")
                    if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", status.stdout + status.stderr):
                        section.violation(trial, f"{where}: status {flags} printed a control character")
            elif result.returncode == 2:
                if len(result.stderr.strip().splitlines()) != 1:
                    section.violation(trial, f"{where}: error is not one line: {result.stderr!r}")
                lost = {k for k in before if snapshot(work / "pvc").get(k) != before[k]}
                if lost:
                    section.violation(trial, f"{where}: exit 2 but changed {sorted(lost)}")
                    section.bytes_lost += sum(len(before[k]) for k in lost)
            elif result.returncode == 0:
                # Only acceptable when the damage did not change what the file means, or when a
                # damaged checkpoint was caught, set aside and an older one resumed instead.
                if (work / "pvc/artifacts/model-v1.json").read_bytes() != self.reference:
                    section.violation(trial, f"{where}: exit 0 with a different artifact (silently wrong)")
                if target.parent.parent.name == "checkpoints" and \
                        '"checkpoint_rejected"' not in (work / "pvc/log.jsonl").read_text():
                    section.violation(trial, f"{where}: a damaged checkpoint was resumed without a word")
            else:
                section.violation(trial, f"{where}: exit {result.returncode}: {result.stderr.strip()[-200:]}")
        return section

    def races(self, trials: int, racers: int = 4) -> Section:
        section = Section("races")
        for trial in range(trials):
            section.trials += 1
            pvc = self.pvc("race")
            procs = [spawn("run", "--pvc", pvc, *RACE_STEPS) for _ in range(racers)]
            section.injected += racers - 1
            codes = sorted(p.wait(timeout=120) for p in procs)
            busy = sum("another trainjob run holds this PVC" in p.stderr.read() for p in procs)
            if codes != [0] + [75] * (racers - 1) or busy != racers - 1:
                section.violation(trial, f"racers exited {codes}, {busy} said busy")
            starts = (pvc / "log.jsonl").read_text().count('"job_started"')
            if starts != 1:
                section.violation(trial, f"{starts} job_started events: more than one run proceeded")
            self.recover(section, trial, pvc, RACE_STEPS)
        return section

    def reshard_races(self, trials: int) -> Section:
        """A reshard started while a run holds the PVC is told to relaunch and changes nothing."""
        section = Section("reshard races")
        for trial in range(trials):
            section.trials += 1
            pvc = self.pvc("rerace")
            trainjob("run", "--pvc", pvc, *RACE_STEPS, "--die-at", "5")
            run = spawn("run", "--pvc", pvc, *RACE_STEPS)
            # Until the run has resumed (anywhere in the log: on an idle machine `resumed` is the
            # last line for only a few milliseconds, and a poll that waited for that missed it and
            # raced a finished run).
            while '"event":"resumed"' not in (pvc / "log.jsonl").read_text(errors="replace") and run.poll() is None:
                time.sleep(0.005)
            checkpoints = sorted(p.name for p in (pvc / "checkpoints").iterdir())
            reshard = trainjob("reshard", "--pvc", pvc, "--world-size", "2")
            section.injected += 1
            if reshard.returncode != 75:
                section.violation(trial, f"reshard during a run exited {reshard.returncode}: {reshard.stderr.strip()}")
            if any("w002" in name for name in os.listdir(pvc / "checkpoints")):
                section.violation(trial, f"reshard wrote beside a live run: {checkpoints}")
            run.send_signal(signal.SIGTERM)
            if run.wait(timeout=120) != 75:
                section.violation(trial, "the run did not stop with 75 after SIGTERM")
            self.recover(section, trial, pvc, RACE_STEPS)
        return section

    def reshard_kills(self, trials: int) -> Section:
        """SIGKILL a reshard at a random instant; reshard again, resume on two ranks."""
        section = Section("reshard kills")
        base = self.pvc("rebase")
        trainjob("run", "--pvc", base, *STEPS, "--die-at", "5")
        timing = base.parent / "timing"
        shutil.copytree(base, timing)
        started = time.monotonic()
        trainjob("reshard", "--pvc", timing, "--world-size", "2")
        seconds = time.monotonic() - started
        for trial in range(trials):
            section.trials += 1
            pvc = Path(tempfile.mkdtemp(prefix="rekill-", dir=self.work)) / "pvc"
            shutil.copytree(base, pvc)
            proc = spawn("reshard", "--pvc", pvc, "--world-size", "2")
            try:
                proc.wait(timeout=self.rng.uniform(0, seconds))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                section.injected += 1
            again = trainjob("reshard", "--pvc", pvc, "--world-size", "2")
            if again.returncode != 0:
                section.violation(trial, f"reshard after a kill exited {again.returncode}: {again.stderr.strip()[-200:]}")
            self.recover(section, trial, pvc, [*STEPS, "--world-size", "2"])
        return section

    def security(self) -> Section:
        section = Section("security")
        section.trials = 3
        forbidden = re.compile(r"\b(pickle|marshal|shelve|eval|exec|yaml\.load|torch\.load)\b")
        for path in sorted((ROOT / "trainjob").rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if forbidden.search(code) and not code.strip().startswith(('"', "'")):
                    section.violation(0, f"{path.relative_to(ROOT)}:{number} may evaluate stored data: {line.strip()}")
        pvc = self.pvc("modes")
        script = ("import os, sys; os.umask(0); from trainjob.cli import main; "
                  f"sys.exit(main(['run', '--pvc', {str(pvc)!r}]))")
        subprocess.run([sys.executable, "-B", "-c", script], capture_output=True)
        loose = [str(p) for p in [pvc, *pvc.rglob("*")] if p.stat().st_mode & 0o022]
        if loose:
            section.violation(1, f"group/world-writable: {loose}")
        log = pvc / "log.jsonl"
        lines = log.read_text().splitlines()
        if any(json.loads(line).keys() != {"ts", "event", "detail"} for line in lines):
            section.violation(2, "a log line is not exactly one event")
        # A PVC entry that is a symlink out of the PVC is refused, and what it points at untouched.
        section.trials += 1
        pvc = self.pvc("link")
        trainjob("run", "--pvc", pvc, *STEPS, "--die-at", "3")
        outside = pvc.parent / "outside.json"
        outside.write_text("precious")
        (pvc / "state.json").unlink()
        (pvc / "state.json").symlink_to(outside)
        result = trainjob("run", "--pvc", pvc, *STEPS)
        if result.returncode != 2 or outside.read_text() != "precious":
            section.violation(3, f"a symlinked state.json gave exit {result.returncode}")
        return section


def corrupt(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One seeded corruption of a file's bytes, of the kinds a disk, a person or an attacker makes."""
    text = raw.decode(errors="replace")
    kinds: dict[str, Callable[[], bytes]] = {
        "truncate": lambda: raw[: rng.randrange(len(raw) or 1)],
        "bit flip": lambda: flip(raw, rng),
        "wrong type": lambda: re.sub(r"-?\d+\.?\d*(e-?\d+)?", '"1"', text, count=1).encode(),
        "huge number": lambda: re.sub(r"-?\d+\.?\d*(e-?\d+)?", rng.choice(["1e400", "9" * 400]), text, count=1).encode(),
        "nan": lambda: re.sub(r"-?\d+\.\d+(e-?\d+)?", "NaN", text, count=1).encode(),
        "unknown key": lambda: text.replace("{", '{"surprise":1,', 1).encode(),
        "deep nesting": lambda: ("[" * 200_000 + "]" * 200_000 + "\n").encode(),
        "not utf-8": lambda: b"\xff\xfe" + raw[2:],
        "empty": lambda: b"",
    }
    kind = rng.choice(sorted(kinds))
    return kind, kinds[kind]()


def make_hostile(work: Path, target: Path, rng: random.Random) -> str:
    """Replace or extend ``target`` with one of the inputs of issue 19 (what a file is, not its
    bytes); the name of what was done."""
    if target.name == "log.jsonl":
        nasty = rng.choice(["\x1b[2J\rok checkpoint\nverdict: ok", "\u202eevil", "9" * 5000])
        line = {"ts": "2026-11-30T10:03:24Z", "event": rng.choice(["job_started", nasty]),
                "detail": f"steps=100 attempt={nasty}", **({nasty: 1} if rng.random() < 0.5 else {})}
        with open(target, "a") as log:
            log.write(json.dumps(line) + "\n")
        return "escape sequences and huge numbers in a log line"
    if target.name == "manifest.json":
        record = json.loads(target.read_text())
        if rng.random() < 0.5:
            record["world_size"] = rng.choice([2, 64, 65, 10 ** 9, 10 ** 18])
        else:
            shape = [rng.choice([0, 1, 10 ** 6, 10 ** 12, 2 ** 62])]
            for entry in (*record["tensors"], *record["shards"][0]["holds"]):
                entry["shape"] = shape
        target.write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
        (work / "pvc/checkpoint.json").unlink()  # no hash of the manifest: only the bounds can catch it
        return "absurd world size or shape, pointer removed"
    kind = rng.choice(["fifo", "socket", "device", "link to /dev/zero"]
                      + (["sparse gigabyte"] if target.parent.name == "data" else []))
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "socket":
        short = Path(tempfile.mkdtemp(dir="/tmp")) / "s"  # AF_UNIX paths are limited to 108 bytes
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(short))
        sock.close()  # the socket file stays; nothing listens
        os.replace(short, target)
    elif kind == "device":
        os.mknod(target, 0o644 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's
    elif kind == "link to /dev/zero":
        target.symlink_to("/dev/zero")
    else:
        with open(target, "wb") as f:
            f.truncate(1 << 30)
    return kind


def flip(raw: bytes, rng: random.Random) -> bytes:
    if not raw:
        return b"\x01"
    data = bytearray(raw)
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    return bytes(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=4,
                        help="kill-storm trials (3 random kills and one late kill each)")
    parser.add_argument("--sigterms", type=int, default=4)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--inputs", type=int, default=40)
    parser.add_argument("--races", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="two-rank kill and SIGTERM trials, reshard kills")
    parser.add_argument("--asyncs", type=int, default=2,
                        help="--async-checkpoint trials: kill storms and SIGTERMs at W=1 and W=2, io faults (x2)")
    parser.add_argument("--torch", type=int, default=2,
                        help="kill storms on a torch trainer (skipped, with a note, without torch)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                        help="how the two-rank sections start their ranks (torchrun: they agree through its store)")
    args = parser.parse_args()
    try:
        import torch  # noqa: F401  (only to know whether the torch storms can run)
    except ImportError:
        print("note: torch is not installed; the torch kill storms are skipped", file=sys.stderr)
        args.torch = 0
    # The torch trainer's module, for every `trainjob run` this campaign starts.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))
    os.environ["BENCH_TORCH_DIM"], os.environ["OMP_NUM_THREADS"] = TORCH_DIM, "1"

    with tempfile.TemporaryDirectory(prefix="trainjob-chaos-") as tmp:
        campaign = Campaign(Path(tmp), args.seed, args.launcher)
        w2 = W2_TORCHRUN_STEPS if args.launcher == "torchrun" else W2_STEPS
        sections = [
            campaign.kill_storm(args.kills),
            campaign.kill_storm(args.ranks, w2),
            campaign.sigterm_storm(args.sigterms),
            campaign.sigterm_storm(args.ranks, w2),
            campaign.reshard_kills(args.ranks * 2),
            campaign.io_faults(args.faults),
            campaign.kill_storm(args.asyncs, ASYNC_STEPS),
            campaign.kill_storm(args.asyncs, W2_ASYNC_STEPS),
            campaign.sigterm_storm(args.asyncs, ASYNC_STEPS),
            campaign.sigterm_storm(args.asyncs, W2_ASYNC_STEPS),
            campaign.io_faults(args.asyncs * 2, ASYNC_STEPS),
            campaign.kill_storm(args.torch, TORCH_STEPS),
            campaign.kill_storm(args.torch, [*TORCH_STEPS, ASYNC]),
            campaign.full_disk(),
            campaign.hostile_inputs(args.inputs),
            campaign.races(args.races),
            campaign.reshard_races(args.races),
            campaign.security(),
        ]
    print(f"{'section':<28}{'trials':>8}{'injected':>10}{'late':>6}{'violations':>12}{'bytes lost':>12}  note")
    for s in sections:
        print(f"{s.name:<28}{s.trials:>8}{s.injected:>10}{s.late:>6}{len(s.violations):>12}{s.bytes_lost:>12}  "
              f"{s.note}")
    violations = [v for s in sections for v in s.violations]
    for v in violations:
        print(f"VIOLATION {v}")
    print(f"seed={args.seed} uninterrupted run={campaign.run_seconds:.2f}s")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
