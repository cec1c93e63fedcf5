"""The controllers' judgment: what one start of ``trainjob run`` amounted to, and what comes next.

Small pure functions, no I/O, no clock, no processes: ``supervise.py`` runs the child and feeds
them what it saw (the child's exit code, read through the contract ``cli.py`` owns, and the events
the child logged). Keeping the policy here is what lets the tests walk every exit code, every last
event and every back-off without starting a process.

A batch scheduler asks the same question at the end of each launch of a job it may requeue
(``after_launch``: what 0, 1, 2, 70 and 75 make it do, within the run's retry budget and a bound on
launches that make no progress); ``slurm.py`` spells the answer as a batch script, whose last step
(``trainjob slurm after``) reads the PVC and the log and asks this.

The supervisor's log lines carry ``source=SOURCE`` so ``trainjob status`` can tell them from the
run's; their details are ``key=value`` tokens built by ``detail``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs

from ..exits import EXIT_FAILED, EXIT_INTERNAL, EXIT_OK, EXIT_RELAUNCH, EXIT_USAGE, rank_exit

from ..records import SUPERVISOR as SOURCE  # noqa: F401 (the supervisor's log source, for cli.py and tests)

# What a child's exit code says under trainjob's contract (cli.py maps codes to these words).
# None is any other code: 70 (a bug), a signal, an OOM kill (137), an interpreter crash.
Said = Literal["ok", "failed", "usage", "relaunch"] | None

# What one start amounted to. Where a word names a machine state, it means that state.
Ending = Literal["completed", "job_failed", "drift_failed", "input_error", "killed", "crashed", "inconsistent"]

# A fresh start can still change these endings: drift_failed leaves the program's own retry
# budget to decide (the next start trains a fresh attempt or logs job_failed), a kill resumes,
# and a crash may have been transient.
RELAUNCHABLE: frozenset[str] = frozenset({"drift_failed", "killed", "crashed"})

# Spare starts beyond the ones the program's own budget needs, for kills and crashes: the
# Kubernetes Job's default backoffLimit.
SPARE_STARTS = 6


def ending(said: Said, last_event: str | None, log_ended_in: str | None = None) -> Ending:
    """Judge one start from its exit code's meaning and the last event it logged.

    Exit 1 is an honest failure only when the log backs it up: Python itself exits 1 on an
    uncaught exception, and that is a crash. Exit 0 without ``completed`` in the log breaks the
    contract; the supervisor will not pass that off as success. A start that logged nothing is
    judged by ``log_ended_in``, the run's last event before it: an idempotent relaunch of a job
    that had already completed exits 0 and, rightly, logs nothing.
    """
    if said == "ok":
        told = last_event if last_event is not None else log_ended_in
        return "completed" if told == "completed" else "inconsistent"
    if said == "failed" and last_event in ("job_failed", "drift_failed"):
        return last_event  # type: ignore[return-value]  # narrowed by the membership test
    if said == "usage":
        return "input_error"
    if said == "relaunch":
        return "killed"
    return "crashed"


def should_relaunch(end: Ending, starts: int, max_starts: int) -> bool:
    """Start the child again? Only after a relaunchable ending, and never beyond ``max_starts``."""
    return end in RELAUNCHABLE and starts < max_starts


def made_progress(events: Iterable[str]) -> bool:
    """Did a start move the job forward? Progress is a checkpoint it committed.

    A checkpoint is what the next start resumes from, so a start that wrote one left the job
    further along than it found it, whatever it ended with. A start that ended without one (a
    crash before the first checkpoint, a busy PVC) did not, and the back-off keeps growing.
    """
    return "checkpointed" in events


def next_streak(streak: int, progressed: bool) -> int:
    """Starts in a row without progress, counting the one that just ended; progress resets it."""
    return 1 if progressed else streak + 1


def backoff_delay(streak: int, base: float, cap: float) -> float:
    """Seconds to wait before the next start: ``base * 2**(streak-1)``, at most ``cap``.

    With base 10 and cap 600 this is the Job controller's sequence 10, 20, 40, ... 600. The
    exponent is clamped so a long streak saturates at ``cap`` instead of overflowing a float.
    """
    return min(cap, base * 2.0 ** min(max(streak, 1) - 1, 1023))


def default_max_starts(backoff_limit: int) -> int:
    """Enough starts for the program's own budget to speak first, plus spare ones.

    A budget of B allows B + 1 attempts; one more start is needed for the program to log
    ``job_failed``. So the supervisor never cuts the program's budget short by default.
    """
    return backoff_limit + 2 + SPARE_STARTS


def detail(**fields: object) -> str:
    """A supervisor line's detail: ``key=value`` tokens in the order given (``status`` parses them)."""
    return " ".join(f"{key}={value}" for key, value in fields.items())


