"""A local Job controller: runs ``trainjob run`` as a child and relaunches it until it is over.

This module owns the process side only: starting the child, forwarding SIGTERM/SIGINT to it,
the grace period, the back-off sleep, and writing the supervisor's lines to the log. Every
judgment (what a start amounted to, whether to start again, how long to wait) is a pure function
in ``policy.py``; exit codes are ``cli.py``'s. It never touches the PVC: the child owns that,
behind its lock. It reads only the child's exit code and the child's log. A child of W > 1 ranks
(the local launcher, or ``trainjob torchrun``) exits with one code for the launch, by the rule of
``exits.job_exit``, so the supervisor judges it as it judges one rank.

Log lines (``source: "supervisor"``, in the run's own log, one per decision):

    relaunch | start=1 exit=75 ending=killed progress=yes delay_s=10.0 max_starts=10
    stop | start=2 exit=0 ending=completed reason=final outcome=completed
    stop | start=1 exit=0 ending=completed reason=final outcome=completed late_signal=SIGTERM

``reason`` is ``final`` (the ending needs no relaunch), ``max_starts`` or ``signal``; ``exit`` is
the child's return code as Python reports it (negative: killed by that signal). A signal stops
relaunching, but never overrides an outcome the child had decided (``late_signal``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import attrs

from . import policy
from .policy import Ending, Said
from ..errors import InputError, TryAgainLater, UsageError
from ..storage.eventlog import EventLog, read_log
from ..engine.job import StopFlag

POLL_S = 0.05  # how often waits look at the stop flag: a signal is acted on within this


@attrs.frozen
class SuperviseSettings:
    """The supervisor's flags: how many starts, the back-off, the grace after a forwarded SIGTERM.
    The decisions made with them are ``policy.py``'s."""

    max_starts: int
    backoff_base: float = 10.0
    backoff_cap: float = 600.0
    grace: float = 30.0

    def check(self) -> None:
        """Raise UsageError for settings that cannot work, naming the flag."""
        if self.max_starts < 1:
            raise UsageError(f"--max-starts must be at least 1, got {self.max_starts}")
        if not 0 <= self.backoff_base < float("inf"):
            raise UsageError(f"--backoff-base must be a finite number of seconds >= 0, got {self.backoff_base}")
        if not self.backoff_base <= self.backoff_cap < float("inf"):
            raise UsageError(
                f"--backoff-cap must be finite and at least --backoff-base ({self.backoff_base}), "
                f"got {self.backoff_cap}"
            )
        if not 0 < self.grace < float("inf"):
            raise UsageError(f"--grace must be a positive finite number of seconds, got {self.grace}")


def supervise(command: Sequence[str], log: EventLog, settings: SuperviseSettings, said: Callable[[int], Said],
              stop: StopFlag) -> Ending:
    """Start ``command`` until a start ends the job, the starts run out, or a signal arrives.

    Returns the last start's ending; ``"killed"`` when a signal came before the child had
    decided one, that is when its ending would have been relaunched.
    """
    starts, streak = 0, 0
    facts: dict[str, object] = {}
    before, mark = _events_since(log, 0)  # only lines written after this belong to our starts
    ended_in = before[-1] if before else None  # the run's last event before the next start
    while True:
        if stop.signal:  # before a start, during the back-off, or just after a child exited
            _record(log, "stop", **facts, reason="signal", signal=stop.signal, outcome="killed")
            return "killed"
        child = subprocess.Popen(command)
        starts += 1
        code = _wait(child, stop, settings.grace)
        events, mark = _events_since(log, mark)
        end = policy.ending(said(code), events[-1] if events else None, ended_in)
        ended_in = events[-1] if events else ended_in
        facts = dict(start=starts, exit=code, ending=end)
        if stop.signal and end in policy.RELAUNCHABLE:
            continue
        if not policy.should_relaunch(end, starts, settings.max_starts):
            reason = "max_starts" if end in policy.RELAUNCHABLE else "final"
            late = dict(late_signal=stop.signal) if stop.signal else {}
            _record(log, "stop", **facts, reason=reason, outcome=end, **late)
            return end
        progressed = policy.made_progress(events)
        streak = policy.next_streak(streak, progressed)
        delay = policy.backoff_delay(streak, settings.backoff_base, settings.backoff_cap)
        _record(log, "relaunch", **facts, progress="yes" if progressed else "no", delay_s=delay,
                max_starts=settings.max_starts)
        _sleep(delay, stop)


def _wait(child: subprocess.Popen[bytes], stop: StopFlag, grace: float) -> int:
    """Wait for the child; pass a signal on once, and SIGKILL it if it outlives ``grace``.

    That is what the kubelet does with terminationGracePeriodSeconds: the child gets time to
    checkpoint, but the supervisor never hangs on a child that ignores the signal.
    """
    forwarded_at: float | None = None
    while True:
        if stop.signal and forwarded_at is None:
            child.send_signal(signal.Signals[stop.signal])
            forwarded_at = time.monotonic()
        elif forwarded_at is not None and time.monotonic() - forwarded_at > grace:
            child.kill()
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass


def _sleep(seconds: float, stop: StopFlag) -> None:
    """Sleep, but wake within POLL_S of a signal: a back-off never delays a shutdown."""
    deadline = time.monotonic() + seconds
    while not stop.signal and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, POLL_S))


def _events_since(log: EventLog, after: int) -> tuple[list[str], int]:
    """The run's events logged after line ``after``, and the number of the log's last line.

    Supervisor lines and torn lines are skipped. A log that does not exist (yet) holds nothing.
    """
    events, last = [], after
    try:
        for line in read_log(log.path):
            last = line.number
            if line.number > after and line.event is not None and line.event.source is None:
                events.append(line.event.event)
    except InputError:
        pass
    return events, last


def _record(log: EventLog, event: str, **fields: object) -> None:
    """Write one decision to the log, and to stderr for whoever is watching.

    A log that cannot take the line (the child could not create its PVC, a full disk) costs the
    line, not the outcome: the exit code still says how the job stands, and stderr says why.
    """
    detail = policy.detail(**fields)
    print(f"trainjob supervise: {event} | {detail}", file=sys.stderr)
    try:
        log.append(event, detail)
    except TryAgainLater as exc:
        print(f"trainjob supervise: warning: decision not logged: {exc}", file=sys.stderr)
