#!/usr/bin/env python3
"""The torch side of scripts/bench.py's trainer section: one model, trained by trainjob and bare.

The model: one ``Linear(DIM, DIM)`` (``BENCH_TORCH_DIM``, default 4096: a 64 MiB weight) trained by
SGD with momentum (a second 64 MiB), batch 64 of synthetic data drawn from the step number, one
thread. The state is the weight, the bias and their momentum buffers: 128 MiB at the default.

    PYTHONPATH=scripts trainjob run --pvc P --trainer bench_torch:make      # trainjob drives it
    python scripts/bench_torch.py bare STEPS EVERY DIR                       # the same loop, bare
    python scripts/bench_torch.py peers DIR REPEAT                           # save/load peers, one state
    python scripts/bench_torch.py engine MODE DIR STEPS EVERY OUT            # trainjob run, loop timed
    python scripts/bench_torch.py async-peers DIR REPEAT                     # async save peers, one state
    python scripts/bench_torch.py steps DIR STEPS BLOCKS                     # per-step time, Run vs bare
    python scripts/bench_torch.py full-state DIR STEPS BLOCKS                # the same, with TrainingState
    python scripts/bench_torch.py vision-workers DIR STEPS BLOCKS WORKERS    # a noisy loader's workers, Run vs bare

``bare`` trains STEPS steps and, when EVERY > 0, saves model and optimizer with ``torch.save`` and
fsyncs every EVERY steps and the model once at the end (what a user writes without trainjob).
``peers`` saves and loads the same live state with trainjob (what a checkpoint and a resume do:
shard write, commit; verified read into the live tensors), torch.distributed.checkpoint and
torch.save/torch.load, interleaved, and prints the seconds of each as JSON.
``engine`` runs ``trainjob run`` in this process (MODE ``sync`` or ``async``: --async-checkpoint) and
times, on the training loop's own thread, each call it makes at a due step (``save``: a whole
synchronous save, or an async hand-off including any back-pressure wait) and after every step
(the async landing), and the run's end (the gate, and the async drain); JSON to OUT.
``steps`` times every step with no checkpoint due, in one process and on one model: from the start
of one step's body to the start of the next, so the engine's work between steps (the report, the
stop check, "is a checkpoint due?") is inside the interval, under ``trainjob.Run`` (a checkpoint
only at the last step, whose interval is not counted) and in a bare ``for`` loop, in BLOCKS
alternating blocks of STEPS steps; JSON lists of seconds per step.
``full-state`` is ``steps`` for a script's whole state (``trainjob.torch.TrainingState``: the same
Linear, AdamW, a warm-up LambdaLR, a StatefulDataLoader, the RNG streams), plus the milliseconds a
checkpoint's snapshot spends on the plain values and RNG streams: a snapshot of the whole state
less one of the model and optimizer tensors alone, interleaved.
``vision-workers`` is ``steps`` for examples/vision.py's kind of step (a small CNN with BatchNorm,
AdamW, a Dataset drawing noise in WORKERS loader workers): under ``trainjob.Run`` with a
``TrainingState`` each worker result carries the worker's random streams (worker_rng.py), the
bare loop's loader has no TrainingState, and ``trainjob_without_streams`` is the Run with the
workers' streams left out (the signal guard alone); a fresh loader per block, alternating blocks.
``async-peers`` times, on the same live state: one in-memory copy of it into buffers kept (the
copy limit), trainjob's ``BackgroundSaver`` (stall: the hand-off; end to end: until the commit)
and ``torch.distributed.checkpoint.async_save`` (stall: until it returns; end to end: its
future), interleaved, and whether each checkpoint verifies on load (trainjob's: every sha256; DCP
has no check, so its "verified" is whether the load raised).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import fsync_path
from trainjob import Score
from trainjob.torch import load_state_dict, materialize_sgd, state_dict

DIM = int(os.environ.get("BENCH_TORCH_DIM", "4096"))
BATCH = 64


class BigTorch:
    def __init__(self) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.net = torch.nn.Linear(DIM, DIM)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-3, momentum=0.9)
        materialize_sgd(self.opt)
        self.data_sha256 = hashlib.sha256(f"bench-torch-{DIM}".encode()).hexdigest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return state_dict(self.net, self.opt)

    def load_state_dict(self, arrays) -> None:
        load_state_dict(arrays, self.net, self.opt)

    def step(self, step: int) -> float:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, DIM, generator=g)
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.net(x), x)
        loss.backward()
        self.opt.step()
        return loss.item()

    def evaluate(self) -> Score:
        return Score(correct=1, total=1)

    def baseline(self) -> Score:
        return Score(correct=1, total=1)

    def export(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith("model.")}


def make(data: object, lr: float) -> BigTorch:
    return BigTorch()


def bare(steps: int, every: int, directory: Path) -> None:
    """The loop a user writes without trainjob; torch.save + fsync every ``every`` steps."""
    model = BigTorch()
    for step in range(1, steps + 1):
        model.step(step)
        if every and (step % every == 0 or step == steps):
            path = directory / f"ckpt-{step}.pt"
            torch.save({"model": model.net.state_dict(), "optim": model.opt.state_dict()}, path)
            fsync_path(path)
            fsync_path(directory)
    if every:
        torch.save(model.net.state_dict(), directory / "model.pt")
        fsync_path(directory / "model.pt")


def peers(directory: Path, repeat: int) -> dict[str, list[float]]:
    """Save and load one live state with each contender, interleaved, ``repeat`` times."""
    import torch.distributed.checkpoint as dcp

    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.snapshot import HostState
    from trainjob.checkpoint.store import Committer
    from trainjob.records import MANIFEST_SCHEMA, Manifest
    from trainjob.storage.pvc import Pvc
    from trainjob.trainers.protocol import restore

    warnings.simplefilter("ignore")  # DCP warns that no process group is initialised: one process is the point
    model = BigTorch()
    model.step(1)
    live = model.state_dict()
    times: dict[str, list[float]] = {}

    def clock(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    for rep in range(repeat):
        root = directory / f"rep{rep}"
        pvc = Pvc(root / "trainjob")
        pvc.create()
        store, ref, host = Committer(pvc), Ref(attempt=1, step=rep + 1, world_size=1), HostState()

        def trainjob_save() -> None:  # what persist_checkpoint does at W=1, minus the pointer and log
            arrays = host.snapshot(model.state_dict(), ref.step)
            staging = store.create_staging(ref, 1)
            entry = store.write_shard(staging, 0, 1, ref.step, arrays)
            store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=ref.step, attempt=1, world_size=1,
                                                loss_milli=0, tensors=host.specs, shards=[entry]))

        def trainjob_load() -> None:  # what a resume does: verified read into the live tensors, then restore
            into = HostState().snapshot(model.state_dict(), 0)
            loaded = store.load(ref, into=into)
            restore(model, host.live(loaded.tensors))

        torch_path = root / "state.pt"

        def torch_save() -> None:
            torch.save(live, torch_path)
            fsync_path(torch_path)
            fsync_path(root)

        def torch_load() -> None:
            model.load_state_dict(torch.load(torch_path, weights_only=True))

        order = [("trainjob", trainjob_save, trainjob_load), ("dcp", lambda: dcp.save(live, checkpoint_id=root / "dcp"),
                                                               lambda: dcp.load(live, checkpoint_id=root / "dcp")),
                 ("torch", torch_save, torch_load)]
        order = order[rep % 3:] + order[:rep % 3]  # each contender first in turn
        for name, save, _ in order:
            clock(f"save {name}", save)
        for name, _, load in order:
            clock(f"load {name}", load)
        shutil.rmtree(root)
    times["state_bytes"] = [float(sum(t.numel() * t.element_size() for t in live.values()))]
    return times


def engine(mode: str, directory: Path, steps: int, every: int, out: Path) -> None:
    """``trainjob run`` on this model in this process, its loop's checkpoint calls timed."""
    from trainjob import cli
    from trainjob.engine.run import Run

    timed: dict = {"save_s": [], "between_s": 0.0, "end_s": 0.0}

    def timer(name: str, key: str, each: bool):
        real = getattr(Run, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                if each:
                    timed[key].append(time.perf_counter() - t0)
                else:
                    timed[key] += time.perf_counter() - t0

        setattr(Run, name, wrapper)

    timer("_save", "save_s", True)  # a due step: a whole synchronous save, or the hand-off + back-pressure
    timer("_between", "between_s", False)  # after every step: the async landing
    timer("gate", "end_s", False)  # the end: the gate ...
    real_settle = Run._settle

    def settle(self, release=False):  # ... and the async drain of the last checkpoint before it
        t0 = time.perf_counter()  # (a settle without release is back-pressure, inside _save's time)
        try:
            return real_settle(self, release)
        finally:
            if release:
                timed["end_s"] += time.perf_counter() - t0

    Run._settle = settle
    flags = ["--async-checkpoint"] if mode == "async" else []
    t0 = time.perf_counter()
    code = cli.main(["run", "--pvc", str(directory / "pvc"), "--steps", str(steps), "--ckpt-every", str(every),
                     "--keep", "2", "--trainer", "bench_torch:make", *flags])
    timed["wall_s"] = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"trainjob run exited {code}")
    out.write_text(json.dumps(timed))


