"""Races: several runs started at once on one PVC (one proceeds, the others say busy and exit 75), a
reshard started beside a live run (refused, nothing written), and reshards killed at random instants.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .harness import RACE_STEPS, STEPS, Campaign, Section, spawn, trainjob


def races(campaign: Campaign, trials: int, racers: int = 4) -> Section:
    section = Section("races")
    for trial in range(trials):
        section.trials += 1
        pvc = campaign.pvc("race")
        procs = [spawn("run", "--pvc", pvc, *RACE_STEPS) for _ in range(racers)]
        section.injected += racers - 1
        codes = sorted(p.wait(timeout=120) for p in procs)
        busy = sum("another trainjob run holds this PVC" in p.stderr.read() for p in procs)
        if codes != [0] + [75] * (racers - 1) or busy != racers - 1:
            section.violation(trial, f"racers exited {codes}, {busy} said busy")
        starts = (pvc / "log.jsonl").read_text().count('"job_started"')
        if starts != 1:
            section.violation(trial, f"{starts} job_started events: more than one run proceeded")
        campaign.recover(section, trial, pvc, RACE_STEPS)
    return section


def reshard_races(campaign: Campaign, trials: int) -> Section:
    """A reshard started while a run holds the PVC is told to relaunch and changes nothing."""
    section = Section("reshard races")
    for trial in range(trials):
        section.trials += 1
        pvc = campaign.pvc("rerace")
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
        campaign.recover(section, trial, pvc, RACE_STEPS)
    return section


def reshard_kills(campaign: Campaign, trials: int) -> Section:
    """SIGKILL a reshard at a random instant; reshard again, resume on two ranks."""
    section = Section("reshard kills")
    base = campaign.pvc("rebase")
    trainjob("run", "--pvc", base, *STEPS, "--die-at", "5")
    timing = base.parent / "timing"
    shutil.copytree(base, timing)
    started = time.monotonic()
    trainjob("reshard", "--pvc", timing, "--world-size", "2")
    seconds = time.monotonic() - started
    for trial in range(trials):
        section.trials += 1
        pvc = Path(tempfile.mkdtemp(prefix="rekill-", dir=campaign.work)) / "pvc"
        shutil.copytree(base, pvc)
        proc = spawn("reshard", "--pvc", pvc, "--world-size", "2")
        try:
            proc.wait(timeout=campaign.rng.uniform(0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            section.injected += 1
        again = trainjob("reshard", "--pvc", pvc, "--world-size", "2")
        if again.returncode != 0:
            section.violation(trial, f"reshard after a kill exited {again.returncode}: {again.stderr.strip()[-200:]}")
        campaign.recover(section, trial, pvc, [*STEPS, "--world-size", "2"])
    return section
