"""``trainjob.integrations.hf``: a ``transformers.Trainer`` script under trainjob, in two lines.

    from trainjob.integrations import hf
    sys.exit(hf.run(trainer, pvc="pvc", gate=my_gate))       # instead of trainer.train()

``run`` trains the Trainer as a ``trainjob.Run``: trainjob's checkpoints (atomic, hashed, rotated,
verified before use) at the Trainer's ``save_steps``, a relaunch resumes from the newest one that
verifies (no ``resume_from_checkpoint``), SIGTERM saves the step and exits 75, and the gate
publishes the model as safetensors or refuses it. ``state.py`` holds what a checkpoint holds,
``hooks.py`` where the Trainer's loop meets the Run, ``masks.py`` a masked-LM's masks drawn by step,
``construction.py`` what a Trainer refused at its construction ends in (imported before it is
built). Needs the ``hf`` extra (transformers, accelerate); docs/hf.md says how, and which versions
are tested.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import UsageError, require

# Looked up, not imported: the script imports transformers itself (its Trainer is what run() drives).
require("trainjob.integrations.hf", "hf", "torch", "transformers", "accelerate")

from ...defaults import BACKOFF_LIMIT  # noqa: E402
from ...engine.run import Run, gate_arguments  # noqa: E402
from ...records import Metric, Score  # noqa: E402
from . import construction, masks  # noqa: E402
from .hooks import Driver  # noqa: E402
from .state import TrainerCheckpoint  # noqa: E402

__all__ = ["run", "metric", "TrainerCheckpoint"]

construction.install()  # a Trainer refused at construction (a stream without max_steps): one line, exit 2

Gate = Callable[[Any], Metric | tuple[Score, Score]]


def run(trainer: Any, *, pvc: str | os.PathLike[str], gate: Gate, export: Callable[[Any], Mapping[str, Any]] | None = None,
        max_drop: int = 20, backoff_limit: int = BACKOFF_LIMIT, keep: int | None = None,
        log: str | os.PathLike[str] | None = None,
        rank_timeout: float = 60.0, idempotent: bool = False, async_checkpoint: bool = False,
        name: str = "hf-trainer") -> int:
    """Train ``trainer`` to its last step as one launch of a trainjob job on ``pvc``, gate it, and
    return the exit code (``sys.exit`` it): 0 completed, 1 drift_failed or job_failed, 2 bad
    input, 75 killed or storage trouble (relaunch), 70 a bug.

    ``gate(trainer)`` returns a ``trainjob.Metric`` (a metric against its frozen value), or
    ``(holdout, baseline)``, two ``trainjob.Score``s: the trained model's and a frozen reference's;
    either passes when it keeps within ``max_drop`` percent of the baseline, as ``Run.gate``
    judges it. ``metric(...)`` makes one from an eval metric. ``export(trainer)`` chooses the
    published tensors (default: what ``save_pretrained`` writes, ``model_tensors``: the model's
    ``state_dict()``, a tied weight once; a PEFT model's adapter). Checkpoints come every ``save_steps`` (the Trainer's
    ``save_strategy``: steps, epoch, or no: the last step only) and at the last step; ``keep``
    of them are kept, the Trainer's ``save_total_limit`` when it is set (3 when neither is; a
    ``save_total_limit`` of 0 or less keeps them all, as the Trainer would). The rest are
    ``trainjob.Run``'s settings (docs/trainers.md). The Trainer's ``output_dir``, which it makes
    when it is built, is taken away again if nothing was written in it."""
    steps, every, refusal = _plan(trainer)
    keep, disagree = _keep(keep, trainer.args.save_total_limit, steps)
    refusal = refusal or disagree
    collator = masks.collator_of(trainer)
    refusal = refusal or (masks.refusal(collator) if collator is not None else None)
    masker = masks.Masker(collator, int(trainer.args.seed), int(trainer.args.process_index)) if collator else None
    state = TrainerCheckpoint(trainer, refusal)
    with Run(pvc, state=state, steps=steps, ckpt_every=every, lr=float(trainer.args.learning_rate),
             max_drop=max_drop, backoff_limit=backoff_limit, keep=keep, log=log, rank_timeout=rank_timeout,
             idempotent=idempotent, async_checkpoint=async_checkpoint, name=name,
             progress=False) as job:  # the Trainer draws its own bar; the run adds the line saying how it ended
        if job.final is None and job.error is None:
            Driver(trainer, state, job, masker).train()
            if job.gate_due:
                job.gate(**gate_arguments(gate(trainer)),
                         export=dict(export(trainer)) if export is not None else model_tensors(trainer.model))
    _remove_if_empty(trainer.args.output_dir)
    return job.exit_code


def _keep(keep: int | None, limit: int | None, steps: int) -> tuple[int, str | None]:
    """How many checkpoints to keep: ``keep``, else the Trainer's ``save_total_limit`` (0 or less:
    all of them, at most one a step), else 3; and a refusal when both are given and differ."""
    wanted = None if limit is None else (limit if limit > 0 else max(steps, 1))
    if keep is not None and wanted is not None and keep != wanted:
        return keep, (f"hf.run(keep={keep}) and TrainingArguments(save_total_limit={limit}) disagree on how many "
                      "checkpoints to keep; give one of them")
    return (keep if keep is not None else wanted if wanted is not None else 3), None


def _remove_if_empty(directory: Any) -> None:
    """The Trainer's output_dir, which it made when it was built, if nothing was written in it."""
    try:
        os.rmdir(directory)
    except (OSError, TypeError):  # not empty, not there, another rank's, or no directory given
        pass


