#!/usr/bin/env python3
"""Per-step cost of trainjob's Lightning callback against plain Lightning saving at the same cadence.

    OMP_NUM_THREADS=1 python scripts/bench_lightning.py [--steps 120] [--ckpt-every 10] [--blocks 5]
                                                        [--dim 1024] [--batch 64] [--json FILE]

One process, one model shape: an MLP ``Linear(DIM, DIM) -> GELU -> Dropout -> Linear(DIM, DIM)``
with AdamW (the state: two DIM x DIM weights and their two moments, 24 MiB at the default, 1.5 MiB
at DIM 256), batches of BATCH from a shuffling StatefulDataLoader over synthetic data, trained by
``Trainer.fit`` for STEPS steps (BATCH sets the step's length: a small state with a step of tens
of ms is DIM 256 and a large BATCH). Four contenders in alternating blocks (A B C D A B C D ...), each a fresh model and a fresh
directory:

    none        plain Lightning, no checkpoint (for scale)
    lightning   plain Lightning with ModelCheckpoint(every_n_train_steps=EVERY, save_top_k=1): its own
                torch.save of the model, optimizer, scheduler and loops every EVERY steps, the
                previous file removed (what a Lightning user runs)
    trainjob    trainjob's TrainJob callback, ckpt_every=EVERY (hashed shards, manifest, pointer,
                rotation to 3, the RNG streams and the loader's position), each write fsynced
    async       the same with async_checkpoint=True: the state is copied into host buffers at the
                step, and a background thread writes, hashes and fsyncs while training goes on

What is timed: the fit loop, from ``on_train_start`` to ``on_train_end`` (a timing callback
listed first), divided by STEPS: every step's work and every checkpoint's, without start-up and
without the end (trainjob's gate and artifact, Lightning's teardown), in wall time and in the
process's CPU time (steadier on a shared machine, but blind to waiting on the disk's fsync).
Each fit counts the checkpoints it wrote (Lightning's saves, trainjob's ``checkpointed`` lines);
the benchmark stops if the contenders' counts differ (STEPS should be a multiple of EVERY:
trainjob also saves the last step). Printed: the counts, the median and range of each
contender's per-step milliseconds over the blocks, and trainjob's (and async's) over lightning's
by the medians, by the fastest blocks and by the median of each block's ratio (its two fits ran
one after the other, so a load that changes over the run moves both; the target: <= 1.05).

And the stall per checkpoint: how long the training thread spends on one checkpoint, two ways.
"Held": the checkpointing callback's ``on_train_batch_end`` (Lightning's ModelCheckpoint, which
saves there; trainjob's callback, whose Run saves there, and with ``async_checkpoint`` copies there
and lands the write at a later step's), timed at every step; the median call is a step without a
checkpoint, and what the calls took beyond it, summed, divided by the checkpoints, is the stall.
"By the wall": the fit's time beyond the same block's fit without checkpoints, per checkpoint
(it also counts what a checkpoint costs elsewhere: a helper thread's CPU on a busy machine, the
caches). The target for ``async``: a stall no longer than Lightning's own synchronous save.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import trainjob  # noqa: E402
from trainjob.integrations.lightning import TrainJob  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(dim, dim))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Counted(L.pytorch.callbacks.ModelCheckpoint):
    """Lightning's ModelCheckpoint, counting its saves (the benchmark checks the cadences match)."""

    saves = 0

    def _save_checkpoint(self, trainer, filepath):
        self.saves += 1
        super()._save_checkpoint(trainer, filepath)


class Held:
    """Times a callback's ``on_train_batch_end`` at every step (the training thread's time in it)."""

    def __init__(self, callback: L.Callback) -> None:
        self.seconds: list[float] = []
        hook = callback.on_train_batch_end

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - began)

        callback.on_train_batch_end = timed  # type: ignore[method-assign]

    def stall(self, checkpoints: int) -> float:
        """Seconds per checkpoint beyond the median step's."""
        usual = statistics.median(self.seconds)
        return sum(t - usual for t in self.seconds) / max(checkpoints, 1)


class Clock(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer, pl_module):
        self.seconds, self.cpu = time.perf_counter() - self.start, time.process_time() - self.cpu_start


