"""The HF Trainer under trainjob against the Trainer saving its own checkpoints at the same cadence:
wall time per step, and the training thread's stall per checkpoint.

    OMP_NUM_THREADS=1 python scripts/bench_hf.py [--rounds 5] [--steps 60] [--save-steps 10] [--width 256]
    OMP_NUM_THREADS=1 python scripts/bench_hf.py --lora [--rounds 5]    # a PEFT LoRA fine-tune (issue 58)

One process, three contenders, a fresh model from the same seed each run, interleaved: in each
round every contender runs once, and the order turns by one from round to round (A B C, B C A,
C A B, ...), so no contender always runs first or after the same neighbour:

    trainer     the Trainer alone, ``save_strategy="steps"``: its own ``checkpoint-N`` every
                ``--save-steps`` into its output_dir (safetensors model, optimizer.pt, scheduler,
                RNG, trainer_state.json; nothing fsynced, nothing hashed)
    sync        the same Trainer script under ``trainjob.integrations.hf.run``: trainjob's
                checkpoints at the same steps on a fresh PVC (hashed shards, fsynced, manifest,
                pointer, rotation, the ``checkpointed`` log line)
    async       the same with ``async_checkpoint=True``: the state copied into host buffers at the
                step, written, hashed and fsynced by a writer thread while training goes on

What is timed, per run. **Wall per step**: from the first step's start to the end of training
(saves included, the last step's too: ``--steps`` is a multiple of ``--save-steps``), divided by
the steps; and the same in the process's CPU time. **The held stall per checkpoint**: the time
the training thread spends on a checkpoint. For the Trainer, its ``_save_checkpoint``, timed at
each save. For trainjob, the integration's hook (``Driver.end_of_step``: the step's loss handed
to the Run, the checkpoint when due, with ``async_checkpoint`` the copy, and at a later step the
landing) timed at every step: the median call is a step with no checkpoint, and what the calls
took beyond it, summed, divided by the checkpoints, is the stall. Both are taken over the
checkpoints before the last step: there the async run also waits for its last write to land
before the gate (one drain per run, not per checkpoint; printed apart, "end drain").

Printed: each contender's medians over the rounds with min..max, and sync's and async's ratios to
the Trainer's, by the medians and paired (the median of each round's own ratio: a round's runs
follow each other, under much the same load). Targets (issue 56, item 5c): wall per step <= 1.05x
the Trainer's; the async held stall <= the Trainer's save. Sizes are the first checkpoint
directory's bytes.

``--lora``: the issue's LoRA run instead, a GPT-2 of 12.7M parameters (width 256, 8 layers, a
vocabulary of 24,576, 16-token sequences, batches of 4) under PEFT's ``LoraConfig(r=8)`` on its
attention (65,536 trainable parameters): the Trainer's ``checkpoint-N`` holds the adapter and its
optimizer state; trainjob's holds the same and references the frozen base by its digest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainjob import Score  # noqa: E402
from trainjob.integrations import hf  # noqa: E402
from trainjob.integrations.hf import hooks  # noqa: E402

VOCAB, LENGTH, BATCH, LAYERS = 512, 64, 8, 4
LORA = {"vocab": 24576, "length": 16, "batch": 4, "layers": 8}  # --lora: the 12.7M-parameter GPT-2
CONTENDERS = ("trainer", "sync", "async")


class Clock(TrainerCallback):
    """The fit's wall and CPU time, from the first step's start to the end of training."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.cpu_start = 0.0
        self.seconds = self.cpu = 0.0

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
        if self.start is None:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
        assert self.start is not None
        self.seconds, self.cpu = time.perf_counter() - self.start, time.process_time() - self.cpu_start


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


