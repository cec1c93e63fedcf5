"""Ranks: which transport a launch's ranks coordinate through, chosen from the environment.

    TRAINJOB_COORDINATION=files|store     forced (every rank of a launch must see the same)
    torchrun's agent store                TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR, MASTER_PORT
    an initialized torch.distributed      its default group's store (a trainer built one)
    otherwise, or with one rank           files on the PVC (the local launcher, the lab)

Every rank of a launch reads the same environment, so every rank picks the same transport.
Store keys live under ``trainjob/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/`` (the
process group's store adds torch's own per-restart prefix), so a relaunch, which torchrun gives a
new restart count or a new run id, never sees a dead launch's keys; the PVC generation in every
key name (store.py) guards any store that outlives its launch.

Must not import torch unless the environment says a torch launcher started this process or the
trainer already imported ``torch.distributed``: ``import trainjob`` and the lab need no torch.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import UsageError, importing
from ..storage.backend import Url
from ..storage.pvc import Pvc
from .coordination import Coordinator, Follower
from .peers import PvcCoordinator, PvcFollower

FORCE = "TRAINJOB_COORDINATION"
TRANSPORTS = ("files", "store")
# How long a rank may take to connect to torchrun's store, at least: connecting waits for no peer
# (the agent's store is up before any worker starts), and torch 2.13's client, connecting to a live
# store here, stalled about 5 s once in 50 connects before it got through (docs/checkpoints.md). A
# budget of --rank-timeout (1 s in some launches) turned that stall into a lost rank. Once
# connected, every call is bounded by --rank-timeout again (``store.StorePeers``).
CONNECT_SECONDS = 30.0


def _agent_store(env: Mapping[str, str]) -> bool:
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and bool(env.get("MASTER_ADDR")) \
        and bool(env.get("MASTER_PORT"))


def _group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # imported by the trainer, or not at all
    return dist is not None and dist.is_available() and dist.is_initialized()


def transport(world_size: int, env: Mapping[str, str]) -> str:
    """"files" or "store" for a launch of ``world_size`` ranks in this environment."""
    forced = env.get(FORCE, "")
    if forced and forced not in TRANSPORTS:
        raise UsageError(f"{FORCE} must be one of {', '.join(TRANSPORTS)}, got {forced!r}")
    if world_size == 1:
        return "files"  # nothing to coordinate: every call is trivial, and the lab's log stays as it was
    if forced:
        if forced == "store" and not (_agent_store(env) or _group_initialized()):
            raise UsageError(f"{FORCE}=store, but there is no store: launch with torchrun, or initialize "
                             "torch.distributed before trainjob runs")
        return forced
    return "store" if _agent_store(env) or _group_initialized() else "files"


def check_pvc(pvc: Path | Url, world_size: int, env: Mapping[str, str]) -> None:
    """Refuse a bucket PVC to ranks that would coordinate through files: a bucket has no
    directory to hold them (the store transport needs none)."""
    if isinstance(pvc, Url) and world_size > 1 and transport(world_size, env) == "files":
        raise UsageError(f"{pvc}: a bucket PVC runs W > 1 ranks under torchrun (they agree through its store); "
                         "the local launcher's ranks coordinate through files on a directory")


def open_store(env: Mapping[str, str], timeout: float) -> Any:
    """The launch's store, under a prefix unique to the launch (module docstring)."""
    with importing("the store transport"):
        import torch.distributed as dist  # only here: the files transport needs no torch

        from .store import answering
    scope = f"trainjob/{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    with answering(f"connecting to {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"):
        if _agent_store(env):  # torchrun's agent hosts it; every worker is a client
            base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                 timeout=datetime.timedelta(seconds=max(timeout, CONNECT_SECONDS)),
                                 wait_for_workers=False)
        else:  # a connection of our own: the group's client serves one call at a time
            base = dist.distributed_c10d._get_default_store().clone()
    return dist.PrefixStore(scope, base)


def coordinator(pvc: Pvc, world_size: int, timeout: float, stop_signal: Callable[[], str | None],
                env: Mapping[str, str] = os.environ) -> Coordinator:
    """Rank 0's side of the launch, on the transport ``transport`` picks."""
    if transport(world_size, env) == "files":
        return PvcCoordinator(pvc, world_size, timeout, stop_signal)
    with importing("the store transport"):
        from .store import StoreCoordinator
    return StoreCoordinator(open_store(env, timeout), pvc, world_size, timeout, stop_signal)


def follower(pvc: Pvc, rank: int, world_size: int, timeout: float, stop_signal: Callable[[], str | None],
             env: Mapping[str, str] = os.environ) -> Follower:
    """Rank ``rank``'s (>= 1) side of the launch, on the transport ``transport`` picks."""
    if transport(world_size, env) == "files":
        return PvcFollower(pvc, rank, world_size, timeout, stop_signal)
    with importing("the store transport"):
        from .store import StoreFollower
    return StoreFollower(open_store(env, timeout), rank, world_size, timeout, stop_signal, pvc)
