"""The built wheel works outside the clone: built from pyproject.toml, installed in a fresh venv
(no system site-packages, no editable install, no PYTHONPATH), it runs the lab job on its embedded
data to the walkthrough's bytes, draws the machine, replays a log (the page's template is package
data), prints its help and ships py.typed. What catches a file a future wheel leaves out."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

IN_CI = bool(os.environ.get("CI"))
SHA = "983aeb4b31e715b4d129cc2aa70f80c8dda23d5b631b10e700705943f091ad5f"  # the walkthrough's model-v1.json


def step(argv: list[str | Path], what: str, **kwargs: object) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{what} exited {done.returncode}: {done.stderr[-3000:]}"
    return done


@pytest.mark.process
@pytest.mark.acceptance  # about 45 s on a loaded 2-core machine: the test command's acceptance step
def test_the_wheel_installed_in_a_fresh_venv_runs_the_lab_draws_replays_and_helps(tmp_path):
    """About 45 s here, most of it installing numpy and building: a wheel built from a copy of the
    sources (so the build's own files, build/ and *.egg-info, never land in the clone other tests
    are reading), a venv without pip, the wheel with its diagrams extra installed by the shared
    venv's pip (its dependencies from the package index, as a user's would be: one left out of
    pyproject.toml fails here; no bytecode compiled), then six commands from another directory."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "trainjob", source / "trainjob", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", tmp_path / "dist", source], capture_output=True, text=True, timeout=300)
    if built.returncode != 0 and "No module named" in built.stderr and not IN_CI:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip().splitlines()[-1]}")
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("trainjob-*.whl")

    venv = tmp_path / "venv"
    step([sys.executable, "-m", "venv", "--without-pip", venv], "python -m venv")
    python, trainjob = venv / "bin/python", venv / "bin/trainjob"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile",
                                f"{wheel}[diagrams]"],
                               capture_output=True, text=True, timeout=300)
    if installed.returncode != 0 and not IN_CI:  # no package index reachable: the dependencies cannot come
        pytest.skip(f"cannot install the wheel's dependencies here: {installed.stderr.strip()[-300:]}")
    assert installed.returncode == 0, installed.stderr[-3000:]

    outside = tmp_path / "elsewhere"  # not the clone: nothing of it on sys.path
    outside.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = step([python, "-c", "import trainjob, pathlib; p = pathlib.Path(trainjob.__file__).parent; "
                                "print(p); assert (p / 'py.typed').is_file() and (p / 'views/replay_page.html').is_file()"],
                 "the installed package", cwd=outside, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    helped = step([trainjob, "--help"], "trainjob --help", cwd=outside, env=env)
    assert "usage: trainjob" in helped.stdout and "run" in helped.stdout
    ran = step([trainjob, "run", "--pvc", "pvc"], "trainjob run", cwd=outside, env=env)
    assert hashlib.sha256((outside / "pvc/artifacts/model-v1.json").read_bytes()).hexdigest() == SHA
    assert ran.stderr.splitlines()[-1].startswith("trainjob: completed (exit 0): published pvc/artifacts/model-v1.json")
    drawn = step([trainjob, "diagram"], "trainjob diagram", cwd=outside, env=env)
    assert drawn.stdout.startswith("---") or "stateDiagram-v2" in drawn.stdout
    if shutil.which("dot") is None and not IN_CI:
        return  # the replay page needs Graphviz's dot (scripts/test.sh installs it)
    step([trainjob, "replay", "pvc/log.jsonl", "-o", "run.html"], "trainjob replay", cwd=outside, env=env)
    assert b"<svg" in (outside / "run.html").read_bytes()
