"""Ranks: a rank's identity from flags, torchrun's environment, a Slurm step or a Kubernetes Indexed Job."""

from __future__ import annotations

import pytest

from trainjob.errors import UsageError
from trainjob.ranks.identity import RankSpec, resolve_rank


# What srun gives the second of two tasks, and what a batch script's own shell (no step) has.
SRUN_TASK_1_OF_2 = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
BATCH_SHELL = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}


@pytest.mark.parametrize("rank, world, env, expected", [
    (None, None, {}, RankSpec(0, 1)),
    (None, 4, {}, RankSpec(None, 4)),                                  # launch 4 ranks here
    (2, 4, {}, RankSpec(2, 4)),
    (None, None, {"RANK": "3", "WORLD_SIZE": "4"}, RankSpec(3, 4)),    # torchrun
    (None, 3, {"JOB_COMPLETION_INDEX": "1"}, RankSpec(1, 3)),          # Kubernetes Indexed Job
    (None, None, {"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "3"}, RankSpec(2, 3)),
    (0, 2, {"RANK": "1", "WORLD_SIZE": "2"}, RankSpec(0, 2)),          # flags win
    (None, None, SRUN_TASK_1_OF_2, RankSpec(1, 2)),                    # one srun task per rank
    (None, 2, SRUN_TASK_1_OF_2, RankSpec(1, 2)),
    (None, None, {**SRUN_TASK_1_OF_2, "RANK": "0", "WORLD_SIZE": "2"}, RankSpec(0, 2)),  # torchrun under srun
    (None, None, BATCH_SHELL, RankSpec(0, 1)),                        # the batch shell is no rank
    (None, 2, BATCH_SHELL, RankSpec(None, 2)),
    (None, 2, {**SRUN_TASK_1_OF_2, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, RankSpec(None, 2)),  # one task
])
def test_rank_identity(rank, world, env, expected):
    assert resolve_rank(rank, world, env) == expected


@pytest.mark.parametrize("rank, world, env, message", [
    (1, None, {}, "needs a world size"),
    (None, None, {"JOB_COMPLETION_INDEX": "1"}, "needs a world size"),
    (2, 2, {}, "rank must be from 0 to"),
    (None, 0, {}, "--world-size must be from 1"),
    (None, None, {"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer"),
    (None, 4, SRUN_TASK_1_OF_2, "srun started 2 tasks"),
    (None, None, {**SRUN_TASK_1_OF_2, "SLURM_PROCID": "x"}, "SLURM_PROCID must be an integer"),
])
def test_bad_rank_identity_is_a_usage_error(rank, world, env, message):
    with pytest.raises(UsageError, match=message):
        resolve_rank(rank, world, env)
