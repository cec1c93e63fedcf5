"""A Lightning script under trainjob: killed at any instant, resumed to the same bits (docs/lightning.md).

    python examples/lightning_trainer.py --pvc pvc
    python examples/lightning_trainer.py --bare weights.pt     # the same script without trainjob
    trainjob torchrun --standalone --nproc-per-node 2 examples/lightning_trainer.py --pvc pvc

An MLP with dropout, AdamW, a warm-up + cosine LambdaLR stepped per batch, gradient clipping, a
shuffling StatefulDataLoader over 3 epochs, a validation twice an epoch; DDP over gloo under
torchrun (each rank shuffles its own part of the data). trainjob's part is the TrainJob callback:
four lines.
"""

import argparse, datetime, math, os, sys  # noqa: E401

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import trainjob
from trainjob.integrations.lightning import TrainJob

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--epochs", type=int, default=3)
cli.add_argument("--ckpt-every", type=int, default=5)
cli.add_argument("--bare", metavar="FILE", help="train without trainjob; save the final weights to FILE")
args = cli.parse_args()
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
torch.manual_seed(0)
x = torch.randn(600, 32)
y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4  # four classes, learnable
train = torch.utils.data.TensorDataset(x[:480], y[:480])


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(inputs), labels)
        if rank == 0:
            print(f"step {self.global_step + 1} loss {loss.item()!r}", flush=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(inputs), labels), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        steps = self.trainer.estimated_stepping_batches
        warmup = steps // 10
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                                  0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def score(module):  # the gate: the holdout's accuracy against always guessing the commonest class
    with torch.no_grad():
        correct = int((module.net(x[480:]).argmax(dim=1) == y[480:]).sum())
    common = int(torch.bincount(y[:480]).argmax())
    return trainjob.Score(correct=correct, total=120), trainjob.Score(correct=int((y[480:] == common).sum()), total=120)


loader = StatefulDataLoader(torch.utils.data.Subset(train, range(rank, 480, world)), batch_size=16 // world,
                            shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(rank))
model = Classifier()
job = TrainJob(args.pvc, ckpt_every=args.ckpt_every, gate=score)
trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=world, num_nodes=1,
                    strategy=L.pytorch.strategies.DDPStrategy(timeout=datetime.timedelta(seconds=30)) if world > 1 else
                    "auto", use_distributed_sampler=False, deterministic=True, gradient_clip_val=1.0,
                    val_check_interval=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[] if args.bare else [job])
validation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[480:], y[480:]), batch_size=40)
trainer.fit(model, loader, validation)
if args.bare:  # the same training without trainjob (a test compares the weights bit for bit)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.bare) if rank == 0 else None
    sys.exit(0)
sys.exit(job.exit_code)
