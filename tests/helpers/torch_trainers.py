"""A small PyTorch trainer written to the Stateful protocol, for the engine's guarantees on torch
tensors (on PYTHONPATH as ``torch_trainers``): a 3-16-1 MLP on the lab's data, SGD with momentum.

``TRAINJOB_TEST_DTYPE`` picks the parameters' dtype (float32 by default, or bfloat16);
``TRAINJOB_TEST_DEVICE`` the device (cpu by default; cuda where present). ``TRAINJOB_TEST_BAD``,
``kind@step``, makes ``state_dict()`` (or ``load_state_dict``) misbehave from that step on, for
the bad-input tests.
"""

import os

import numpy as np
import torch

from trainjob import Score
from trainjob.trainers.data import load_dataset
from trainjob.torch import load_state_dict, materialize_sgd, state_dict


class TorchLab:
    def __init__(self, data, lr):
        torch.manual_seed(0)
        torch.set_num_threads(1)
        self.data, self.data_sha256 = data, data.sha256
        dtype = getattr(torch, os.environ.get("TRAINJOB_TEST_DTYPE", "float32"))
        self.device = os.environ.get("TRAINJOB_TEST_DEVICE", "cpu")
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.net.to(device=self.device, dtype=dtype)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=lr, momentum=0.9)
        materialize_sgd(self.opt)
        self.x = torch.tensor([s.x for s in data.train], dtype=dtype, device=self.device)
        self.y = torch.tensor([[1.0 if s.y else -1.0] for s in data.train], dtype=dtype, device=self.device)
        self.hx = torch.tensor([s.x for s in data.holdout], dtype=dtype, device=self.device)
        self.hy = np.array([s.y for s in data.holdout])
        kind, _, at = os.environ.get("TRAINJOB_TEST_BAD", "@").partition("@")
        self.bad, self.bad_at, self.steps = kind, int(at or 0), 0

    def state_dict(self):
        live = state_dict(self.net, self.opt)
        if self.steps < self.bad_at or self.bad in ("", "load_raises"):
            return live
        w = live["model.0.weight"]
        broken = {"not_a_tensor": {1.0, 2.0}, "renamed": w, "reshaped": w.reshape(-1),
                  "retyped": w.double(), "non_contiguous": w.t(), "sparse": w.to_sparse()}[self.bad]
        name = "model.0.renamed" if self.bad == "renamed" else "model.0.weight"
        del live["model.0.weight"]
        return {**live, name: broken}

    def load_state_dict(self, arrays):
        if self.bad == "load_raises":
            raise ValueError("this trainer refuses every checkpoint")
        load_state_dict(arrays, self.net, self.opt)

    def step(self, step):
        self.steps = step
        order = torch.from_numpy(np.random.default_rng([3, step]).permutation(len(self.y)))
        losses = []
        for i in range(0, len(order), 8):
            idx = order[i:i + 8].to(self.device)
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.net(self.x[idx]), self.y[idx])
            loss.backward()
            self.opt.step()
            losses.append(loss.item())
        return float(np.mean(losses))

    def evaluate(self):
        with torch.no_grad():
            guess = (self.net(self.hx).float().cpu().numpy()[:, 0] > 0).astype(int)
        return Score(correct=int((guess == self.hy).sum()), total=len(self.hy))

    def baseline(self):
        return Score(correct=int(0.5 * len(self.hy)), total=len(self.hy))  # a coin's score

    def export(self):
        return {k: v for k, v in self.state_dict().items() if k.startswith("model.")}


def make(data, lr):
    return TorchLab(load_dataset(data), lr)
