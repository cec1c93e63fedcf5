"""A user's training script whose loader has worker processes (tests/trainers/test_workers.py).

    python worker_loop.py PVC [--context fork|spawn|forkserver] [--persistent] [--eval-workers] [--steps N]

The script uses a shuffling ``StatefulDataLoader(num_workers=2)`` inside ``trainjob.Run(state=TrainingState(...))``.
``--eval-workers``: it also evaluates, every five steps from step 1, over a loader of its own
that trainjob is never given (a plain ``DataLoader``, two persistent workers: alive from the
first step on), as a script's validation loader is; the evaluation changes nothing it trains.
Its dataset refuses to serve an item in a worker where the script's own ``worker_init_fn`` has not
run, so a wrapper that drops the user's function fails the run. Each item takes a few
milliseconds, so a signal sent once the first checkpoint is logged arrives before the last step.
"""

import argparse
import sys
import time

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import trainjob
from trainjob.torch import TrainingState


class Data(torch.utils.data.Dataset):
    offset = None  # set in each worker by the script's worker_init_fn

    def __len__(self):
        return 256  # 32 batches an epoch: the first checkpoint and the signal land mid-epoch

    def __getitem__(self, i):
        if Data.offset is None:
            raise RuntimeError("the script's own worker_init_fn did not run in this worker")
        time.sleep(0.003)
        return torch.arange(4, dtype=torch.float32) * i / 256 + Data.offset


def init_worker(worker_id):
    Data.offset = 0.25


def main():
    cli = argparse.ArgumentParser()
    cli.add_argument("pvc")
    cli.add_argument("--context", default=None)
    cli.add_argument("--persistent", action="store_true")
    cli.add_argument("--eval-workers", action="store_true")
    cli.add_argument("--steps", type=int, default=120)
    args = cli.parse_args()
    torch.manual_seed(0)
    loader = StatefulDataLoader(Data(), batch_size=8, shuffle=True, num_workers=2, worker_init_fn=init_worker,
                                multiprocessing_context=args.context, persistent_workers=args.persistent,
                                generator=torch.Generator().manual_seed(1))
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    state = TrainingState(model=net, optimizer=opt, loader=loader)
    held_out = torch.utils.data.DataLoader(Data(), batch_size=64, num_workers=2, worker_init_fn=init_worker,
                                           multiprocessing_context=args.context, persistent_workers=True,
                                           generator=torch.Generator().manual_seed(2))

    def batches():
        while True:
            yield from loader

    with trainjob.Run(args.pvc, state=state, steps=args.steps, ckpt_every=5) as run:
        feed = batches()
        for step in run:
            loss = net(next(feed)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if args.eval_workers and step % 5 == 1:
                with torch.no_grad():
                    sum(float(net(batch).sum()) for batch in held_out)
            run.report(loss.item())
        run.gate(holdout=trainjob.Score(correct=1, total=1), baseline=trainjob.Score(correct=0, total=1),
                 export=dict(net.state_dict()))
    sys.exit(run.exit_code)


if __name__ == "__main__":  # spawn and forkserver import this file again in each worker
    main()
