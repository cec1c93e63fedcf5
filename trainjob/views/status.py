"""What a decision log says happened: the summary ``trainjob status`` prints.

Streams the log once, in constant memory. Lines that are not valid events (torn by a crash,
edited by hand) are counted and reported, never fatal. It only summarises; whether a sequence
of events is legal is the state machine's business.

The outcome is the run's: lines written by ``trainjob supervise`` (``source: "supervisor"``) never
change ``last_event``, ``attempts`` or ``drift``; the last of them is reported as ``supervisor``.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from ..deploy.policy import SOURCE as SUPERVISOR
from ..engine.machine import parse_detail
from ..errors import InputError
from ..storage.eventlog import read_log


@attrs.define
class Status:
    lines: int = 0
    last_event: str | None = None
    attempts: int = 0
    artifact: str | None = None
    drift: str = "none"  # pass | fail | none
    supervisor: str | None = None  # the supervisor's last decision, "event | detail"
    skipped: list[str] = attrs.Factory(list)


def summarize(path: Path) -> Status:
    status = Status()
    for line in read_log(path):
        if line.event is None:
            status.skipped.append(f"line {line.number}: {line.problem}")
            continue
        ev = line.event
        status.lines += 1
        if ev.source == SUPERVISOR:
            status.supervisor = f"{ev.event} | {ev.detail}"
            continue
        status.last_event = ev.event
        # Only two events' details are read (a detail not in its event's format is ignored), so
        # only theirs are parsed: the other lines of a long log cost no more than a comparison.
        if ev.event == "job_started":
            if fields := parse_detail(ev.event, ev.detail):
                status.attempts = max(status.attempts, fields["attempt"])
        elif ev.event == "artifact_written":
            if fields := parse_detail(ev.event, ev.detail):
                status.artifact = fields["path"]
        elif ev.event == "completed":
            status.drift = "pass"
        elif ev.event == "drift_failed":
            status.drift = "fail"
    if status.last_event is None:  # empty, or only the supervisor's lines: the run never logged
        raise InputError(f"{path}: holds no events from trainjob run")
    return status
