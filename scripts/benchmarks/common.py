"""What every benchmark section shares: sizes, the bracketing of a contender by its reference,
summaries and their formatting, peak RSS, and a description of the machine.

Each section (a module beside this one) measures one thing against a reference measured in the
same run; none of them times anything alone, because this machine's disk and cores are shared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent  # scripts/: bench_torch.py and bench_trainer.py live here
MiB = 1 << 20


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]i?B?)?", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MiB, 1GiB)")
    unit = (m.group(2) or "B")[0].upper()
    return int(m.group(1)) << {"B": 0, "K": 10, "M": 20, "G": 30}[unit]


def vm_hwm() -> int:
    """Peak resident set of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_env(dim: int) -> dict:
    """The environment of a torch section's child: bench_torch.py importable, its model's width, one thread."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])),
            "BENCH_TORCH_DIM": str(dim), "OMP_NUM_THREADS": "1"}


def bench_torch(mode: str, directory: Path, *args: str, env: dict) -> dict:
    """Run ``scripts/bench_torch.py MODE DIRECTORY ARGS...`` in a fresh ``directory``; the JSON it prints last."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_torch.py"), mode, str(directory), *args],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"bench_torch.py {mode} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


PEAK_CHILD = """
import resource, subprocess, sys, time
t0 = time.perf_counter()
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
print(rc, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def measured(cmd: list[str], env: dict) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of ``cmd``, a fresh process, from a wrapper that runs only it."""
    proc = subprocess.run([sys.executable, "-c", PEAK_CHILD, *cmd], capture_output=True, text=True, env=env)
    rc, seconds, peak = proc.stdout.split() if proc.returncode == 0 else ("?", 0, 0)
    if rc != "0":
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return float(seconds), int(peak)



def bracketed(run, ref: str, kinds: list[str]) -> dict[str, list[dict]]:
    """Run ``ref``, then each contender followed by ``ref`` again (R A R B R ...).

    Each contender's run gets ``ref_seconds``: the mean of the reference runs on either side, so
    its ratio is to the disk as it was while it ran, not at some other moment of the repeat.
    """
    before = run(ref)
    before["ref_seconds"] = before["seconds"]
    out = {ref: [before]}
    for kind in kinds:
        r = run(kind)
        after = run(ref)
        after["ref_seconds"] = after["seconds"]
        r["ref_seconds"] = (before["seconds"] + after["seconds"]) / 2
        out[ref].append(after)
        out[kind] = [r]
        before = after
    return out


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def have_torch() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


def cpu_probe() -> dict:
    """How much a second thread buys right now: sha256 of 64 MiB on one thread, then on two at once.

    The cores are shared with other tenants; when the second core is busy, overlapping hashing
    with I/O (what trainjob does) cannot beat doing both in series, and this says so.
    """
    import threading
    buf = os.urandom(1 << 20) * 64
    one, two = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        hashlib.sha256(buf)
        one.append(time.perf_counter() - t0)
        threads = [threading.Thread(target=hashlib.sha256, args=(buf,)) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        two.append(time.perf_counter() - t0)
    return {"sha256_mb_per_s_one_thread": len(buf) / 1e6 / statistics.median(one),
            "two_thread_speedup": 2 * statistics.median(one) / statistics.median(two)}


def machine(work: Path) -> dict:
    mem = next((int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal:")), 0)
    dev = fs = "?"
    best = ""
    for line in open("/proc/mounts"):
        d, mnt, kind = line.split()[:3]
        if str(work.resolve()).startswith(mnt) and len(mnt) > len(best):
            best, dev, fs = mnt, d, kind
    versions = {}
    for pkg in ("numpy", "safetensors", "torch", "transitions", "attrs", "cattrs"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cores": os.cpu_count(), "memory_gib": round(mem / (1 << 30), 1), "disk": f"{dev} ({fs}) at {best}",
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions}



def fmt(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def targets_lines(targets: dict[str, bool]) -> list[str]:
    return [f"- [{'x' if ok else ' '}] {name}" for name, ok in targets.items()]
