"""The names of the job's states, written once, at the foundation.

This module only names the states; the table in ``engine/machine.py`` says how a run moves
between them. Living below every part, the names can be used by ``records`` (what ``state.json``
may hold), the rank protocol and the views without importing the engine. It imports nothing.

Each value is the exact string written to ``state.json`` and the log, so a value never changes.
The members are lower case, equal to their values, because ``transitions`` names an ``Enum`` state
by the member's *name*: ``State.completed`` is the state ``"completed"`` to the machine, in the
diagrams and on disk alike.
"""

from __future__ import annotations

import enum


class State(enum.StrEnum):
    pending = "pending"
    started = "started"
    resumed = "resumed"
    checkpointed = "checkpointed"
    snapshotted = "snapshotted"
    killed = "killed"
    refused = "refused"
    drift_failed = "drift_failed"
    job_failed = "job_failed"
    completed = "completed"
    resharded = "resharded"