def async_peers(directory: Path, repeat: int) -> dict[str, list[float]]:
    """The copy limit, trainjob's background saver and DCP's async_save on one live state."""
    import torch.distributed.checkpoint as dcp

    from trainjob.checkpoint.background import BackgroundSaver
    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.snapshot import HostState
    from trainjob.checkpoint.store import Committer
    from trainjob.records import MANIFEST_SCHEMA, Manifest
    from trainjob.storage.pvc import Pvc

    warnings.simplefilter("ignore")
    model = BigTorch()
    model.step(1)
    live = model.state_dict()
    times: dict[str, list[float]] = {}
    copier, saver = HostState(copy=True), BackgroundSaver[str](timeout=600)
    copier.snapshot(live, 0)  # the buffers are allocated once, as the engine's are
    saver.prepare(live)  # as the engine does before its loop

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for rep in range(repeat):
        root = directory / f"rep{rep}"
        pvc = Pvc(root / "trainjob")
        pvc.create()
        store, ref = Committer(pvc), Ref(attempt=1, step=rep + 1, world_size=1)

        def write(arrays) -> str:  # what the engine's writer thread does at W=1, minus pointer and rotation
            staging = store.create_staging(ref, 1)
            entry = store.write_shard(staging, 0, 1, ref.step, arrays)
            return store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=ref.step, attempt=1,
                                                       world_size=1, loss_milli=0, tensors=saver.host.specs,
                                                       shards=[entry]))

        def copy() -> None:
            t0 = time.perf_counter()
            copier.snapshot(model.state_dict(), rep + 1)
            add("copy", time.perf_counter() - t0)

        def trainjob_async() -> None:
            t0 = time.perf_counter()
            saver.hand_off(model.state_dict(), ref.step, write)
            add("stall trainjob", time.perf_counter() - t0)
            saver.wait()
            saver.take()
            add("end-to-end trainjob", time.perf_counter() - t0)
            loaded = store.load(ref)  # raises unless every sha256 matches
            add("verified trainjob", float(loaded.manifest.step == ref.step))

        def dcp_async() -> None:
            t0 = time.perf_counter()
            future = dcp.async_save(live, checkpoint_id=root / "dcp")
            add("stall dcp", time.perf_counter() - t0)
            future.result()
            add("end-to-end dcp", time.perf_counter() - t0)
            add("verified dcp", 0.0)  # DCP stores no hash of what it wrote: a load cannot tell damage

        order = [copy, trainjob_async, dcp_async]
        for fn in order[rep % 3:] + order[:rep % 3]:  # each contender first in turn
            fn()
        shutil.rmtree(root)
    times["state_bytes"] = [float(sum(t.numel() * t.element_size() for t in live.values()))]
    return times


