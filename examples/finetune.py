"""A training script as ML engineers write it, under trainjob: killed at any instant, resumed to the same bits.

    python examples/finetune.py --pvc pvc
    trainjob torchrun --standalone --nproc-per-node 2 examples/finetune.py --pvc pvc

An MLP with dropout, AdamW, a warm-up + cosine LambdaLR, gradient clipping, gradient accumulation over
2 micro-batches, a shuffling StatefulDataLoader over 3 epochs; DDP over gloo under torchrun (each rank
shuffles its own part of the data). trainjob's part is the TrainingState and the Run.
"""

import argparse, datetime, math, os, sys  # noqa: E401

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

import trainjob
from trainjob.torch import TrainingState

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--epochs", type=int, default=3)
cli.add_argument("--ckpt-every", type=int, default=5)
cli.add_argument("--async-checkpoint", action="store_true")
cli.add_argument("--workers", type=int, default=0)
cli.add_argument("--bare", metavar="FILE", help="train without trainjob; save the final weights to FILE")
args = cli.parse_args()
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if world > 1:  # torchrun: DDP averages the gradients of each rank's micro-batches
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
x = torch.randn(600, 32)
y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4  # four classes, learnable
train = torch.utils.data.TensorDataset(x[:480], y[:480])
loader = StatefulDataLoader(torch.utils.data.Subset(train, range(rank, 480, world)), batch_size=16 // world,
                            shuffle=True, drop_last=True, num_workers=args.workers,
                            generator=torch.Generator().manual_seed(rank))
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
steps = args.epochs * len(loader) // 2  # an optimizer step every 2 micro-batches
warmup = steps // 10
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                          0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))))


def micro_batches():  # epoch after epoch; the loader resumes mid-epoch after a relaunch
    while True:
        yield from loader


def train_step(batches):
    model.train()
    total = 0.0
    for _ in range(2):  # gradient accumulation
        inputs, labels = next(batches)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels) / 2
        loss.backward()  # a peer lost in any collective of the step is trainjob.Run's to end (75)
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    return total


if args.bare:  # the same training without trainjob (a test compares the weights bit for bit)
    batches = micro_batches()
    for step in range(1, steps + 1):
        train_step(batches)
    torch.save({k: v.clone() for k, v in net.state_dict().items()}, args.bare) if rank == 0 else None
    sys.exit(0)

state = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader)  # all a step depends on
with trainjob.Run(args.pvc, state=state, steps=steps, ckpt_every=args.ckpt_every,
                  async_checkpoint=args.async_checkpoint) as run:
    batches = micro_batches()
    for step in run:  # from the resumed step on; a checkpoint after the body when due; a stop on SIGTERM
        loss = train_step(batches)
        run.report(loss)
        if rank == 0:
            print(f"step {step} loss {loss!r}", flush=True)
    model.eval()
    with torch.no_grad():  # the gate: publish the model only if the holdout beats the baseline
        correct = int((net(x[480:]).argmax(dim=1) == y[480:]).sum())
        common = int(torch.bincount(y[:480]).argmax())
        run.gate(holdout=trainjob.Score(correct=correct, total=120),
                 baseline=trainjob.Score(correct=int((y[480:] == common).sum()), total=120),
                 export={k: v for k, v in net.state_dict().items()})
sys.exit(run.exit_code)
