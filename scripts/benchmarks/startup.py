"""The start-up section: how long a fresh `trainjob` takes to start, against bare Python and numpy.

Every test, supervisor, relaunch, `status` and `verify` starts a new process, so start-up is
paid thousands of times. Each command runs ``repeat`` times, interleaved with its two references
(``python -c pass`` and ``python -c "import numpy"``) so all see the same machine; the figure is
the median wall time and its ratio to each reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .common import fmt, summary

# The target (issue 24): a light command starts in at most twice an `import numpy`.
NUMPY_TIMES = 2.0


def commands(work: Path) -> dict[str, list[str]]:
    log = work / "startup-log.jsonl"
    log.write_text(json.dumps({"ts": "2026-12-02T00:00:00Z", "event": "job_started",
                               "detail": "steps=10 attempt=1"}) + "\n")
    py = sys.executable
    return {"python -c pass": [py, "-c", "pass"], "python -c 'import numpy'": [py, "-c", "import numpy"],
            "python -c 'import trainjob'": [py, "-c", "import trainjob"],
            "trainjob --help": [py, "-m", "trainjob", "--help"],
            "trainjob status (one line)": [py, "-m", "trainjob", "status", str(log)]}


def wall(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run_section(work: Path, repeat: int) -> dict:
    todo = commands(work)
    seconds: dict[str, list[float]] = {name: [] for name in todo}
    bare_ratio: dict[str, list[float]] = {name: [] for name in todo}
    numpy_ratio: dict[str, list[float]] = {name: [] for name in todo}
    for name in todo:
        wall(todo[name])  # warm the page cache once, as a machine that runs trainjob often has it
    for _ in range(repeat):
        for name, argv in todo.items():
            bare, t, numpy = wall(todo["python -c pass"]), wall(argv), wall(todo["python -c 'import numpy'"])
            seconds[name].append(t)
            bare_ratio[name].append(t / bare)
            numpy_ratio[name].append(t / numpy)
    out = {name: {"seconds": summary(seconds[name]), "x_python": summary(bare_ratio[name]),
                  "x_numpy": summary(numpy_ratio[name])} for name in todo}
    light = [n for n in todo if n.startswith(("trainjob", "python -c 'import trainjob"))]
    return {"commands": out, "targets": {
        f"start-up: {n} <= {NUMPY_TIMES:g}x import numpy": out[n]["x_numpy"]["median"] <= NUMPY_TIMES for n in light}}


def table(s: dict) -> list[str]:
    lines = ["start-up, fresh processes, median (min..max)", "",
             "| command | ms | x python -c pass | x import numpy |", "| --- | --- | --- | --- |"]
    for name, c in s["commands"].items():
        ms = {k: v * 1e3 for k, v in c["seconds"].items()}
        lines.append(f"| `{name}` | {fmt(ms, 0)} | {fmt(c['x_python'])} | {fmt(c['x_numpy'])} |")
    return lines
