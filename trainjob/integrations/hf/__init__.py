"""``trainjob.integrations.hf``: a ``transformers.Trainer`` script under trainjob, in two lines.

    from trainjob.integrations import hf
    sys.exit(hf.run(trainer, pvc="pvc", gate=my_gate))       # instead of trainer.train()

``run`` trains the Trainer as a ``trainjob.Run``: trainjob's checkpoints (atomic, hashed, rotated,
verified before use) at the Trainer's ``save_steps``, a relaunch resumes from the newest one that
verifies (no ``resume_from_checkpoint``), SIGTERM saves the step and exits 75, and the gate
publishes the model as safetensors or refuses it. ``state.py`` holds what a checkpoint holds,
``hooks.py`` where the Trainer's loop meets the Run. Needs the ``hf`` extra (transformers,
accelerate); docs/hf.md says how, and which versions are tested.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import UsageError, require

# Looked up, not imported: the script imports transformers itself (its Trainer is what run() drives).
require("trainjob.integrations.hf", "hf", "torch", "transformers", "accelerate")

from ...defaults import BACKOFF_LIMIT  # noqa: E402
from ...engine.run import Run, gate_arguments  # noqa: E402
from ...records import Metric, Score  # noqa: E402
from .hooks import Driver  # noqa: E402
from .state import TrainerCheckpoint  # noqa: E402

__all__ = ["run", "metric", "TrainerCheckpoint"]

Gate = Callable[[Any], Metric | tuple[Score, Score]]


def run(trainer: Any, *, pvc: str | os.PathLike[str], gate: Gate, export: Callable[[Any], Mapping[str, Any]] | None = None,
        max_drop: int = 20, backoff_limit: int = BACKOFF_LIMIT, keep: int = 3, log: str | os.PathLike[str] | None = None,
        rank_timeout: float = 60.0, idempotent: bool = False, async_checkpoint: bool = False,
        name: str = "hf-trainer") -> int:
    """Train ``trainer`` to its last step as one launch of a trainjob job on ``pvc``, gate it, and
    return the exit code (``sys.exit`` it): 0 completed, 1 drift_failed or job_failed, 2 bad
    input, 75 killed or storage trouble (relaunch), 70 a bug.

    ``gate(trainer)`` returns a ``trainjob.Metric`` (a metric against its frozen value), or
    ``(holdout, baseline)``, two ``trainjob.Score``s: the trained model's and a frozen reference's;
    either passes when it keeps within ``max_drop`` percent of the baseline, as ``Run.gate``
    judges it. ``metric(...)`` makes one from an eval metric. ``export(trainer)`` chooses the published tensors (default: the model's
    ``state_dict()``, a tied weight once). Checkpoints come every ``save_steps`` (the Trainer's
    ``save_strategy``: steps, epoch, or no: the last step only) and at the last step. The rest are
    ``trainjob.Run``'s settings (docs/trainers.md)."""
    steps, every, refusal = _plan(trainer)
    state = TrainerCheckpoint(trainer, refusal)
    with Run(pvc, state=state, steps=steps, ckpt_every=every, lr=float(trainer.args.learning_rate),
             max_drop=max_drop, backoff_limit=backoff_limit, keep=keep, log=log, rank_timeout=rank_timeout,
             idempotent=idempotent, async_checkpoint=async_checkpoint, name=name,
             progress=False) as job:  # the Trainer draws its own bar; the run adds the line saying how it ended
        if job.final is None and job.error is None:
            Driver(trainer, state, job).train()
            if job.gate_due:
                job.gate(**gate_arguments(gate(trainer)),
                         export=dict(export(trainer)) if export is not None else model_tensors(trainer.model))
    return job.exit_code


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
    """The model's ``state_dict()``, each storage once: a tied weight (GPT-2's ``lm_head.weight``,
    which is its token embedding) keeps its first name, as ``save_pretrained`` does."""
    out: dict[str, Any] = {}
    seen: set[tuple[int, int]] = set()
    for key, tensor in model.state_dict().items():
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
        (args.load_best_model_at_end, "load_best_model_at_end needs the Trainer's own checkpoints"),
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


def _value(strategy: Any) -> Any:
    """A Trainer strategy (an enum of str, or the str itself) as its str."""
    return getattr(strategy, "value", strategy)
