"""A Lightning script as Lightning's "in 15 minutes" page writes one, trained for ``max_steps``
alone (no ``max_epochs``), plus trainjob's lines (docs/lightning.md).

    python lightning_max_steps.py --pvc pvc

The page's autoencoder on random images instead of MNIST: a LightningModule with ``self.log``,
Adam, the Trainer's default logger and ModelCheckpoint.
"""

import argparse
import sys

import lightning as L
import torch
from torch import nn, optim
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import trainjob
from trainjob.integrations.lightning import TrainJob

parser = argparse.ArgumentParser()
parser.add_argument("--pvc", default="pvc")
args = parser.parse_args()

L.seed_everything(42, workers=True)
encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))


class LitAutoEncoder(L.LightningModule):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optim.Adam(self.parameters(), lr=1e-3)


def score(model):  # trainjob's gate: holdout images reconstructed within the mean image's median error
    with torch.no_grad():
        x = holdout.view(holdout.size(0), -1)
        error = ((model.decoder(model.encoder(x)) - x) ** 2).mean(dim=1)
        mean = ((images[:200].view(200, -1).mean(dim=0) - x) ** 2).mean(dim=1)  # the baseline: the mean image
    within = mean.median()
    return trainjob.Score(int((error < within).sum()), 50), trainjob.Score(int((mean < within).sum()), 50)


images = torch.rand(4, 1, 28, 28)[torch.randint(4, (250,))] + 0.05 * torch.randn(250, 1, 28, 28)  # 4 kinds
holdout = images[200:]
dataset = TensorDataset(images[:200], torch.zeros(200))
train_loader = StatefulDataLoader(dataset, batch_size=16, shuffle=True)

autoencoder = LitAutoEncoder(encoder, decoder)
job = TrainJob(args.pvc, ckpt_every=10, gate=score)
trainer = L.Trainer(max_steps=60, callbacks=[job])
trainer.fit(model=autoencoder, train_dataloaders=train_loader)
sys.exit(job.exit_code)
