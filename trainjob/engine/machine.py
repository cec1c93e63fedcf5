"""The job's state machine: one declarative table, read top to bottom in the order a run meets it.

This table is the single source of truth. The engine (``job.py``) drives it, the diagrams are
drawn from it, and the log reader checks recorded paths against it.

Each process starts in ``pending``; its one ``start`` trigger decides, through guards that call
the pure functions in ``decisions.py``, whether this is a resumed attempt, a fresh attempt, or
the end of the retry budget. Each state (but ``pending``) names the event logged on entering it.
``trainjob reshard`` is a process of its own that takes the one ``reshard`` edge.

Some events are announced *within* a transition, before its state's event: the required
``ANNOUNCED_WITHIN`` (the artifact's hash) and the optional ``NOTED_WITHIN`` (cleanup of what
killed writers left, checkpoints rejected by verification). Nothing is logged beside this table.

Each event's detail is written once, as a template in ``DETAIL``: ``format_detail`` fills it
when the machine announces, and ``parse_detail`` reads it back for the views (status, verify,
plot), so what the log says and what its readers expect cannot drift apart.

Callback order, and why: ``before`` callbacks persist to the PVC *before* the state changes, so
a failed write leaves the machine where it was and nothing is announced; the machine-wide
``after_state_change`` then appends the log event. The log never claims what is not on disk.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

import parse
from transitions import Machine
from transitions import State as MachineState

from ..states import State

INITIAL = State.pending
# Where an attempt can be while it trains with no checkpoint write in flight; a kill can land in
# any of them. (In ``snapshotted``, --async-checkpoint's write is in flight; the loop lands it
# before any other edge, so a logged kill always finds the write landed.)
TRAINING = [State.started, State.resumed, State.checkpointed]
FINAL = [State.killed, State.refused, State.drift_failed, State.job_failed, State.completed, State.resharded]
STATES = [INITIAL, *TRAINING, State.snapshotted, *FINAL]

TRANSITIONS: list[dict[str, Any]] = [
    # A process begins, first clearing what killed writers left. Its predecessor may have been
    # killed after committing "completed" but before logging it: finish that announcement
    # (transitions takes the first edge whose guards pass, so this one must come first).
    dict(trigger="start", source=INITIAL, dest=State.completed, conditions="completion_unannounced",
         before=["persist_cleanup", "recall_artifact"], after=["announce_notes", "announce_artifact"]),
    # Otherwise: continue the cut-short attempt (from the newest checkpoint that verifies),
    # start a fresh one, or give up.
    dict(trigger="start", source=INITIAL, dest=State.resumed, conditions="should_resume",
         before=["persist_cleanup", "persist_resume"], after="announce_notes"),
    dict(trigger="start", source=INITIAL, dest=State.started, conditions="within_backoff", unless="should_resume",
         before=["persist_cleanup", "persist_start"], after="announce_notes"),
    dict(trigger="start", source=INITIAL, dest=State.job_failed, unless=["should_resume", "within_backoff"],
         before=["persist_cleanup", "persist_state"], after="announce_notes"),
    # Training: after each step, a checkpoint when due; a kill between any two steps.
    dict(trigger="checkpoint", source=TRAINING, dest=State.checkpointed,
         conditions="should_checkpoint", unless="async_save", before="persist_checkpoint"),
    # --async-checkpoint: the loop and the writer part here. The state is copied into host
    # staging buffers and a writer thread writes, hashes, fsyncs and commits it while the loop
    # trains on; nothing is claimed on disk yet (snapshotted is not persisted in state.json).
    # Only `land` leaves snapshotted (or `refuse`, the write refused): at most one checkpoint in
    # flight, and no gate or logged kill before it landed (a SIGKILL logs nothing; the previous
    # checkpoint stands).
    dict(trigger="checkpoint", source=TRAINING, dest=State.snapshotted,
         conditions=["should_checkpoint", "async_save"], before="hand_off"),
    # ...and meet here, at the first step boundary after the commit is durable (or at a due
    # checkpoint, the gate or a stop, which wait for it: back-pressure): only now is `checkpointed` logged. A
    # write that failed raises its error from the guard, on the main thread: exit 75.
    dict(trigger="land", source=State.snapshotted, dest=State.checkpointed,
         conditions="commit_landed", before="persist_landed"),
    dict(trigger="kill", source=TRAINING, dest=State.killed, before="persist_state"),
    # What the script handed over cannot be kept (an export that cannot be published, replicated
    # state the ranks disagree on: from `snapshotted` when the writer thread found it, nothing
    # committed): the process ends with exit 2, the attempt stays in flight, and a relaunch with
    # the script mended resumes from the newest checkpoint (unmended, it is refused again).
    dict(trigger="refuse", source=[*TRAINING, State.snapshotted], dest=State.refused, before="persist_state"),
    # The gate: publish only a model that holds up against the baseline.
    dict(trigger="gate", source=[State.resumed, State.checkpointed], dest=State.completed,
         conditions="drift_passes", before=["persist_artifact", "persist_state"],
         after="announce_artifact"),
    dict(trigger="gate", source=[State.resumed, State.checkpointed], dest=State.drift_failed,
         unless="drift_passes", before="persist_state"),
    # `trainjob reshard`: rewrite a checkpoint for another world size, then stop.
    dict(trigger="reshard", source=INITIAL, dest=State.resharded,
         before=["persist_cleanup", "persist_reshard"], after="announce_notes"),
]

# How each guard reads on the diagrams: the decision it stands for when it holds, and when it
# does not. A guard missing here is drawn by its name (``name`` / ``!name``).
GUARD_LABELS = {
    "completion_unannounced": ("completed on disk, not in the log", "completion logged"),
    "should_resume": ("attempt in flight", "no attempt in flight"),
    "within_backoff": ("attempts <= backoff_limit", "attempts > backoff_limit"),
    "should_checkpoint": ("step % ckpt_every == 0, last step or SIGTERM", "checkpoint not due"),
    "async_save": ("--async-checkpoint", "synchronous"),
    "commit_landed": ("writer committed, durable", "write in flight"),
    "drift_passes": ("correct*100 >= bcorrect*(100-max_drop)", "correct*100 < bcorrect*(100-max_drop)"),
}

# The log event announced on entering each state, and how its detail reads.
EVENT_FOR_STATE = {state: state.value for state in STATES if state != INITIAL}
EVENT_FOR_STATE[State.started] = "job_started"
STATE_FOR_EVENT = {event: state for state, event in EVENT_FOR_STATE.items()}
# Logged inside a transition rather than as one, before the event of the state entered.
# Required, once: artifact_written comes just before completed.
ANNOUNCED_WITHIN = {"artifact_written": State.completed}
# Optional notes a process's first transition may log first, in this order, each zero or more
# times: event -> the states that transition may enter. (How the ranks of a W > 1 launch reach
# each other; what killed writers left and was cleaned up; each checkpoint that failed
# verification and was set aside; the rank-local state a reshard was told to drop.)
NOTED_WITHIN: dict[str, tuple[str, ...]] = {
    "ranks_coordinated": (State.completed, State.resumed, State.started, State.job_failed),
    "cleaned_up": (State.completed, State.resumed, State.started, State.job_failed, State.resharded),
    "checkpoint_rejected": (State.resumed,),
    "rank_local_dropped": (State.resharded,),
}
# States whose event claims nothing on disk (the state was copied in memory for the writer
# thread): appended without an fsync of its own, so the loop's stall is the copy, not a log
# fsync too. The next event's fsync (its `checkpointed`, or `killed`) makes the line durable;
# a power loss before that may drop it, and the log is then one legal step shorter.
UNSYNCED = (State.snapshotted,)
# States a process of its own reaches that leave the run's persisted state as it was: a
# `trainjob reshard` may run between any two processes, so its event may appear there in a log.
OUT_OF_BAND = (State.resharded,)

# Each event's detail, as templates that both format it and parse it back: ``{name:int}`` is a
# whole number (digits only), ``{name}`` any text, ``{holdout.correct:int}`` an attribute of a
# fact (a ``Score``). An event whose detail has an optional part has one template per shape, the
# fullest first: formatting takes the first whose facts are all given (else the last), parsing
# the first that fits.
_VERDICT = ("holdout: {holdout.correct:int}/{holdout.total:int} "
            "vs baseline {baseline.correct:int}/{baseline.total:int}")
DETAIL: dict[str, tuple[str, ...]] = {
    "job_started": ("steps={steps:int} attempt={attempt:int}",),
    "resumed": ("from_step={from_step:int}",),
    "job_failed": ("attempts={attempts:int} backoffLimit={backoff_limit:int}",),
    "checkpointed": ("step={step:int} loss_milli={loss_milli:int}",),
    "snapshotted": ("step={step:int} loss_milli={loss_milli:int}",),
    "killed": ("at_step={at_step:int} signal={signal}", "at_step={at_step:int}"),
    "refused": ("at_step={at_step:int} reason={reason}",),
    "artifact_written": ("sha256={sha256} path={path}",),
    "completed": (_VERDICT,),
    "drift_failed": (_VERDICT + " (max drop {max_drop:int}%); refusing artifact",),
    "ranks_coordinated": ("transport={transport} world_size={world_size:int}",),
    "cleaned_up": ("removed={removed:int} paths={paths}",),
    "checkpoint_rejected": ("path={path} moved_to={moved_to} reason={reason}",),
    "rank_local_dropped": ("from_world_size={from_world_size:int} world_size={world_size:int}",),
    "resharded": ("step={step:int} from_world_size={from_world_size:int} world_size={world_size:int} "
                  "path={path} source_manifest_sha256={source_manifest_sha256}",),
}


@parse.with_pattern(r"[0-9]{1,18}")  # ASCII, bounded: int() refuses a log's 5000-digit "number"
def _whole(text: str) -> int:
    return int(text)


# For str.format the types go (they are parse's); a field name keeps its attribute path.
_FORMATS = {t: "".join(literal + (f"{{{name}}}" if name is not None else "")
                       for literal, name, _, _ in string.Formatter().parse(t))
            for templates in DETAIL.values() for t in templates}
_PARSERS = {t: parse.compile(t, extra_types={"int": _whole}, case_sensitive=True)
            for templates in DETAIL.values() for t in templates}


def format_detail(event: str, facts: Mapping[str, Any]) -> str:
    """The detail the machine logs for ``event``, from ``facts`` (which may hold more)."""
    *fuller, last = DETAIL[event]
    given = lambda t: all(facts.get(name.split(".")[0]) not in (None, "")
                          for _, name, _, _ in string.Formatter().parse(t) if name is not None)
    return _FORMATS[next((t for t in fuller if given(t)), last)].format_map(facts)


def parse_detail(event: str, detail: str) -> dict[str, Any] | None:
    """The facts a logged ``detail`` of ``event`` holds (``{"step": 4, "loss_milli": 241}``, a
    score as ``holdout.correct``...), or None for an unknown event or a detail not in its format."""
    for template in DETAIL.get(event, ()):
        found = _PARSERS[template].parse(detail)
        if found is not None:
            return dict(found.named)
    return None


def build(model: object) -> Machine:
    """Attach the machine to ``model``, which provides the guards and callbacks the table names.

    ``send_event=True``: every guard and callback receives the trigger's EventData, so trigger
    keyword arguments (``step=4``) reach them. Illegal triggers raise ``MachineError``.
    """
    return Machine(
        model=model,
        states=[MachineState(s, final=s in FINAL) for s in STATES],
        transitions=TRANSITIONS,
        initial=INITIAL,
        auto_transitions=False,
        send_event=True,
        after_state_change="announce",
    )
