"""Regenerate the committed pictures in diagrams/ from the transition table; run after any change
to trainjob/engine/machine.py (tests/views/test_diagram.py fails while a committed picture is stale):

    .venv/bin/python scripts/render_diagrams.py

diagrams/machine.{mmd,dot,svg}  the machine, as the table defines it
diagrams/walkthrough.{dot,svg}  the seed's walkthrough (kill at step 4, resume, complete), drawn
                                from the log of a fresh real run
diagrams/walkthrough.html       the same log as `trainjob replay` steps through it, on machine.svg,
                                its timestamps fixed so the page is the same every time
The mermaid source is also copied between the ``BEGIN/END machine.mmd`` markers of each doc that
embeds it (docs/diagrams.md). SVG needs Graphviz's ``dot``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainjob.views import diagram, replay_page  # noqa: E402
from trainjob.views.history import legal_path  # noqa: E402

DIAGRAMS = ROOT / "diagrams"
# The pages show diagrams/machine.svg itself (scripts/mkdocs_hooks.py draws it inline); this page also
# embeds a copy of the mermaid source, which GitHub draws.
DOCS = [ROOT / "docs" / "diagrams.md"]
# The walkthrough page's timestamps (a real run's change every second): the tutorial's (docs/tutorial/walkthrough.md).
STEADY_TS = "2026-11-30T10:03:24Z"
EMBEDDED = re.compile(r"(<!-- BEGIN machine\.mmd[^>]*-->\n```mermaid\n)(.*?)(```\n<!-- END machine\.mmd -->)", re.S)


def run_walkthrough(workdir: Path) -> Path:
    """The seed's walkthrough through the real CLI; returns its decision log."""
    pvc = workdir / "pvc"
    for args, expected in ((["--die-at", "4", "--steps", "10"], 75), ([], 0)):
        code = subprocess.run([sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc), *args],
                              capture_output=True).returncode
        if code != expected:
            raise SystemExit(f"walkthrough run {args} exited {code}, expected {expected}")
    return pvc / "log.jsonl"


# File under diagrams/ -> (format, drawn on the walkthrough's path?)
PICTURES = {
    "machine.mmd": ("mermaid", False),
    "machine.dot": ("dot", False),
    "machine.svg": ("svg", False),
    "walkthrough.dot": ("dot", True),
    "walkthrough.svg": ("svg", True),
}
TEXT = [name for name, (fmt, _) in PICTURES.items() if fmt in ("mermaid", "dot")]


def render_all(walkthrough_log: Path, names: list[str]) -> dict[str, bytes]:
    """The named files of diagrams/ as the current table draws them."""
    run = legal_path(walkthrough_log)
    title = diagram.run_title(run)
    drawn = {}
    for name in names:
        fmt, on_run = PICTURES[name]
        drawn[name] = diagram.render(fmt, run, title) if on_run else diagram.render(fmt)
    return drawn


def replay_walkthrough(walkthrough_log: Path, machine_svg: bytes, workdir: Path) -> bytes:
    """diagrams/walkthrough.html: the walkthrough's replay page, the same bytes for every run."""
    steady = workdir / "walkthrough.jsonl"
    steady.write_text("".join(json.dumps({**json.loads(line), "ts": STEADY_TS}, separators=(",", ":")) + "\n"
                              for line in walkthrough_log.read_text().splitlines()))
    return replay_page.build(legal_path(steady), machine_svg)


def embed(doc: str, mermaid: str) -> str:
    return EMBEDDED.sub(lambda m: m.group(1) + mermaid + m.group(3), doc)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = run_walkthrough(Path(tmp))
        drawn = render_all(log, list(PICTURES))
        drawn["walkthrough.html"] = replay_walkthrough(log, drawn["machine.svg"], Path(tmp))
    DIAGRAMS.mkdir(exist_ok=True)
    for name, data in drawn.items():
        (DIAGRAMS / name).write_bytes(data)
        print(f"wrote diagrams/{name}")
    for doc in filter(Path.exists, DOCS):
        text = doc.read_text()
        if EMBEDDED.search(text):
            doc.write_text(embed(text, drawn["machine.mmd"].decode()))
            print(f"embedded machine.mmd in {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
