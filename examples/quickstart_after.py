"""The same script under trainjob: the "after" of docs/quickstart.md.

    python examples/quickstart_after.py --pvc out/quick
"""

import argparse
import sys

import torch

import trainjob
from trainjob.torch import TrainingState

cli = argparse.ArgumentParser()
cli.add_argument("--steps", type=int, default=30)
cli.add_argument("--pvc", default="pvc")  # the job's directory: checkpoints, log, the published model
args = cli.parse_args()

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)  # a resumed run must reach the same bytes
x = torch.randn(512, 8)
y = (x[:, :4].sum(dim=1) > x[:, 4:].sum(dim=1)).long()  # two classes, learnable
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
state = TrainingState(model=model, optimizer=opt)  # what a checkpoint holds: a Stateful

with trainjob.Run(args.pvc, state=state, steps=args.steps, ckpt_every=10, lr=0.01) as run:
    for step in run:  # the steps left (a relaunch resumes); a checkpoint every 10; SIGTERM saves and stops
        batch = torch.randperm(448, generator=torch.Generator().manual_seed(step))[:64]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        run.report(loss)  # once per step: logged at each checkpoint

    with torch.no_grad():
        correct = int((model(x[448:]).argmax(dim=1) == y[448:]).sum())
    majority = max(int(y[448:].sum()), 64 - int(y[448:].sum()))  # the frozen baseline: always the common class
    run.gate(holdout=trainjob.Score(correct=correct, total=64), baseline=trainjob.Score(correct=majority, total=64),
             export=model.state_dict())  # mandatory: publishes the export only if the holdout keeps up
sys.exit(run.exit_code)  # 0 completed, 1 the gate said no, 2 bad input, 75 relaunch me
