"""Every fsync and rename a checkpoint makes is announced: docs/checkpoints.md's table of durability
points is compared, row by row, with the calls a real run makes (traced in process).

A point that appears (a new fsync, say) or disappears without the table changing fails here, so
the cost of a checkpoint and the failure each call guards against stay written down.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fstrace
from conftest import ROOT
from trainjob import cli

# The traced processes import this checkout and tests/fstrace.py, whatever the caller's PYTHONPATH.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}

Point = tuple[str, str]


def documented() -> list[Point]:
    """The (call, on) columns of the table under "Durability points of one checkpoint (W=1)"."""
    text = (ROOT / "docs/checkpoints.md").read_text()
    section = text.split("### Durability points of one checkpoint (W=1)", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| \d+ \| (fsync|rename) \| `([^`]+)` \|", section, re.M)
    assert len(rows) >= 5, "the table is gone"
    return rows


def traced(monkeypatch: pytest.MonkeyPatch, pvc: Path, *flags: str) -> list[Point]:
    """Every fsync, rename and replace ``trainjob run`` makes (tests/fstrace.py's tracer)."""
    seen: list[Point] = []
    fstrace.record(str(pvc), seen, lambda name, wrapper: monkeypatch.setattr(os, name, wrapper))
    assert cli.main(["run", "--pvc", str(pvc), *flags]) == 0
    monkeypatch.undo()
    return seen


def checkpoints(points: list[Point]) -> list[list[Point]]:
    """The run's points cut into one list per checkpoint: from a shard's fsync to the log line
    that announces it."""
    found, current = [], None
    for point in points:
        if point[0] == "fsync" and "/shard-" in point[1] and point[1].startswith("checkpoints/.tmp-"):
            current = []
            found.append(current)
        if current is not None:
            current.append(point)
            if point == ("fsync", "log.jsonl"):
                current = None
    return found


def test_a_steady_checkpoint_makes_exactly_the_documented_fsyncs_and_renames(tmp_path, monkeypatch):
    points = traced(monkeypatch, tmp_path / "pvc", "--steps", "3", "--ckpt-every", "1", "--keep", "1")
    made = checkpoints(points)
    assert len(made) == 3
    assert made[-1] == documented()  # the third: the state is already `checkpointed`, one to rotate


def test_the_first_checkpoint_adds_only_the_state_record_before_its_log_line(tmp_path, monkeypatch):
    first = checkpoints(traced(monkeypatch, tmp_path / "pvc", "--steps", "3", "--ckpt-every", "1", "--keep", "1"))[0]
    state = [("fsync", "state.json.tmp.N"), ("rename", "state.json.tmp.N -> state.json"), ("fsync", ".")]
    no_rotation = [p for p in documented() if ".trash-" not in p[1]]
    assert first == no_rotation[:-1] + state + no_rotation[-1:]


@pytest.mark.process
@pytest.mark.torchrun
def test_under_torchrun_rank_0_makes_the_documented_points_and_every_other_rank_one_fsync(tmp_path):
    """At W=2 through torchrun's store (the receipts go through the store, not the PVC), rank 0's
    checkpoint is the W=1 table's, and rank 1's is its shard's fsync and nothing else."""
    out = tmp_path / "trace"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.1", str(ROOT / "tests/fstrace.py"), str(out), "run", "--pvc",
                           str(tmp_path / "pvc"), "--steps", "3", "--ckpt-every", "1", "--keep", "1"],
                          capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    rank0, rank1 = ([tuple(p) for p in json.loads(Path(f"{out}-rank{r}.json").read_text())] for r in (0, 1))
    assert checkpoints(rank0)[-1] == documented()
    assert rank1 == [("fsync", "checkpoints/.tmp-step-N-aN-wN.gN/shard-N-of-N.safetensors")] * 3


@pytest.mark.process
@pytest.mark.torchrun
def test_ranks_coordinating_through_the_pvc_add_one_unsynced_rename_per_checkpoint_on_the_others(tmp_path):
    """Ranks started on their own (no launcher's store) hand rank 0 their receipts as files: rank
    0's checkpoint is still the table's, and rank 1 adds one rename, its receipt's, with no fsync
    (the manifest that copies it is what becomes durable; a crash before that abandons it all)."""
    out, pvc = tmp_path / "trace", tmp_path / "pvc"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/fstrace.py"), str(out), "run", "--pvc", str(pvc),
                               "--steps", "3", "--ckpt-every", "1", "--keep", "1", "--world-size", "2",
                               "--rank", str(r)], stderr=subprocess.PIPE, text=True,
                              env=ENV)
             for r in (0, 1)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
        p.stderr.close()
    rank0, rank1 = ([tuple(p) for p in json.loads(Path(f"{out}-rank{r}.json").read_text())] for r in (0, 1))
    assert checkpoints(rank0)[-1] == documented()
    staged = "checkpoints/.tmp-step-N-aN-wN.gN/shard-N-of-N.safetensors"
    receipt = ("rename", f"{staged}.receipt.json.tmp.N -> {staged}.receipt.json")
    assert rank1[rank1.index(("fsync", staged)):] == [("fsync", staged), receipt] * 3
