"""examples/vision.py, a typical vision script (a CNN with BatchNorm and Dropout, AdamW in two
parameter groups, warm-up + cosine SequentialLR, a GradScaler, a shuffling StatefulDataLoader whose
Dataset adds noise, flips and a brightness drawn from torch, random and numpy in its workers, one
random and one numpy draw per step, ``export=net.state_dict()``), as a user runs it, with
``--workers 0`` and ``--workers 2``: uninterrupted, it publishes the weights the script trains
without trainjob, bit for bit; SIGKILLed at a checkpoint and again at a random instant, the
relaunch publishes the uninterrupted bytes and prints the uninterrupted loss at every step after
its resume point; ``trainjob prove`` says PROVEN. The control: without the workers' streams in the
loader's snapshot, a resume with workers publishes other bytes. Under ``trainjob torchrun`` at
W = 2 (DDP with BatchNorm) ``prove`` says PROVEN too.

Slow (a few minutes under load): each case runs the script two or three times, about 15 s each
on a loaded 2-core machine; the references are built once per test run."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, built_once
from example_runs import ENV, artifact, finish, killed

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")
pytestmark = [pytest.mark.process, pytest.mark.acceptance]  # scripts/test.sh's acceptance step

EXAMPLE = ROOT / "examples/vision.py"
SEED = int(os.environ.get("TRAINJOB_KILL_SEED", random.randrange(10 ** 6)))  # printed on failure
STEPS = 48  # 3 epochs of 16 batches, a checkpoint every 4 steps


def reference(factory: pytest.TempPathFactory, workers: int) -> tuple[bytes, dict[int, str]]:
    def run(directory: Path) -> None:
        lines = finish(EXAMPLE, directory / "pvc", "--workers", str(workers))
        assert sorted(lines) == list(range(1, STEPS + 1))
        (directory / "losses.json").write_text(json.dumps(lines))

    directory = built_once(factory, f"vision-reference-w{workers}", run)
    lines = {int(step): loss for step, loss in json.loads((directory / "losses.json").read_text()).items()}
    return artifact(directory / "pvc"), lines


def resumed_matches(expected: tuple[bytes, dict[int, str]], script: Path, pvc: Path, workers: int) -> bool:
    lines = finish(script, pvc, "--workers", str(workers))
    assert lines and max(lines) == STEPS and '"resumed"' in (pvc / "log.jsonl").read_text()
    return artifact(pvc) == expected[0] and all(expected[1][s] == v for s, v in lines.items())


@pytest.mark.parametrize("workers", [0, 2])
def test_the_script_without_trainjob_reaches_the_same_weights(tmp_path_factory, tmp_path, workers):
    """trainjob draws nothing, in the loop or in the workers: the same bits with and without it.
    The published safetensors hold BatchNorm's 0-d num_batches_tracked as 0-d."""
    from safetensors.torch import load
    expected = reference(tmp_path_factory, workers)
    done = subprocess.run([sys.executable, str(EXAMPLE), "--bare", str(tmp_path / "bare.pt"), "--workers", str(workers)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    published, bare = load(expected[0]), torch.load(tmp_path / "bare.pt")
    assert published.keys() == bare.keys() and "1.num_batches_tracked" in bare
    for k in bare:
        assert published[k].shape == bare[k].shape and published[k].dtype == bare[k].dtype, k
        assert published[k].numpy().tobytes() == bare[k].numpy().tobytes(), k
    assert published["1.num_batches_tracked"].shape == () and int(published["1.num_batches_tracked"]) == STEPS


@pytest.mark.parametrize("workers", [0, 2])
def test_kills_at_a_checkpoint_and_at_a_random_instant_resume_to_the_uninterrupted_bytes(tmp_path_factory, tmp_path,
                                                                                          workers):
    """The first kill after step 12's loss line (its checkpoint is due: mid-epoch, the workers'
    streams far from their seeds), the second at a random step of the second or third epoch."""
    expected = reference(tmp_path_factory, workers)
    rng, pvc = random.Random(SEED), tmp_path / "pvc"
    killed(EXAMPLE, pvc, "--workers", str(workers), at_line=12)
    killed(EXAMPLE, pvc, "--workers", str(workers), at_line=rng.randrange(17, 40), then=rng.uniform(0, 0.05))
    assert resumed_matches(expected, EXAMPLE, pvc, workers), f"TRAINJOB_KILL_SEED={SEED}"


def test_without_the_workers_streams_a_resume_with_workers_publishes_other_bytes(tmp_path_factory, tmp_path):
    """The control: the same script with trainjob's worker streams switched off (worker_rng.install
    made a no-op before the script runs); the loader's position and every other piece still resume."""
    expected = reference(tmp_path_factory, 2)
    script = tmp_path / "vision_without_worker_streams.py"
    script.write_text("import runpy, sys\nfrom trainjob.trainers.torch import worker_rng\n"
                      "worker_rng.install = lambda loader: None\n"
                      f"sys.argv[0] = {str(EXAMPLE)!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    pvc = tmp_path / "pvc"
    killed(script, pvc, "--workers", "2", at_line=12)
    assert not resumed_matches(expected, script, pvc, 2)


@pytest.mark.killpoint
@pytest.mark.parametrize("workers", [0, 2])
def test_prove_says_proven(capsys, workers):
    """One trial (between checkpoints, a resume) beside prove's own reference: the kills above
    cover the rest."""
    from trainjob import cli
    code = cli.main(["prove", "--kills", "1", "--", sys.executable, str(EXAMPLE), "--pvc", "{pvc}",
                     "--workers", str(workers)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PROVEN" in out and out.count("same bytes, verified") == 1 and "-9 0" in out


@pytest.mark.killpoint
@pytest.mark.torchrun
def test_prove_says_proven_under_trainjob_torchrun_at_two_ranks_ddp_with_batchnorm(capsys):
    """DDP broadcasts rank 0's BatchNorm statistics at each forward, then each rank updates its own
    copy: the checkpoint writes them from rank 0, so the resume is the uninterrupted run's (a mix
    of the ranks' copies published other weights). Slower than 20 s: three launches of two ranks
    (prove's reference, one trial and its relaunch), with a loader worker per rank."""
    from trainjob import cli
    code = cli.main(["prove", "--kills", "1", "--", sys.executable, "-m", "trainjob", "torchrun", "--standalone",
                     "--nproc-per-node", "2", "--monitor-interval", "0.1", str(EXAMPLE), "--pvc", "{pvc}",
                     "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PROVEN" in out and out.count("same bytes, verified") == 1, out