def timed(loop, into: list[float]):
    """Yield ``loop``'s items, appending to ``into`` the seconds from one item's start to the next's."""
    last = None
    for item in loop:
        now = time.perf_counter()
        if last is not None:
            into.append(now - last)
        last = now
        yield item


def steps(directory: Path, n: int, blocks: int) -> dict[str, list[float]]:
    """Seconds per step with no checkpoint due, under trainjob.Run and bare, alternating blocks."""
    from trainjob import Run

    model = BigTorch()
    times: dict[str, list[float]] = {"trainjob": [], "bare": []}
    for block in range(blocks):
        for step in timed(range(1, n + 1), times["bare"]):
            model.step(step)
        pvc = directory / f"block{block}"
        with Run(pvc, state=model, steps=n, ckpt_every=n, raise_errors=True) as run:
            for step in timed(run, times["trainjob"]):
                run.report(model.step(step))
            run.gate(holdout=model.evaluate(), baseline=model.baseline(), export=model.export())
        shutil.rmtree(pvc)
    return times


class _Noisy(torch.utils.data.Dataset):
    """8x8 images with noise drawn in the worker that fetches them (torch, as augmentation does)."""

    def __len__(self) -> int:
        return 1 << 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((1, 8, 8), float(i % 7)) + 0.1 * torch.randn(1, 8, 8), i % 4


