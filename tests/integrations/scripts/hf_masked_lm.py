"""Masked language modeling as the Transformers task guide writes it, with `hf.run` in place of `trainer.train()`.

    python tests/integrations/scripts/hf_masked_lm.py --pvc pvc [--workers 2]

The guide's steps: tokenize a text data set with `map`, concatenate and cut it into blocks
(`group_texts`), let `DataCollatorForLanguageModeling(mlm_probability=0.15)` mask 15% of the tokens
at random in every batch, train an `AutoModelForMaskedLM` with `eval_strategy="epoch"`. What differs,
and why: the model is a tiny BERT built from a config and the tokenizer a word-level one built from
its vocabulary (no download); `set_seed` comes before the model is built (the docs' reproducibility
advice); `push_to_hub` is left out; `--workers` sets `dataloader_num_workers` (the masks are then
drawn in the loader's worker processes).
"""

import argparse
import sys

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForMaskedLM, BertConfig, DataCollatorForLanguageModeling, PreTrainedTokenizerFast,
                          Trainer, TrainingArguments, set_seed)

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--workers", type=int, default=0)
cli.add_argument("--epochs", type=int, default=3)
args = cli.parse_args()
set_seed(0)

WORDS = "the cat dog sat ran on a mat rug log and then slept ate fish bread".split()
vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                    cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def stories(n, offset):
    return {"text": [" ".join(WORDS[(3 * i + 5 * k + offset) % len(WORDS)] for k in range(5 + i % 7)) for i in range(n)]}


eli5 = {"train": Dataset.from_dict(stories(120, 0)), "test": Dataset.from_dict(stories(24, 1))}


def preprocess_function(examples):
    return tokenizer([" ".join(x) for x in [t.split() for t in examples["text"]]])


tokenized_eli5 = {k: v.map(preprocess_function, batched=True, remove_columns=["text"]) for k, v in eli5.items()}
block_size = 16


def group_texts(examples):
    concatenated_examples = {k: sum(examples[k], []) for k in examples.keys()}
    total_length = len(concatenated_examples[list(examples.keys())[0]])
    if total_length >= block_size:
        total_length = (total_length // block_size) * block_size
    result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
              for k, t in concatenated_examples.items()}
    return result


lm_dataset = {k: v.map(group_texts, batched=True) for k, v in tokenized_eli5.items()}
data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=0.15)

model = AutoModelForMaskedLM.from_config(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=block_size, pad_token_id=0))

training_args = TrainingArguments(
    output_dir=f"{args.pvc}-trainer",
    eval_strategy="epoch",
    learning_rate=2e-3,
    num_train_epochs=args.epochs,
    weight_decay=0.01,
    per_device_train_batch_size=8,
    dataloader_num_workers=args.workers,
    save_steps=4,
    report_to="none",
    use_cpu=True,
)

trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=lm_dataset["train"],
    eval_dataset=lm_dataset["test"],
    data_collator=data_collator,
    processing_class=tokenizer,
)

# trainer.train(), under trainjob:
from trainjob.integrations import hf  # noqa: E402

sys.exit(hf.run(trainer, pvc=args.pvc, gate=hf.metric("eval_loss", baseline=3.0, higher_is_better=False)))
