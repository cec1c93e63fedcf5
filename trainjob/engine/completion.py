"""The engine: has this job already completed, and does what it published still verify?

An idempotent start (``Run(idempotent=True)``, ``trainjob run --idempotent``) asks this under the
job lock before anything else, so a relaunch after a late kill, or a second supervisor, ends with
the completed job's answer instead of a refusal. ``trainjob verify`` checks artifacts with the
same function. ``ended_job`` asks the wider question a launcher asks before it waits for any peer
(``trainjob torchrun``): would this start end at once, and with which code? Read-only: they write
nothing and decide nothing beyond "over, and how".
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs

from ..checkpoint import plan
from ..errors import ArtifactUnverified, InputError
from ..exits import EXIT_FAILED, EXIT_OK
from ..storage.eventlog import EventLog, log_exists, read_log
from ..storage.pvc import Pvc
from . import decisions
from .job import already_completed, artifact_names
from .machine import parse_detail


@attrs.frozen
class Item:
    kind: str      # checkpoint | pointer | artifact
    path: str      # relative to the PVC
    verdict: str   # ok | corrupt | partial | in-flight | set-aside | missing | unlogged | unknown
    detail: str = ""


def logged_artifacts(log_path: Path) -> dict[str, str]:
    """Each artifact's path -> the sha256 its ``artifact_written`` event recorded."""
    logged: dict[str, str] = {}
    if log_exists(log_path):
        for line in read_log(log_path):
            if line.event is not None and line.event.event == "artifact_written":
                fields = parse_detail("artifact_written", line.event.detail)
                if fields is not None:
                    logged[fields["path"]] = fields["sha256"]
    return logged


def check_artifact(pvc: Pvc, rel: str, logged_sha256: str | None) -> Item:
    """One artifact against the hash the log recorded for it (None: the log records none)."""
    try:
        raw = pvc.read_bytes(pvc.root / rel) if plan.plain_name(rel.removeprefix("artifacts/")) else None
    except InputError as exc:  # a symlink, unreadable: never followed, reported
        return Item("artifact", rel, "corrupt", str(exc))
    if logged_sha256 is None:
        return Item("artifact", rel, "unlogged", "no artifact_written event in the log records its sha256")
    if raw is None:
        return Item("artifact", rel, "missing", f"the log records sha256={logged_sha256}")
    if hashlib.sha256(raw).hexdigest() != logged_sha256:
        return Item("artifact", rel, "corrupt", f"sha256 differs from the log's {logged_sha256[:12]}...")
    return Item("artifact", rel, "ok", f"sha256={logged_sha256}")


@attrs.frozen
class Completion:
    """A completed job found by a relaunch: the attempt that completed and its verified artifact."""

    attempt: int
    artifact: Item

    def line(self) -> str:
        return (f"already completed (attempt {self.attempt}): {self.artifact.path} verified, "
                f"{self.artifact.detail}; nothing to do")


def completed_job(pvc: Pvc, log_path: Path) -> Completion | None:
    """The job this PVC holds, if it is over (state.json and the log both say ``completed``).

    Raises ArtifactUnverified when it is over but its artifact is missing or fails the hash the
    log recorded: success must not be reported for a model that cannot be trusted. Read-only.
    """
    last = pvc.read_state()
    if not decisions.completion_announced(last.state if last else None,
                                          EventLog(log_path).last_event() == "completed"):
        return None
    assert last is not None  # completion_announced needs a state
    logged = logged_artifacts(log_path)
    names = [f"artifacts/{name}" for name in artifact_names(last.attempt)]  # json for the lab's model
    rel = next((r for r in names if r in logged), names[0])
    item = check_artifact(pvc, rel, logged.get(rel))
    if item.verdict != "ok":
        raise ArtifactUnverified(
            f"{pvc.root}: the job completed (attempt {last.attempt}) but {rel} is {item.verdict}: {item.detail}; "
            f"the published model cannot be trusted: run `trainjob verify --pvc {pvc.root}`, then restore "
            "the artifact or start over on a fresh --pvc")
    return Completion(attempt=last.attempt, artifact=item)


@attrs.frozen
class Ended:
    """A job found over before a launch: the code its start would end with, and why."""

    code: int
    line: str


def ended_job(pvc: Pvc, log_path: Path, backoff_limit: int, idempotent: bool) -> Ended | None:
    """How a start of ``trainjob run`` on this PVC would end without training, or None if it
    would train (or resume). The same decisions the start makes (``decisions.py``), read-only:

    completed, ``idempotent``    0 once the artifact verifies (ArtifactUnverified, exit 2, if not)
    completed                    AlreadyCompleted, exit 2: the lab's refusal
    an ended attempt and no      1: the start would log ``job_failed`` again (the log already
    budget left                  ends in it; this writes nothing)

    A corrupt state, log or attempts file is the InputError (2) the start would raise too.
    """
    if idempotent and (done := completed_job(pvc, log_path)) is not None:
        return Ended(EXIT_OK, done.line())
    last = pvc.read_state()
    state = last.state if last else None
    if decisions.completion_announced(state, EventLog(log_path).last_event() == "completed"):
        raise already_completed(pvc, last.attempt)  # type: ignore[union-attr]  # completed needs a state
    if state in decisions.ATTEMPT_ENDED and not decisions.within_backoff(attempts := pvc.read_attempts(),
                                                                          backoff_limit):
        return Ended(EXIT_FAILED, f"the job failed: attempts={attempts} backoffLimit={backoff_limit}; its retry "
                                  "budget is spent (a larger --backoff-limit allows another attempt)")
    return None
