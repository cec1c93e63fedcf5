"""examples/quickstart_before.py and examples/quickstart_after.py, the two sides of the Quickstart's
diff (docs/quickstart.md): the script under trainjob trains exactly what the script alone trains,
checkpoints it, gates it and publishes it."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, events, skip_without

skip_without("torch", "the quickstart is a torch script (trainjob[torch])")
pytestmark = pytest.mark.process

BEFORE, AFTER = ROOT / "examples/quickstart_before.py", ROOT / "examples/quickstart_after.py"


def test_the_script_under_trainjob_publishes_the_weights_the_script_alone_saves(tmp_path):
    from safetensors.numpy import load_file

    alone = subprocess.run([sys.executable, BEFORE, "--out", tmp_path / "before.safetensors"],
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    under = subprocess.run([sys.executable, AFTER, "--pvc", tmp_path / "pvc"], capture_output=True, text=True, timeout=300)
    assert under.returncode == 0, under.stderr[-2000:]

    saved, published = load_file(tmp_path / "before.safetensors"), load_file(tmp_path / "pvc/artifacts/model-v1.safetensors")
    assert sorted(saved) == sorted(published) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(np.array_equal(saved[name], published[name]) for name in saved)  # bit for bit

    log = events(tmp_path / "pvc/log.jsonl")
    assert [d.split()[0] for e, d in log if e == "checkpointed"] == ["step=10", "step=20", "step=30"]
    holdout = re.fullmatch(r"holdout: (\d+)/64 vs baseline (\d+)/64", log[-1][1])
    assert log[-1][0] == "completed" and holdout and int(holdout[1]) > int(holdout[2])
    assert f"holdout: {holdout[1]}/64" in alone.stdout  # the score the script alone printed


def test_the_quickstart_page_shows_the_diff_of_these_two_files():
    """The page holds the marker the site's hook turns into their diff (scripts/mkdocs_hooks.py),
    never a copy; tests/test_docs_site.py checks the built page shows both files' lines."""
    page = (ROOT / "docs/quickstart.md").read_text()
    assert "<!-- diff: examples/quickstart_before.py examples/quickstart_after.py -->" in page
    assert "```python" not in page
