"""Ranks: who this process is (its rank and the world size), from flags or the environment.

Pure: reads the environment mapping it is given, touches no file and starts no process.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..errors import UsageError
from ..checkpoint.plan import world_size_problem


@attrs.frozen
class RankSpec:
    """``rank`` None: no rank was given, so a world of W > 1 is launched locally by this process."""

    rank: int | None
    world_size: int


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    if name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"environment variable {name} must be an integer, got {env[name]!r}") from None


def resolve_rank(rank: int | None, world_size: int | None, env: Mapping[str, str]) -> RankSpec:
    """Rank identity from flags, else torchrun's RANK/WORLD_SIZE, else a Kubernetes Indexed Job.

    Flags win over the environment; a rank without a world size is a usage error.
    """
    env_world = _env_int(env, "WORLD_SIZE")
    if rank is None:
        rank = _env_int(env, "RANK")
        if rank is None:
            rank = _env_int(env, "JOB_COMPLETION_INDEX")
    world = world_size if world_size is not None else env_world
    if world is None:
        if rank not in (None, 0):
            raise UsageError(f"rank {rank} needs a world size: pass --world-size (or set WORLD_SIZE)")
        world = 1
    if (problem := world_size_problem(world)) is not None:
        raise UsageError(problem)
    if rank is not None and not 0 <= rank < world:
        raise UsageError(f"rank must be from 0 to world size - 1 ({world - 1}), got {rank}")
    if rank is None and world == 1:
        rank = 0
    return RankSpec(rank=rank, world_size=world)
