"""The HF Trainer under trainjob against the Trainer alone: time per step with the same save cadence,
and each checkpoint's time and size.

    OMP_NUM_THREADS=1 python scripts/bench_hf.py [--rounds 3] [--steps 40] [--save-steps 10] [--width 256]
    OMP_NUM_THREADS=1 python scripts/bench_hf.py --lora [--rounds 5]    # a PEFT LoRA fine-tune (issue 58)

One process; in each round, the plain Trainer (its own checkpoints every ``--save-steps`` into its
output_dir, safetensors model + optimizer.pt + scheduler + RNG + trainer_state.json) and then the
same Trainer script under ``trainjob.integrations.hf.run`` (trainjob's checkpoints at the same
steps, on a fresh PVC), alternating, a fresh model from the same seed each time. A step's time is
the wall time from the first step's start to the end of training (saves included, the last step's
too: ``--steps`` is a multiple of ``--save-steps``), divided by the steps; a save's time is what
the Trainer's ``_save_checkpoint`` takes, and for trainjob the extra time of a step whose
checkpoint is due over the median step. Sizes are the checkpoint directories' bytes. Prints one
table (medians over the rounds, min..max); docs/benchmarks.md records it.

``--lora``: the issue's LoRA run instead, a GPT-2 of 12.7M parameters (width 256, 8 layers, a
vocabulary of 24,576, 16-token sequences, batches of 4) under PEFT's ``LoraConfig(r=8)`` on its
attention (65,536 trainable parameters): the Trainer's ``checkpoint-N`` holds the adapter and its
optimizer state; trainjob's holds the same and references the frozen base by its digest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from trainjob import Score
from trainjob.integrations import hf
from trainjob.integrations.hf import hooks

VOCAB, LENGTH, BATCH, LAYERS = 512, 64, 8, 4
LORA = {"vocab": 24576, "length": 16, "batch": 4, "layers": 8}  # --lora: the 12.7M-parameter GPT-2


class Clock(TrainerCallback):
    def __init__(self) -> None:
        self.start: float | None = None
        self.ends: list[float] = []

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
        self.ends.append(time.perf_counter())


def build(out: Path, a: argparse.Namespace) -> tuple[Trainer, Clock]:
    shape = LORA if a.lora else {"vocab": VOCAB, "length": LENGTH, "batch": BATCH, "layers": LAYERS}
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (a.steps * shape["batch"], shape["length"]), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=shape["vocab"], n_positions=shape["length"], n_embd=a.width,
                                       n_layer=shape["layers"], n_head=4, bos_token_id=0, eos_token_id=0))
    if a.lora:
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=32, lora_dropout=0.1))
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=shape["batch"], max_steps=a.steps,
                             learning_rate=1e-3, save_strategy="steps", save_steps=a.save_steps, logging_steps=10 ** 6,
                             report_to="none", disable_tqdm=True, seed=0, use_cpu=True)
    clock = Clock()
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[clock]), clock


def size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def plain(root: Path, a: argparse.Namespace) -> dict[str, float]:
    trainer, clock = build(root / "out", a)
    saves: list[float] = []
    original = trainer._save_checkpoint

    def timed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        original(*args, **kw)
        saves.append(time.perf_counter() - t)

    trainer._save_checkpoint = timed
    trainer.train()
    assert clock.start is not None
    first = sorted((root / "out").glob("checkpoint-*"))[0]
    return {"step": (clock.ends[-1] - clock.start) / a.steps, "save": statistics.median(saves), "size": size(first)}


def under_trainjob(root: Path, a: argparse.Namespace) -> dict[str, float]:
    trainer, clock = build(root / "out", a)
    ends: dict[int, float] = {}
    original = hooks.Driver.end_of_step

    def timed(driver: hooks.Driver) -> None:
        step, t = driver.step, time.perf_counter()
        original(driver)
        ends[step] = time.perf_counter() - t

    hooks.Driver.end_of_step = timed  # type: ignore[method-assign]
    try:
        code = hf.run(trainer, pvc=root / "pvc", gate=lambda t: (Score(correct=1, total=1), Score(correct=1, total=1)))
    finally:
        hooks.Driver.end_of_step = original  # type: ignore[method-assign]
    assert code == 0, code
    assert clock.start is not None
    others = statistics.median(v for s, v in ends.items() if s % a.save_steps)
    due = [v - others for s, v in ends.items() if s % a.save_steps == 0]
    first = sorted((root / "pvc/checkpoints").glob("step-*"))[0]
    return {"step": (clock.ends[-1] - clock.start) / a.steps, "save": statistics.median(due), "size": size(first),
            "between": others}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=3)
    cli.add_argument("--steps", type=int, default=40)
    cli.add_argument("--save-steps", type=int, default=10)
    cli.add_argument("--width", type=int, default=256)
    cli.add_argument("--lora", action="store_true", help="a PEFT LoRA fine-tune of a 12.7M-parameter GPT-2")
    a = cli.parse_args()
    if a.steps % a.save_steps:
        sys.exit("--steps must be a multiple of --save-steps (both then save the last step)")
    rows: dict[str, list[dict[str, float]]] = {"trainer": [], "trainjob": []}
    for r in range(a.rounds):
        for name, fn in (("trainer", plain), ("trainjob", under_trainjob)) if r % 2 == 0 else (
                ("trainjob", under_trainjob), ("trainer", plain)):
            with tempfile.TemporaryDirectory() as d:
                rows[name].append(fn(Path(d), a))
            print(f"round {r + 1} {name}: {rows[name][-1]}", file=sys.stderr, flush=True)

    def show(name: str, key: str, scale: float) -> str:
        v = [row[key] * scale for row in rows[name]]
        return f"{statistics.median(v):.3g} ({min(v):.3g}..{max(v):.3g})"

    def ratio(key: str) -> str:
        return f"{statistics.median(rows['trainjob'][i][key] / rows['trainer'][i][key] for i in range(a.rounds)):.3f}"

    shape = LORA if a.lora else {"vocab": VOCAB, "layers": LAYERS}
    print(f"HF Trainer (transformers {__import__('transformers').__version__}), GPT-2 width {a.width}, "
          f"{shape['layers']} layers, vocabulary {shape['vocab']}{', PEFT LoRA r=8' if a.lora else ''}, "
          f"{a.steps} steps, a checkpoint every {a.save_steps}, {a.rounds} rounds, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| median (min..max) | Trainer alone | under trainjob | ratio |")
    print("|---|---|---|---|")
    print(f"| ms per step, saves included | {show('trainer', 'step', 1e3)} | {show('trainjob', 'step', 1e3)} | "
          f"{ratio('step')} |")
    print(f"| ms per save | {show('trainer', 'save', 1e3)} | {show('trainjob', 'save', 1e3)} | {ratio('save')} |")
    between = [row["between"] * 1e3 for row in rows["trainjob"]]
    print(f"| ms per step in the integration's end of step, no checkpoint due | | "
          f"{statistics.median(between):.2f} ({min(between):.2f}..{max(between):.2f}) | |")
    print(f"| MB per checkpoint | {show('trainer', 'size', 1e-6)} | {show('trainjob', 'size', 1e-6)} | "
          f"{ratio('size')} |")


if __name__ == "__main__":
    main()
