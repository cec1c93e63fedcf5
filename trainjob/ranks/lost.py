"""Ranks: recognising a peer lost in a collective, from the error that escaped a training step.

A rank that dies (SIGKILL, a crash, its node gone) in the middle of a step leaves the others
inside a collective (FSDP's all-gather in the forward, DDP's all-reduce in the backward, the
optimizer's, a user's own ``all_reduce``), which fails with the process group's error: gloo's
``RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer``, NCCL's
``DistBackendError``, torch's ``DistNetworkError``. Nothing is wrong with the job: the engine's
``Run`` turns it into PeerFailed (exit 75), so no user wraps every collective in a ``try``.

Only errors that say a connection to a peer went away count: the torch.distributed error classes
(looked up in ``sys.modules``, never imported: no torch, no process group), and gloo's and NCCL's
messages for a lost connection, anywhere in the error's chain. A process group's error that
says the call itself was wrong (a shape, a dtype, an unsupported op) is a plain RuntimeError:
a bug, 70. Pure: asks no peer, touches no file.
"""

from __future__ import annotations

import sys

# What the process groups say when the other end of a connection went away (gloo's tcp
# transport; NCCL's remote and aborted communicators). Not "gloo" or "NCCL" alone: a call the
# backend refuses names it too, and that is a bug.
LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
        "NCCL communicator was aborted", "ncclRemoteError", "Connection refused")
# torch.distributed's error classes for a failed backend, network or store (DistError's kin).
CLASSES = ("DistBackendError", "DistNetworkError", "DistStoreError")


def first_line(exc: BaseException, limit: int = 240) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}{': ' if text else ''}{text}"[:limit]


def collective_failure(exc: BaseException) -> str | None:
    """The error (``Kind: first line``) in ``exc``'s chain that says a peer of the process group
    went away, or None when nothing there does."""
    dist = sys.modules.get("torch.distributed")
    kinds = tuple(k for k in (getattr(dist, name, None) for name in CLASSES) if isinstance(k, type))
    seen: BaseException | None = exc
    for _ in range(8):  # the chain, a few links deep: autograd and hooks wrap what they re-raise
        if seen is None:
            return None
        if (kinds and isinstance(seen, kinds)) or (
                isinstance(seen, RuntimeError) and any(marker in str(seen) for marker in LOST)):
            return first_line(seen)
        seen = seen.__cause__ or seen.__context__
    return None
