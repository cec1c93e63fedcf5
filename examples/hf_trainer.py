"""A Hugging Face Trainer script under trainjob: killed at any instant, resumed to the same bits, gated.

    python examples/hf_trainer.py --pvc pvc
    python -m trainjob torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --pvc pvc
    python examples/hf_trainer.py --bare model.safetensors    # the same script without trainjob

A tiny GPT-2 built from a config (no download) learns a toy language (each sentence counts up in
steps of 1, 2 or 3, modulo the vocabulary), AdamW with a linear warm-up and decay, dropout,
gradient accumulation over 2 micro-batches, 3 epochs of a shuffled data set. Everything above the
marked lines is an ordinary Trainer script; trainjob's part is those lines (docs/hf.md).
"""

import argparse, sys  # noqa: E401

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--epochs", type=int, default=3)
cli.add_argument("--save-steps", type=int, default=5)
cli.add_argument("--workers", type=int, default=0, help="the data loader's worker processes")
cli.add_argument("--out", default=None, help="the Trainer's output_dir (default: a folder beside --pvc)")
cli.add_argument("--bare", metavar="FILE", help="train without trainjob; save the final weights to FILE")
args = cli.parse_args()

VOCAB, LENGTH = 32, 16
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)


def sentences(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


train, holdout = sentences(192, 1), sentences(64, 2)
model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
training = TrainingArguments(
    output_dir=args.out or f"{args.bare or args.pvc}-trainer", per_device_train_batch_size=8,
    gradient_accumulation_steps=2, num_train_epochs=args.epochs, learning_rate=3e-3, warmup_steps=4,
    weight_decay=0.01, save_strategy="steps", save_steps=args.save_steps, logging_steps=1, report_to="none",
    disable_tqdm=True, seed=0, use_cpu=True, ddp_find_unused_parameters=False,
    dataloader_num_workers=args.workers)


class PrintLoss(Trainer):  # each step's loss on stdout, as `trainjob prove` reads it
    def log(self, logs, *rest, **kw):
        if "loss" in logs and self.is_world_process_zero():
            print(f"step {self.state.global_step} loss {logs['loss']!r}", flush=True)
        super().log(logs, *rest, **kw)


trainer = PrintLoss(model=model, args=training, train_dataset=train)

if args.bare:  # the same training with the Trainer alone (a test compares the weights bit for bit)
    training.save_strategy = "no"
    trainer.train()
    if trainer.is_world_process_zero():
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, args.bare)
    sys.exit(0)


@torch.no_grad()
def next_token_accuracy(trainer):  # the gate: the model's next token against a frozen baseline's
    ids = torch.stack([s["input_ids"] for s in holdout])
    trainer.model.eval()
    guess = trainer.model(input_ids=ids).logits[:, :-1].argmax(-1)
    right, total = int((guess == ids[:, 1:]).sum()), ids[:, 1:].numel()
    repeat = int((ids[:, :-1] + 1 == ids[:, 1:]).sum())  # the baseline: "the next token is this one plus 1"
    return trainjob.Score(correct=right, total=total), trainjob.Score(correct=repeat, total=total)


# ---- trainjob's lines: instead of trainer.train() ----
import trainjob  # noqa: E402
from trainjob.integrations import hf  # noqa: E402
sys.exit(hf.run(trainer, pvc=args.pvc, gate=next_token_accuracy))
