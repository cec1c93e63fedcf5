"""The job's judgment: small pure functions, no I/O, no clock, no globals.

The state machine's guards call these; so do the tests, directly and with hypothesis. Keeping
them pure is what lets a reader check every decision the job makes without a disk.
"""

from __future__ import annotations

from ..states import State

# States after which an attempt is over: the next start is a fresh attempt (or a refusal).
ATTEMPT_ENDED = frozenset({State.completed, State.drift_failed, State.job_failed})


def should_resume(last_state: str | None, checkpoint_step: int | None, steps: int) -> bool:
    """Continue the same attempt instead of starting a new one?

    With a run record, the answer is "was the last attempt cut short?": a kill is never a failed
    attempt, even one that landed before the first checkpoint. Without a record (a PVC holding
    only a lab checkpoint) fall back to the lab's rule: resume from an unfinished checkpoint.
    """
    if last_state is not None:
        return last_state not in ATTEMPT_ENDED
    return checkpoint_step is not None and checkpoint_step < steps


def completion_unannounced(last_state: str | None, log_says_completed: bool) -> bool:
    """Did the previous process commit "completed" but die before logging it?"""
    return last_state == State.completed and not log_says_completed


def completion_announced(last_state: str | None, log_says_completed: bool) -> bool:
    """Is the job over: "completed" committed to state.json *and* logged? Then a relaunch has
    nothing left to do (the lab refuses it; an idempotent relaunch verifies and says so)."""
    return last_state == "completed" and log_says_completed


def within_backoff(attempts: int, limit: int) -> bool:
    """May a fresh attempt start? A limit of B allows B + 1 attempts in all."""
    return attempts <= limit


def drift_passes(correct: int, total: int, bcorrect: int, max_drop: int) -> bool:
    """Does the holdout count stay within ``max_drop`` percent of the baseline's count?

    Integer arithmetic only, so a result exactly on the boundary (16/20 against 20/20 at 20%)
    gets the same verdict on every machine.
    """
    return total > 0 and correct * 100 >= bcorrect * (100 - max_drop)


def should_checkpoint(step: int, every: int, steps: int) -> bool:
    """Checkpoint every ``every`` steps and always at the last one."""
    return step % every == 0 or step == steps


def loss_milli(mean_loss: float) -> int:
    """Mean loss in thousandths, rounded half away from zero (as the lab's reference does)."""
    return int(mean_loss * 1000 + 0.5)
