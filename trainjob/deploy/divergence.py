"""Where two runs of one command part: the first differing logged loss, the state entries that
differ at a checkpoint both hold, and the evidence from which ``hints.py`` names the piece that did
not resume (both runs' plain documents at that checkpoint, decoded). Reads the two PVCs (the log,
and checkpoints through trainjob's own store, hashes verified); writes nothing. Used by
``trainjob prove``: the reading is here, the deciding in ``hints.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from .. import plain
from ..errors import InputError, importing
from .hints import EntryDiff, Evidence, Hint, Snapshot, hints
from .launches import events


@attrs.frozen
class Divergence:
    first_loss_step: int | None
    losses: tuple[object, object]  # the reference's and the trial's loss at that step
    resumed_from: int | None
    compared_step: int | None
    entries: tuple[EntryDiff, ...]
    hints: tuple[Hint, ...]
    same_at_resume: bool | None = None  # both runs' checkpoints at the resume step equal (None: not both held)
    tensors_at_resume: bool | None = None  # their tensors equal (the plain values may differ: timings a framework logs)
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
    with importing("the checkpoint store"):
        from ..checkpoint.store import CheckpointStore
        from ..storage.pvc import Pvc
    try:
        return {ref.step: ref for ref in CheckpointStore(Pvc(pvc)).committed()}
    except InputError:
        return {}


def _load(pvc: Path, ref) -> tuple[dict, Snapshot, int] | None:
    """A checkpoint's tensors, and its documents decoded (the replicated plain values and each
    rank's rank-local state), hashes verified; None when it does not load."""
    with importing("the checkpoint store"):
        from ..checkpoint.store import CheckpointStore
        from ..storage.pvc import Pvc
    try:
        loaded = CheckpointStore(Pvc(pvc)).load(ref)
    except InputError:
        return None
    local = {}
    for rank in range(loaded.manifest.world_size):
        text = loaded.documents(rank)[1]
        if text is not None:
            local[rank] = _decoded(text)
    shared = loaded.documents(0)[0]
    snapshot = Snapshot(tuple(sorted(loaded.tensors)), None if shared is None else _decoded(shared), local)
    return loaded.tensors, snapshot, loaded.manifest.world_size


def _decoded(text: str) -> object:
    try:
        return plain.decode(text)
    except plain.PlainError:  # a document the hints cannot read: compared as text, whole
        return text


def entry_diffs(reference: dict, trial: dict) -> list[EntryDiff]:
    with importing("numpy"):
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
    loaded: dict[tuple[Path, int], tuple[dict, Snapshot, int] | None] = {}

    def load(pvc: Path, held: dict[int, object], at: int | None) -> tuple[dict, Snapshot, int] | None:
        if at not in held:
            return None
        if (pvc, at) not in loaded:
            loaded[pvc, at] = _load(pvc, held[at])
        return loaded[pvc, at]

    diffs: list[EntryDiff] = []
    snapshots = (Snapshot(()), Snapshot(()))
    world = 1
    a, b = load(reference, ref_ckpts, step), load(trial, trial_ckpts, step)
    if a is not None and b is not None:
        diffs, snapshots, world = entry_diffs(a[0], b[0]), (a[1], b[1]), a[2]
    # Each run's checkpoint nearest the compared one (the trial's: the one it resumed from, if held):
    # what tells a stream the run drew from after the resume from one seeded at start-up from entropy.
    ref_other, trial_other = _neighbour(ref_ckpts, step, None), _neighbour(trial_ckpts, step, resumed)
    ref_before, trial_before = load(reference, ref_ckpts, ref_other), load(trial, trial_ckpts, trial_other)
    same = tensors_same = None
    a, b = load(reference, ref_ckpts, resumed), load(trial, trial_ckpts, resumed)
    if a is not None and b is not None:  # the tensors and replicated values; the rank-local streams may be
        tensors_same = not entry_diffs(a[0], b[0])  # seeded from entropy, never drawn
        same = tensors_same and a[1].plain == b[1].plain
    at = (ref_loss.get(first), trial_loss.get(first)) if first is not None else (None, None)
    seen = resumed is not None and any(s > resumed for s in set(ref_loss) & set(trial_loss))
    evidence = Evidence(resumed, step, tuple(diffs), first, seen, world, *snapshots,
                        reference_other=None if ref_before is None else ref_before[1],
                        trial_other=None if trial_before is None else trial_before[1],
                        others_at_resume=resumed is not None and ref_other == trial_other == resumed)
    return Divergence(first, at, resumed, step, tuple(diffs), tuple(hints(evidence)), same_at_resume=same,
                      tensors_at_resume=tensors_same, loss_source=source)


def _neighbour(held: dict[int, object], step: int | None, prefer: int | None) -> int | None:
    """``prefer`` when held, else the latest checkpoint before ``step``, else the first after it."""
    if step is None:
        return None
    if prefer in held and prefer != step:
        return prefer
    before = [s for s in held if s < step]
    return max(before) if before else min((s for s in held if s > step), default=None)


def describe(d: Divergence, against: str = "the reference") -> list[str]:
    lines = []
    if d.resumed_from is not None:
        lines.append(f"resumed from step {d.resumed_from}")
    if d.same_at_resume:
        lines.append(f"the checkpoint at step {d.resumed_from} equals {against}'s: what was saved was right, "
                     "what differs after the resume was never saved")
    elif d.same_at_resume is False and d.tensors_at_resume:
        lines.append(f"the checkpoint at step {d.resumed_from} holds the same tensors as {against}'s; only its "
                     "plain values differ (a framework's logged timings differ run to run)")
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
    lines += [f"hint: {h.text}" for h in d.hints]
    return lines
