"""A loader worker's random streams, carried in the loader's own per-worker snapshot.

Randomness drawn in a DataLoader worker (a ``Dataset.__getitem__`` adding noise, a random crop,
a ``collate_fn`` that shuffles) comes from the worker's own global streams: torch seeds each
worker's torch, Python ``random`` and numpy streams from ``base_seed + worker_id`` when it starts
the worker, ``base_seed`` being drawn once per iterator. torchdata 0.11's ``StatefulDataLoader``
saves ``base_seed`` and, after each batch it hands out, each worker's dataset state (the
dataset's ``state_dict()``, if it has one) in its snapshot; a resumed iterator starts its workers
with the saved ``base_seed`` and hands each worker its dataset state. What it does not save is
where the workers' streams had got to: a relaunch mid-epoch starts them from the epoch's seeds,
and every batch after the resume carries other noise than the uninterrupted run's.

``Streams`` (a ``worker_init_fn`` wrapper, installed by ``TrainingState`` through ``install``)
gives the worker's copy of a map-style dataset a ``state_dict()`` / ``load_state_dict()`` of its
own (instance attributes, in the worker process only). torchdata calls them where it already
saves and restores a dataset's state: ``state_dict()`` holds the worker's streams as they are
after the batch (``capture``, which draws nothing, raw: a worker's result goes through a pipe
after every batch) beside the dataset's own state, if it has one; ``load_state_dict()`` puts
both back before the resumed worker fetches anything. The streams travel to the training process inside the loader's ``state_dict()`` (only the entries that
changed since the worker's last batch: torchdata sends deltas), so the checkpoint holds them with
the loader's position. Nothing is drawn, so a script trains on the same numbers with and without
trainjob.

``refusal(loader)`` names a loader whose workers' randomness cannot be resumed exactly, checked
when the ``with trainjob.Run`` is entered:

- ``in_order=False``: batches are handed out in the order the workers finish them, which no
  snapshot pins (torchdata itself warns that its state is not kept);
- an iterable-style dataset that keeps a state of its own: torchdata then restores that state
  and skips the replay it would otherwise do, so the workers' streams restart from their seeds
  (without a state, torchdata replays the epoch's batches in fresh workers seeded as before,
  which draws the same numbers again: exact). The dataset is checked here, its iterator when
  the loader's first state is read (``check_state``);
- a map-style dataset whose worker copy cannot take attributes (a list, a tuple, a numpy
  array, a class with ``__slots__``) when the loader has a ``collate_fn`` of its own: the collate may
  draw, and nothing would carry those streams. With the default collate such a dataset draws
  nothing in the workers, and is accepted.

Owns: the worker-side streams of a loader given to ``TrainingState``. Must not: draw from any
stream, or change what a worker fetches.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import torch

KEY, OWN = "trainjob.worker_rng", "trainjob.dataset"  # the keys of the state a worker's dataset hands out


def _is_map_style(dataset: object) -> bool:
    return not isinstance(dataset, torch.utils.data.IterableDataset)


def _takes_attributes(dataset: object) -> bool:
    return hasattr(dataset, "__dict__") and not isinstance(dataset, type)


def _default_collate(fn: object) -> bool:
    from torch.utils.data._utils.collate import default_collate, default_convert
    return fn is None or fn is default_collate or fn is default_convert


def refusal(loader: Any) -> str | None:
    """Why this loader's workers' randomness cannot be resumed exactly, or None (module docstring)."""
    workers = getattr(loader, "num_workers", 0)
    if not (isinstance(workers, int) and workers > 0):
        return None
    if getattr(loader, "in_order", True) is False:
        return (f"the loader has {workers} workers and in_order=False: its batches come in the order the "
                "workers finish them, which no checkpoint can pin; use in_order=True (the default)")
    dataset = getattr(loader, "dataset", None)
    if not _is_map_style(dataset):
        if callable(getattr(dataset, "state_dict", None)):
            return (f"the loader has {workers} workers over an iterable dataset ({type(dataset).__name__}) that "
                    "has a state_dict() of its own: its workers' random streams would restart from their "
                    "seeds at a resume; use num_workers=0, or drop the dataset's state_dict()")
        return None
    if not _takes_attributes(dataset) and not _default_collate(getattr(loader, "collate_fn", None)):
        return (f"the loader has {workers} workers and a collate_fn of its own over a {type(dataset).__name__}, "
                "whose worker copy cannot carry the workers' random streams; wrap the data in a "
                "torch.utils.data.Dataset class, or use num_workers=0")
    return None


def check_state(loader: Any, state: dict[str, Any]) -> None:
    """ValueError if the loader's state shows an iterable dataset's iterator keeping a state of
    its own (torchdata then skips the replay that makes its workers' draws exact)."""
    if getattr(loader, "num_workers", 0) == 0 or _is_map_style(getattr(loader, "dataset", None)):
        return
    snapshots = state.get("_snapshot", {}).get("_worker_snapshots", {})
    for key, worker in sorted(snapshots.items()):
        fetcher = (worker or {}).get("fetcher_state") or {}
        if fetcher.get("dataset_iter_state") is not None:
            raise ValueError(f"the loader's workers iterate an iterable dataset whose iterator has a state_dict() "
                             f"of its own ({key}): its workers' random streams would restart from their seeds at "
                             "a resume; use num_workers=0, or drop the iterator's state_dict()")


def install(loader: Any) -> None:
    """Wrap ``loader``'s ``worker_init_fn`` in ``Streams`` (once), if it has workers over a map-style
    dataset. Call before the loader's first ``iter()``: a started worker has run its init."""
    from .workers import StopOnOwner  # the signal guard may already wrap it (a second TrainingState)
    workers = getattr(loader, "num_workers", 0)
    if not (isinstance(workers, int) and workers > 0 and hasattr(loader, "worker_init_fn")):
        return
    if not _is_map_style(getattr(loader, "dataset", None)):
        return
    fn = loader.worker_init_fn
    if isinstance(fn, Streams) or (isinstance(fn, StopOnOwner) and isinstance(fn.inner, Streams)):
        return
    if isinstance(fn, StopOnOwner):
        fn.inner = Streams(fn.inner)
    else:
        loader.worker_init_fn = Streams(fn)


class Streams:
    """A ``worker_init_fn``: gives the worker's dataset copy the streams' state (module docstring),
    then runs the user's own function (``inner``). A module-level class: spawn sends it by value."""

    def __init__(self, inner: Callable[[int], Any] | None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        dataset = info.dataset if info is not None else None
        if dataset is not None and _takes_attributes(dataset):
            own = (getattr(dataset, "state_dict", None), getattr(dataset, "load_state_dict", None))
            if not (callable(own[0]) and callable(own[1])):
                own = (None, None)
            dataset.state_dict = _Save(own[0])
            dataset.load_state_dict = _Load(own[1])
        if self.inner is not None:
            self.inner(worker_id)


def capture() -> dict[str, Any]:
    """This worker's streams, raw: called after every batch, so nothing is converted here (the
    bytes become text in the training process, at a checkpoint: ``loader.py``). About 11 KB
    pickled, where ``rng.capture``'s text is 20."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = (kind, keys.tobytes(), int(pos), int(has_gauss), float(cached))
    return out


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))


class _Save:
    def __init__(self, own: Callable[[], Any] | None) -> None:
        self.own = own

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {KEY: capture()}
        if self.own is not None:
            out[OWN] = self.own()
        return out


class _Load:
    def __init__(self, own: Callable[[Any], Any] | None) -> None:
        self.own = own

    def __call__(self, state: dict[str, Any]) -> None:
        if KEY not in state:  # a checkpoint from before the streams were kept: the dataset's own state
            if self.own is not None:
                self.own(state)
            return
        if self.own is not None and OWN in state:
            self.own(state[OWN])
        restore(state[KEY])
