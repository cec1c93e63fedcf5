"""What DistributedDataParallel keeps alike on every rank, and what it does not, as a checkpoint
must know it (``checkpoint/replicas.py``).

DDP all-reduces the gradients, so every rank's parameters, and the optimizer state over them,
stay the same: ``Replicated``, written once, split across ranks, never compared. Its buffers
(BatchNorm's running statistics and ``num_batches_tracked``) do not: every rank updates them with
its own batch. With ``broadcast_buffers=True`` (DDP's default) DDP overwrites every rank's with
rank 0's at the start of the next forward, so rank 0's are the state the run goes on from:
``FromRank0``, written whole by rank 0 and handed to every rank at a resume, which makes the
resumed run's next forward broadcast the very values the uninterrupted run's did. With
``broadcast_buffers=False`` each rank goes on from its own: they are rank-local, kept per rank
in the ``rank`` part as exact bytes (a resume at another world size drops them with the rest of
it, and each rank keeps its live buffers then).

A model that is not DDP-wrapped is left as it is: at W > 1 its entries are compared across
ranks at each checkpoint. Never steps, broadcasts or changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _get_fqns

from ...state_tree import FromRank0, Replicated


def find(model: torch.nn.Module) -> Any:
    """The DistributedDataParallel wrapper of ``model`` (under torch.compile's too), or None."""
    from torch.nn.parallel import DistributedDataParallel
    seen = model
    while not isinstance(seen, DistributedDataParallel):
        inner = getattr(seen, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, torch.nn.Module):
            return None
        seen = inner
    return seen


def buffer_fqns(model: torch.nn.Module) -> set[str]:
    """The model's buffers as torch.distributed.checkpoint names them (without DDP's ``module.``
    and torch.compile's ``_orig_mod.``)."""
    return {fqn for name, _ in model.named_buffers() for fqn in _get_fqns(model, name)}


class Marks:
    """How one model's state is handed out (module docstring): ``ddp`` the wrapper or None,
    ``buffers`` its buffers' FQNs, ``per_rank`` whether they are rank-local."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ddp = find(model)
        if self.ddp is not None and not _spans_the_world(self.ddp):
            # Its rank 0 is not the run's (a DDP over a subgroup of the ranks): left unmarked, so
            # the ranks' copies are compared at each checkpoint rather than one assumed the source.
            self.ddp = None
        self.buffers = buffer_fqns(model) if self.ddp is not None else set()
        # ``broadcast_buffers`` (a property of ``forward_sync_buffers`` in newer torch).
        self.per_rank = self.ddp is not None and not self.ddp.broadcast_buffers

    def model(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The model's tensors as the checkpoint takes them: under DDP its parameters Replicated,
        its buffers FromRank0 (or left out: ``rank_local`` hands them out); else as they are."""
        if self.ddp is None:
            return dict(tensors)
        if self.per_rank:
            return Replicated({k: v for k, v in tensors.items() if k not in self.buffers})
        return Replicated({k: FromRank0(v) if k in self.buffers else v for k, v in tensors.items()})

    def optim(self, state: dict[str, Any]) -> dict[str, Any]:
        return Replicated(state) if self.ddp is not None else state

    def rank_local(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
        """With ``broadcast_buffers=False``: this rank's buffers, for the rank part (their exact
        bytes in this rank's shard header: ``state_tree.RankLocal``)."""
        if not self.per_rank:
            return None
        return {k: v for k, v in sorted(tensors.items()) if k in self.buffers}


def _spans_the_world(module: Any) -> bool:
    """Whether a DDP module's process group is every rank of the run, its rank 0 the run's."""
    import torch.distributed as dist
    group = getattr(module, "process_group", None)
    if group is None or not dist.is_initialized():
        return True
    return dist.get_world_size(group) == dist.get_world_size() and dist.get_global_rank(group, 0) == 0
