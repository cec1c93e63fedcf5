"""docs/troubleshooting.md quotes what trainjob prints. The cases its commands reproduce are
checked where they run (tests/test_docs_commands.py, its output blocks); this one takes a script
that is not deterministic, which the page shows on the quickstart without its seed (minutes of
torch under prove), here a small numpy loop with an unseeded generator."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.process
def test_prove_twice_on_an_unseeded_script_prints_the_not_deterministic_line_the_page_quotes(tmp_path):
    page = (ROOT / "docs/troubleshooting.md").read_text()
    quoted = re.search(r"^trainjob prove: NOT DETERMINISTIC: .*$", page, re.M)[0]
    proved = subprocess.run([sys.executable, "-m", "trainjob", "prove", "--twice", "--", sys.executable,
                             ROOT / "tests/helpers/unseeded_loop.py", "{pvc}"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # the runs prove keeps on failure
    assert proved.returncode == 1, proved.stderr[-2000:]
    assert quoted in proved.stdout.splitlines(), proved.stdout