def fit(kind: str, args: argparse.Namespace, directory: Path) -> tuple[float, float, int, float]:
    """Seconds and CPU seconds per step, the number of checkpoints written, and the seconds the
    training thread was held per checkpoint."""
    torch.manual_seed(0)
    rows = args.batch * args.steps
    data = torch.utils.data.TensorDataset(torch.randn(rows, args.dim), torch.randn(rows, args.dim))
    loader = StatefulDataLoader(data, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    clock = Clock()
    callbacks: list[L.Callback] = [clock]
    saver, held = None, None
    if kind == "lightning":
        saver = Counted(dirpath=directory, every_n_train_steps=args.ckpt_every, save_top_k=1)
        callbacks.append(saver)
        held = Held(saver)
    elif kind in ("trainjob", "async"):
        job = TrainJob(directory, ckpt_every=args.ckpt_every, async_checkpoint=kind == "async",
                       gate=lambda m: (trainjob.Score(1, 1), trainjob.Score(1, 1)))
        callbacks.append(job)
        held = Held(job)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=kind == "lightning", callbacks=callbacks)
    trainer.fit(Net(args.dim), loader)
    if saver is not None:
        saves = saver.saves
    elif kind == "none":
        saves = 0
    else:
        saves = (directory / "log.jsonl").read_text().count('"event":"checkpointed"')
    return clock.seconds / args.steps, clock.cpu / args.steps, saves, held.stall(saves) if held else 0.0


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--steps", type=int, default=120)
    cli.add_argument("--ckpt-every", type=int, default=10)
    cli.add_argument("--blocks", type=int, default=5)
    cli.add_argument("--dim", type=int, default=1024)
    cli.add_argument("--batch", type=int, default=64)
    cli.add_argument("--json", type=Path)
    args = cli.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    kinds = ("none", "lightning", "trainjob", "async")
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    saves: dict[str, set[int]] = {k: set() for k in kinds}
    held: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-lightning-") as tmp:
        fit("none", args, Path(tmp) / "warm-up")  # imports, first allocations
        for block in range(args.blocks):
            for kind in kinds:
                seconds, cpu_seconds, written, stall = fit(kind, args, Path(tmp) / f"{kind}-{block}")
                wall[kind].append(seconds)
                cpu[kind].append(cpu_seconds)
                saves[kind].add(written)
                held[kind].append(stall)
    if not saves["lightning"] == saves["trainjob"] == saves["async"]:  # the comparison would not be fair
        sys.exit(f"the contenders saved different numbers of checkpoints: {saves}")
    state_mib = 4 * 3 * 2 * args.dim * (args.dim + 1) / 2 ** 20
    print(f"{args.steps} steps of batch {args.batch}, a checkpoint every {args.ckpt_every}, model + AdamW state "
          f"{state_mib:.1f} MiB, {args.blocks} blocks; checkpoints written per fit: "
          f"{', '.join(f'{k} {min(v)}' for k, v in saves.items())}")
    checkpoints = min(saves["lightning"])
    by_wall = {k: [(t - n) * args.steps / checkpoints for t, n in zip(wall[k], wall["none"])]
               for k in kinds if k != "none"}
    print("stall per checkpoint, ms: held median (min..max); by the wall median")
    for kind in by_wall:
        ms = [s * 1000 for s in held[kind]]
        print(f"  {kind:<10} {statistics.median(ms):.1f} ({min(ms):.1f}..{max(ms):.1f}); "
              f"{statistics.median(by_wall[kind]) * 1000:.1f}")
    ratios = {}
    for clock, times in (("wall", wall), ("cpu", cpu)):
        print(f"{clock:<5} ms per step: median (min..max)")
        for kind in kinds:
            ms = [s * 1000 for s in times[kind]]
            print(f"  {kind:<10} {statistics.median(ms):.1f} ({min(ms):.1f}..{max(ms):.1f})")
        for kind in ("trainjob", "async"):
            ratios[f"{clock} {kind}"] = ratio = {
                "median": statistics.median(times[kind]) / statistics.median(times["lightning"]),
                "fastest": min(times[kind]) / min(times["lightning"]),
                # each block's two fits ran one after the other, under much the same load
                "paired": statistics.median(t / r for t, r in zip(times[kind], times["lightning"]))}
            print(f"  {kind} / lightning: {ratio['median']:.3f} by the medians, {ratio['fastest']:.3f} by the "
                  f"fastest blocks, {ratio['paired']:.3f} by the median of the blocks' ratios (target <= 1.05)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "wall_s": wall,
                                         "cpu_s": cpu, "ratios": ratios, "held_s": held,
                                         "stall_by_wall_s": by_wall,
                                         "checkpoints_per_fit": {k: min(v) for k, v in saves.items()}}, indent=1))


if __name__ == "__main__":
    main()
