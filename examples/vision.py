"""A vision training script as people write it, under trainjob: killed at any instant, resumed to the same bits.

    python examples/vision.py --pvc pvc --workers 2
    trainjob torchrun --standalone --nproc-per-node 2 examples/vision.py --pvc pvc

A small CNN with BatchNorm and Dropout on tiny synthetic images, AdamW with two parameter groups
(no weight decay on norms and biases), a warm-up + cosine SequentialLR, a GradScaler (active on
CUDA), a shuffling StatefulDataLoader whose Dataset adds random noise and flips in its workers
(torch, random and numpy draws), and one random and one numpy draw per step in the loop; DDP over
gloo under torchrun. trainjob's part is the TrainingState and the Run.
"""

import argparse, datetime, os, random, sys  # noqa: E401

import numpy as np
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

import trainjob
from trainjob.torch import TrainingState

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--epochs", type=int, default=3)
cli.add_argument("--ckpt-every", type=int, default=4)
cli.add_argument("--workers", type=int, default=0)
cli.add_argument("--bare", metavar="FILE", help="train without trainjob; save the final weights to FILE")
args = cli.parse_args()
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if world > 1:  # torchrun: DDP averages the gradients, and broadcasts rank 0's BatchNorm statistics
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
random.seed(0)
np.random.seed(0)
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
patterns = torch.randn(4, 1, 8, 8)  # four classes of 8x8 images, told apart by their pattern
labels = torch.arange(320) % 4
images = patterns[labels] + 0.5 * torch.randn(320, 1, 8, 8)


class Augmented(torch.utils.data.Dataset):
    """Noise, a random flip and a random brightness, drawn where the loader fetches (in its workers)."""

    def __init__(self, indices):
        self.indices = indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x = images[self.indices[i]] + 0.1 * torch.randn(1, 8, 8)
        if random.random() < 0.5:
            x = x.flip(-1)
        return x * float(np.random.uniform(0.8, 1.2)), labels[self.indices[i]]


loader = StatefulDataLoader(Augmented(range(rank, 256, world)), batch_size=16 // world, shuffle=True, drop_last=True,
                            num_workers=args.workers, generator=torch.Generator().manual_seed(rank))
net = torch.nn.Sequential(
    torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4)).to(device)
model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
decay = [p for n, p in net.named_parameters() if p.dim() > 1]  # conv and linear weights
no_decay = [p for n, p in net.named_parameters() if p.dim() <= 1]  # norms and biases
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
steps = args.epochs * len(loader)
warmup = steps // 8
sched = torch.optim.lr_scheduler.SequentialLR(opt, [
    torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
    torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - warmup)], milestones=[warmup])
scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")


def batches():  # epoch after epoch; the loader resumes mid-epoch after a relaunch
    while True:
        yield from loader


def train_step(feed):
    model.train()
    inputs, targets = next(feed)
    smoothing = random.choice([0.0, 0.05, 0.1])  # a python draw and a numpy draw in every step
    inputs = inputs + float(np.random.normal(0.0, 0.01))
    with torch.autocast(device.type, enabled=device.type == "cuda"):
        loss = torch.nn.functional.cross_entropy(model(inputs.to(device)), targets.to(device),
                                                 label_smoothing=smoothing)
    try:
        scaler.scale(loss).backward()
    except RuntimeError as exc:  # gloo: a peer left mid-step; nothing is wrong with the job (75)
        raise trainjob.PeerFailed(str(exc).splitlines()[0]) from None
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad()
    return loss.item()


if args.bare:  # the same training without trainjob (a test compares the weights bit for bit)
    feed = batches()
    for step in range(1, steps + 1):
        train_step(feed)
    torch.save({k: v.clone() for k, v in net.state_dict().items()}, args.bare) if rank == 0 else None
    sys.exit(0)

state = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader, scaler=scaler)
with trainjob.Run(args.pvc, state=state, steps=steps, ckpt_every=args.ckpt_every) as run:
    feed = batches()
    for step in run:  # from the resumed step on; a checkpoint after the body when due; a stop on SIGTERM
        loss = train_step(feed)
        run.report(loss)
        if rank == 0:
            print(f"step {step} loss {loss!r}", flush=True)
    model.eval()
    with torch.no_grad():  # the gate: the held-out images (without augmentation) against the majority class
        correct = int((net(images[256:].to(device)).argmax(dim=1).cpu() == labels[256:]).sum())
        run.gate(holdout=trainjob.Score(correct=correct, total=64),
                 baseline=trainjob.Score(correct=int((labels[256:] == 0).sum()), total=64),
                 export=net.state_dict())
sys.exit(run.exit_code)
