"""I/O faults: libfiu fails write, fsync, rename or open inside a running trainjob, or open while
``trainjob run`` loads its own modules (``import_faults``), or every read of a checkpoint's shards
while a run resumes (``read_faults``: at W=1 and W=2, and in one rank of an FSDP verdict round);
a real tiny tmpfs fills up under one. Each run must end 0 or 75 with one line, and never leave a
torn checkpoint; a read that fails never sets a good checkpoint aside.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from trainjob.deploy.launches import last_event, with_descendants

from pathlib import Path

from .harness import ROOT, STEPS, ASYNC, Campaign, Section, command, label, snapshot, spawn, trainjob


def io_faults(campaign: Campaign, trials: int, flags: list[str] = STEPS) -> Section:
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
        pvc = campaign.pvc("fiu")
        ctrl = campaign.work / f"fiu-{trial}"
        # --quiet: a fault's error must be one line, which the progress lines around it would hide.
        proc = spawn("run", "--pvc", pvc, *flags, "--quiet", prefix=("fiu-run", "-x", "-f", str(ctrl)))
        # Arm the fault only once the run is under way: failing the interpreter's own imports
        # would test Python, not trainjob.
        while last_event(pvc) is None and proc.poll() is None:
            time.sleep(0.005)
        probability = campaign.rng.choice([0.05, 0.2, 1.0])
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
        campaign.recover(section, trial, pvc, flags)
    if ASYNC in flags:
        section.note = f"{in_writer} of the faults ended the run from the writer thread's checkpoint I/O"
    return section


# `trainjob run`, started so that the campaign arms libfiu after the interpreter and the command
# line's own modules are loaded and before the command loads the rest (the engine, numpy): those
# imports are trainjob's to map (errors.importing), the interpreter's start-up is not.
ARMED_START = ("import sys, trainjob.cli; print('loaded', flush=True); sys.stdin.readline(); "
               "sys.argv[0] = 'trainjob'; trainjob.cli.entry()")


def import_faults(campaign: Campaign, trials: int, flags: list[str] = STEPS) -> Section:
    """open() fails (EMFILE, ENOMEM or EIO, at a random probability) from the moment ``trainjob
    run`` starts loading its command's modules: exit 75 with one line (or 0, if no fault struck),
    never 70 with a traceback; then the PVC recovers as after any fault."""
    section = Section("import faults")
    if not shutil.which("fiu-run") or not shutil.which("fiu-ctrl"):
        section.note = "skipped: fiu-run/fiu-ctrl not installed (apt-get install fiu-utils)"
        return section
    struck = 0
    for trial in range(trials):
        section.trials += 1
        pvc, ctrl = campaign.pvc("fiu-import"), campaign.work / f"fiu-import-{trial}"
        proc = subprocess.Popen(["fiu-run", "-x", "-f", str(ctrl), sys.executable, "-B", "-c", ARMED_START, "run",
                                 "--pvc", str(pvc), *flags, "--quiet"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()  # "loaded": the command line's modules are in
        fault = campaign.rng.choice([errno.EMFILE, errno.ENOMEM, errno.EIO])
        probability = campaign.rng.choice([0.1, 0.5, 1.0])
        armed = subprocess.run(["fiu-ctrl", "-f", str(ctrl), "-c", f"enable_random name=posix/io/oc/open,"
                                f"probability={probability},failinfo={fault}", str(proc.pid)], capture_output=True)
        proc.stdin.write("go\n")
        proc.stdin.close()
        code = proc.wait(timeout=120)
        stderr = proc.stderr.read()
        if armed.returncode == 0:
            section.injected += 1
        struck += code == 75
        lines = stderr.strip().splitlines()
        if code not in (0, 75):
            section.violation(trial, f"{errno.errorcode[fault]} p={probability}: exit {code}: {stderr.strip()[-300:]}")
        elif code == 75 and (len(lines) != 1 or not lines[0].startswith("trainjob run: ")):
            section.violation(trial, f"{errno.errorcode[fault]} p={probability}: expected one line, got "
                                     f"{stderr.strip()[-300:]!r}")
        campaign.recover(section, trial, pvc, flags)
    section.note = f"{struck} of {trials} runs ended 75 on the fault"
    return section


# A read of a shard: front to back (readv) or by offset (Python's preadv is glibc's preadv2, which
# libfiu does not wrap; at the world size that wrote it a resume reads by offset only the header of
# rank 0's shard, so failing readv fails every share).
READS = ("posix/io/rw/readv", "posix/io/rw/preadv")
READ_ERRORS = (errno.EIO, errno.ETIMEDOUT)


def checkpoints_of(pvc: Path) -> dict[str, bytes]:
    """The checkpoints' files, by name (what a read error must leave as it was)."""
    return {name: data for name, data in snapshot(pvc).items() if name.startswith("checkpoints/")}


