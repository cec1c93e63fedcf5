"""The Lightning callback with a frozen layer (issue 58.1: every path, not an HF special case): its
checkpoints hold the trainable layer, its optimizer state and the frozen layer's reference, not the
frozen layer; a SIGTERM and a relaunch publish the uninterrupted run's bytes.

Slow: three launches of examples/lightning_trainer.py with its first layer frozen (each imports
Lightning, seconds of CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, skip_without

pytestmark = pytest.mark.acceptance
EXAMPLE = ROOT / "examples/lightning_trainer.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def frozen_example(path: Path) -> Path:
    source = EXAMPLE.read_text()
    old = "model = Classifier()\n"
    assert old in source
    path.write_text(source.replace(old, old + "model.net[0].requires_grad_(False)  # a frozen first layer\n"))
    return path


@pytest.mark.process
@pytest.mark.killpoint
def test_a_frozen_layer_is_referenced_not_written_and_a_resume_reaches_the_uninterrupted_bytes(tmp_path):
    skip_without("lightning", "needs the lightning extra")
    script = frozen_example(tmp_path / "frozen.py")
    done = subprocess.run([sys.executable, str(script), "--pvc", str(tmp_path / "ref")], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    step = sorted((tmp_path / "ref/checkpoints").glob("step-*"))[-1]
    names = [t["name"] for t in json.loads((step / "manifest.json").read_text())["tensors"]]
    assert not [n for n in names if ".net.0." in n] and "model.net.3.weight" in names, names
    assert [n for n in names if n.startswith("optim.state.net.3.")]
    from safetensors import safe_open
    with safe_open(str(step / "shard-00000-of-00001.safetensors"), "np") as shard:
        assert '"frozen"' in shard.metadata()["trainjob.local"]

    pvc = tmp_path / "pvc"
    proc = subprocess.Popen([sys.executable, str(script), "--pvc", str(pvc)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 12 "):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    again = subprocess.run([sys.executable, str(script), "--pvc", str(pvc)], env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    artifact = "artifacts/model-v1.safetensors"
    assert (pvc / artifact).read_bytes() == (tmp_path / "ref" / artifact).read_bytes()
