"""The supervisor's pure policy: every exit code and last event, the start budget, the back-off."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainjob.deploy import policy
from trainjob.cli import EXIT_FOR_ENDING, SAID_BY_EXIT
from trainjob.engine.machine import EVENT_FOR_STATE

EVENTS = sorted(set(EVENT_FOR_STATE.values()) | {"artifact_written"})
last_events = st.sampled_from([None, *EVENTS])
codes = st.integers(min_value=-64, max_value=255)


def judge(code: int, last_event: str | None) -> str:
    return policy.ending(SAID_BY_EXIT.get(code), last_event)


# --- what a start amounted to ----------------------------------------------------------------------

@pytest.mark.parametrize(("code", "last_event", "expected"), [
    (0, "completed", "completed"),
    (1, "job_failed", "job_failed"),
    (1, "drift_failed", "drift_failed"),
    (2, None, "input_error"),
    (75, "killed", "killed"),
    (75, None, "killed"),  # PVC busy: the child logged nothing, and that is fine
    (70, "checkpointed", "crashed"),
    (-9, "checkpointed", "crashed"),  # SIGKILL, e.g. the OOM killer (a shell shows 137)
    (137, "checkpointed", "crashed"),
])
def test_each_exit_code_reads_as_the_contract_says(code, last_event, expected):
    assert judge(code, last_event) == expected


@given(last_event=last_events.filter(lambda e: e not in ("job_failed", "drift_failed")))
def test_exit_1_without_an_honest_failure_logged_is_a_crash(last_event):
    # Python exits 1 on an uncaught exception; only the log makes a 1 an honest failure.
    assert judge(1, last_event) == "crashed"


@given(before=last_events)
def test_exit_0_from_a_start_that_logged_nothing_is_success_only_if_the_log_had_completed(before):
    # An idempotent relaunch of a completed job verifies it and rightly logs nothing.
    end = policy.ending("ok", None, before)
    assert end == ("completed" if before == "completed" else "inconsistent")


@given(last_event=last_events.filter(lambda e: e not in (None, "completed")), before=last_events)
def test_what_a_start_logged_outranks_what_the_log_held_before_it(last_event, before):
    assert policy.ending("ok", last_event, before) == "inconsistent"


@given(last_event=last_events.filter(lambda e: e != "completed"))
def test_exit_0_without_completed_in_the_log_is_never_success(last_event):
    end = judge(0, last_event)
    assert end == "inconsistent"
    assert EXIT_FOR_ENDING[end] not in (0, 1)


@given(code=codes, last_event=last_events)
def test_every_ending_has_an_exit_code_and_only_honest_failures_exit_1(code, last_event):
    end = judge(code, last_event)
    assert end in EXIT_FOR_ENDING
    assert (EXIT_FOR_ENDING[end] == 1) == (end in ("job_failed", "drift_failed"))
    assert (EXIT_FOR_ENDING[end] == 0) == (code == 0 and last_event == "completed")


# --- whether to start again ----------------------------------------------------------------------

@given(code=codes, last_event=last_events, starts=st.integers(1, 50), max_starts=st.integers(1, 50))
def test_never_starts_beyond_max_starts(code, last_event, starts, max_starts):
    if policy.should_relaunch(judge(code, last_event), starts, max_starts):
        assert starts < max_starts


@pytest.mark.parametrize(("code", "last_event"), [(0, "completed"), (1, "job_failed"), (2, None)])
def test_final_endings_stop_even_with_starts_left(code, last_event):
    assert not policy.should_relaunch(judge(code, last_event), 1, 100)


@pytest.mark.parametrize(("code", "last_event"), [(1, "drift_failed"), (75, "killed"), (70, None), (-9, None)])
def test_relaunchable_endings_relaunch_while_starts_remain(code, last_event):
    assert policy.should_relaunch(judge(code, last_event), 1, 2)
    assert not policy.should_relaunch(judge(code, last_event), 2, 2)


@given(limit=st.integers(0, 100))
def test_default_max_starts_lets_the_programs_budget_speak_first(limit):
    # B + 1 attempts that fail the gate, then the start that logs job_failed.
    assert policy.default_max_starts(limit) >= limit + 2


# --- progress and back-off -----------------------------------------------------------------------

def test_progress_is_a_committed_checkpoint():
    assert policy.made_progress(["resumed", "checkpointed", "killed"])
    assert not policy.made_progress(["resumed", "killed"])
    assert not policy.made_progress([])


def test_backoff_follows_the_job_controller_sequence():
    delays = [policy.backoff_delay(n, 10, 600) for n in range(1, 9)]
    assert delays == [10, 20, 40, 80, 160, 320, 600, 600]


@given(streaks=st.lists(st.booleans(), max_size=40))
def test_progress_resets_the_backoff_to_its_first_step(streaks):
    streak = 0
    for progressed in streaks:
        streak = policy.next_streak(streak, progressed)
        if progressed:
            assert policy.backoff_delay(streak, 10, 600) == 10


@given(streak=st.integers(0, 10**6), base=st.floats(0, 1e6), extra=st.floats(0, 1e6))
def test_backoff_is_bounded_and_monotonic(streak, base, extra):
    cap = base + extra
    delay = policy.backoff_delay(streak, base, cap)
    assert base <= delay <= cap
    assert policy.backoff_delay(streak + 1, base, cap) >= delay


# --- what a batch scheduler does after a launch (Slurm) -----------------------------------------------

AFTER = dict(log="pvc/log.jsonl", pvc="pvc")
SPENT = policy.Over(1, "the job failed: attempts=2 backoffLimit=1")
DONE = policy.Over(0, "already completed (attempt 1)")


@pytest.mark.parametrize(("code", "over", "expected"), [
    (0, None, ("complete", 0)),
    (2, None, ("fail", 2)),          # bad input: the same input fails the same way
    (70, None, ("fail", 70)),        # a bug: never run again
    (1, None, ("requeue", 75)),      # the gate failed, attempts left: a fresh attempt
    (1, SPENT, ("fail", 1)),         # the budget is spent: no requeue at all
    (75, None, ("requeue", 75)),     # a kill, a preemption, a time limit
    (75, DONE, ("complete", 0)),     # killed after it completed: it stays completed
    (143, None, ("requeue", 75)),    # the tasks ended by SIGTERM (128 + 15)
    (137, None, ("requeue", 75)),    # or SIGKILL: a kill, never a spent attempt
    (3, None, ("fail", 70)),         # a code outside the contract is a crash
])
def test_each_exit_code_makes_the_scheduler_do_what_the_contract_says(code, over, expected):
    verdict = policy.after_launch(code, over, True, 0, policy.MAX_STALLS, **AFTER)
    assert (verdict.action, verdict.code) == expected
    assert verdict.code != 75 or verdict.action == "requeue"  # a 75 that ends the job would be requeued by RequeueExit=75


@given(code=st.sampled_from([1, 75, 137, 143]), stalls=st.integers(0, 20), limit=st.integers(1, 10))
def test_requeues_without_progress_stop_at_the_bound_naming_storage(code, stalls, limit):
    verdict = policy.after_launch(code, None, False, stalls, limit, **AFTER)
    assert verdict.stalls == stalls + 1
    if stalls + 1 >= limit:
        assert (verdict.action, verdict.code) == ("fail", 1)
        assert "storage at pvc" in verdict.line and "no new checkpoint" in verdict.line
    else:
        assert verdict.action == "requeue"


@given(code=st.sampled_from([1, 75, 137]), stalls=st.integers(0, 20))
def test_a_launch_that_committed_a_checkpoint_resets_the_count(code, stalls):
    verdict = policy.after_launch(code, None, True, stalls, 1, **AFTER)
    assert (verdict.action, verdict.stalls) == ("requeue", 0)


def test_a_bug_names_the_log():
    assert "pvc/log.jsonl" in policy.after_launch(70, None, False, 0, 3, **AFTER).line
