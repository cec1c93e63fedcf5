"""A model no rank holds whole, under trainjob: FSDP2 shards, checkpointed and resumed by offsets.

    trainjob torchrun --standalone --nproc-per-node 2 examples/fsdp.py --pvc pvc

A small residual MLP (an embedding of the input, blocks of LayerNorm + two Linears, a head), each
block wrapped by ``fully_shard`` and the whole model too, so every parameter and its AdamW state is
a DTensor sharded along its first axis. Each checkpoint holds every rank's own shards (no
all-gather), and a resume reads back, by offsets, only the shards that overlap what each rank
holds. The same code runs on CUDA (nccl, one GPU per rank) and on CPU (gloo). The data of step s
is drawn from a generator seeded by s (each rank takes its part of the batch), so the run needs no
rank-local state, and a checkpoint written at one world size resumes at another after
``trainjob reshard`` (docs/trainers.md).
"""

import argparse, datetime, os, sys  # noqa: E401

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import trainjob
from trainjob.torch import TrainingState

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--steps", type=int, default=24)
cli.add_argument("--ckpt-every", type=int, default=4)
cli.add_argument("--width", type=int, default=66)  # uneven on purpose: 66 rows split 33/33, 17/17/16/16, ...
cli.add_argument("--blocks", type=int, default=3)
cli.add_argument("--async-checkpoint", action="store_true")
args = cli.parse_args()

cuda = torch.cuda.is_available()
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=30))
device = torch.device("cuda" if cuda else "cpu")
torch.manual_seed(0)  # the same initial weights on every rank, before they are sharded
torch.use_deterministic_algorithms(True)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = (torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width),
                                         torch.nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


model = torch.nn.Sequential(torch.nn.Linear(8, args.width), *(Block(args.width) for _ in range(args.blocks)),
                            torch.nn.Linear(args.width, 4)).to(device)
for block in model[1:-1]:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
target = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))  # what the model learns


def batch(step: int, size: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch (the same whatever the world size), this rank's part of it."""
    x = torch.randn(size, 8, generator=torch.Generator().manual_seed(1000 + step))
    part = slice(rank * size // world, (rank + 1) * size // world)
    return x[part].to(device), (x @ target)[part].to(device)


def train_step(step: int) -> float:
    inputs, labels = batch(step)
    loss = torch.nn.functional.mse_loss(model(inputs), labels)
    loss.backward()  # FSDP reduce-scatters the gradients: each rank keeps its shard's
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # every rank reports the same loss
    return float(total) / world


state = TrainingState(model=model, optimizer=opt, rng=False)  # the data depends on the step alone
with trainjob.Run(args.pvc, state=state, steps=args.steps, ckpt_every=args.ckpt_every, name="fsdp",
                  async_checkpoint=args.async_checkpoint) as run:
    for step in run:
        loss = train_step(step)
        run.report(loss)
        if rank == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
    with torch.no_grad():  # the gate: the model must beat predicting zeros on held-out inputs
        inputs, labels = batch(10_000)
        err = ((model(inputs) - labels) ** 2).mean(dim=1)
        zero = (labels ** 2).mean(dim=1)
        counts = torch.tensor([int((err < 0.5 * zero).sum()), int((zero < 0.5 * zero).sum()), len(err)])
        dist.all_reduce(counts)
        run.gate(holdout=trainjob.Score(correct=int(counts[0]), total=int(counts[2])),
                 baseline=trainjob.Score(correct=int(counts[1]), total=int(counts[2])),
                 export=dict(model.state_dict()))  # DTensors: published whole, one tensor at a time
dist.destroy_process_group()
sys.exit(run.exit_code)
