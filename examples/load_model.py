"""Load the model examples/own_loop.py published into a fresh module of your own, and use it.

    python examples/load_model.py out/own/artifacts/model-v1.safetensors

The artifact is a plain safetensors file: the tensors the gate's ``export`` named, under the
names it gave them, and trainjob's record of the run (attempt, step, the gate's scores) in the
header's metadata. own_loop.py exports ``trainjob.torch.state_dict``'s ``model.`` entries, so
every name starts with ``model.``: strip it to load them into the bare module.
"""

import json
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

path = sys.argv[1]
tensors = load_file(path)  # {"model.0.weight": ..., "model.0.bias": ..., ...}
with safe_open(path, "pt") as f:
    record = json.loads(f.metadata()["trainjob.artifact"])  # what the run published, and why

net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).double()
net.load_state_dict({name.removeprefix("model."): tensor for name, tensor in tensors.items()})

rng = np.random.default_rng(0)  # own_loop.py's data: its holdout is the last 100 rows
x = torch.from_numpy(rng.normal(size=(600, 16)))
y = (x @ torch.from_numpy(rng.normal(size=16)) > 0).long()
with torch.no_grad():
    correct = int((net(x[500:]).argmax(dim=1) == y[500:]).sum())
print(f"attempt {record['attempt']}, step {record['step']}: the gate saw {record['holdout']['correct']}/100, "
      f"this module scores {correct}/100")
