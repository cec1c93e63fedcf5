"""A loader's worker processes and a signal sent to the whole process group (trainjob/trainers/torch/workers.py).

Slurm's scancel, systemd and ``kill -TERM -PGID`` signal the whole group, and so does Ctrl-C
(SIGINT to the foreground group). The DataLoader's workers get the signal too, and the run must
still finish its step, save a checkpoint, log ``killed`` and exit 75, leave no worker behind, and
resume to the uninterrupted run's bytes. Without the guard, the workers died of the SIGTERM and
the run ended in exit 70 with no stop checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import ROOT, events

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from trainjob.torch import TrainingState  # noqa: E402
from trainjob.trainers.torch import worker_rng, workers  # noqa: E402

SCRIPT = ROOT / "tests/helpers/worker_loop.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def users_init(worker_id: int) -> None:
    """A user's worker_init_fn, at module level so a pickle can name it."""


# --- the pure part, in process ---------------------------------------------------------------


def test_a_worker_ends_on_its_owners_signal_and_ignores_others_while_the_owner_lives():
    assert workers.verdict(sender=100, owner=100, owner_alive=True) == workers.END
    assert workers.verdict(sender=100, owner=100, owner_alive=False) == workers.END
    for sender in (0, 1, 555):  # the kernel (a terminal's Ctrl-C), init, scancel's or systemd's process
        assert workers.verdict(sender=sender, owner=100, owner_alive=True) == workers.IGNORE
        assert workers.verdict(sender=sender, owner=100, owner_alive=False) == workers.AS_WITHOUT


def test_a_training_state_guards_its_loader_s_workers_once_keeping_the_user_s_own_init():
    loader = StatefulDataLoader(list(range(8)), num_workers=2, worker_init_fn=users_init)
    TrainingState(model=torch.nn.Linear(1, 1), loader=loader)
    guard = loader.worker_init_fn  # the signal guard first, then the workers' streams (worker_rng.py), then the user's
    assert isinstance(guard, workers.StopOnOwner) and isinstance(guard.inner, worker_rng.Streams)
    assert guard.inner.inner is users_init
    TrainingState(model=torch.nn.Linear(1, 1), loader=loader)  # a second state over the same loader
    assert loader.worker_init_fn is guard and guard.inner.inner is users_init
    bare = StatefulDataLoader(list(range(8)), num_workers=2)
    TrainingState(model=torch.nn.Linear(1, 1), loader=bare)
    assert isinstance(bare.worker_init_fn, workers.StopOnOwner) and bare.worker_init_fn.inner.inner is None
    inline = StatefulDataLoader(list(range(8)), num_workers=0, worker_init_fn=users_init)
    TrainingState(model=torch.nn.Linear(1, 1), loader=inline)
    assert inline.worker_init_fn is users_init  # no workers: nothing to guard


def test_a_pickled_guard_names_the_process_that_pickled_it_as_the_owner():
    """Under spawn and forkserver the worker unpickles its worker_init_fn. The process that
    pickled it starts the worker (under forkserver it is not the worker's parent)."""
    copy = pickle.loads(pickle.dumps(workers.StopOnOwner(users_init)))
    assert copy.inner is users_init and copy.owner == os.getpid()
    assert workers.StopOnOwner(None).owner is None  # fork: the parent, read in the worker


# --- real processes and real signals ---------------------------------------------------------


def artifact(pvc: Path) -> bytes:
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()


def launch(pvc: Path, *flags: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(pvc), *flags], env=ENV, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kwargs)


def group_gone(pgid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[tuple[str, ...]], bytes]:
    """The uninterrupted runs' artifacts, by flags, run with fork only when first needed. The start method
    does not change the batches. Persistent workers do change them: a loader whose workers are
    restarted every epoch draws their seed from its shuffling generator each time."""
    made: dict[tuple[str, ...], bytes] = {}
    root = tmp_path_factory.mktemp("workers")

    def reference(flags: tuple[str, ...]) -> bytes:
        if flags not in made:
            pvc = root / f"ref{len(made)}"
            done = launch(pvc, *flags)
            _, err = done.communicate(timeout=120)
            assert done.returncode == 0, err[-3000:]
            made[flags] = artifact(pvc)
        return made[flags]
    return reference


