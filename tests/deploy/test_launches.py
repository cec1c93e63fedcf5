"""A launch as a supervisor sees it (trainjob/deploy/launches.py): the rule every launch of prove,
the campaign and the acceptance tests is judged by, that its exit code and its log agree."""

from __future__ import annotations

import pytest

from trainjob.deploy.launches import disagreement


def logged(*names: str) -> list[dict[str, str]]:
    return [{"event": name, "detail": ""} for name in names]


@pytest.mark.parametrize("code, log", [
    (0, logged("job_started", "checkpointed", "artifact_written", "completed")),
    (1, logged("job_started", "checkpointed", "drift_failed")),
    (1, logged("job_failed")),
    (2, logged("job_started", "refused")),
    (75, logged("job_started", "checkpointed", "killed")),
    (75, logged("job_started", "checkpointed")),  # storage trouble: the attempt in flight
    (70, logged("job_started", "checkpointed")),  # a crash leaves it in flight too
    (-9, logged("job_started", "completed")),  # a SIGKILL after `completed` is never judged
    (137, logged("job_started")),
])
def test_a_launch_whose_code_its_log_says_agrees(code, log):
    assert disagreement(code, log) is None


@pytest.mark.parametrize("code, log, says", [
    (2, logged("job_started"), "ends at 'job_started', for which `trainjob status` says 75"),
    (70, logged("job_started", "completed"), "exited 70 but its log ends at 'completed'"),
    (0, logged("job_started", "checkpointed"), "says 75"),
    (75, logged("job_started", "refused"), "says 2"),
    (-15, logged("job_started", "completed"), "exited -15, not with one of trainjob's codes"),
    (143, logged(), "not with one of trainjob's codes"),
])
def test_a_launch_whose_log_says_another_code_disagrees(code, log, says):
    problem = disagreement(code, log)
    assert problem is not None and says in problem, problem


def test_a_launch_that_logged_nothing_left_the_job_as_it_was_and_only_its_code_is_judged():
    done = logged("job_started", "completed")
    assert disagreement(2, done, before=2) is None  # "already completed": refused before it began
    assert disagreement(75, done, before=2) is None  # a busy PVC
    assert disagreement(2, [*done, *logged("job_started", "refused")], before=2) is None
    assert disagreement(0, [*done, *logged("job_started", "refused")], before=2) is not None
