"""Replicated state at W = 2 (issue 44): DDP + BatchNorm under ``trainjob torchrun``, killed and
resumed, publishes the uninterrupted run's bytes; an entry whose ranks' copies genuinely differ
is refused (exit 2, naming it and the ranks), never written half from each.

The script is tests/helpers/ddp_batchnorm.py: rank 1's batches are scaled, so the ranks' BatchNorm
running statistics differ at every checkpoint. Before this, the checkpoint split each of them
by rows across the ranks, and a resume published other bytes (the loss lines all agreed).
Slow (a few minutes under load, each launch mostly importing torch): seven torchrun launches in all,
each variant's reference built once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, built_once, events, trainjob

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.process, pytest.mark.torchrun]

SCRIPT = ROOT / "tests/helpers/ddp_batchnorm.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(pvc: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node", "2",
                             "--monitor-interval", "0.1", str(SCRIPT), "--pvc", str(pvc), *flags],
                            env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def finish(pvc: Path, *flags: str) -> tuple[int, str]:
    proc = launch(pvc, *flags)
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


def artifact(pvc: Path) -> bytes:
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()


def committed(pvc: Path) -> list[Path]:
    return sorted(p.parent for p in (pvc / "checkpoints").glob("step-*/manifest.json"))


def worker(launcher: int, rank: int) -> int:
    """The pid of rank ``rank``'s worker under the launcher (its child, RANK in its environment)."""
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"no worker for rank {rank}")


# DDP's default, checkpoints written by the loop; broadcast_buffers=False, written by the background
# writer (the receipts, digests and rank-local parts through the async path).
VARIANTS = {"broadcast": (), "no-broadcast-async": ("--no-broadcast", "--async-checkpoint")}


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory) -> tuple[tuple[str, ...], bytes]:
    """A variant's flags and its uninterrupted run's published bytes (one launch per test run:
    built_once)."""
    flags = VARIANTS[request.param]

    def run(directory: Path) -> None:
        code, err = finish(directory / "pvc", *flags)
        assert code == 0, err[-2000:]

    return flags, artifact(built_once(tmp_path_factory, f"ddp-batchnorm-{request.param}", run) / "pvc")


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
def test_a_kill_mid_run_resumes_to_the_uninterrupted_published_weights(reference, tmp_path):
    """Rank 1 SIGKILLed once the checkpoint of step 8 is committed (16 steps of 0.1 s still to go);
    the relaunch resumes from the newest one and publishes the uninterrupted bytes. Checked on the
    PVC too: each parameter is split; each BatchNorm buffer is written whole by rank 0 (rank 1's
    slice of it empty), or with ``--no-broadcast`` by each rank into its own shard's rank-local
    part, the two copies differing."""
    flags, expected = reference
    pvc = tmp_path / "pvc"
    launcher = launch(pvc, *flags)
    deadline = time.monotonic() + 300
    while len(committed(pvc)) < 2 and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.poll() is None, launcher.communicate()[1][-2000:]
    os.kill(worker(launcher.pid, 1), signal.SIGKILL)
    launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    newest = committed(pvc)[-1]
    step = json.loads((newest / "manifest.json").read_text())["step"]
    assert 8 <= step < 24, step  # a resume mid-run, not a relaunch of a finished job
    holds = {(s["rank"], h["name"]): h["shape"] for s in json.loads((newest / "manifest.json").read_text())["shards"]
             for h in s["holds"]}
    assert holds[0, "model.0.weight"][0] == holds[1, "model.0.weight"][0] == 8
    buffers = ("model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked")
    if "--no-broadcast" in flags:  # each rank's own, in its shard's header
        assert not any((r, name) in holds for r in (0, 1) for name in buffers)
        own = [local_buffers(newest, r)["1.running_mean"].data for r in (0, 1)]
        assert own[0] != own[1]
    else:
        for name in buffers:
            assert holds[0, name][0] > 0 and holds[1, name][0] == 0, name

    code, err = finish(pvc, *flags)
    assert code == 0, err[-2000:]
    assert [e for e, _ in events(pvc / "log.jsonl") if e == "resumed"], "the relaunch did not resume"
    assert artifact(pvc) == expected


def local_buffers(checkpoint: Path, rank: int) -> dict:
    """The DDP buffers rank ``rank`` kept in its shard's rank-local part."""
    from trainjob.checkpoint.snapshot import LOCAL_KEY
    from trainjob.plain import decode
    raw = (checkpoint / f"shard-{rank:05d}-of-00002.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    parts = decode(header["__metadata__"][LOCAL_KEY])  # [[path of keys, part], ...]
    return next(part for path, part in parts if path == ["rank"])["buffers"]


@pytest.mark.parametrize("flags", [(), ("--async-checkpoint",)], ids=["sync", "async"])
def test_an_entry_whose_ranks_disagree_is_refused_naming_it_and_the_ranks(tmp_path, flags):
    """``--disagree``: an ``extra`` module's buffer sums each rank's own inputs. The first
    checkpoint is refused on every rank (exit 2) with one line naming the entry and the ranks,
    nothing is committed, and the log says so (``refused``), so ``status`` says 2 as well; with
    ``--async-checkpoint`` too, where the writer thread finds it while the log says
    ``snapshotted``."""
    pvc = tmp_path / "pvc"
    code, err = finish(pvc, "--disagree", *flags)
    assert code == 2, err[-2000:]
    said = [line for line in err.splitlines() if "differs between ranks" in line]
    assert said and "extra.seen.total" in said[0] and "(rank 0 and rank 1 hold different values)" in said[0], err[-2000:]
    assert "model.1.running_mean" not in err  # DDP's buffers have their source: never the refusal
    assert committed(pvc) == []
    last, detail = events(pvc / "log.jsonl")[-1]
    assert last == "refused" and detail.startswith("at_step=4 ") and "extra.seen.total" in detail
    assert trainjob("status", pvc / "log.jsonl").returncode == 2