@pytest.mark.process
@pytest.mark.parametrize("sig, flags, twice", [
    (signal.SIGTERM, ("--eval-workers",), True),
    (signal.SIGINT, ("--context", "spawn", "--persistent", "--eval-workers"), False),
], ids=["sigterm-twice-fork", "sigint-spawn-persistent"])
@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
def test_a_signal_to_the_whole_group_saves_the_step_exits_75_and_leaves_no_worker(references, tmp_path, sig, flags,
                                                                                  twice):
    """The SIGTERM case is scancel's and systemd's, sent twice half a second apart as Slurm's
    preemption does: before the guard it ended in exit 70 with "DataLoader worker (pid N) is
    killed by signal: Terminated", and no stop checkpoint. The SIGINT case is Ctrl-C with workers
    that spawn started. Such a worker does not inherit the training process's SIGINT handler, so a
    KeyboardInterrupt ended its loop and the step waiting for it failed. Persistent workers are
    started once and kept across epochs, and the guard must already be in them. In both, the
    script also evaluates over a loader of its own that trainjob never sees (``--eval-workers``):
    when only the train loader's workers were guarded, those died of the signal and the run
    ended in exit 70 (the SIGCHLD handler's "killed by signal", or "exited unexpectedly")."""
    pvc = tmp_path / "pvc"
    proc = launch(pvc, *flags, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline and not (
                (pvc / "log.jsonl").exists() and '"checkpointed"' in (pvc / "log.jsonl").read_text()):
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        os.killpg(proc.pid, sig)
        if twice:
            time.sleep(0.5)
            os.killpg(proc.pid, sig)
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
        assert code == 75, err[-3000:]
        assert group_gone(proc.pid, within=10), "a worker outlived the run"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    *_, (saved, saved_detail), (last, detail) = events(pvc / "log.jsonl")
    at_step = int(detail.split()[0].removeprefix("at_step="))
    assert last == "killed" and detail.endswith(f" signal={sig.name}"), err[-3000:]
    assert saved == "checkpointed" and saved_detail.startswith(f"step={at_step} ")
    assert json.loads((pvc / "checkpoint.json").read_text())["step"] == at_step
    forked = tuple(f for f in flags if f not in ("--context", "spawn"))  # the same batches, started faster
    again = launch(pvc, *forked)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert [e for e, _ in events(pvc / "log.jsonl")].count("resumed") == 1
    assert artifact(pvc) == references(forked)


ORPHANS = '''
import os, sys, time, torch
from torchdata.stateful_dataloader import StatefulDataLoader
from trainjob.torch import TrainingState

class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        return torch.rand(4)  # a draw: every result carries the worker's streams (worker_rng.py)

loader = StatefulDataLoader(Noisy(), batch_size=2, num_workers=2, prefetch_factor=16)
state = TrainingState(model=torch.nn.Linear(4, 1), loader=loader)
batches = iter(loader)
next(batches)
print(" ".join(str(w.pid) for w in batches._workers), flush=True)
time.sleep(600)  # reads nothing more: the workers fill the result pipe, then this process is SIGKILLed
'''


@pytest.mark.process
def test_a_sigkilled_runs_workers_leave_even_with_a_full_result_pipe(tmp_path):
    """torch's watchdog ends a worker's loop once its parent is gone, but the worker's exit then
    waits for its result queue's feeder thread, blocked on a full pipe nobody reads: with 32
    results in flight, each carrying the worker's random streams, such an orphan never ended
    (holding the killed run's stdout and stderr open). The guard ends it."""
    script = tmp_path / "orphans.py"
    script.write_text(ORPHANS)
    proc = subprocess.Popen([sys.executable, str(script)], env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(2)  # the workers fill the pipe
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, "a worker outlived its killed run"


def test_importing_the_torch_adapter_guards_every_loaders_workers_once():
    """Every worker torch or torchdata starts calls ``_set_worker_signal_handlers`` first: the
    guard follows it there, whichever loader started the worker (the train loader's, a
    validation loader's, a script's own), once however often the hook is installed."""
    from torch.utils.data._utils import signal_handling

    hooked = signal_handling._set_worker_signal_handlers
    assert isinstance(hooked, workers._GuardAfter) and not isinstance(hooked.original, workers._GuardAfter)
    workers._hook()
    assert signal_handling._set_worker_signal_handlers is hooked
