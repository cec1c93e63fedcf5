"""A causal LM trained on a streamed data set as the datasets docs write one, with `hf.run` in place of `trainer.train()`.

    python tests/integrations/scripts/hf_streaming.py --pvc pvc [--workers 2]

The datasets "Stream" guide's steps: an `IterableDataset` (`Dataset.to_iterable_dataset(num_shards=...)`,
what `load_dataset(..., streaming=True)` gives for data on a hub), tokenized lazily with `map`, shuffled
with `.shuffle(seed=42, buffer_size=...)`; the Trainer, which cannot know the length of a stream, is
given `max_steps` (here three passes over the data: the Trainer calls `set_epoch` between them, so
each pass is shuffled anew). What differs, and why: the text is generated and the tokenizer is a
word-level one built from its vocabulary, the model a tiny GPT-2 from a config (no download);
`set_seed` comes before the model is built; trainjob's import is at the top, with the others.
"""

import argparse
import sys

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, DataCollatorForLanguageModeling, GPT2Config, PreTrainedTokenizerFast,
                          Trainer, TrainingArguments, set_seed)

from trainjob.integrations import hf

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--workers", type=int, default=0)
cli.add_argument("--max-steps", type=int, default=30)  # 80 examples in batches of 8: 10 steps a pass
args = cli.parse_args()
set_seed(0)

WORDS = "red green blue yellow black white big small old new one two".split()
vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", *WORDS])}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")

texts = [" ".join(WORDS[(i * 7 + k * (1 + i % 3)) % len(WORDS)] for k in range(4 + i % 5)) for i in range(80)]
my_dataset = Dataset.from_dict({"text": texts})
my_iterable_dataset = my_dataset.to_iterable_dataset(num_shards=4)
tokenized = my_iterable_dataset.map(lambda example: tokenizer(example["text"]), remove_columns=["text"])
shuffled_dataset = tokenized.shuffle(seed=42, buffer_size=16)

model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(vocab), n_positions=16, n_embd=32, n_layer=2,
                                                    n_head=2, pad_token_id=0, bos_token_id=0, eos_token_id=0))
training_args = TrainingArguments(
    output_dir=f"{args.pvc}-trainer",
    max_steps=args.max_steps,
    per_device_train_batch_size=8,
    learning_rate=5e-3,
    save_steps=4,
    dataloader_num_workers=args.workers,
    report_to="none",
    use_cpu=True,
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=shuffled_dataset,
    data_collator=DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False),
)


def first_tokens_right(trainer):  # the gate: next-token accuracy on the texts, against guessing the commonest word
    import torch

    import trainjob

    batch = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)([tokenizer(t) for t in texts])
    with torch.no_grad():
        trainer.model.eval()
        guess = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].argmax(-1)
    labels = batch["input_ids"][:, 1:]
    real = batch["attention_mask"][:, 1:].bool()
    right, total = int(((guess == labels) & real).sum()), int(real.sum())
    common = int(((labels == labels[real].mode().values) & real).sum())
    return trainjob.Score(correct=right, total=total), trainjob.Score(correct=common, total=total)


# trainer.train(), under trainjob:
sys.exit(hf.run(trainer, pvc=args.pvc, gate=first_tokens_right))
