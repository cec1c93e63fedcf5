"""A Lightning script as Lightning's docs write one (a LightningDataModule, OneCycleLR stepped per
batch, gradient accumulation and clipping, EarlyStopping), plus trainjob's lines (docs/lightning.md).

    python lightning_datamodule.py --pvc pvc

Both loaders run two worker processes; the training set draws its augmentation (noise) in them.
EarlyStopping ends the fit long before ``max_epochs``: the run publishes the model it stopped with.
"""

import argparse
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import Dataset, random_split
from torchdata.stateful_dataloader import StatefulDataLoader

import trainjob
from trainjob.integrations.lightning import TrainJob

parser = argparse.ArgumentParser()
parser.add_argument("--pvc", default="pvc")
args = parser.parse_args()


class Points(Dataset):
    """Noisy points in four classes; ``augment`` adds fresh noise to each sample it hands out."""

    def __init__(self, augment):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(600, 16, generator=generator)
        self.y = (self.x[:, :4].argmax(dim=1) + (torch.rand(600, generator=generator) < 0.3).long()) % 4
        self.augment = augment

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return (self.x[i] + 0.1 * torch.randn(16) if self.augment else self.x[i]), self.y[i]


class PointsDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str):
        split = torch.Generator().manual_seed(42)
        self.train_set, _ = random_split(Points(augment=True), [400, 200], generator=split)
        _, self.val_set = random_split(Points(augment=False), [400, 200], generator=torch.Generator().manual_seed(42))
        self.test_set = self.val_set

    def train_dataloader(self):
        return StatefulDataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=2)

    def val_dataloader(self):
        return StatefulDataLoader(self.val_set, batch_size=self.batch_size, num_workers=2)


class LitClassifier(L.LightningModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr,
                                                        total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def score(model):  # trainjob's gate: the validation set's accuracy against guessing the commonest class
    model.eval()
    x, y = torch.stack([v[0] for v in dm.val_set]), torch.stack([v[1] for v in dm.val_set])
    with torch.no_grad():
        correct = int((model(x).argmax(dim=1) == y).sum())
    return trainjob.Score(correct, len(y)), trainjob.Score(int(torch.bincount(y).max()), len(y))


L.seed_everything(42, workers=True)
dm = PointsDataModule()
model = LitClassifier()
job = TrainJob(args.pvc, ckpt_every=5, gate=score)
early_stopping = EarlyStopping(monitor="val_loss", mode="min", min_delta=0.01, patience=2)
trainer = L.Trainer(max_epochs=30, accumulate_grad_batches=2, gradient_clip_val=0.5,
                    callbacks=[early_stopping, job])
trainer.fit(model, datamodule=dm)
sys.exit(job.exit_code)
