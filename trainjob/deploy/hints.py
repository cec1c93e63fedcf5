"""Which piece of a training state did not resume: a pure decision over what ``prove`` read from two runs.

The evidence (``Evidence``) is both runs' state at the first checkpoint after the trial's resume
(``Snapshot``: the tensor names, the replicated plain document, each rank's rank-local document),
the tensor entries that differ there, where the logged losses part, the world size, and each
run's other checkpoint nearest it (whether a run drew from a random stream at all). The
checkpoint the trial resumed from was its own and verified, so whatever differs after it is a
piece the checkpoint did not hold, or held and did not put back. ``hints`` names it, most certain
first:

- ``optimizer``  the checkpoint holds no optimizer entry at all;
- ``scheduler``  a param group's ``lr`` differs: the LR scheduler (or whatever sets lr) did not resume;
- ``loader``     the data loader's saved position differs: other batches after the resume;
- ``rng``        the loader's position agrees but a saved random stream a run drew from after the
                 resume differs (python, numpy, torch, cuda, a named generator, the seed the
                 loader's workers start from): named, with its rank;
- ``replicated`` at W > 1, every logged loss agrees yet entries differ: state every rank holds
                 its own copy of (DDP's buffers), named;
- ``unsaved``    no definite cause, and the checkpoint holds no RNG streams or no loader position
                 (after a definite cause, in a nested state: those pieces, as "also not saved");
- ``elsewhere``  every saved piece agrees, yet the weights differ: randomness outside the state
                 (the loader's epoch-shuffled sampler named first when its record holds one).

No I/O, no clock: ``divergence.py`` reads the checkpoints and hands the documents over decoded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

# Tensor entry names that hold an optimizer's state, or a learning rate (a trainer's own flat state).
OPTIMIZER = re.compile(r"optim|momentum|exp_avg|buf|^v[A-Z_a-z]?$", re.IGNORECASE)
LEARNING_RATE = re.compile(r"(^|[._])(lr|learning_rate)$|sched", re.IGNORECASE)
SEED = re.compile(r"seed", re.IGNORECASE)  # a seed inside a loader's record: its workers' randomness
STREAMS = ("python", "numpy", "torch", "cuda")  # rng.py's record, in the order a reader knows them
STREAM_NAMES = {"python": "python's random", "numpy": "numpy's global generator", "torch": "torch's CPU generator",
                "cuda": "the CUDA generators"}


@attrs.frozen
class EntryDiff:
    name: str
    what: str  # "max abs diff 0.0123", "only in the reference", "shape (3,) vs (4,)"


@attrs.frozen
class Snapshot:
    """One run's checkpoint at the compared step, as far as hints look at it."""

    names: tuple[str, ...]  # the tensor entries
    plain: Any = None  # the replicated plain document, decoded (None: the state had none)
    local: Mapping[int, Any] = attrs.field(factory=dict)  # rank -> its rank-local document, decoded


@attrs.frozen
class Evidence:
    resumed: int | None  # the step the trial resumed from; None: it never resumed
    step: int | None  # the checkpoint compared (the first after the resume both runs hold)
    differing: tuple[EntryDiff, ...]  # tensor entries that differ there
    first_loss_step: int | None  # the first step whose logged loss differs
    losses_seen: bool  # both runs logged losses after the resume (so "every loss agrees" means something)
    world_size: int
    reference: Snapshot
    trial: Snapshot
    # Another checkpoint of each run, nearest the compared one (the trial's: the one it resumed
    # from, when held): whether a run drew from a stream at all. None: none held.
    reference_other: Snapshot | None = None
    trial_other: Snapshot | None = None
    others_at_resume: bool = False  # both are at the resume step (so they are comparable to each other)


@attrs.frozen
class Hint:
    piece: str  # one of the names in the module docstring
    text: str


# --- reading the documents (pure) ----------------------------------------------------------------------