def metric(name: str, baseline: float, *, higher_is_better: bool = True) -> Gate:
    """A gate on one of ``trainer.evaluate()``'s metrics (``"eval_loss"``, an ``"eval_accuracy"``
    your ``compute_metrics`` returns) against a frozen value, for ``run(gate=...)``: the
    ``trainjob.Metric`` it scored, judged as ``Run.gate(metric=...)`` judges one (the same rule
    in own loops, HF and Lightning: ``decisions.metric_counts``). Higher is better: passes when
    the metric is at least ``baseline`` less ``max_drop`` percent of it. Lower is better (a loss):
    passes when the metric less ``max_drop`` percent of itself is at most ``baseline``. A metric
    that is missing, or not a finite number from 0, or a baseline that is not above 0, is a
    UsageError (exit 2)."""

    def gate(trainer: Any) -> Metric:
        found = trainer.evaluate()
        if name not in found:
            raise UsageError(f"trainer.evaluate() gave no {name} (it gave {', '.join(sorted(found))})")
        return Metric(found[name], baseline=baseline, higher_is_better=higher_is_better, name=name)

    return gate


def model_tensors(model: Any) -> dict[str, Any]:
    """What ``save_pretrained`` writes: the model's ``state_dict()``, each storage once (a tied
    weight, GPT-2's ``lm_head.weight``, which is its token embedding, keeps its first name); for
    a PEFT model, its adapter as PEFT's ``adapter_model.safetensors`` holds it (the same keys,
    ``get_peft_model_state_dict``), not the base model it was trained on."""
    peft = sys.modules.get("peft")  # a PEFT model's script imported it
    if peft is not None and isinstance(model, peft.PeftModel):
        tensors = peft.get_peft_model_state_dict(model)
    else:
        tensors = model.state_dict()
    out: dict[str, Any] = {}
    seen: set[tuple[int, int]] = set()
    for key, tensor in tensors.items():
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if where not in seen:
            seen.add(where)
            out[key] = tensor.detach().contiguous()
    return out


def _plan(trainer: Any) -> tuple[int, int, str | None]:
    """The run's steps and checkpoint interval from the Trainer's arguments, or why it cannot run
    under trainjob (refused as exit 2 when the Run starts). Creates the optimizer now, as
    ``train()`` would (it keeps one that exists): a checkpoint holds its state from step 0."""
    args = trainer.args
    unsupported = [why for bad, why in (
        (getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False),
         "DeepSpeed and FSDP keep their own checkpoint formats"),
        (trainer.model_init is not None, "model_init builds the model anew inside train()"),
        (args.load_best_model_at_end, "load_best_model_at_end=True: trainjob publishes the model of the last "
         "step (or of an EarlyStoppingCallback's stop) once its gate passes; leave it out and gate on the metric "
         f"instead, hf.run(trainer, ..., gate=hf.metric({_eval_name(args.metric_for_best_model)!r}, baseline=...))"),
        (_value(args.save_strategy) == "best", "save_strategy='best' saves when a metric improves"),
        (getattr(args, "enable_jit_checkpoint", False), "enable_jit_checkpoint: trainjob saves on SIGTERM itself"),
        (args.ignore_data_skip, "ignore_data_skip: a resume would train on other batches than the run it continues"),
    ) if bad]
    try:
        loader = trainer.get_train_dataloader()
        values = trainer.set_initial_training_values(args, loader)
        per_epoch, steps = int(values[1]), int(values[-1])
        trainer.create_optimizer()
    except (ValueError, TypeError, AttributeError) as exc:
        return 1, 1, f"the Trainer cannot train: {exc}".splitlines()[0]
    if unsupported:
        return steps, 1, f"this Trainer cannot run under trainjob: {'; '.join(unsupported)}"
    strategy = _value(args.save_strategy)
    if strategy == "steps":  # a save_steps below 1 is a fraction of the run, as the Trainer reads it
        every = int(args.save_steps) if args.save_steps >= 1 else math.ceil(steps * args.save_steps)
    elif strategy == "epoch":
        every = per_epoch
    else:
        every = steps
    return steps, max(1, min(every, steps)), None


def _eval_name(metric: str | None) -> str:
    """``metric_for_best_model`` as ``trainer.evaluate()`` names it (its default: the loss)."""
    name = metric or "loss"
    return name if name.startswith("eval_") else f"eval_{name}"


def _value(strategy: Any) -> Any:
    """A Trainer strategy (an enum of str, or the str itself) as its str."""
    return getattr(strategy, "value", strategy)
