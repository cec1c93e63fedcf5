"""The path a decision log records through the state machine, and whether it is a legal one.

Owns: replaying a log's events against ``machine.TRANSITIONS`` (which transition each event
belongs to, how often each edge was taken, where the run stands) and naming the first step no
run of this engine could have logged. Must not: keep a list of legal pairs of its own (every
rule below is derived from the table, with the start guards asked of ``decisions``), touch the
PVC, or choose exit codes (``cli.py`` does).

The rule
--------
A log holds the events of one or more processes. Each process begins in ``pending``, so its
first event is an *entry*: the event of a state the table reaches from ``pending``. Within a
process, an event is legal when the table has a transition from the state the previous event
announced to the event's state. An event announced *within* a transition
(``machine.ANNOUNCED_WITHIN``: ``artifact_written`` inside every move to ``completed``) stands
for that transition: the transition's own event is legal only right after it. A process's first
transition may also log optional notes before anything else (``machine.NOTED_WITHIN``:
``cleaned_up``, then ``checkpoint_rejected``, each any number of times); a note stands for every
transition it may belong to until the next event tells them apart.

A process that leaves the run's persisted state as it was (``machine.OUT_OF_BAND``: ``trainjob
reshard``) may run between any two processes: its events are steps of their own, after which the
log stands where it stood before them.

A new process may begin after any event: a SIGKILL ends a process anywhere without a word in the
log. Which entry it logs depends on what the PVC holds, and the engine persists a state *before*
announcing it, so the PVC may be ahead of the log:

- the last process may have persisted one more transition and died before announcing it (after
  ``checkpointed`` the PVC may already say ``drift_failed`` or ``completed``);
- each later process may have reached its own entry state and died before announcing it
  (after ``drift_failed`` the PVC may say ``started``, so the next process resumes).

From each state the PVC may hold, the entry is picked as ``transitions`` picks it: the first row
from ``pending`` whose guards pass. The guards ``should_resume`` and ``completion_unannounced``
are asked of their pure decisions (with the log's last event); ``within_backoff`` depends on
counts and flags no log line holds, so it may go either way. And ``job.Job`` starts no process
at all once the PVC says ``completed`` and the log's last event says so too. For today's table:

    after                       a new process may log
    started, killed             resumed
    resumed, checkpointed       resumed, job_started, job_failed; artifact_written (announcing a
                                completion its predecessor committed but never logged)
    snapshotted                 resumed (a background write in flight is never a completion)
    drift_failed, job_failed    job_started, job_failed; resumed (a job_started never logged)
    artifact_written            artifact_written (completed, if the same process goes on)
    completed                   nothing

The first event of a log may be any entry: the log can be younger than the PVC it describes.
Lines that are not events (torn by a crash) are reported as skipped and never break the path.
Lines another writer marked with its ``source`` (``trainjob supervise``) are not the machine's:
they are shown beside the path and take no part in it.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from ..engine import decisions
from ..errors import InputError
from ..storage.eventlog import SHOW_SKIPPED, cut, read_log
from ..states import State
from ..engine.machine import ANNOUNCED_WITHIN, EVENT_FOR_STATE, INITIAL, NOTED_WITHIN, OUT_OF_BAND, TRANSITIONS

# What the start guards answer for a PVC holding state ``p`` while the log's last event is or is
# not ``completed``, asked of the pure decisions the guards call. A start guard missing here
# (within_backoff: counts and flags no log line holds) may go either way.
START_GUARDS: dict[str, Callable[[str, bool], bool]] = {
    # With a run record, the checkpoint does not matter: "was the last attempt cut short?"
    "should_resume": lambda p, _log_says_completed: decisions.should_resume(p, None, 0),
    "completion_unannounced": decisions.completion_unannounced,
}


def _refused(persisted: str, log_says_completed: bool) -> bool:
    """``job.Job`` starts no process (AlreadyCompleted) once the log announced the completion."""
    return persisted == State.completed and log_says_completed


Edge = tuple[str, str]


def _names(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def guards(row: dict[str, Any]) -> tuple[list[str], list[str]]:
    """A row's guards: those that must hold (``conditions``) and those that must not (``unless``)."""
    return _names(row.get("conditions")), _names(row.get("unless"))


def table_edges() -> Iterator[tuple[str, dict[str, Any]]]:
    """Each row of the table once per source state, in table order."""
    for row in TRANSITIONS:
        for source in _names(row["source"]):
            yield source, row


def _successors(state: str) -> list[str]:
    return list(dict.fromkeys(row["dest"] for source, row in table_edges() if source == state))