# What a batch scheduler does after a launch: the job ends (COMPLETED or FAILED) or runs again.
Action = Literal["complete", "requeue", "fail"]
# Launches in a row that may commit no new checkpoint before a job that would run again is
# stopped instead (``after_launch``): a full disk or a storage that is down fails every launch the
# same way, and a requeue loop would hold a node forever.
MAX_STALLS = 3


@attrs.frozen
class Verdict:
    """What to do after one launch: ``code`` is what the batch script exits with (0 alone ends the
    job COMPLETED), ``stalls`` the launches in a row, this one counted, that committed no new
    checkpoint (the next launch's count starts from it), ``line`` says why to the job's output."""

    action: Action
    code: int
    stalls: int
    line: str


@attrs.frozen
class Over:
    """The job is over whatever a launch would do: the next one would end at once with ``code``
    (0: completed and its artifact verifies; 1: the retry budget is spent), for ``line``'s reason."""

    code: int
    line: str


def after_launch(code: int, over: Over | None, progressed: bool, stalls: int, max_stalls: int,
                 log: str, pvc: str) -> Verdict:
    """A launch ended with ``code`` (its tasks' status, a signal's 128 + N included): what next?

    0 completes. 2 (bad input) fails and is never run again: the same input fails the same way.
    70 (a bug) fails, naming the log: running a bug again spends a node for nothing. A job
    ``over`` ends with its code (a kill that came after the job completed, a gate failure with no
    attempt left). Otherwise (75, a kill, a preemption, a time limit; 1 with attempts left; a
    process killed by a signal) it runs again: kills never spend the retry budget, which the run
    counts in its own log. Only a run of ``max_stalls`` launches in a row that committed no new
    checkpoint stops it, failed, naming the storage: each of them found the job where the
    previous one left it.
    """
    said = rank_exit(code)
    if said == EXIT_OK:
        return Verdict("complete", EXIT_OK, 0, "the job completed")
    if said == EXIT_USAGE:
        return Verdict("fail", EXIT_USAGE, stalls,
                       f"bad input (exit {EXIT_USAGE}): not requeued, a launch with the same input fails the same "
                       "way; fix the flag or the data (the job's output says which) and submit again")
    if said == EXIT_INTERNAL:
        return Verdict("fail", EXIT_INTERNAL, stalls,
                       f"internal error (exit {code}): not requeued; the job's output holds the traceback and "
                       f"{log} what the run decided before it; please report it")
    if over is not None:
        return Verdict("complete" if over.code == EXIT_OK else "fail", over.code, 0 if progressed else stalls,
                       over.line)
    stalls = 0 if progressed else stalls + 1
    if stalls >= max_stalls:
        return Verdict("fail", EXIT_FAILED, stalls,
                       f"{stalls} launches in a row committed no new checkpoint (the last exited {code}): the storage "
                       f"at {pvc} may be full, read-only or down; not requeued again (fix it, then submit the job "
                       "again: it resumes from its last checkpoint)")
    why = ("the gate failed and the retry budget has attempts left: requeued for a fresh attempt"
           if said == EXIT_FAILED else f"stopped (exit {code}): requeued, to resume from its last checkpoint")
    return Verdict("requeue", EXIT_RELAUNCH, stalls, why)
