"""examples/finetune.py, the docs' typical training script (AdamW, warm-up + cosine, dropout,
a shuffling StatefulDataLoader over 3 epochs, clipping, accumulation), as a user runs it:
SIGKILLed mid-epoch, at an epoch boundary during a checkpoint, and at random instants of a sync
and an async run, each relaunch ends with the uninterrupted run's artifact bytes and prints the
uninterrupted loss for every step after its resume point. A control per piece of the state
(the same script with that piece left out of its TrainingState) shows the comparison can fail;
the script without trainjob reaches the same weights bit for bit.

Slow (about a minute under load): each case runs the script two or three times."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, built_once
from example_runs import ENV, artifact, finish, killed, losses

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")
pytestmark = pytest.mark.process

EXAMPLE = ROOT / "examples/finetune.py"
SEED = int(os.environ.get("TRAINJOB_KILL_SEED", random.randrange(10 ** 6)))  # printed on failure


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[bytes, dict[int, str]]:
    """The uninterrupted run's artifact and loss lines (one run per test run: built_once)."""

    def run(directory: Path) -> None:
        lines = finish(EXAMPLE, directory / "pvc")
        assert len(lines) == 45 and "completed" in (directory / "pvc/log.jsonl").read_text()
        (directory / "losses.json").write_text(json.dumps(lines))

    directory = built_once(tmp_path_factory, "finetune-reference", run)
    lines = {int(step): loss for step, loss in json.loads((directory / "losses.json").read_text()).items()}
    return artifact(directory / "pvc"), lines


def resumed_matches(reference, pvc: Path, script: Path = EXAMPLE, *flags: str) -> bool:
    """Relaunch (once more if a random kill landed before any checkpoint); the artifact and each
    step's loss after the resume point as the uninterrupted run's."""
    expected_bytes, expected_lines = reference
    lines = finish(script, pvc, *flags)
    assert lines and max(lines) == 45
    return artifact(pvc) == expected_bytes and all(expected_lines[s] == v for s, v in lines.items())


@pytest.mark.parametrize("line", [12, 15], ids=["mid-epoch", "epoch-boundary-during-checkpoint"])
def test_a_kill_resumes_to_the_uninterrupted_bytes_and_losses(reference, tmp_path, line):
    pvc = tmp_path / "pvc"
    killed(EXAMPLE, pvc, at_line=line)
    assert resumed_matches(reference, pvc)


@pytest.mark.parametrize("flags", [(), ("--async-checkpoint",)], ids=["sync", "async"])
def test_kills_at_random_instants_resume_to_the_uninterrupted_bytes_and_losses(reference, tmp_path, flags):
    """Instants drawn as a step and a delay after its loss line (a step takes a few ms, a
    checkpoint more: the delay lands in either), not as wall-clock times, which the machine's
    load would move anywhere, past the run's end included."""
    rng = random.Random(SEED)
    pvc = tmp_path / "pvc"
    first = rng.randrange(2, 21)
    for at in (first, rng.randrange(first + 1, 36)):
        killed(EXAMPLE, pvc, *flags, at_line=at, then=rng.uniform(0, 0.02))
    assert resumed_matches(reference, pvc, EXAMPLE, *flags), f"TRAINJOB_KILL_SEED={SEED}"


CONTROLS = {
    "rng": ("loader=loader)", "loader=loader, rng=False)"),
    "loader": (", loader=loader)", ")"),
    "scheduler": (", scheduler=sched", ""),
    "optimizer": (", optimizer=opt", ""),
}


@pytest.mark.parametrize("piece", CONTROLS)
def test_a_resume_without_one_piece_of_the_state_differs(reference, tmp_path, piece):
    """The control: the same script with one piece left out of its TrainingState."""
    old, new = CONTROLS[piece]
    call, text = "TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)", EXAMPLE.read_text()
    assert text.count(call) == 1
    script = tmp_path / "finetune.py"
    script.write_text(text.replace(call, call.replace(old, new)))
    pvc = tmp_path / "pvc"
    killed(script, pvc, at_line=12)
    assert not resumed_matches(reference, pvc, script)


def test_the_script_without_trainjob_reaches_the_same_weights(reference, tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), "--bare", str(tmp_path / "bare.pt")], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from safetensors.torch import load
    published = load(reference[0])
    bare = torch.load(tmp_path / "bare.pt")
    assert published.keys() == bare.keys()
    assert all(torch.equal(published[k].view(torch.int32), bare[k].view(torch.int32)) for k in bare)


def test_the_docs_show_the_example_file_itself():
    """The how-to page includes the file (pymdownx.snippets; the site's build fails on a missing one)."""
    assert '```python\n--8<-- "examples/finetune.py"\n```' in (ROOT / "docs/howto/typical-script.md").read_text()


def torchrun(pvc: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--monitor-interval", "0.1", str(EXAMPLE), "--pvc", str(pvc)], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.torchrun
def test_under_torchrun_a_kill_of_either_rank_resumes_to_the_uninterrupted_bytes_and_losses(tmp_path):
    """DDP over gloo, each rank with its own loader and RNG (rank-local state, saved per rank). Slow
    (about a minute): four torchrun launches. Also: a reshard to one rank refuses the rank-local
    state unless told to drop it, and logs the drop."""
    from test_run_example import newest_step, rank_pid
    out, err = torchrun(tmp_path / "ref").communicate(timeout=600)
    assert "completed" in (tmp_path / "ref/log.jsonl").read_text(), err[-2000:]
    expected, expected_bytes = losses(out), artifact(tmp_path / "ref")
    rng, pvc = random.Random(SEED), tmp_path / "pvc"
    for victim in (1, 0):
        launcher, after = torchrun(pvc), newest_step(pvc) + 5 * rng.randrange(1, 3)
        while newest_step(pvc) < after and launcher.poll() is None:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.03))  # a random instant of the next steps, checkpoints included
        os.kill(rank_pid(launcher.pid, victim), signal.SIGKILL)
        launcher.communicate(timeout=120)
    reshard = [sys.executable, "-m", "trainjob", "reshard", "--pvc", str(pvc), "--world-size", "1"]
    refused = subprocess.run(reshard, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "holds rank-local state" in refused.stderr and "--drop-rank-local" in refused.stderr
    dropped = subprocess.run([*reshard, "--drop-rank-local"], capture_output=True, text=True, timeout=120)
    assert dropped.returncode == 0 and '"rank_local_dropped"' in (pvc / "log.jsonl").read_text(), dropped.stderr
    out, err = torchrun(pvc).communicate(timeout=600)  # at W=2 it resumes from the W=2 checkpoint, kept
    assert "completed" in (pvc / "log.jsonl").read_text(), err[-2000:]
    assert artifact(pvc) == expected_bytes and all(expected[s] == v for s, v in losses(out).items()), f"seed {SEED}"