def _row_passes(row: dict[str, Any], persisted: str, log_says_completed: bool) -> bool | None:
    """Do the row's guards pass? None when the log cannot tell."""
    def holds(guard: str) -> bool | None:
        read = START_GUARDS.get(guard)
        return None if read is None else read(persisted, log_says_completed)

    must, must_not = guards(row)
    answers = [holds(g) for g in must] + [None if holds(g) is None else not holds(g) for g in must_not]
    if False in answers:
        return False
    return None if None in answers else True


def _entries_from(persisted: str, log_says_completed: bool) -> list[str]:
    """The entry states a new process may reach from ``persisted``.

    Like ``transitions``, try the rows from ``pending`` in table order; the first that surely
    passes ends the search, and each one that may pass is a possibility.
    """
    if _refused(persisted, log_says_completed):
        return []
    entries = []
    for source, row in table_edges():
        if row["dest"] in OUT_OF_BAND:
            continue  # not a way for the run to begin: see _candidates
        passes = _row_passes(row, persisted, log_says_completed) if source == INITIAL else False
        if passes is not False:
            entries.append(row["dest"])
        if passes:
            break
    return entries


def _entries_after(persisted: Iterable[str] | None, log_says_completed: bool) -> list[str]:
    """Entries a new process may log; ``persisted`` None means the PVC is unknown.

    Follows processes that reached an entry state and died before announcing it.
    """
    entries = [dest for dest in _successors(INITIAL) if dest not in OUT_OF_BAND]
    if persisted is None:
        return entries
    seen, todo, reachable = set(persisted), list(persisted), set()
    while todo:
        for entry in _entries_from(todo.pop(), log_says_completed):
            reachable.add(entry)
            if entry not in seen:
                seen.add(entry)
                todo.append(entry)
    return [entry for entry in entries if entry in reachable]


@attrs.frozen
class Step:
    """One logged event and the transition it belongs to."""

    line: int
    source: str
    dest: str
    event: str
    detail: str

    @property
    def completes(self) -> bool:
        """True for the transition's own event, False for an announcement made within it."""
        return self.event == EVENT_FOR_STATE[self.dest]

    def __str__(self) -> str:
        move = f"{self.source} -> {self.dest}"
        return f"line {self.line:>3}  {move:<28}  {self.event} | {self.detail}"


@attrs.frozen
class IllegalStep:
    """The first event that no run of this engine could have logged where it stands."""

    line: int
    after: str | None  # the state (or half-announced move) the log stood in; None at its start
    event: str
    expected: tuple[str, ...]

    def __str__(self) -> str:
        where = f"from {self.after}" if self.after else "at the start of the log"
        allowed = f"expected one of: {', '.join(self.expected)}" if self.expected else "nothing may follow it"
        return f"line {self.line}: illegal step {where}: {self.event} ({allowed})"


@attrs.frozen
class Aside:
    """A line another writer (its ``source``) put in the log: shown, but no step of the machine."""

    line: int
    source: str
    event: str
    detail: str

    def __str__(self) -> str:
        return f"line {self.line:>3}  ({self.source})  {self.event} | {self.detail}"


@functools.cache
def _candidates(at: str | None, within: tuple[Edge, ...] | None, last_event: str | None) -> tuple[Edge, ...]:
    """Transitions the next event may belong to: the same process's first, then a new one's,
    then an out-of-band process's (never once the log announced the completion)."""
    if within is not None:  # an out-of-band process persists nothing of the run's
        same, persisted = list(within), [edge[1] for edge in within if edge[1] not in OUT_OF_BAND] or None
    elif at is None:
        same, persisted = [], None
    else:
        same = [(at, dest) for dest in _successors(at)]
        persisted = [at, *_successors(at)]
    log_says_completed = last_event == EVENT_FOR_STATE[State.completed]
    entries = _entries_after(persisted, log_says_completed)
    aside = [] if log_says_completed else [dest for dest in _successors(INITIAL) if dest in OUT_OF_BAND]
    return tuple(dict.fromkeys([*same, *((INITIAL, entry) for entry in [*entries, *aside])]))


def _events_for(edge: Edge, within: tuple[Edge, ...] | None, last_event: str | None) -> list[str]:
    """Events that may be logged next for ``edge``: optional notes (a process's first transition
    only), then the required announcement made within it, then its own event."""
    own = [EVENT_FOR_STATE[edge[1]]]
    required = [event for event, dest in ANNOUNCED_WITHIN.items() if dest == edge[1]]
    notes = [event for event, dests in NOTED_WITHIN.items() if edge[0] == INITIAL and edge[1] in dests]
    if within is not None and edge in within:  # part of this transition is logged already
        if last_event in required:
            return own
        notes = notes[notes.index(last_event):] if last_event in notes else []
    return notes + (required or own)


