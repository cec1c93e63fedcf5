"""Frozen parameters: a checkpoint references them by their digest, it does not write them.

A parameter that does not require grad (a LoRA's base model, a backbone held fixed, the layers a
fine-tune leaves alone) does not change as the run trains, and at a relaunch the script builds it
again from where it came from (``from_pretrained``, a seeded init). Writing it into every
checkpoint made a LoRA checkpoint of a 12.7M-parameter GPT-2 60 times the size of the adapter
and its optimizer state (issue 58). So ``TrainingState`` hands out the model's other entries
only, and a checkpoint holds, in the rank's own part, the digest of what it left out:

    Base(model)        the frozen entries: every state_dict name of a parameter that does not
                       require grad (a tied one under each of its names), fixed at the launch's
                       first checkpoint or load
    Base.reference()   ``{"sha256": ..., "tensors": n, "bytes": b}``: the sha256 over each
                       entry's name, dtype, shape and the sha256 of its bytes (hashed once per
                       launch, tensor by tensor on a few threads; a DTensor's local shard)
    Base.check(saved)  at a resume: the live base against the checkpoint's reference, or a
                       UsageError saying the script builds another base (exit 2, nothing loaded)

At each later checkpoint ``reference`` proves the base unchanged without hashing it again: each
entry still has the storage and version counter it had when hashed (an optimizer's step, an
in-place op under ``no_grad``, a ``.data =`` assignment all change one), and the same
fingerprint, its rows' and columns' sums computed where it lives (two passes over its memory,
no copy), which catch a write through ``.data`` or numpy that the version counter does
not see (an EMA teacher updated as ``p.data.mul_(m)``). Changed, it is hashed again, and a different digest is a UsageError naming
the entry (the checkpoint would lose what changed): such a script passes
``TrainingState(..., write_frozen=True)``, or keeps the changing module in ``extra=``.

Buffers are always written (BatchNorm's statistics move; the rest are small). Pure torch, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import _get_fqns

from ...errors import UsageError

_THREADS = 4  # hashlib releases the GIL: the entries are hashed side by side
_COLUMNS = 4096  # the fingerprint's row width (words)


def frozen_fqns(model: torch.nn.Module) -> set[str]:
    """Each state_dict name (torch.distributed.checkpoint's FQN) of a parameter that does not
    require grad; a tied parameter under every name it has."""
    return {fqn for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
            for fqn in _get_fqns(model, name)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds ``t``'s values on this rank (a DTensor's local shard)."""
    inner = getattr(t, "_local_tensor", None)
    return (inner if isinstance(inner, torch.Tensor) else t).detach()


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as one axis of the widest integer words that tile them."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if flat.numel() % size == 0:
            return flat.view(dtype)
    return flat


def fingerprint(t: torch.Tensor) -> str:
    """A change detector, not a digest: laid out as rows of ``_COLUMNS`` words, the sum of each row
    and of each column (in 32-bit words that wrap), and the words past the last whole row,
    hashed. A change of one word changes its row's sum (by a difference below 2**32, never 0
    once wrapped); two different words swapped change their rows' sums, or in one row their
    columns'. Two passes over the tensor's memory where it lives (numpy on the CPU: torch's
    integer sums are several times slower there), no copy; only the sums leave a device."""
    words = _words(_local(t))
    rows = words.numel() // _COLUMNS
    body, tail = words[: rows * _COLUMNS].view(rows, _COLUMNS), words[rows * _COLUMNS:]
    if words.device.type == "cpu":
        b = body.numpy()
        parts = (b.sum(axis=1, dtype=np.int32), b.sum(axis=0, dtype=np.int32), tail.numpy())
    else:
        parts = tuple(p.cpu().numpy() for p in (body.sum(dim=1, dtype=torch.int32),
                                                  body.sum(dim=0, dtype=torch.int32), tail))
    digest = hashlib.sha256()
    for part in parts:
        digest.update(np.ascontiguousarray(part).tobytes())
    return digest.hexdigest()


def _sha256(t: torch.Tensor) -> str:
    data = _local(t).cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


class Base:
    """The frozen entries of one model, fixed when first seen (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.names: frozenset[str] | None = None  # fixed at the first split or check
        self._reference: dict[str, Any] | None = None
        self._marks: dict[str, tuple[int, int, str]] = {}  # name -> (data_ptr, version, fingerprint)

    def split(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``tensors`` (the model's state_dict) as (what a checkpoint writes, the frozen entries)."""
        if self.names is None:
            self.names = frozenset(frozen_fqns(self.model) & tensors.keys())
        kept = {k: v for k, v in tensors.items() if k not in self.names}
        return kept, {k: v for k, v in tensors.items() if k in self.names}

    def reference(self, frozen: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The frozen entries' reference, hashed when first asked and whenever an entry changed
        since; UsageError when the digest is then another (the module docstring)."""
        marks = _marks(frozen)
        changed = [k for k in sorted(frozen) if self._marks.get(k) != marks[k]]
        if self._reference is not None and not changed:
            return self._reference
        made = _digest(frozen)
        if self._reference is not None and made["sha256"] != self._reference["sha256"]:
            raise UsageError(f"the frozen parameter {changed[0]!r} (it does not require grad) changed since the "
                             "run's first checkpoint: trainjob references frozen parameters by their digest and "
                             "does not write them. Pass TrainingState(..., write_frozen=True), or keep a module "
                             "that changes this way (an EMA teacher) in extra=")
        self._reference = made
        self._marks = marks
        return made

    def check(self, frozen: Mapping[str, torch.Tensor], saved: Mapping[str, Any] | None) -> None:
        """At a resume: the live frozen entries must be the checkpoint's (``saved``, its
        reference; None, a checkpoint that holds no rank part: nothing to compare)."""
        if saved is None:
            return
        live = self.reference(frozen)
        if live["sha256"] != saved.get("sha256"):
            raise UsageError(f"the model's frozen parameters ({live['tensors']} tensors that do not require grad, "
                             f"sha256 {live['sha256'][:12]}...) are not those the checkpoint was trained on "
                             f"({saved.get('tensors')} tensors, sha256 {str(saved.get('sha256'))[:12]}...): the script "
                             "must build the same base model (the same weights, the same parameters frozen)")


def _distinct(frozen: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each entry's local tensor, and for each name the first name (sorted) of the same memory:
    a tied tensor (two names, one storage) is read once."""
    tensors = {k: _local(frozen[k]) for k in sorted(frozen)}
    first: dict[tuple[Any, ...], str] = {}
    for k, t in tensors.items():
        first.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), k)
    return tensors, {k: first[(t.data_ptr(), t.dtype, tuple(t.shape), t.stride())] for k, t in tensors.items()}


def _marks(frozen: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int, str]]:
    """Each entry's storage, version counter and fingerprint."""
    tensors, same = _distinct(frozen)
    prints = {k: fingerprint(tensors[k]) for k in set(same.values())}  # threads measured slower: small tensors
    return {k: (t.data_ptr(), t._version, prints[same[k]]) for k, t in tensors.items()}


def _digest(frozen: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    tensors, same = _distinct(frozen)
    once = sorted(set(same.values()))
    with ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="frozen-sha256") as pool:
        hashed = dict(zip(once, pool.map(lambda k: _sha256(tensors[k]), once)))
    whole = hashlib.sha256()
    for k, t in tensors.items():
        whole.update(f"{k} {str(t.dtype).removeprefix('torch.')} {list(t.shape)} {hashed[same[k]]}\n".encode())
    size = sum(tensors[k].numel() * tensors[k].element_size() for k in once)
    return {"sha256": whole.hexdigest(), "tensors": len(tensors), "bytes": size}
