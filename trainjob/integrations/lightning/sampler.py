"""Lightning's own DistributedSampler, resumed to the order the uninterrupted run walked.

Under DDP Lightning puts a distributed sampler into the train loader itself
(``use_distributed_sampler=True``, its default). For a ``StatefulDataLoader(shuffle=True)`` it is
a ``DistributedSamplerWrapper``: torchdata shuffles with a ``RandomSampler`` of its own, which
Lightning does not take for torch's, so it wraps it. At every ``iter()`` the wrapper draws a whole
permutation from that inner sampler (``list(sampler)``: one draw from the inner sampler's
generator), then deals this rank its part, shuffled again by ``seed + epoch``. The loader's state
holds how far into the epoch it is and ``trainers/torch/loader.py`` the sampler's epoch; neither
holds the generator as it was when the epoch's permutation was drawn, so a resumed iterator drew
another permutation and walked it from the saved position (``trainjob prove`` found Lightning's DDP
default diverging from the first resume on).

``Replay`` sits between the wrapper and the inner sampler: it notes the generator's state before
each draw. The checkpoint holds that state and the generator's current one (each rank's own); a
load makes every draw of the resumed iterator start from the noted state, so the resumed epoch
walks the same permutation, and then leaves the generator where the uninterrupted run's was, for
the epochs after. A wrapped sampler without a ``torch.Generator`` of its own (a sampler of the
user's) is left as it is; the loader's record names the wrapper for ``trainjob prove``'s hint.

Must not: change the order an uninterrupted run walks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper


class Replay:
    """The inner sampler of Lightning's ``DistributedSamplerWrapper``, its draws noted (module docstring)."""

    def __init__(self, sampler: Any, generator: torch.Generator) -> None:
        self.sampler, self.generator = sampler, generator
        self.drawn_from = generator.get_state()  # the generator before the latest draw
        self._from: torch.Tensor | None = None  # while a load replays: where every draw starts

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        if self._from is not None:
            self.generator.set_state(self._from)
        self.drawn_from = self.generator.get_state()
        return iter(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn_from": self.drawn_from.clone(), "now": self.generator.get_state()}

    def replay_from(self, state: Mapping[str, Any]) -> None:
        """The resumed iterator's draws start where the saved epoch's did (until ``done``)."""
        self._from = _bytes(state["drawn_from"])

    def done(self, state: Mapping[str, Any]) -> None:
        """The load is over: the generator goes on from where the saved run's was."""
        self._from = None
        self.drawn_from = _bytes(state["drawn_from"])
        self.generator.set_state(_bytes(state["now"]))


def install(loader: Any) -> Replay | None:
    """Put ``Replay`` under the loader's ``DistributedSamplerWrapper`` when its inner sampler
    shuffles with a generator of its own; None when there is none to put."""
    wrapper = _wrapper(loader)
    if wrapper is None:
        return None
    indices: Any = wrapper.dataset  # Lightning's _DatasetSamplerWrapper: the inner sampler's draw
    if isinstance(indices._sampler, Replay):
        return indices._sampler
    generator = getattr(indices._sampler, "generator", None)
    if not isinstance(generator, torch.Generator):
        return None
    indices._sampler = replay = Replay(indices._sampler, generator)
    return replay


def _wrapper(loader: Any) -> DistributedSamplerWrapper | None:
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, DistributedSamplerWrapper):
            return sampler
    return None


def _bytes(state: Any) -> torch.Tensor:
    return torch.as_tensor(state, dtype=torch.uint8).clone()
