"""A Lightning DDP script as Lightning's docs write one, plus trainjob's lines (docs/lightning.md).

    trainjob torchrun --standalone --nproc-per-node 2 lightning_ddp.py --pvc pvc

A small classifier with BatchNorm, trained with ``strategy="ddp"`` on two CPU processes; the
loaders are plain Lightning: Lightning puts its own DistributedSampler in (the default
``use_distributed_sampler=True``), and both loaders run two worker processes.
"""

import argparse
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import trainjob
from trainjob.integrations.lightning import TrainJob

parser = argparse.ArgumentParser()
parser.add_argument("--pvc", default="pvc")
args = parser.parse_args()


class LitClassifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def score(model):  # trainjob's gate: the holdout's accuracy against always guessing the commonest class
    model.eval()
    with torch.no_grad():
        correct = int((model(x[400:]).argmax(dim=1) == y[400:]).sum())
    common = int(torch.bincount(y[:400]).argmax())
    return trainjob.Score(correct, 100), trainjob.Score(int((y[400:] == common).sum()), 100)


L.seed_everything(42, workers=True)
x = torch.randn(500, 16)
y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4
train_loader = StatefulDataLoader(TensorDataset(x[:400], y[:400]), batch_size=16, shuffle=True, num_workers=2)
val_loader = StatefulDataLoader(TensorDataset(x[400:], y[400:]), batch_size=50, num_workers=2)

job = TrainJob(args.pvc, ckpt_every=5, gate=score)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, callbacks=[job])
trainer.fit(LitClassifier(), train_loader, val_loader)
sys.exit(job.exit_code)