def read_faults(campaign: Campaign, trials: int, flags: list[str] = STEPS) -> Section:
    """A run cut short, then resumed with libfiu failing its shard reads (EIO or ETIMEDOUT in
    turn, every read or half of them at random): it must end 75 (or 0, when no read failed),
    rank 0's line naming storage trouble, with every checkpoint as it was (none set aside as
    rejected, no fallback logged), and recover to the uninterrupted bytes once the reads succeed."""
    section = Section(label("read faults", flags))
    if not shutil.which("fiu-run"):
        section.note = "skipped: fiu-run not installed (apt-get install fiu-utils)"
        return section
    torchrun = campaign.torchrun(flags)
    wait = ["--rank-timeout", "5"] if "--world-size" in flags else []  # the files: rank 1 waits out rank 0's end
    for trial in range(trials):
        section.trials += 1
        pvc = campaign.pvc("reads")
        trainjob("run", "--pvc", pvc, *flags, "--die-at", str(campaign.rng.randrange(3, 8)), torchrun=torchrun)
        before = checkpoints_of(pvc)
        fault, probability = READ_ERRORS[trial % 2], campaign.rng.choice([1.0, 0.5])
        enable = [f for point in READS for f in ("-c", f"enable_random name={point},probability={probability},"
                                                        f"failinfo={fault}")]
        result = trainjob("run", "--pvc", pvc, *flags, *wait, prefix=("fiu-run", "-x", *enable), torchrun=torchrun)
        section.injected += 1
        where = f"{errno.errorcode[fault]} p={probability}"
        first = (result.stderr.strip().splitlines() or [""])[0]
        if result.returncode not in (0, 75):
            section.violation(trial, f"{where}: exit {result.returncode}: {result.stderr.strip()[-300:]}")
        elif result.returncode == 75 and "storage trouble" not in first:
            section.violation(trial, f"{where}: 75 without naming storage trouble: {result.stderr.strip()[-300:]}")
        if result.returncode == 75 and checkpoints_of(pvc) != before:
            section.violation(trial, f"{where}: the checkpoints changed on a read error: "
                                     f"{sorted(set(checkpoints_of(pvc)) ^ set(before))[:4]}")
        if '"checkpoint_rejected"' in (pvc / "log.jsonl").read_text(errors="replace"):
            section.violation(trial, f"{where}: a checkpoint was rejected over a read error")
        campaign.recover(section, trial, pvc, flags)
    return section


FSDP = ROOT / "examples/fsdp.py"


def descendant_of_rank(root: int, rank: int) -> int | None:
    """The pid of the process below ``root`` whose environment says RANK=``rank`` (a torchrun
    worker), or None while there is none."""
    for pid in with_descendants(root)[1:]:
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            pass
    return None


def verdict_read_faults(campaign: Campaign, trials: int) -> Section:
    """FSDP2 under `trainjob torchrun` at W=2, cut short, then resumed with libfiu failing every
    shard read of rank 1 alone (armed in its process as soon as it exists, with EIO or ETIMEDOUT
    in turn) while it verifies its share in the verdict round: rank 1 must answer "failed", not
    "refused", so the launch ends 75 for every rank, no checkpoint set aside, and a relaunch
    resumes from the newest and completes."""
    section = Section("read faults FSDP verdict")
    try:
        import torch  # noqa: F401  (only to know whether the example can run)
    except ImportError:
        section.note = "skipped: torch is not installed"
        return section
    if not shutil.which("fiu-run") or not shutil.which("fiu-ctrl"):
        section.note = "skipped: fiu-run/fiu-ctrl not installed (apt-get install fiu-utils)"
        return section
    launch = ("torchrun", "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", FSDP)
    for trial in range(trials):
        section.trials += 1
        pvc, ctrl = campaign.pvc("verdict"), campaign.work / f"fiu-verdict-{trial}"
        first = spawn(*launch, "--pvc", pvc, "--steps", "8")
        while not any(pvc.glob("checkpoints/step-*")) and first.poll() is None:
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGTERM)  # to the launch: it stops with a checkpoint (75)
        first.communicate(timeout=300)
        before = checkpoints_of(pvc)
        fault = READ_ERRORS[trial % 2]
        resumed = spawn(*launch, "--pvc", pvc, "--steps", "8", prefix=("fiu-run", "-x", "-f", str(ctrl)))
        rank1 = None
        while rank1 is None and resumed.poll() is None:
            rank1 = descendant_of_rank(resumed.pid, 1)
            time.sleep(0.01)
        armed = rank1 is not None and subprocess.run(
            ["fiu-ctrl", "-f", str(ctrl), "-c", f"enable name=posix/io/rw/readv,failinfo={fault}", str(rank1)],
            capture_output=True).returncode == 0
        stderr = resumed.communicate(timeout=600)[1]
        code = resumed.returncode
        section.injected += armed
        where = errno.errorcode[fault]
        if not armed or code == 0:
            section.note = "a fault armed too late counts as not injected"
        elif code != 75 or "rank 1 failed verifying its share" not in stderr or "storage trouble" not in stderr:
            section.violation(trial, f"{where}: exit {code}: {stderr.strip()[-400:]}")
        if checkpoints_of(pvc) != before and code != 0:
            section.violation(trial, f"{where}: the checkpoints changed on a read error")
        relaunch = subprocess.run(command((*launch, "--pvc", pvc, "--steps", "8")), capture_output=True, text=True,
                                  timeout=600)
        log = (pvc / "log.jsonl").read_text(errors="replace")
        if relaunch.returncode != 0 or '"checkpoint_rejected"' in log:
            section.violation(trial, f"{where}: the relaunch exited {relaunch.returncode} "
                                     f"{'after a rejection' if 'checkpoint_rejected' in log else ''}: "
                                     f"{relaunch.stderr.strip()[-300:]}")
    return section


def full_disk(campaign: Campaign) -> Section:
    section = Section("full disk")
    mount = campaign.work / "tiny"
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
        campaign.recover(section, 0, pvc)
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
    return section
