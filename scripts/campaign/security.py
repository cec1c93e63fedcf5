"""Security: no code path that evaluates stored data, no group- or world-writable file even under umask 0,
every log line exactly one event, and a symlinked PVC entry refused with its target untouched.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

from .harness import ROOT, STEPS, Campaign, Section, trainjob


FORBIDDEN = {"pickle", "marshal", "shelve", "eval", "exec"}
FORBIDDEN_LOADS = {"yaml", "torch"}  # yaml.load, torch.load (yaml.safe_load and safetensors are fine)


def evaluating(path: Path) -> list[tuple[int, str]]:
    """The lines of ``path`` whose code (not its strings or comments) names a way to run stored data."""
    found = []
    names = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
             if t.type in (tokenize.NAME, tokenize.OP)]
    for before, dot, name in zip([None, None, *names], [None, *names], names):
        if name.type != tokenize.NAME:
            continue
        if name.string in FORBIDDEN or (name.string == "load" and dot is not None and dot.string == "."
                                        and before is not None and before.string in FORBIDDEN_LOADS):
            found.append((name.start[0], name.line))
    return found


def security(campaign: Campaign) -> Section:
    section = Section("security")
    section.trials = 3
    # Read as Python reads it (tokens), not as lines: a docstring saying "an eval metric" is prose.
    for path in sorted((ROOT / "trainjob").rglob("*.py")):
        for number, line in evaluating(path):
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
