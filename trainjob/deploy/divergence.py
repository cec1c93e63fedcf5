"""Where two runs of one command part: the first differing logged loss, the state entries that
differ at a checkpoint both hold, and a likely cause. Reads the two PVCs (the log, and checkpoints
through trainjob's own store, hashes verified); writes nothing. Used by ``trainjob prove``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import attrs

from ..errors import InputError
from .launches import events

# Entry names that hold an optimizer's state or randomness: what a hint can point at.
OPTIMIZER = re.compile(r"optim|momentum|exp_avg|buf|^v[A-Z_a-z]?$", re.IGNORECASE)
RANDOMNESS = re.compile(r"rng|generator|seed|random", re.IGNORECASE)
SCHEDULER = re.compile(r"sched|lr", re.IGNORECASE)


@attrs.frozen
class EntryDiff:
    name: str
    what: str  # "max abs diff 0.0123", "only in the reference", "shape (3,) vs (4,)"


@attrs.frozen
class Divergence:
    first_loss_step: int | None
    losses: tuple[object, object]  # the reference's and the trial's loss at that step
    resumed_from: int | None
    compared_step: int | None
    entries: tuple[EntryDiff, ...]
    hints: tuple[str, ...]
    same_at_resume: bool | None = None  # both runs' checkpoints at the resume step equal (None: not both held)
    loss_source: str = "loss_milli"  # "printed loss": the command's own per-step lines


def losses(pvc: Path) -> dict[int, int]:
    """loss_milli by step from the log's ``checkpointed`` lines; a step logged twice (a resume redid
    it) keeps the later value, the one the run went on from."""
    found = {}
    for e in events(pvc):
        fields = dict(re.findall(r"(\w+)=(-?\d+)", e["detail"]))
        if e["event"] == "checkpointed" and "step" in fields and "loss_milli" in fields:
            found[int(fields["step"])] = int(fields["loss_milli"])
    return found


def printed_losses(pvc: Path) -> dict[int, str]:
    """The loss by step from the ``step N loss X`` lines the command printed on stdout (kept by
    prove beside the PVC, one file per launch), the later launch's value for a step redone."""
    found = {}
    for out in sorted(pvc.parent.glob("launch-*.stdout")):
        for step, loss in re.findall(r"^step (\d+) loss (\S+)$", out.read_text(errors="replace"), re.M):
            found[int(step)] = loss
    return found


def resumed_from(pvc: Path) -> int | None:
    steps = [int(m.group(1)) for e in events(pvc) if e["event"] == "resumed"
             if (m := re.search(r"from_step=(\d+)", e["detail"]))]
    return max(steps) if steps else None


def _checkpoints(pvc: Path) -> dict[int, object]:
    from ..checkpoint.store import CheckpointStore
    from ..storage.pvc import Pvc
    try:
        return {ref.step: ref for ref in CheckpointStore(Pvc(pvc)).committed()}
    except InputError:
        return {}


def _load(pvc: Path, ref) -> dict | None:
    from ..checkpoint.store import CheckpointStore
    from ..storage.pvc import Pvc
    try:
        return CheckpointStore(Pvc(pvc)).load(ref).tensors
    except InputError:
        return None


def entry_diffs(reference: dict, trial: dict) -> list[EntryDiff]:
    import numpy as np
    found = []
    for name in sorted(set(reference) | set(trial)):
        a, b = reference.get(name), trial.get(name)
        if a is None or b is None:
            found.append(EntryDiff(name, "only in the " + ("trial" if a is None else "reference")))
        elif a.shape != b.shape:
            found.append(EntryDiff(name, f"shape {a.shape} vs {b.shape}"))
        elif a.tobytes() != b.tobytes():
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            found.append(EntryDiff(name, f"max abs diff {float(diff.max()):.6g}"))
    return found


