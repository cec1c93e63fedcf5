"""A PyTorch trainer for trainjob: a small MLP on the digits, DistributedDataParallel over gloo.

    trainjob gen --dataset digits data
    PYTHONPATH=examples trainjob torchrun --standalone --nproc-per-node 2 -m trainjob run \\
        --pvc pvc --data data --trainer torch_digits:make

torchrun sets RANK and WORLD_SIZE; trainjob reads them, so each process is one trainjob rank: it
writes its own shard of every checkpoint and rank 0 commits. DDP averages the gradients of the
two halves of each mini-batch, so both ranks hold the same weights after every step; one step is
one epoch in an order drawn from the step number. Kill either rank, relaunch, and the run
resumes to the weights an uninterrupted run ends with (tests/trainers/test_torch.py).
"""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainjob import Score
from trainjob.trainers.digits import BATCH, CLASSES, FEATURES, SEED, DigitsTrainer, make as digits_data
from trainjob.torch import load_state_dict, materialize_sgd, state_dict

HIDDEN, MOMENTUM = 32, 0.9


class TorchDigits:
    def __init__(self, data: DigitsTrainer, lr: float) -> None:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # the same reduction order in every launch
        self.data, self.data_sha256 = data, data.data_sha256
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and not dist.is_initialized():
            # A peer killed mid-step must not leave this rank in allreduce for gloo's default 30 minutes.
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                       torch.nn.Linear(HIDDEN, CLASSES)).double()
        self.model = DistributedDataParallel(self.net) if self.world > 1 else self.net
        self.opt = torch.optim.SGD(self.net.parameters(), lr=lr, momentum=MOMENTUM)
        materialize_sgd(self.opt)  # seeded init: the same on every rank and launch
        self.x, self.y = torch.from_numpy(data.x), torch.from_numpy(data.y)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return state_dict(self.net, self.opt)  # the live tensors: trainjob reads them at a checkpoint

    def load_state_dict(self, arrays) -> None:
        load_state_dict(arrays, self.net, self.opt)  # copied into the live tensors, in place

    def step(self, step: int) -> float:
        order = torch.from_numpy(np.random.default_rng([SEED, step]).permutation(len(self.y)))
        total = torch.zeros(2, dtype=torch.float64)  # loss sum and batch count, summed over ranks
        # A peer lost in any collective here (DDP's all-reduce, the one below) is trainjob's to end: 75.
        for i in range(0, len(order), BATCH):
            mine = order[i:i + BATCH][self.rank::self.world]  # this rank's half of the mini-batch
            self.opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(self.x[mine]), self.y[mine])
            loss.backward()  # DDP averages the gradients over ranks here
            self.opt.step()
            total += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(total)
        return float(total[0] / total[1])

    def evaluate(self) -> Score:
        with torch.no_grad():
            guess = self.net(torch.from_numpy(self.data.hx)).argmax(dim=1).numpy()
        return Score(correct=int((guess == self.data.hy).sum()), total=len(self.data.hy))

    def baseline(self) -> Score:
        return self.data.baseline()  # the frozen reference model `trainjob gen` wrote

    def export(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith("model.")}


def make(data, lr):
    return TorchDigits(digits_data(data, lr), lr)
