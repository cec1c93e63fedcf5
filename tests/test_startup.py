"""Start-up stays light: what `import trainjob`, `trainjob --help` and `trainjob status` load.

Every `trainjob` a test, a supervisor, a relaunch or a person starts pays for its imports, and
ml_dtypes alone once cost 0.9 s of each. The heavy packages load only in the command that needs
them; these tests pin that by the modules a fresh interpreter holds afterwards (times are
scripts/bench.py's business: `--only startup`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Packages no light command may load: each costs tens of milliseconds to most of a second.
HEAVY = ("numpy", "torch", "torchdata", "ml_dtypes", "safetensors", "matplotlib", "graphviz", "kubernetes_validate",
         "yaml", "sklearn", "selenium", "boto3", "botocore", "obstore", "asyncio", "importlib.metadata")
# trainjob's own heavy parts: the engine and everything that writes checkpoints.
ENGINE = ("trainjob.engine.job", "trainjob.engine.run", "trainjob.checkpoint", "trainjob.ranks",
          "trainjob.trainers.protocol")


def loaded_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(tuple(h + "." for h in HEAVY + ENGINE)) or m in HEAVY + ENGINE]


@pytest.mark.process
def test_import_trainjob_loads_no_heavy_package():
    assert heavy(loaded_after("import trainjob")) == []


@pytest.mark.process
def test_the_public_names_still_import_on_first_use():
    modules = loaded_after("import trainjob\nassert trainjob.Run and trainjob.Score and trainjob.Stateful")
    assert "trainjob.engine.run" in modules and "numpy" in modules


@pytest.mark.process
def test_help_loads_no_heavy_package():
    modules = loaded_after("from trainjob import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass")
    assert "argparse" in modules and heavy(modules) == []


@pytest.mark.process
def test_status_of_a_small_log_loads_no_heavy_package(tmp_path: Path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"ts": "2026-12-02T00:00:00Z", "event": "job_started", "detail": "steps=10 attempt=1"})
                   + "\n")
    modules = loaded_after(f"from trainjob import cli\nassert cli.main(['status', {str(log)!r}]) == 75")
    assert "trainjob.views.status" in modules and heavy(modules) == []


@pytest.mark.process
def test_a_bfloat16_dtype_code_still_loads_ml_dtypes_when_asked():
    modules = loaded_after("from trainjob.tensors import np_dtype\nassert np_dtype('BF16').itemsize == 2")
    assert "ml_dtypes" in modules
