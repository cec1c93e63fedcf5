"""A DDP + BatchNorm training script at W = 2 (tests/engine/test_replicated_state.py).

    trainjob torchrun --standalone --nproc-per-node 2 ddp_batchnorm.py --pvc PVC [--no-broadcast | --disagree]
        [--async-checkpoint]

BatchNorm's running statistics are buffers: every rank updates them with its own batch, so at a
checkpoint the ranks hold different values; DDP broadcasts rank 0's at the next forward (unless
``--no-broadcast``: ``broadcast_buffers=False``, each rank goes on from its own). The published
artifact holds them, so a resume that mixed the ranks' copies publishes other bytes.
``--disagree`` adds an ``extra`` module whose buffer counts each rank's own inputs, an entry
every rank holds that nothing marks: the first checkpoint refuses it. Each rank's batch depends
on the step and the rank alone (no loader, no RNG after the start). A short sleep per step
leaves a kill time to land mid-run.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import trainjob
from trainjob.torch import TrainingState

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", required=True)
cli.add_argument("--steps", type=int, default=24)
cli.add_argument("--no-broadcast", action="store_true")
cli.add_argument("--disagree", action="store_true")
cli.add_argument("--async-checkpoint", action="store_true")
args = cli.parse_args()
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
x = torch.randn(512, 8)
y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long()
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
model = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=not args.no_broadcast)
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


class Seen(torch.nn.Module):
    """What this rank's inputs summed to: a buffer that differs by rank."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(8))


seen = Seen()
state = TrainingState(model=model, optimizer=opt, extra={"seen": seen} if args.disagree else None, rng=False)
with trainjob.Run(args.pvc, state=state, steps=args.steps, ckpt_every=4, rank_timeout=30,
                  async_checkpoint=args.async_checkpoint) as run:
    for step in run:
        rows = (torch.arange(16) * 7 + step * 32 + rank * 16) % 512  # this rank's batch of this step
        # Rank 1's inputs scaled: its batch statistics, and so its running ones, differ from rank 0's.
        inputs = x[rows] * (1.0 + rank)
        seen.total += inputs.sum(dim=0)
        loss = torch.nn.functional.cross_entropy(model(inputs), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.report(loss.item())
        time.sleep(0.1)
    run.gate(holdout=trainjob.Score(correct=1, total=1), baseline=trainjob.Score(correct=1, total=1),
             export={k: v.reshape(1) if v.dim() == 0 else v for k, v in net.state_dict().items()})
sys.exit(run.exit_code)
