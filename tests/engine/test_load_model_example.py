"""examples/load_model.py, docs/howto/load-model.md's loader: the model examples/own_loop.py
published loads into a fresh module once the export's ``model.`` prefix is stripped, and scores
what the gate saw; the plain ``load_state_dict(load_file(...))`` fails as the page quotes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT, events, skip_without

skip_without("torch", "the example is a torch script (trainjob[torch])")
pytestmark = pytest.mark.process

NAIVE = """import sys, torch
from safetensors.torch import load_file
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).double()
net.load_state_dict(load_file(sys.argv[1]))
"""


def test_the_published_model_loads_into_a_fresh_module_and_scores_what_the_gate_saw(tmp_path):
    pvc = tmp_path / "own"
    trained = subprocess.run([sys.executable, ROOT / "examples/own_loop.py", "--pvc", pvc],
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    gate = re.fullmatch(r"holdout: (\d+)/100 vs baseline \d+/100", events(pvc / "log.jsonl")[-1][1])
    artifact = pvc / "artifacts/model-v1.safetensors"

    loaded = subprocess.run([sys.executable, ROOT / "examples/load_model.py", artifact],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout == f"attempt 1, step 40: the gate saw {gate[1]}/100, this module scores {gate[1]}/100\n"

    naive = subprocess.run([sys.executable, "-c", NAIVE, artifact], capture_output=True, text=True, timeout=300)
    assert naive.returncode == 1
    page = (ROOT / "docs/howto/load-model.md").read_text()
    quoted = re.search(r"the plain load fails:\n\n```text\n(.*?)```", page, re.S)[1]
    said = [line.strip() for line in naive.stderr.splitlines()]
    assert [line.strip() for line in quoted.splitlines() if line.strip() not in said] == []
