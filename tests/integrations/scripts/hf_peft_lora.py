"""A LoRA fine-tune of a causal LM as PEFT's quicktour writes one, with `hf.run` in place of `trainer.train()`.

    python tests/integrations/scripts/hf_peft_lora.py --pvc pvc

What differs from the docs, and why: the model is a tiny GPT-2 built from a config and the tokenizer
a word-level one built from its vocabulary (no download); `set_seed` comes before the model is built
(the docs' reproducibility advice: the LoRA weights are drawn at `get_peft_model`); the quicktour's
`load_best_model_at_end=True` is left out (trainjob refuses it: its gate decides what is published);
`model.save_pretrained(...)` after training is the artifact trainjob publishes (the adapter, in
PEFT's own format).
"""

import argparse
import sys

from datasets import Dataset
from peft import LoraConfig, TaskType, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, DataCollatorForLanguageModeling, GPT2Config,
                          PreTrainedTokenizerFast, Trainer, TrainingArguments, set_seed)

cli = argparse.ArgumentParser()
cli.add_argument("--pvc", default="pvc")
cli.add_argument("--epochs", type=int, default=3)
args = cli.parse_args()
set_seed(0)

WORDS = "zero one two three four five six seven eight nine ten eleven".split()
vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", *WORDS])}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")


def counting(n, offset):  # sentences that count up in steps of 1 or 2, wrapping around
    return {"text": [" ".join(WORDS[(i + offset + k * (1 + i % 2)) % len(WORDS)] for k in range(6 + i % 4))
                     for i in range(n)]}


def tokenize(examples):
    return tokenizer(examples["text"])


train = Dataset.from_dict(counting(64, 0)).map(tokenize, batched=True, remove_columns=["text"])
test = Dataset.from_dict(counting(16, 5)).map(tokenize, batched=True, remove_columns=["text"])
data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)

model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(vocab), n_positions=16, n_embd=32, n_layer=2,
                                                    n_head=2, pad_token_id=0, bos_token_id=0, eos_token_id=0))
peft_config = LoraConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, r=8, lora_alpha=32, lora_dropout=0.1)
model = get_peft_model(model, peft_config)
model.print_trainable_parameters()

training_args = TrainingArguments(
    output_dir=f"{args.pvc}-trainer",
    learning_rate=1e-2,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    num_train_epochs=args.epochs,
    weight_decay=0.01,
    eval_strategy="epoch",
    save_strategy="epoch",
    report_to="none",
    use_cpu=True,
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=train,
    eval_dataset=test,
    processing_class=tokenizer,
    data_collator=data_collator,
)

# trainer.train(), under trainjob:
from trainjob.integrations import hf  # noqa: E402

sys.exit(hf.run(trainer, pvc=args.pvc, gate=hf.metric("eval_loss", baseline=3.0, higher_is_better=False)))
