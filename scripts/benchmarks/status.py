"""The status section: ``trainjob status`` on a log of a million lines, its seconds and peak RSS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .common import MiB


STATUS_CHILD = """
import sys, time, io, contextlib
from trainjob.cli import main
out = io.StringIO()
t0 = time.perf_counter()
try:
    with contextlib.redirect_stdout(out):
        main(["status", sys.argv[1]])
except SystemExit:
    pass
elapsed = time.perf_counter() - t0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(elapsed, hwm)
"""


def run_section(work: Path, lines: int) -> dict:
    log = work / "long.jsonl"
    first = '{"ts":"2026-11-30T00:00:00Z","event":"job_started","detail":"attempt=1 steps=10"}\n'
    line = '{"ts":"2026-11-30T00:00:00Z","event":"checkpointed","detail":"step=4 loss_milli=241"}\n'
    with open(log, "w") as f:
        f.write(first)
        block = line * 10000
        for _ in range((lines - 1) // 10000):
            f.write(block)
        f.write(line * ((lines - 1) % 10000))
    proc = subprocess.run([sys.executable, "-c", STATUS_CHILD, str(log)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"status benchmark failed: {proc.stderr[-2000:]}")
    seconds, hwm = proc.stdout.split()
    log.unlink()
    return {"lines": lines, "seconds": float(seconds), "peak_mib": int(hwm) / MiB}


def table(status: dict) -> list[str]:
    return [f"status on {status['lines']:,} lines: {status['seconds']:.1f} s, peak RSS {status['peak_mib']:.0f} MiB"]
