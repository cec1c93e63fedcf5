"""Hostile inputs: one file a run reads damaged (seeded corruptions of its bytes) or replaced by what a
file must not be (issue 19's classes). Every run ends in bounded time with exit 2 and one line, the PVC
unchanged, or with exit 0 and the undamaged artifact. Forged manifests (``forged_manifests``): a
checkpoint's manifest edited so that its slices land elsewhere, every digest still right, are
refused by a resume falling back to them and by a reshard.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from .harness import STEPS, W2_STEPS, Campaign, Section, label, snapshot, trainjob


def hostile_inputs(campaign: Campaign, trials: int) -> Section:
    """Damage one file a run reads: its bytes (a seeded corruption), or what it is (issue 19's
    classes: a FIFO, socket or device in its place, a link to /dev/zero, a sparse file of a
    gigabyte, a manifest whose sizes and world size are absurd but whose hashes agree, a log
    line holding escape sequences or a 5000-digit number). Every run must end in bounded time
    with exit 2 and one line (the PVC unchanged) or exit 0 with the undamaged artifact."""
    section = Section("hostile inputs")
    base = campaign.pvc("base")
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
        work = Path(tempfile.mkdtemp(prefix="hostile-", dir=campaign.work))
        shutil.copytree(base, work / "pvc")
        shutil.copytree(data, work / "data")
        target = next(work.glob(campaign.rng.choice(targets)))
        original = target.read_bytes()
        if campaign.rng.random() < 0.5:
            kind, corrupted = corrupt(original, campaign.rng)
            if corrupted == original:
                continue
            target.write_bytes(corrupted)
        else:
            kind = make_hostile(work, target, campaign.rng)
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
            if (work / "pvc/artifacts/model-v1.json").read_bytes() != campaign.reference:
                section.violation(trial, f"{where}: exit 0 with a different artifact (silently wrong)")
            if target.parent.parent.name == "checkpoints" and \
                    '"checkpoint_rejected"' not in (work / "pvc/log.jsonl").read_text():
                section.violation(trial, f"{where}: a damaged checkpoint was resumed without a word")
        else:
            section.violation(trial, f"{where}: exit {result.returncode}: {result.stderr.strip()[-200:]}")
    return section


def forge(manifest: Path, rng: random.Random) -> str:
    """Edit a two-rank manifest so that its shards' bytes would load elsewhere, every digest still
    matching its file: the forgeries of issue 54. The name of the one made."""
    record = json.loads(manifest.read_text())
    a, b = record["shards"]
    kind = rng.choice(["slices swapped", "shards handed to each other's ranks", "slices swapped, schema 2"])
    if kind == "shards handed to each other's ranks":  # each entry, its rows and its file, given to the other rank
        record["shards"] = [dict(b, rank=0), dict(a, rank=1)]
        for entry, (rows, _) in zip(record["shards"], ((0, 2), (2, 4))):
            entry["holds"][0]["start"] = rows
    else:
        a["holds"][0]["start"], b["holds"][0]["start"] = b["holds"][0]["start"], a["holds"][0]["start"]
        if kind.endswith("schema 2"):  # as an older trainjob wrote it: headers that do not say where
            record["schema"] = 2
    manifest.write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
    return kind


def forged_manifests(campaign: Campaign, trials: int, flags: list[str] = W2_STEPS) -> Section:
    """A two-rank run cut short (three checkpoints), then one manifest forged (``forge``): an older
    one, behind a newest whose shard has a flipped byte, so the resume must fall back past it (it
    must not resume the forged checkpoint; it ends 0 with the uninterrupted bytes from the one
    below, or 2 with the PVC unchanged), or the newest, which `trainjob reshard` must refuse
    (2, one line, nothing written). `verify` calls the forged one corrupt either way."""
    section = Section(label("forged manifests", flags))
    torchrun = campaign.torchrun(flags)
    for trial in range(trials):
        section.trials += 1
        pvc = campaign.pvc("forged")
        trainjob("run", "--pvc", pvc, *flags, "--die-at", "7", torchrun=torchrun)
        committed = sorted((pvc / "checkpoints").glob("step-*"))  # steps 5, 6, 7 (--keep 3)
        target = campaign.rng.choice(committed)
        kind = forge(target / "manifest.json", campaign.rng)
        section.injected += 1
        where = f"{target.name}: {kind}"
        verdicts = trainjob("verify", "--pvc", pvc).stdout
        if f"corrupt   checkpoint checkpoints/{target.name}" not in verdicts:
            section.violation(trial, f"{where}: verify did not call it corrupt")
        before = snapshot(pvc)
        if target == committed[-1]:
            result = trainjob("reshard", "--pvc", pvc, "--world-size", "4")
            changed = snapshot(pvc) != before
            if result.returncode != 2 or len(result.stderr.strip().splitlines()) != 1 or changed:
                section.violation(trial, f"{where}: reshard exited {result.returncode}, the PVC "
                                         f"{'' if changed else 'un'}changed: {result.stderr.strip()[-200:]}")
            continue
        shard = committed[-1] / "shard-00001-of-00002.safetensors"
        shard.write_bytes(flip(shard.read_bytes(), campaign.rng))
        before = snapshot(pvc)
        result = trainjob("run", "--pvc", pvc, *flags, torchrun=torchrun)
        resumed = [line for line in (pvc / "log.jsonl").read_text().splitlines() if '"resumed"' in line]
        if resumed and f"from_step={int(target.name[5:13])}" in resumed[-1]:
            section.violation(trial, f"{where}: the forged checkpoint was resumed")
        if result.returncode == 0:
            if (pvc / "artifacts/model-v1.json").read_bytes() != campaign.reference_for(flags):
                section.violation(trial, f"{where}: exit 0 with a different artifact (silently wrong)")
        elif result.returncode != 2 or snapshot(pvc) != before:
            section.violation(trial, f"{where}: exit {result.returncode}: {result.stderr.strip()[-300:]}")
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
