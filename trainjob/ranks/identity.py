"""Ranks: who this process is (its rank and the world size), from flags or the environment.

The sources, first found wins: the flags; torchrun's ``RANK``/``WORLD_SIZE``; a Slurm step's
``SLURM_PROCID``/``SLURM_NTASKS`` (one ``srun`` task per rank); a Kubernetes Indexed Job's
``JOB_COMPLETION_INDEX`` (its world size from the flag or ``WORLD_SIZE``).

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


def slurm_task(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, world size) of one task of a Slurm step of several tasks, else None.

    Only inside a step (``SLURM_STEP_ID``: what ``srun`` starts; a batch script's own shell has
    ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` too, and is no rank) and only with more than
    one task: a step of one task is rank 0 of a world the flags give (``--world-size 2`` then
    launches both ranks here, as anywhere). Torchrun's workers under ``srun`` (one ``trainjob
    torchrun`` per node) carry ``RANK``, which wins.
    """
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    tasks = _env_int(env, "SLURM_NTASKS")
    if tasks is None or tasks <= 1:
        return None
    return _env_int(env, "SLURM_PROCID"), tasks  # type: ignore[return-value]  # present, checked above


def resolve_rank(rank: int | None, world_size: int | None, env: Mapping[str, str]) -> RankSpec:
    """Rank identity from flags, else torchrun's RANK/WORLD_SIZE, else a Slurm step's tasks, else
    a Kubernetes Indexed Job.

    Flags win over the environment; a rank without a world size is a usage error, and so is a
    ``--world-size`` other than the number of tasks a Slurm step started, each a rank.
    """
    env_world = _env_int(env, "WORLD_SIZE")
    if rank is None:
        rank = _env_int(env, "RANK")
        if rank is None and (task := slurm_task(env)) is not None:
            rank, tasks = task
            if world_size is not None and world_size != tasks:
                raise UsageError(f"srun started {tasks} tasks (SLURM_NTASKS), each a rank, but --world-size is "
                                 f"{world_size}: give srun --ntasks {world_size}, or drop --world-size")
            env_world = tasks
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
