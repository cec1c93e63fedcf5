"""A small PyTorch training script, as it is before trainjob: the "before" of docs/quickstart.md.

    python examples/quickstart_before.py --out model.safetensors
"""

import argparse

import torch
from safetensors.torch import save_file

cli = argparse.ArgumentParser()
cli.add_argument("--steps", type=int, default=30)
cli.add_argument("--out", default="model.safetensors")
args = cli.parse_args()

torch.manual_seed(0)
x = torch.randn(512, 8)
y = (x[:, :4].sum(dim=1) > x[:, 4:].sum(dim=1)).long()  # two classes, learnable
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)

for step in range(1, args.steps + 1):
    batch = torch.randperm(448, generator=torch.Generator().manual_seed(step))[:64]
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.3f}")

with torch.no_grad():
    correct = int((model(x[448:]).argmax(dim=1) == y[448:]).sum())
print(f"holdout: {correct}/64")
save_file(model.state_dict(), args.out)