def vision_workers(directory: Path, n: int, blocks: int, workers: int) -> dict[str, list[float]]:
    """Seconds per step, trainjob.Run with a TrainingState (workers carrying their streams) vs a bare
    loop over a loader without one."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from trainjob import Run
    from trainjob.torch import TrainingState

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(_Noisy(), batch_size=32, shuffle=True, num_workers=workers,
                                  generator=torch.Generator().manual_seed(0))

    def step(batches) -> float:
        x, y = next(batches)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    times: dict[str, list[float]] = {"trainjob": [], "bare": [], "trainjob_without_streams": []}
    for block in range(blocks):
        batches = iter(loader())
        step(batches)  # the workers started and their first batches in, as in the Run's block below
        for _ in timed(range(n), times["bare"]):
            step(batches)
        del batches
        for name in ("trainjob", "trainjob_without_streams"):
            feed = loader()
            state = TrainingState(model=net, optimizer=opt, loader=feed)
            if name == "trainjob_without_streams":  # the signal guard alone: what worker_rng.py costs
                feed.worker_init_fn.inner = feed.worker_init_fn.inner.inner
            pvc = directory / f"vision{block}"
            with Run(pvc, state=state, steps=n + 1, ckpt_every=n + 1, raise_errors=True) as run:
                batches = iter(feed)
                for _ in timed(run, times[name]):
                    run.report(step(batches))
                run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1),
                         export=dict(net.state_dict()))
            del batches, feed, state, run
            # Untimed: the Run's own reference cycles keep the block's loader (and its workers) until
            # the collector runs; collected inside a later block, the workers' shutdown (a join of up
            # to 5 s per worker) would land in a timed step.
            gc.collect()
            shutil.rmtree(pvc)
    return times


def full_state(directory: Path, n: int, blocks: int) -> dict[str, list[float]]:
    """Seconds per step, trainjob.Run with a TrainingState vs bare; seconds per snapshot of the
    plain values and RNG streams (the whole state less its tensors alone)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from trainjob import Run
    from trainjob.checkpoint.snapshot import HostState
    from trainjob.torch import TrainingState

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Linear(DIM, DIM)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * 8, DIM))
    loader = StatefulDataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    state = TrainingState(model=net, optimizer=opt, scheduler=sched, loader=loader)
    tensors_only = TrainingState(model=net, optimizer=opt, rng=False)
    batches = iter(())

    def step() -> float:
        nonlocal batches
        try:
            (x,) = next(batches)
        except StopIteration:
            batches = iter(loader)
            (x,) = next(batches)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), x)
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    times: dict[str, list[float]] = {"trainjob": [], "bare": [], "snapshot_whole": [], "snapshot_tensors": []}
    for block in range(blocks):
        for _ in timed(range(n), times["bare"]):
            step()
        pvc = directory / f"full{block}"
        with Run(pvc, state=state, steps=n, ckpt_every=n, raise_errors=True) as run:
            for _ in timed(run, times["trainjob"]):
                run.report(step())
            run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1),
                     export=dict(net.state_dict()))
        shutil.rmtree(pvc)
        for _ in range(5):  # a snapshot on the host is views, so the difference is the plain values' cost
            for name, which in (("snapshot_whole", state), ("snapshot_tensors", tensors_only)):
                began = time.perf_counter()
                HostState().snapshot(which.state_dict(), 1)
                times[name].append(time.perf_counter() - began)
    return times


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "vision-workers":
        print(json.dumps(vision_workers(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
        sys.exit(0)
    if mode == "full-state":
        print(json.dumps(full_state(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
        sys.exit(0)
    if mode == "engine":
        engine(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
        sys.exit(0)
    if mode == "steps":
        print(json.dumps(steps(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
        sys.exit(0)
    if mode == "async-peers":
        print(json.dumps(async_peers(Path(sys.argv[2]), int(sys.argv[3]))))
        sys.exit(0)
    if mode == "bare":
        bare(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    elif mode == "peers":
        print(json.dumps(peers(Path(sys.argv[2]), int(sys.argv[3]))))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
