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


# A metric is gated in millionths of itself: ``drift_passes`` judges whole numbers.
METRIC_PARTS = 10**6
# The largest count a metric's verdict may log: 2**53, exact in every JSON reader (as a loss is).
MAX_COUNT = 2**53


def metric_counts(value: float, baseline: float, higher_is_better: bool) -> tuple[int, int, int]:
    """A metric and its frozen baseline as ``drift_passes``' whole numbers: (correct, total,
    baseline's correct), so that ``max_drop`` percent is the tolerance, as it is for a Score.

    Higher is better (an accuracy): both in millionths; the gate passes when ``value`` is at
    least ``baseline`` less ``max_drop`` percent of it. Lower is better (a loss, a perplexity):
    the ratio ``baseline / value`` in millionths, against a baseline of one; the gate passes when
    ``value`` less ``max_drop`` percent of itself is at most ``baseline`` (a value of 0 always
    passes). Each count is at most ``MAX_COUNT``, so a verdict on the same two numbers is the same
    on every machine and every integration (``trainjob.Metric``, ``hf.metric``). Expects what
    ``Run.gate`` checks: ``value`` from 0, ``baseline`` above 0, both finite and at most
    ``MAX_COUNT / METRIC_PARTS``.
    """
    if higher_is_better:
        return (min(round(value * METRIC_PARTS), MAX_COUNT), METRIC_PARTS,
                min(round(baseline * METRIC_PARTS), MAX_COUNT))
    scaled = baseline * METRIC_PARTS / value if value > 0 else float("inf")
    return round(scaled) if scaled < MAX_COUNT else MAX_COUNT, METRIC_PARTS, METRIC_PARTS


def should_checkpoint(step: int, every: int, steps: int) -> bool:
    """Checkpoint every ``every`` steps and always at the last one."""
    return step % every == 0 or step == steps


def loss_milli(mean_loss: float) -> int:
    """Mean loss in thousandths, rounded half away from zero (as the lab's reference does)."""
    return int(mean_loss * 1000 + 0.5)