def leaves(doc: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every plain leaf with its path (``optim.param_groups[0].lr``)."""
    if isinstance(doc, Mapping):
        for k, v in doc.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(doc, list | tuple):
        for i, v in enumerate(doc):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, doc


def lr_diffs(reference: Any, trial: Any) -> list[tuple[str, Any, Any]]:
    """The plain ``lr`` leaves (a param group's, as the optimizer's state_dict holds them) whose
    values differ between the two documents, with both values."""
    ours = dict(leaves(trial))
    return [(path, value, ours[path]) for path, value in leaves(reference)
            if path.rsplit(".", 1)[-1] == "lr" and path in ours and ours[path] != value]


def holds(doc: Any, key: str) -> bool:
    """Whether any mapping inside ``doc`` has ``key`` (or a key containing it) as a key."""
    if isinstance(doc, Mapping):
        return any(key in str(k) or holds(v, key) for k, v in doc.items())
    if isinstance(doc, list | tuple):
        return any(holds(v, key) for v in doc)
    return False


def find(doc: Any, key: str) -> Any:
    """The value under the first mapping key ``key`` inside ``doc`` (depth first), else None."""
    if isinstance(doc, Mapping):
        if key in doc:
            return doc[key]
        for v in doc.values():
            if (found := find(v, key)) is not None:
                return found
    elif isinstance(doc, list | tuple):
        for v in doc:
            if (found := find(v, key)) is not None:
                return found
    return None


def _expand(value: Any) -> Any:
    """A record held as JSON text (the loader's position) read as its values, to say where it differs."""
    if isinstance(value, str) and value[:1] in "{[":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def differences(a: Any, b: Any) -> list[str]:
    """The paths of the leaves where two plain values differ, in order (``[""]``: they differ as a
    whole, with no leaf to name); empty when they are equal."""
    a, b = _expand(a), _expand(b)
    if a == b:
        return []
    left, right = dict(leaves(a)), dict(leaves(b))
    found = [path for path in [*left, *(p for p in right if p not in left)]
             if left.get(path, _MISSING) != right.get(path, _MISSING)]
    return found or [""]


def first_difference(a: Any, b: Any) -> str | None:
    """The path of the first leaf where two plain values differ ("" for the whole), None when equal."""
    found = differences(a, b)
    return found[0] if found else None


_MISSING = object()


def streams(local: Any) -> dict[str, Any]:
    """A rank-local document's random streams by name: ``rng.py``'s record (python, numpy, torch,
    cuda) and the named generators of ``TrainingState(extra=...)``."""
    out: dict[str, Any] = {}
    rng = find(local, "rng")
    if isinstance(rng, Mapping):
        out.update({STREAM_NAMES[s]: rng.get(s) for s in STREAMS})
    generators = find(local, "generators")
    if isinstance(generators, Mapping):
        out.update({f"the generator {name!r}": state for name, state in sorted(generators.items())})
    return out


def stream_diffs(reference: Any, trial: Any, reference_other: Any = None, trial_other: Any = None,
                 others_at_resume: bool = False) -> list[str]:
    """The names of the random streams that differ between two rank-local documents, except those
    whose difference the resume did not make: one that already differed at the resume step
    (``others_at_resume``), or one neither run drew from between its other checkpoint and this
    one (unchanged in both): a stream nothing seeded, drawn from entropy at start-up, differs from
    run to run and means nothing."""
    ref, ours = streams(reference), streams(trial)
    ref_was, our_was = streams(reference_other), streams(trial_other)
    out = []
    for name in [*ref, *(n for n in ours if n not in ref)]:
        if ref.get(name) == ours.get(name):
            continue
        if name in ref_was and name in our_was:
            if others_at_resume and ref_was[name] != our_was[name]:
                continue  # differed already where the trial resumed from
            if ref_was[name] == ref.get(name) and our_was[name] == ours.get(name):
                continue  # neither run drew from it
        out.append(name)
    return out


# --- the decision ------------------------------------------------------------------------------------------

def _model_differs(e: Evidence) -> bool:
    return bool(e.differing) or e.first_loss_step is not None


def hints(e: Evidence) -> list[Hint]:
    """Each piece the evidence points to, most certain first (module docstring)."""
    if e.resumed is None or not _model_differs(e):
        return []
    at = f"at step {e.step}" if e.step is not None else "after the resume"
    found = _optimizer(e) + _scheduler(e, at) + _loader_and_streams(e, at)
    if not found:
        found = _replicated(e, at)
    if found:  # a nested state (a TrainingState's) may leave pieces out; a flat mapping of arrays has none
        return found + (_unsaved(e, also=True) if e.reference.plain is not None else [])
    if (unsaved := _unsaved(e, also=False)):
        return unsaved
    workers = max((_workers(find(doc, "loader")) for doc in e.reference.local.values()), default=0)
    samplers = _samplers(e)
    return [Hint("elsewhere", f"randomness outside the saved state: the saved lr, loader position and the RNG "
                              f"streams the runs draw from all agree {at}, yet the run went elsewhere: "
                              + (f"{_sampler_order(samplers)}; or " if samplers else "")
                              + (f"the loader runs {workers} worker processes, which a relaunch starts afresh, and "
                                 "what they draw (noise or augmentation in Dataset.__getitem__) is in no saved "
                                 "stream; or " if workers else "")
                              + "a generator or iterator made before the loop (save it: "
                                "TrainingState(extra={'noise': generator}))")]


def _optimizer(e: Evidence) -> list[Hint]:
    if any(OPTIMIZER.search(n) for n in e.reference.names) or holds(e.reference.plain, "optim"):
        return []
    return [Hint("optimizer", "optimizer state: the checkpoint holds no optimizer entry (momentum buffers, Adam "
                              "moments); if the optimizer keeps state, return it from state_dict() and restore it "
                              "in load_state_dict()")]


def _loader_and_streams(e: Evidence, at: str) -> list[Hint]:
    """The loader's position first (other batches explain everything after them), else the
    random streams a run drew from after the resume, per rank, the first rank that differs named."""
    found: list[Hint] = []
    ref, trial = e.reference, e.trial
    ranks = sorted(set(ref.local) & set(trial.local))
    # A loader's record holds its position (the sampler's counters and generator: the batch order)
    # and, with worker processes, the seed they are started from (their randomness, not the order).
    held = [r for r in ranks if find(ref.local[r], "loader") is not None]
    parted = {r: differences(find(ref.local[r], "loader"), find(trial.local[r], "loader")) for r in held}
    moved = {r: where for r, paths in parted.items() if (where := [p for p in paths if not SEED.search(p)])}
    if moved:
        rank, where = next(iter(moved.items()))
        found.append(Hint("loader", f"data loader: its saved position {at} differs{_on(rank, e)}"
                                    + (f" (first at {where[0]})" if where[0] else "")
                                    + ": the batches after the resume are not the reference's; the loader's state "
                                      "must be restored before its first iter() after the resume, and its "
                                      "iterator not rebuilt"))
    drawn = {r: which for r in ranks
             if (which := stream_diffs(ref.local[r], trial.local[r], _local(e.reference_other, r),
                                       _local(e.trial_other, r), e.others_at_resume)
                 + [f"the loader workers' seed ({p})" for p in parted.get(r, []) if SEED.search(p)])}
    if drawn and not moved:
        rank, which = next(iter(drawn.items()))
        agree = "the batch order agrees (the loader's saved position is the reference's)" if held \
            else "the checkpoint holds no loader position to compare"
        if all(w.startswith("the loader workers'") for w in which):
            why = ("the loader's worker processes were seeded afresh on the relaunch, so what they draw (noise or "
                   "augmentation in Dataset.__getitem__) differs after the resume")
        else:
            why = ("after the resume the run drew from it a different number of times, so dropout masks, noise or a "
                   "data collator's random draws (masked-LM masking, drawn as batches are collated ahead of "
                   "training) differ (a DataLoader without generator= draws a seed from torch's stream for each "
                   "iterator it builds; a reseed inside the loop)")
            if not held:  # the batches themselves may be others: nothing saved says where the data stood
                why = ("the batches after the resume may be other ones than the reference's (the data order: a "
                       "stream's pass over its data, batches skipped from the wrong place), drawing other numbers; "
                       "or " + why)
        if (n := _workers(find(ref.local[rank], "loader"))) > 0:
            why += (f"; the loader runs {n} worker processes, which a relaunch starts afresh: what they draw is in "
                    "no saved stream")
        if samplers := _samplers(e):
            why += f"; and {_sampler_order(samplers)}"
        verb = "differs" if len(which) == 1 else "differ"
        found.append(Hint("rng", f"RNG stream: {_join(which)} {at} {verb}{_on(rank, e)}, and {agree}: {why}"))
    return found


def _replicated(e: Evidence, at: str) -> list[Hint]:
    """At W > 1, entries that differ while every logged loss agrees: state that does not steer the
    training (the losses would part) yet is in the checkpoint, as DDP's buffers are."""
    if not (e.world_size > 1 and e.first_loss_step is None and e.losses_seen and e.differing) \
            or any(OPTIMIZER.search(d.name) for d in e.differing):
        return []
    names = [d.name for d in e.differing]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return [Hint("replicated", f"replicated state that differs across ranks: every logged loss agrees, yet {shown} "
                               f"differ {at}: at W={e.world_size} each rank holds its own copy of these (DDP's "
                               "buffers, such as BatchNorm's running statistics, which every rank updates with its "
                               "own batch), and a checkpoint that takes each from one rank or another mixes them; "
                               "write them from one defined rank, or keep them per rank")]


def _scheduler(e: Evidence, at: str) -> list[Hint]:
    ref, trial = e.reference, e.trial
    differ = lr_diffs(ref.plain, trial.plain)
    if differ:
        path, was, now = differ[0]
        seen = f"{path} is {was!r} in the reference, {now!r} here"
        if not holds(ref.plain, "sched"):
            return [Hint("scheduler", f"LR scheduler: the optimizer's learning rate {at} differs ({seen}) and the "
                                      "checkpoint holds no scheduler: a relaunch starts the scheduler again from its "
                                      "first step; put it in the state (TrainingState(scheduler=sched)) or restore "
                                      "its state_dict() in load_state_dict()")]
        return [Hint("scheduler", f"LR scheduler: the optimizer's learning rate {at} differs ({seen}) although the "
                                  "checkpoint holds a scheduler: the scheduler restored is not the one that sets "
                                  "this optimizer's lr, or lr is set elsewhere from a count the state does not hold")]
    # A trainer's own flat state: a learning-rate entry alone among the tensors that differ.
    if (any(LEARNING_RATE.search(d.name) for d in e.differing)
            and not any(OPTIMIZER.search(d.name) for d in e.differing)):
        return [Hint("scheduler", "LR scheduler: only a learning-rate entry differs; restore the scheduler's "
                                  "position on a resume")]
    return []


def _unsaved(e: Evidence, also: bool) -> list[Hint]:
    """The pieces the checkpoint does not hold at all, which no comparison can clear."""
    local = [e.reference.local[r] for r in sorted(e.reference.local)]
    missing = []
    if not any(find(doc, "rng") is not None for doc in local):
        missing.append("RNG streams")
    if not any(find(doc, "loader") is not None for doc in local):
        missing.append("data loader position")
    if not missing:
        return []
    if also:
        return [Hint("unsaved", f"also not in the checkpoint, so not restored if the script uses them: "
                                f"{_join(missing)} (TrainingState(loader=..., rng=True))")]
    what = " or ".join(m.removesuffix(" streams") for m in missing)  # "RNG or data loader position"
    return [Hint("unsaved", f"{what}: the model and optimizer were restored, yet the run went elsewhere after the "
                            f"resume, and the checkpoint holds no {' and no '.join(missing)}; a generator or "
                            "iterator made before the loop restarts on a relaunch: derive each step's randomness "
                            "from the step (np.random.default_rng([seed, step])) or save its state "
                            "(TrainingState(loader=..., rng=True, extra={'noise': generator}))")]


def _local(snapshot: Snapshot | None, rank: int) -> Any:
    return None if snapshot is None else snapshot.local.get(rank)


def _workers(loader: Any) -> int:
    """How many worker processes a loader's saved record says it runs (torchdata's ``_num_workers``)."""
    found = find(_expand(loader), "_num_workers")
    return found if isinstance(found, int) and not isinstance(found, bool) else 0


def _samplers(e: Evidence) -> list[str]:
    """The loader's samplers that are told their epoch, as its record names them (``loader.py``:
    a DistributedSampler, Lightning's DistributedSamplerWrapper), each with its epoch."""
    for rank in sorted(e.reference.local):
        found = find(_expand(find(e.reference.local[rank], "loader")), "samplers")
        if isinstance(found, list) and found:
            return [f"{s.get('sampler')} (epoch {s.get('epoch')})" for s in found if isinstance(s, Mapping)]
    return []


def _sampler_order(samplers: Sequence[str]) -> str:
    return (f"the loader's sampler, {_join(samplers)}, draws each epoch's order when the epoch's iterator is "
            "built, and the saved position only counts how far into that order the run was: an order drawn from "
            "more than the sampler's seed and epoch (a sampler it wraps, shuffling with a stream of its own) is "
            "another one after a resume (use_distributed_sampler=False and a DistributedSampler of your own, or a "
            "sampler with a state_dict())")


def _on(rank: int, e: Evidence) -> str:
    return f" on rank {rank}" if e.world_size > 1 else ""


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