@attrs.define
class _Cursor:
    """Where the log stands: the last state announced, or the transitions (one, or several a
    note may belong to) announced only within so far."""

    at: str | None = None
    within: tuple[Edge, ...] | None = None
    last_event: str | None = None
    before: tuple[str | None, tuple[Edge, ...] | None, str | None] | None = None  # before this transition

    def where(self) -> str | None:
        return " | ".join(" -> ".join(edge) for edge in self.within) if self.within else self.at

    def _candidates(self) -> tuple[Edge, ...]:
        return _candidates(self.at, self.within, self.last_event)

    def expected(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e for edge in self._candidates()
                                   for e in _events_for(edge, self.within, self.last_event)))

    def advance(self, line: int, event: str, detail: str) -> Step | None:
        matches = [edge for edge in self._candidates() if event in _events_for(edge, self.within, self.last_event)]
        if not matches:
            return None
        step = Step(line, *matches[0], event, detail)
        if self.before is None:
            self.before = (self.at, self.within, self.last_event)
        if not step.completes:  # a note may belong to any of them; an announcement, to the first
            self.within, self.last_event = tuple(matches if event in NOTED_WITHIN else matches[:1]), event
        elif step.dest in OUT_OF_BAND:  # the run's persisted state is as it was before
            (self.at, self.within, self.last_event), self.before = self.before, None
        else:
            self.at, self.within, self.last_event, self.before = step.dest, None, event, None
        return step


@attrs.frozen
class Skipped:
    """A line that is not an event (torn by a crash, edited by hand): reported, never a step."""

    line: int
    problem: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.problem}"


@attrs.define
class RunPath:
    """A log's path: its steps, the lines that were not events, and the first illegal step."""

    log: Path
    steps: list[Step] = attrs.Factory(list)
    asides: list[Aside] = attrs.Factory(list)
    skipped: list[Skipped] = attrs.Factory(list)  # the first SHOW_SKIPPED; the rest are counted
    more_skipped: int = 0
    illegal: IllegalStep | None = None

    def lines(self) -> list[str]:
        """The path and the asides, in log order."""
        return [str(entry) for entry in sorted([*self.steps, *self.asides], key=lambda entry: entry.line)]

    def taken(self) -> Counter[Edge]:
        """How many times the run took each edge (announcements within a move do not count)."""
        return Counter((s.source, s.dest) for s in self.steps if s.completes)

    def visited(self) -> set[str]:
        return {state for edge in self.taken() for state in edge}

    @property
    def last_state(self) -> str | None:
        return next((s.dest for s in reversed(self.steps) if s.completes), None)

    @property
    def last_event(self) -> str | None:
        return self.steps[-1].event if self.steps else None


def _settle_notes(steps: list[Step], dest: str) -> None:
    """A note stands for every transition it may belong to until the next event of its process
    tells them apart; once one has, the notes just before it name that transition."""
    at = len(steps)
    while at and steps[at - 1].source == INITIAL and steps[at - 1].event in NOTED_WITHIN:
        at -= 1
        steps[at] = attrs.evolve(steps[at], dest=dest)


def replay(log: Path) -> RunPath:
    """Replay ``log`` against the table, stopping at the first illegal step."""
    found, cursor = RunPath(log), _Cursor()
    for line in read_log(log):
        if line.event is None:
            if len(found.skipped) < SHOW_SKIPPED:  # flat memory for a log of a million garbage lines
                found.skipped.append(Skipped(line.number, cut(line.problem)))
            else:
                found.more_skipped += 1
            continue
        if line.event.source is not None:
            found.asides.append(Aside(line.number, line.event.source, line.event.event, line.event.detail))
            continue
        step = cursor.advance(line.number, line.event.event, line.event.detail)
        if step is None:
            found.illegal = IllegalStep(line.number, cursor.where(), line.event.event, cursor.expected())
            return found
        if step.source == INITIAL and step.event not in NOTED_WITHIN:
            _settle_notes(found.steps, step.dest)
        found.steps.append(step)
    if not found.steps:
        raise InputError(f"{log}: holds no events from trainjob run")
    return found


def legal_path(log: Path) -> RunPath:
    """The path ``log`` records, or InputError naming its first illegal step."""
    found = replay(log)
    if found.illegal is not None:
        raise InputError(f"{log} {found.illegal}")
    return found
