"""Your own torch training loop under trainjob: resumed, checkpointed, gated, published, honest exit.

    python examples/own_loop.py --pvc pvc
    trainjob torchrun --standalone --nproc-per-node 2 examples/own_loop.py --pvc pvc
"""

import argparse, datetime, os, sys  # noqa: E401

import numpy as np
import torch
import torch.distributed as dist
import trainjob
from trainjob.torch import load_state_dict, materialize_sgd, state_dict

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--steps", type=int, default=40)
cli.add_argument("--ckpt-every", type=int, default=10)
args = cli.parse_args()
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if world > 1:  # torchrun: DDP averages the gradients of each rank's half of the batch
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)  # a resumed run must reach the same bytes
rng = np.random.default_rng(0)
x = torch.from_numpy(rng.normal(size=(600, 16)))
y = (x @ torch.from_numpy(rng.normal(size=16)) > 0).long()
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).double()
model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
materialize_sgd(opt)  # its momentum exists before the first step, so a checkpoint can hold it


class ModelAndOptimizer:  # what a checkpoint holds; trainjob reads it only when one is due
    def state_dict(self):
        return state_dict(net, opt)

    def load_state_dict(self, arrays):
        load_state_dict(arrays, net, opt)


guess = max(int(y[500:].sum()), 100 - int(y[500:].sum()))  # the frozen baseline: always the common class
with trainjob.Run(args.pvc, state=ModelAndOptimizer(), steps=args.steps, ckpt_every=args.ckpt_every,
                  lr=0.05) as run:
    for step in run:  # from the resumed step on; a checkpoint after the body when due; a stop on SIGTERM
        batch = torch.from_numpy(np.random.default_rng([1, step]).choice(500, 64, replace=False))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch[rank::world]]), y[batch[rank::world]])
        loss.backward()  # a peer lost here (or in any collective of the step): trainjob.Run ends it, 75
        opt.step()
        run.report(loss.item())
    with torch.no_grad():  # the gate: publish the model only if the holdout beats the baseline
        correct = int((net(x[500:]).argmax(dim=1) == y[500:]).sum())
        run.gate(holdout=trainjob.Score(correct=correct, total=100), baseline=trainjob.Score(correct=guess, total=100),
                 export={k: v for k, v in state_dict(net, opt).items() if k.startswith("model.")})
sys.exit(run.exit_code)
