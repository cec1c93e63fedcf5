"""The PyTorch adapter and the torchrun example: DDP over gloo, one trainjob rank per process.

Skipped only where torch cannot be imported; ``scripts/test.sh`` installs ``torch==2.13.0``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, trainjob

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'trainjob[torch]')")
pytest.importorskip("sklearn", reason="scikit-learn (the digits extra) is not installed")

from trainjob.trainers.torch_state import from_arrays, materialize_sgd, to_arrays  # noqa: E402

FLAGS = ("--trainer", "torch_digits:make", "--steps", "8", "--ckpt-every", "1", "--keep", "2",
         "--rank-timeout", "20")
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "examples"), "OMP_NUM_THREADS": "1"}


def test_adapter_round_trips_module_and_momentum_without_pickle():
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    materialize_sgd(opt)
    net(torch.ones(4, 3)).sum().backward()
    opt.step()
    arrays = to_arrays(net, opt)
    assert sorted(arrays) == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight",
                              "optim.0.momentum_buffer", "optim.1.momentum_buffer", "optim.2.momentum_buffer",
                              "optim.3.momentum_buffer"]
    assert all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in arrays.values())
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    materialize_sgd(other_opt)
    from_arrays(arrays, other, other_opt)
    assert all(np.array_equal(arrays[k], b) for k, b in to_arrays(other, other_opt).items())


def torchrun(pvc: Path, data: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--monitor-interval", "0.1", "-m", "trainjob", "run", "--pvc", str(pvc),
                             "--data", str(data), *FLAGS],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def rank_pid(launcher: int, rank: int) -> int:
    """The worker process torchrun started for ``rank`` (read from its environment)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no worker for rank {rank}")


def newest_step(pvc: Path) -> int:
    names = [p.name for p in (pvc / "checkpoints").glob("step-*")] if (pvc / "checkpoints").is_dir() else []
    return max((int(n[5:13]) for n in names), default=0)


def arrays(pvc: Path):
    return json.loads((pvc / "artifacts/model-v1.json").read_text())["arrays"]


@pytest.mark.process
def test_torchrun_kill_either_rank_then_relaunch_resumes_to_the_same_weights(tmp_path):
    data = tmp_path / "data"
    assert trainjob("gen", "--dataset", "digits", data).returncode == 0
    reference = torchrun(tmp_path / "ref", data)
    # Alone, not alongside the victim's launches: on two cores a second job's load can push a
    # rank past --rank-timeout, which ends a launch (honestly, 75) before the test can kill it.
    assert reference.wait(120) == 0, reference.stderr.read()[-2000:]
    pvc = tmp_path / "pvc"
    step = 0
    for victim in (1, 0):  # SIGKILL rank 1 in one launch, rank 0 in the next
        launcher = torchrun(pvc, data)
        deadline = time.monotonic() + 90
        while newest_step(pvc) < step + 2 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert launcher.poll() is None, "the launch ended before the kill: " + "\n".join(
            line for line in launcher.stderr.read().decode(errors="replace").splitlines() if "trainjob" in line)
        step = newest_step(pvc)
        os.kill(rank_pid(launcher.pid, victim), signal.SIGKILL)
        assert launcher.wait(120) != 0
    final = torchrun(pvc, data)
    assert final.wait(120) == 0, final.stderr.read().decode()[-3000:]
    log = (pvc / "log.jsonl").read_text()
    assert log.count('"event":"resumed"') >= 2 and log.count('"event":"job_started"') == 1
    assert arrays(pvc) == arrays(tmp_path / "ref")
    manifest = json.loads((pvc / "checkpoints/step-00000008-a0001-w002/manifest.json").read_text())
    assert [s["rank"] for s in manifest["shards"]] == [0, 1]
