"""Lightning scripts written the way Lightning's own docs write them (``tests/integrations/scripts/``),
with only the lines docs/lightning.md adds, proven by ``trainjob prove --kills 4 --signal both``:

- ``lightning_datamodule.py``: a LightningDataModule with two workers on both loaders (the training
  set drawing its augmentation in them), OneCycleLR per step, gradient accumulation, clipping, and
  an EarlyStopping that fires (step 56 of 210): the run publishes the model it stopped with;
- ``lightning_ddp.py``: W=2 ``strategy="ddp"`` with BatchNorm and Lightning's own DistributedSampler,
  under ``trainjob torchrun``;
- ``lightning_max_steps.py``: ``Trainer(max_steps=60)`` alone.

Each failed on the main branch before issue 56: the first ended 2 ("the fit ended before step 57"),
and killed and resumed published the full 210-step model; the second refused its first checkpoint
(BatchNorm's statistics differ between the ranks, exit 2), and once it trained, diverged from the
first resume past epoch 0 (the sampler); the third was refused at the start ("this fit has 0 train
loaders").

Slow (minutes each under load): a proof is the reference run and four trials, each killed once and
relaunched; every launch imports lightning. The tests run in their own directory (Lightning's default
logger and ModelCheckpoint write ``lightning_logs/`` into the working directory).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, skip_without

skip_without("lightning", "lightning (the lightning extra) is not installed")
skip_without("torchdata", "torchdata (the torch extra) is not installed")
pytestmark = [pytest.mark.process, pytest.mark.acceptance]

SCRIPTS = ROOT / "tests/integrations/scripts"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TORCHRUN = [sys.executable, "-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.1"]


def proven(command: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    """``trainjob prove --kills 4 --signal both -- command``: its report, asserted PROVEN."""
    import tempfile

    from trainjob import cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["prove", "--kills", "4", "--signal", "both", "--", *command, "--pvc", "{pvc}"])
    out = capsys.readouterr().out
    assert code == 0 and "verdict: PROVEN" in out and "4 signals delivered" in out, out
    return out


def launch(script: Path, pvc: Path, cwd: Path, *, replace: tuple[str, str] | None = None,
           prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (with ``replace`` made in a copy of it) to its end."""
    if replace is not None:
        text = script.read_text()
        assert text.count(replace[0]) == 1, replace[0]
        script = cwd / script.name
        script.write_text(text.replace(*replace))
    return subprocess.run([*(prefix or [sys.executable]), str(script), "--pvc", str(pvc)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=900)


def refused_in_one_line(done: subprocess.CompletedProcess, naming: str, pvc: Path) -> None:
    """Exit 2, one ``trainjob:`` line naming ``naming``, no traceback, and no PVC made."""
    said = [line for line in done.stderr.splitlines() if line.startswith("trainjob:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(said) == 1 and naming in said[0] and said[0].endswith("(exit 2)"), said
    assert not pvc.exists()


def events(pvc: Path) -> list[tuple[str, str]]:
    return [(e["event"], e["detail"]) for e in map(json.loads, (pvc / "log.jsonl").read_text().splitlines())]


def published_step(pvc: Path) -> int:
    from trainjob.engine.job import read_artifact_record

    data = (pvc / "artifacts/model-v1.safetensors").read_bytes()
    return read_artifact_record(data, "model-v1").step


DATAMODULE = SCRIPTS / "lightning_datamodule.py"
DDP = SCRIPTS / "lightning_ddp.py"
MAX_STEPS = SCRIPTS / "lightning_max_steps.py"
CALLBACK = "job = TrainJob(args.pvc, ckpt_every=5, gate=score)"


def test_early_stopping_ends_the_run_where_it_fired_and_killed_and_resumed_ends_the_same(tmp_path):
    """EarlyStopping fires after epoch 8 (step 56 of the 210 that max_epochs=30 gives): the run
    saves step 56 (not a checkpoint step: forced), publishes that model (its record says 56),
    logs ``completed`` and exits 0. Stopped at step 35 (an epoch's last step: the checkpoint is
    taken before EarlyStopping's epoch-end check, which the resume runs again on the val_loss it
    saved) and relaunched, it ends the same: step 56, the same bytes. Three launches."""
    whole = launch(DATAMODULE, tmp_path / "whole", tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    log = events(tmp_path / "whole")
    assert log[0] == ("job_started", "steps=210 attempt=1")
    assert [d.split()[0] for e, d in log if e == "checkpointed"][-2:] == ["step=55", "step=56"]
    assert [e for e, _ in log][-2:] == ["artifact_written", "completed"]
    assert published_step(tmp_path / "whole") == 56

    stops = launch(DATAMODULE, tmp_path / "pvc", tmp_path, replace=(CALLBACK, CALLBACK.replace("score)",
                                                                                              "score, die_at=35)")))
    assert stops.returncode == 75 and events(tmp_path / "pvc")[-1] == ("killed", "at_step=35"), stops.stderr[-3000:]
    relaunch = launch(DATAMODULE, tmp_path / "pvc", tmp_path)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    resumed = events(tmp_path / "pvc")
    after = resumed[resumed.index(("resumed", "from_step=35")):]
    assert [d for e, d in after if e == "checkpointed"] == [d for e, d in log if e == "checkpointed"][-5:], after
    assert [e for e, _ in after][-2:] == ["artifact_written", "completed"]
    assert (tmp_path / "pvc/artifacts/model-v1.safetensors").read_bytes() == \
        (tmp_path / "whole/artifacts/model-v1.safetensors").read_bytes()


@pytest.mark.killpoint
def test_prove_finds_the_datamodule_script_with_early_stopping_proven(tmp_path, monkeypatch, capsys):
    """Slower than 20 s: the reference and four trials (SIGKILL and SIGTERM, at every phase)."""
    proven([sys.executable, str(DATAMODULE)], tmp_path, monkeypatch, capsys)


@pytest.mark.killpoint
@pytest.mark.torchrun
def test_prove_finds_ddp_with_batchnorm_and_lightnings_sampler_proven_under_trainjob_torchrun(
        tmp_path, monkeypatch, capsys):
    """Slower than 20 s: the reference and four trials of two DDP ranks each. A TERM trial needs
    the validation loader's workers guarded against a group SIGTERM, as the train loader's are
    (issue 54 item 8, ``trainers/torch/workers.py``): without it they die and the rank ends 70.
    Under load, one DataLoader worker in some hundreds never came out of os.fork() (CPython 3.11's
    gh-112275), holding the run until gloo's timeout: ``trainers/torch/forking.py``."""
    proven([*TORCHRUN, str(DDP)], tmp_path, monkeypatch, capsys)


def test_sync_batchnorm_on_cpu_is_refused_in_one_line_with_exit_2_before_the_pvc_is_touched(tmp_path):
    """torch's DDP refuses SyncBatchNorm on CPU with a ValueError when Lightning wraps the model,
    which ended the run 70 with a traceback. One DDP process (``devices=1``) is enough to show it."""
    done = launch(DDP, tmp_path / "pvc", tmp_path,
                  replace=('devices=2, strategy="ddp",', 'devices=1, strategy="ddp", sync_batchnorm=True,'))
    refused_in_one_line(done, "sync_batchnorm=True on CPU", tmp_path / "pvc")


def test_stochastic_weight_averaging_is_refused_in_one_line_with_exit_2_before_the_pvc_is_touched(tmp_path):
    """Lightning's StochasticWeightAveraging (as its docs add it: one callback) completed when
    never killed, but a relaunch after a checkpoint of its epochs was refused at the resume
    (exit 2: the optimizer's param groups had gained ``initial_lr`` and ``swa_lr``), the
    training lost. Now refused before anything is written."""
    done = launch(MAX_STEPS, tmp_path / "pvc", tmp_path, replace=(
        "L.Trainer(max_steps=60, callbacks=[job])",
        "L.Trainer(max_epochs=6, callbacks=[job, L.pytorch.callbacks.StochasticWeightAveraging(swa_lrs=1e-2)])"))
    refused_in_one_line(done, "StochasticWeightAveraging", tmp_path / "pvc")


@pytest.mark.killpoint
def test_prove_finds_max_steps_alone_proven(tmp_path, monkeypatch, capsys):
    """Slower than 20 s: the reference and four trials."""
    out = proven([sys.executable, str(MAX_STEPS)], tmp_path, monkeypatch, capsys)
    assert re.search(r"reference [\d.]+ s, 6 checkpoints", out), out
