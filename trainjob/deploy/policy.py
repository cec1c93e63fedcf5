"""The supervisor's judgment: what one start of ``trainjob run`` amounted to, and what comes next.

Small pure functions, no I/O, no clock, no processes: ``supervise.py`` runs the child and feeds
them what it saw (the child's exit code, read through the contract ``cli.py`` owns, and the events
the child logged). Keeping the policy here is what lets the tests walk every exit code, every last
event and every back-off without starting a process.

The supervisor's log lines carry ``source=SOURCE`` so ``trainjob status`` can tell them from the
run's; their details are ``key=value`` tokens built by ``detail``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

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
