"""docs/lightning.md shows the lines examples/lightning_trainer.py adds for trainjob as they stand in
the file the tests run (no lightning needed: the files are only read)."""

from __future__ import annotations

import re

from conftest import ROOT


def test_the_docs_lines_are_the_examples_own():
    block = re.search(r"## The lines a script adds.*?```python\n(.*?)```", (ROOT / "docs/lightning.md").read_text(),
                      re.S)
    assert block, "docs/lightning.md lost its code block"
    example = (ROOT / "examples/lightning_trainer.py").read_text().splitlines()
    shown = [line for line in block[1].splitlines() if line.strip()]
    assert len(shown) >= 4 and all(line in example for line in shown), shown
