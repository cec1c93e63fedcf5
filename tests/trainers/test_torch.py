"""The PyTorch adapter and the torchrun example: DDP over gloo, one trainjob rank per process.

Skipped only where torch cannot be imported; ``scripts/test.sh`` installs ``torch==2.13.0``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, built_once, said, skip_without, snapshot, trainjob

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'trainjob[torch]')")
skip_without("sklearn", "scikit-learn (the digits extra) is not installed")

from trainjob.torch import load_state_dict, materialize_sgd, state_dict  # noqa: E402

pytestmark = pytest.mark.process  # every test here runs the CLI or torchrun in a subprocess

# 16 steps (a step is about 50 ms of CPU): each interrupted launch is signalled two checkpoints
# after its resume, and on a loaded machine a SIGTERM's agreed stop lands some steps later. At 8
# steps the second launch once finished before its signal could reach a worker.
FLAGS = ("--trainer", "torch_digits:make", "--steps", "16", "--ckpt-every", "1", "--keep", "2",
         "--rank-timeout", "20")
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "examples"), "OMP_NUM_THREADS": "1"}


def sgd_net(seed: int):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    materialize_sgd(opt)
    return net, opt


def test_adapter_hands_out_the_live_tensors_and_loads_into_them_in_place():
    net, opt = sgd_net(0)
    net(torch.ones(4, 3)).sum().backward()
    opt.step()
    live = state_dict(net, opt)
    assert sorted(live) == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight",
                            "optim.0.momentum_buffer", "optim.1.momentum_buffer", "optim.2.momentum_buffer",
                            "optim.3.momentum_buffer"]
    assert live["model.0.weight"].data_ptr() == net[0].weight.data_ptr()  # a view, not a copy
    assert live["optim.3.momentum_buffer"].data_ptr() == opt.state[net[2].bias]["momentum_buffer"].data_ptr()
    other, other_opt = sgd_net(1)
    before = {k: v.data_ptr() for k, v in state_dict(other, other_opt).items()}
    load_state_dict(live, other, other_opt)
    after = state_dict(other, other_opt)
    assert {k: v.data_ptr() for k, v in after.items()} == before  # copied into the same tensors
    assert all(torch.equal(live[k], after[k]) for k in live)
    with pytest.raises(KeyError, match="missing"):
        load_state_dict({k: v for k, v in live.items() if k != "model.0.bias"}, other, other_opt)


def torchrun(pvc: Path, data: Path, *flags: str, script: tuple[str, ...] = ("-m", "trainjob"),
             env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--monitor-interval", "0.1", *script, "run", "--pvc", str(pvc),
                             "--data", str(data), *FLAGS, *flags],
                            env=env or ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


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
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()


def after_each_step(out: Path) -> list[dict[str, list[str]]]:
    return [json.loads(Path(f"{out}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, digits_data) -> tuple[Path, bytes, list[dict[str, list[str]]]]:
    """The digits data, the artifact an uninterrupted W=2 torchrun run ends with, and that run's
    file-system calls after each step (tests/fscount.py, through torchrun's store). One launch
    per test run, shared by the workers (built_once). It checkpoints every 4 steps where the
    launches compared with it checkpoint at every step: how often a run saves must not change
    what it trains."""

    def launch(directory: Path) -> None:
        # Alone, not alongside the victim's launches: on two cores a second job's load can push a
        # rank past --rank-timeout, which ends a launch (honestly, 75) before the test can kill it.
        launcher = torchrun(directory / "ref", digits_data, "--ckpt-every", "4",
                            script=(str(ROOT / "tests/fscount.py"), str(directory / "calls")),
                            env={**ENV, "TRAINJOB_COORDINATION": "store"})
        assert launcher.wait(120) == 0, launcher.stderr.read()[-2000:]

    directory = built_once(tmp_path_factory, "torchrun-reference", launch)
    return digits_data, arrays(directory / "ref"), after_each_step(directory / "calls")


def interrupt_twice_then_finish(pvc: Path, data: Path, sig: signal.Signals) -> list[str]:
    """Send ``sig`` to rank 1 in one launch and to rank 0 in the next, each at the launch's first
    checkpoint (newer than all the launch before left, a SIGTERM's own checkpoint included); then
    a last launch finishes. What torchrun said of each interrupted launch."""
    step, said = 0, []
    for victim in (1, 0):
        launcher = torchrun(pvc, data)
        deadline = time.monotonic() + 90
        while newest_step(pvc) <= step and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert launcher.poll() is None, "the launch ended before the signal: " + "\n".join(
            line for line in launcher.stderr.read().decode(errors="replace").splitlines() if "trainjob" in line)
        os.kill(rank_pid(launcher.pid, victim), sig)
        assert launcher.wait(120) != 0
        said.append(launcher.stderr.read().decode(errors="replace"))
        step = newest_step(pvc)
    final = torchrun(pvc, data)
    assert final.wait(120) == 0, final.stderr.read().decode()[-3000:]
    return said


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.torchrun
def test_torchrun_kill_either_rank_then_relaunch_resumes_to_the_same_weights(tmp_path, reference):
    """Slower than 20 s under load: three launches of two torch workers (rank 1 killed, rank 0
    killed, the relaunch), checked against the module's one reference launch."""
    data, expected, _ = reference
    pvc = tmp_path / "pvc"
    interrupt_twice_then_finish(pvc, data, signal.SIGKILL)
    log = (pvc / "log.jsonl").read_text()
    assert log.count('"event":"resumed"') >= 2 and log.count('"event":"job_started"') == 1
    assert log.count('"detail":"transport=store world_size=2"') == 3  # torchrun's store, in every launch
    assert arrays(pvc) == expected
    manifest = json.loads((pvc / "checkpoints/step-00000016-a0001-w002/manifest.json").read_text())
    assert [s["rank"] for s in manifest["shards"]] == [0, 1]


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.torchrun
def test_torchrun_sigterm_to_either_rank_stops_both_at_one_step_with_a_checkpoint_and_resumes(tmp_path,
                                                                                             reference):
    """Slower than 20 s under load: three launches of two torch workers, as the SIGKILL test above."""
    data, expected, _ = reference
    pvc = tmp_path / "pvc"
    said = interrupt_twice_then_finish(pvc, data, signal.SIGTERM)
    for launch in said:  # torchrun names each failed worker with its exit code: both relaunchable
        assert launch.count("exitcode  : 75") == 2, launch[-2000:]
    logged = [(e["event"], e["detail"]) for e in map(json.loads, (pvc / "log.jsonl").read_text().splitlines())]
    kills = [i for i, (event, _) in enumerate(logged) if event == "killed"]
    assert [logged[i][1].split(" signal=")[1] for i in kills] == ["SIGTERM@rank1", "SIGTERM"]
    for i in kills:  # each stop saved the step every rank agreed on, just before it was logged
        at_step = logged[i][1].split()[0].removeprefix("at_step=")
        assert logged[i - 1][0] == "checkpointed" and logged[i - 1][1].startswith(f"step={at_step} ")
    assert arrays(pvc) == expected


@pytest.mark.torchrun
def test_torchrun_ranks_make_no_file_system_call_on_a_step_without_a_checkpoint(tmp_path, reference):
    """tests/fscount.py counts trainjob's own file-system calls after each step, at each rank. Through
    torchrun's store (the reference launch): none but at checkpoints (every 4th). Through the PVC's
    files: a directory listing after every step, which a network file system serves late and at a
    cost (docs/checkpoints.md)."""
    data, expected, through_store = reference
    for calls in through_store:
        quiet = {step: names for step, names in calls.items() if int(step) % 4}
        assert quiet == {} and all(calls[str(s)] for s in (4, 8, 12, 16)), calls  # it sees checkpoints
    out = tmp_path / "files"
    launcher = torchrun(tmp_path / "pvc", data, "--ckpt-every", "4", script=(str(ROOT / "tests/fscount.py"), str(out)),
                        env={**ENV, "TRAINJOB_COORDINATION": "files"})
    assert launcher.wait(120) == 0, launcher.stderr.read().decode()[-3000:]
    for calls in after_each_step(out):
        assert sorted(int(step) for step in calls if int(step) % 4) == [s for s in range(1, 16) if s % 4], calls
    assert arrays(tmp_path / "pvc") == expected  # either transport, the same training


# --- a torch trainer written to the Stateful protocol: bad state is bad input (exit 2) ---------------

LAB = {**os.environ, "PYTHONPATH": str(ROOT / "tests/helpers"), "OMP_NUM_THREADS": "1"}
LAB_FLAGS = ("--trainer", "torch_trainers:make", "--steps", "3", "--ckpt-every", "1")


def lab_torch(pvc: Path, *flags: str, bad: str = "") -> subprocess.CompletedProcess:
    return trainjob("run", "--pvc", pvc, *LAB_FLAGS, *flags, env={**LAB, "TRAINJOB_TEST_BAD": bad}, timeout=120)


@pytest.fixture(scope="module")
def killed_at_1(tmp_path_factory) -> Path:
    """A torch run killed after its step-1 checkpoint: the PVC the bad relaunches must not change."""
    pvc = tmp_path_factory.mktemp("torch") / "pvc"
    result = lab_torch(pvc, "--die-at", "1")
    assert result.returncode == 75, result.stderr
    return pvc


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = said(result.stderr)  # a relaunch's progress lines before it: not its error
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("kind, says", [
    ("not_a_tensor", "state_dict(): model.0.weight: a set cannot be checkpointed as a plain value"),
    ("non_contiguous", "a non-contiguous tensor"),
    ("sparse", "a sparse tensor"),
    ("load_raises", "load_state_dict raised ValueError: this trainer refuses every checkpoint"),
])
def test_a_state_that_cannot_be_checkpointed_or_loaded_exits_2_and_changes_nothing(tmp_path, killed_at_1, kind,
                                                                                    says):
    pvc = tmp_path / "pvc"
    shutil.copytree(killed_at_1, pvc)
    before = snapshot(pvc)
    line = one_line(lab_torch(pvc, bad=f"{kind}@0"))
    assert says in line and (kind in ("load_raises", "not_a_tensor") or "state_dict()['model.0.weight']" in line)
    assert snapshot(pvc) == before


@pytest.mark.parametrize("kind, says", [
    ("renamed", "step 2: names changed (missing model.0.weight; new model.0.renamed)"),
    ("reshaped", "step 2: state_dict()['model.0.weight'] is now F32[48], was F32[16, 3]"),
    ("retyped", "step 2: state_dict()['model.0.weight'] is now F64[16, 3], was F32[16, 3]"),
])
def test_a_state_that_changes_between_checkpoints_exits_2_before_writing_any_of_it(tmp_path, killed_at_1, kind,
                                                                                    says):
    pvc = tmp_path / "pvc"
    assert says in one_line(lab_torch(pvc, bad=f"{kind}@2"))
    assert snapshot(pvc / "checkpoints") == snapshot(killed_at_1 / "checkpoints")  # step 1, no half of step 2


@pytest.mark.killpoint
def test_a_bfloat16_torch_trainer_killed_before_every_io_call_resumes_to_the_same_bytes(tmp_path):
    """SIGKILL before each write, fsync and rename of a clean run (every one, counted), then a
    relaunch: always the uninterrupted run's artifact, bit for bit (tests/forked_killpoints.py)."""
    # Imported once, before the forks: torch.optim.SGD imports torch._dynamo, seconds per process.
    env = {**LAB, "TRAINJOB_TEST_DTYPE": "bfloat16", "TRAINJOB_PRELOAD": "torch,torch._dynamo,torch_trainers"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/forked_killpoints.py"), str(tmp_path), "run",
                           "--trainer", "torch_trainers:make", "--steps", "1", "--ckpt-every", "1", "--keep", "1"],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["clean"] == 0 and result["artifacts"] == ["model-v1.safetensors"] and result["count"] > 20
    # A kill after "completed" reached the log leaves a finished job: its relaunch is refused (2) today.
    wrong = [t for t in result["trials"] if t["killed"] != -signal.SIGKILL or not t["same_bytes"]
             or t["relaunch"] not in ((0, 2) if t["logged_completed"] else (0,))]
    assert not wrong, wrong