def timed(calls: list[tuple[int, float]], step: Callable[[], int], method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` timed at every call: (the step it was called at, its seconds) appended to ``calls``."""

    def wrapper(*args: Any, **kw: Any) -> Any:
        at, began = step(), time.perf_counter()
        try:
            return method(*args, **kw)
        finally:
            calls.append((at, time.perf_counter() - began))

    return wrapper


def plain(root: Path, a: argparse.Namespace) -> dict[str, float]:
    """The Trainer alone, saving its own checkpoints every ``save_steps``."""
    trainer, clock = build(root / "out", a)
    saves: list[tuple[int, float]] = []
    trainer._save_checkpoint = timed(saves, lambda: trainer.state.global_step, trainer._save_checkpoint)
    trainer.train()
    before_last = [s for at, s in saves if at < a.steps]
    first = sorted((root / "out").glob("checkpoint-*"))[0]
    return {"step": clock.seconds / a.steps, "cpu": clock.cpu / a.steps, "checkpoints": len(saves),
            "held": statistics.mean(before_last), "drain": 0.0, "size": size(first)}


def under_trainjob(root: Path, a: argparse.Namespace, async_checkpoint: bool) -> dict[str, float]:
    """``hf.run``: trainjob's checkpoints at the Trainer's ``save_steps``, synchronous or not."""
    trainer, clock = build(root / "out", a)
    calls: list[tuple[int, float]] = []
    original = hooks.Driver.end_of_step
    hooks.Driver.end_of_step = timed(calls, lambda: trainer.state.global_step, original)  # type: ignore[method-assign]
    try:
        code = hf.run(trainer, pvc=root / "pvc", async_checkpoint=async_checkpoint,
                      gate=lambda t: (Score(correct=1, total=1), Score(correct=1, total=1)))
    finally:
        hooks.Driver.end_of_step = original  # type: ignore[method-assign]
    assert code == 0, code
    checkpoints = (root / "pvc/log.jsonl").read_text().count('"event":"checkpointed"')
    before_last = [s for at, s in calls if at < a.steps]
    usual = statistics.median(before_last)  # a step with no checkpoint due, nothing landing
    due = sum(1 for at, _ in calls if at < a.steps and at % a.save_steps == 0)
    last = sum(s for at, s in calls if at == a.steps)
    first = sorted((root / "pvc/checkpoints").glob("step-*"))[0]
    return {"step": clock.seconds / a.steps, "cpu": clock.cpu / a.steps, "checkpoints": checkpoints,
            "held": sum(s - usual for s in before_last) / due, "drain": last - usual, "usual": usual,
            "size": size(first)}


RUNS: dict[str, Callable[[Path, argparse.Namespace], dict[str, float]]] = {
    "trainer": plain,
    "sync": lambda root, a: under_trainjob(root, a, False),
    "async": lambda root, a: under_trainjob(root, a, True),
}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=5)
    cli.add_argument("--steps", type=int, default=60)
    cli.add_argument("--save-steps", type=int, default=10)
    cli.add_argument("--width", type=int, default=256)
    cli.add_argument("--lora", action="store_true", help="a PEFT LoRA fine-tune of a 12.7M-parameter GPT-2")
    cli.add_argument("--json", type=Path, help="also write every run's figures here")
    a = cli.parse_args()
    if a.steps % a.save_steps or a.steps < 2 * a.save_steps:
        sys.exit("--steps must be a multiple of --save-steps, at least two of them (all save the last step; the "
                 "stall is taken over the checkpoints before it)")
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as d, contextlib.redirect_stdout(sys.stderr):
        under_trainjob(  # untimed: the imports, the first allocations
            Path(d), argparse.Namespace(**{**vars(a), "steps": 2 * a.save_steps}), True)
    for r in range(a.rounds):
        for name in CONTENDERS[r % 3:] + CONTENDERS[:r % 3]:
            with tempfile.TemporaryDirectory(prefix="bench-hf-") as d, contextlib.redirect_stdout(sys.stderr):
                rows[name].append(RUNS[name](Path(d), a))  # the Trainer prints its summary: kept off the table
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[name][-1].items()),
                  file=sys.stderr, flush=True)
    counts = {k: {row["checkpoints"] for row in rows[k]} for k in CONTENDERS}
    if len(set().union(*counts.values())) != 1:  # the comparison would not be fair
        sys.exit(f"the contenders wrote different numbers of checkpoints: {counts}")

    def show(name: str, key: str, scale: float, digits: str = ".3g") -> str:
        v = [row[key] * scale for row in rows[name]]
        return f"{statistics.median(v):{digits}} ({min(v):{digits}}..{max(v):{digits}})"

    def ratio(name: str, key: str) -> str:
        mine, theirs = [row[key] for row in rows[name]], [row[key] for row in rows["trainer"]]
        paired = statistics.median(m / t for m, t in zip(mine, theirs))
        return f"{statistics.median(mine) / statistics.median(theirs):.3f}, {paired:.3f}"

    shape = LORA if a.lora else {"vocab": VOCAB, "layers": LAYERS}
    print(f"HF Trainer (transformers {__import__('transformers').__version__}), GPT-2 width {a.width}, "
          f"{shape['layers']} layers, vocabulary {shape['vocab']}{', PEFT LoRA r=8' if a.lora else ''}, "
          f"{a.steps} steps, a checkpoint every {a.save_steps} ({min(counts['trainer'])} per run), {a.rounds} rounds, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| median (min..max) over the rounds | Trainer + save_steps | hf.run | hf.run, async | "
          "ratios to the Trainer (medians, paired): hf.run; async |")
    print("|---|---|---|---|---|")
    for label, key, scale in (("wall ms per step, saves included", "step", 1e3),
                              ("CPU ms per step", "cpu", 1e3),
                              ("held stall per checkpoint, ms", "held", 1e3)):
        print(f"| {label} | {show('trainer', key, scale)} | {show('sync', key, scale)} | {show('async', key, scale)} "
              f"| {ratio('sync', key)}; {ratio('async', key)} |")
    print(f"| end drain (the last step's hook beyond a plain step), ms | | {show('sync', 'drain', 1e3)} | "
          f"{show('async', 'drain', 1e3)} | |")
    print(f"| the hook on a step with no checkpoint, ms | | {show('sync', 'usual', 1e3, '.2f')} | "
          f"{show('async', 'usual', 1e3, '.2f')} | |")
    print(f"| MB per checkpoint | {show('trainer', 'size', 1e-6)} | {show('sync', 'size', 1e-6)} | "
          f"{show('async', 'size', 1e-6)} | {ratio('sync', 'size')}; {ratio('async', 'size')} |")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
