"""Security: no code path that evaluates stored data, no group- or world-writable file even under umask 0,
every log line exactly one event, and a symlinked PVC entry refused with its target untouched.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from .harness import ROOT, STEPS, Campaign, Section, trainjob


def security(campaign: Campaign) -> Section:
    section = Section("security")
    section.trials = 3
    forbidden = re.compile(r"\b(pickle|marshal|shelve|eval|exec|yaml\.load|torch\.load)\b")
    for path in sorted((ROOT / "trainjob").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if forbidden.search(code) and not code.strip().startswith(('"', "'")):
                section.violation(0, f"{path.relative_to(ROOT)}:{number} may evaluate stored data: {line.strip()}")
    pvc = campaign.pvc("modes")
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
    pvc = campaign.pvc("link")
    trainjob("run", "--pvc", pvc, *STEPS, "--die-at", "3")
    outside = pvc.parent / "outside.json"
    outside.write_text("precious")
    (pvc / "state.json").unlink()
    (pvc / "state.json").symlink_to(outside)
    result = trainjob("run", "--pvc", pvc, *STEPS)
    if result.returncode != 2 or outside.read_text() != "precious":
        section.violation(3, f"a symlinked state.json gave exit {result.returncode}")
    return section
