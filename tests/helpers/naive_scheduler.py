"""The naive form of a training script, for ``trainjob prove``'s hints: a TrainingState of the model
and the optimizer only (``rng=False``), a plain DataLoader, and a LambdaLR warm-up that is NOT in
the state. A relaunch restarts the scheduler at its first step, so the optimizer's param-group lr
in the first checkpoint after the resume differs from the uninterrupted run's.

    python tests/helpers/naive_scheduler.py --pvc {pvc}
    python tests/helpers/naive_scheduler.py --pvc {pvc} --scheduler-in-state   (the same, resumed right)

``--scheduler-in-state`` adds the scheduler and a StatefulDataLoader (and the RNG streams) to the
state: the control, which prove must find PROVEN. Small enough to take about a second on a CPU.
"""

import argparse, sys  # noqa: E401

import torch

import trainjob
from trainjob.torch import TrainingState

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", required=True)
cli.add_argument("--steps", type=int, default=16)
cli.add_argument("--ckpt-every", type=int, default=4)
cli.add_argument("--scheduler-in-state", action="store_true")
args = cli.parse_args()
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
x = torch.randn(256, 8)
y = (x[:, 0] + x[:, 1] > 0).long()
data = torch.utils.data.TensorDataset(x[:192], y[:192])
if args.scheduler_in_state:
    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))
else:
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 8))  # an 8-step warm-up
if args.scheduler_in_state:
    state = TrainingState(model=net, optimizer=opt, scheduler=sched, loader=loader)
else:
    state = TrainingState(model=net, optimizer=opt, rng=False)  # what a first attempt often looks like


def batches():
    while True:
        yield from loader


with trainjob.Run(args.pvc, state=state, steps=args.steps, ckpt_every=args.ckpt_every) as run:
    feed = batches()
    for step in run:
        inputs, labels = next(feed)
        loss = torch.nn.functional.cross_entropy(net(inputs), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        run.report(loss.item())
        print(f"step {step} loss {loss.item()!r}", flush=True)
    net.eval()
    with torch.no_grad():
        correct = int((net(x[192:]).argmax(dim=1) == y[192:]).sum())
        run.gate(holdout=trainjob.Score(correct=correct, total=64), baseline=trainjob.Score(correct=0, total=64),
                 export={k: v for k, v in net.state_dict().items()})
sys.exit(run.exit_code)