def hints(names: Sequence[str], differing: Sequence[EntryDiff], first_loss_step: int | None,
          resumed: int | None) -> list[str]:
    """A cause per common bug, where the evidence points to it. The checkpoint the run resumed from
    was its own and verified, so what differs after it was state the checkpoint did not hold."""
    found = []
    if resumed is None or not (differing or first_loss_step is not None):
        return found
    if not any(OPTIMIZER.search(n) for n in names):
        found.append("optimizer state: the checkpoint holds no optimizer entry (momentum buffers, Adam moments); "
                     "if the optimizer keeps state, return it from state_dict() and restore it in load_state_dict()")
    elif not any(RANDOMNESS.search(n) for n in names):
        found.append("RNG or data loader position: the model and optimizer were restored, yet the run went elsewhere "
                     "after the resume; a generator or iterator made before the loop restarts on a relaunch: "
                     "derive each step's randomness from the step (np.random.default_rng([seed, step])) or save its "
                     "state")
    if any(SCHEDULER.search(d.name) for d in differing) and not any(OPTIMIZER.search(d.name) for d in differing):
        found.append("scheduler: only a learning-rate entry differs; restore the scheduler's position on a resume")
    return found


def divergence(reference: Path, trial: Path) -> Divergence:
    ref_loss: dict[int, object] = dict(printed_losses(reference))
    trial_loss: dict[int, object] = dict(printed_losses(trial))
    source = "printed loss"  # every step's, when the command prints them; else the log's, per checkpoint
    if not (ref_loss and trial_loss):
        ref_loss, trial_loss, source = losses(reference), losses(trial), "loss_milli"
    parted = sorted(s for s in set(ref_loss) & set(trial_loss) if ref_loss[s] != trial_loss[s])
    first = parted[0] if parted else None
    resumed = resumed_from(trial)
    ref_ckpts, trial_ckpts = _checkpoints(reference), _checkpoints(trial)
    common = sorted(set(ref_ckpts) & set(trial_ckpts))
    after = [s for s in common if resumed is None or s > resumed]
    step = after[0] if after else (common[-1] if common else None)
    diffs: list[EntryDiff] = []
    names: list[str] = []
    if step is not None:
        a, b = _load(reference, ref_ckpts[step]), _load(trial, trial_ckpts[step])
        if a is not None and b is not None:
            diffs, names = entry_diffs(a, b), sorted(a)
    same = None
    if resumed in ref_ckpts and resumed in trial_ckpts:
        a, b = _load(reference, ref_ckpts[resumed]), _load(trial, trial_ckpts[resumed])
        same = None if a is None or b is None else not entry_diffs(a, b)
    at = (ref_loss.get(first), trial_loss.get(first)) if first is not None else (None, None)
    return Divergence(first, at, resumed, step, tuple(diffs), tuple(hints(names, diffs, first, resumed)), same,
                      source)


def describe(d: Divergence, against: str = "the reference") -> list[str]:
    lines = []
    if d.resumed_from is not None:
        lines.append(f"resumed from step {d.resumed_from}")
    if d.same_at_resume:
        lines.append(f"the checkpoint at step {d.resumed_from} equals {against}'s: what was saved was right, "
                     "what differs after the resume was never saved")
    elif d.same_at_resume is False:
        lines.append(f"the checkpoint at step {d.resumed_from} already differs from {against}'s")
    if d.first_loss_step is not None:
        lines.append(f"first differing loss: step {d.first_loss_step} ({d.loss_source} {d.losses[0]} in {against}, "
                     f"{d.losses[1]} here)")
    else:
        lines.append("every logged loss agrees")
    if d.compared_step is not None:
        if d.entries:
            lines.append(f"state at step {d.compared_step}: {len(d.entries)} entries differ")
            lines += [f"  {e.name}: {e.what}" for e in d.entries[:8]]
            if len(d.entries) > 8:
                lines.append(f"  ... and {len(d.entries) - 8} more")
        else:
            lines.append(f"state at step {d.compared_step}: every entry equal")
    else:
        lines.append("no checkpoint step held by both runs to compare")
    lines += [f"hint: {h}" for h in d.hints]
    return lines
