"""The replay page: one self-contained HTML file that steps a person through a decision log.

Owns: turning a log's replay (``history.replay``) into frames, one per line up to the first
illegal one: the state the machine stands in, the edge just taken, the decision in plain words
with the facts the log gives for it, and what the PVC holds as far as the log tells; and putting
the frames, the machine's SVG and the page's style and script (``replay_page.html``) into one file
that opens from ``file://`` with no network.

Must not: decide which edge a line belongs to or whether it is legal (``history`` does, from the
table; this module only words its answer), need Graphviz when the page is opened (the SVG is drawn
when the page is built, and inlined), let log text reach the page as markup (the frames travel as
JSON with ``<``, ``>``, ``&`` and the line separators escaped, and the script inserts them with
``textContent`` only), touch the PVC, or choose exit codes.
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from ..engine.decisions import ATTEMPT_ENDED
from ..engine.machine import INITIAL, OUT_OF_BAND, parse_detail
from ..errors import InputError, os_errors
from ..records import converter
from .diagram import guard_label
from .history import Aside, RunPath, Step, table_edges

# A line longer than this is shown cut, saying how much was left out: a page must stay a page.
SHOWN_CHARS = 2000
# What JSON may hold that an HTML parser must not see inside a <script> element. (json.dumps writes
# ASCII, so U+2028/2029, which old script parsers took for line ends, arrive escaped already.)
_UNSAFE_IN_SCRIPT = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}


def _clip(text: str) -> str:
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]} … ({len(text) - SHOWN_CHARS} more characters not shown)"


@attrs.frozen
class Frame:
    """One line of the log as the page shows it."""

    line: int
    kind: str  # step | aside | skipped | illegal
    event: str  # the event's name ("" for a line that is not an event)
    raw: str = attrs.field(converter=_clip)  # the line as the log holds it
    state: str | None  # the state the machine stands in after this line (None: not told yet)
    edge: tuple[str, str] | None  # the transition this line belongs to
    completes: bool  # the transition's own event (it counts as taken), not a note or announcement
    headline: str = attrs.field(converter=_clip)
    why: tuple[str, ...] = attrs.field(converter=lambda texts: tuple(map(_clip, texts)))
    # What the PVC holds after this line, as far as the log tells: (what, its value).
    pvc: tuple[tuple[str, str], ...] = attrs.field(converter=lambda rows: tuple((k, _clip(v)) for k, v in rows))


@attrs.frozen
class LossPoint:
    """A checkpoint's loss, and the line that logged it (the page draws those up to the current line)."""

    line: int
    step: int
    loss_milli: int
    attempt: int | None


@attrs.define
class _Told:
    """What the log has told so far about the run and its PVC."""

    state: str | None = None
    attempt: int | None = None
    last: Step | None = None  # the run's last step
    checkpoint: tuple[int, int, int | None] | None = None  # step, loss_milli, attempt
    rejected: list[str] = attrs.Factory(list)
    resharded: list[str] = attrs.Factory(list)
    artifacts: list[tuple[str, str]] = attrs.Factory(list)
    points: list[LossPoint] = attrs.Factory(list)

    def holds(self) -> tuple[tuple[str, str], ...]:
        step_loss = self.checkpoint and (f"step {self.checkpoint[0]}, loss_milli {self.checkpoint[1]} "
                                         f"(attempt {_number_or_unknown(self.checkpoint[2])})")
        return (("machine state", self.state or "not told yet"),
                ("attempts counter", _number_or_unknown(self.attempt, "not told yet")),
                ("newest checkpoint", step_loss or "none logged yet"),
                *(("set aside", text) for text in self.rejected),
                *(("resharded copy", text) for text in self.resharded),
                *(("artifact", f"{path}\nsha256 {sha}") for path, sha in self.artifacts))


def _number_or_unknown(value: int | None, unknown: str = "?") -> str:
    return unknown if value is None else str(value)


Facts = dict[str, Any]


def _facts(step: Step) -> Facts:
    """What the step's detail says, as machine.DETAIL reads it; nothing for a detail in no known
    format (a hand-edited log): the page then says "?" where a fact would go."""
    return parse_detail(step.event, step.detail) or {}


def _edge_label(source: str, dest: str) -> str:
    return next(guard_label(row) for s, row in table_edges() if (s, row["dest"]) == (source, dest))


def _why_start(step: Step, fields: Facts, told: _Told) -> list[str]:
    last = told.last
    if step.dest == "started":
        attempt = fields.get("attempt")
        ended = ("no earlier attempt is in the log" if last is None else
                 f"the last attempt ended in {last.dest} (line {last.line})" if last.dest in ATTEMPT_ENDED else
                 f"the log's last line ({last.event}, line {last.line}) ends no attempt: the PVC was further "
                 "ahead than its log (a process persisted a state and died before logging it)")
        budget = (f"attempts so far {attempt - 1} <= backoff limit" if attempt else "attempts <= backoff limit")
        return [f"No attempt in flight: {ended}.",
                f"Within the retry budget: {budget} (the limit itself is not logged), so attempt "
                f"{_number_or_unknown(attempt)} begins at step 0 of {fields.get('steps', '?')}.",
                f"The PVC's attempts counter is now {_number_or_unknown(attempt)}."]
    if step.dest == "resumed":
        from_step = fields.get("from_step")
        if last is not None and last.dest == "killed":
            killed = _facts(last)
            by = f" by {killed['signal']}" if "signal" in killed else ""
            cut = f"the last process was killed{by} at step {killed.get('at_step', '?')} (line {last.line})"
        elif last is None:
            cut = "the log begins here, with an attempt the PVC says was cut short"
        elif last.dest in ATTEMPT_ENDED:
            cut = (f"the last logged attempt ended ({last.dest}, line {last.line}), but the PVC already held a "
                   "fresh attempt whose job_started was never logged (that process died in between)")
        else:
            cut = (f"the last process logged {last.event} (line {last.line}) and then stopped without a word "
                   "(a SIGKILL, a crash, a lost node)")
        where = (f"from the step-{from_step} checkpoint" if from_step else "from step 0 (no checkpoint had committed)")
        return [f"Attempt in flight: {cut}, so the attempt keeps its number "
                f"({_number_or_unknown(told.attempt)}) and training continues {where}."]
    if step.dest == "job_failed":
        attempts, limit = fields.get("attempts", "?"), fields.get("backoff_limit", "?")
        ended = f"the last attempt ended in {last.dest} (line {last.line})" if last else "no attempt in flight"
        return [f"No attempt in flight ({ended}), and attempts {attempts} > backoff limit {limit}: job_failed.",
                "The retry budget is spent: nothing trains, exit 1, and every later start says the same."]
    if step.dest == "completed":
        return ["Completed on disk, not in the log: the last process committed the completion and died before "
                "announcing it, so this process only announces it.", *_why_published(step, fields)]
    return []


def _why_published(step: Step, fields: Facts) -> list[str]:
    if step.event != "artifact_written":
        return []
    return [f"The model is published: {fields.get('path', '?')}, SHA-256 {fields.get('sha256', '?')} (the hash of "
            "the very bytes written), logged inside the move to completed, before completed itself."]


def _why(step: Step, told: _Told) -> list[str]:
    """The decision at ``step`` in plain words, from the facts the log gave before it."""
    fields = _facts(step)
    if step.event == "cleaned_up":
        return [f"Before its first move ({step.source} → {step.dest}), the process removed "
                f"{fields.get('removed', '?')} leftover(s) of killed writers: {fields.get('paths', '?')}."]
    if step.event == "ranks_coordinated":
        how = {"store": "the launcher's rendezvous store (torchrun's): the PVC holds only their data",
               "files": "files on the PVC (ranks started by trainjob's local launcher)"}
        return [f"This launch has {fields.get('world_size', '?')} ranks; they join, agree on stops, hand in "
                f"their receipts and learn the outcome through {how.get(fields.get('transport'), '?')}."]
    if step.event == "checkpoint_rejected":
        return [f"The checkpoint {fields.get('path', '?')} failed verification ({fields.get('reason', '?')}) and "
                f"was moved aside to {fields.get('moved_to', '?')}: the resume falls back to the newest "
                "checkpoint that verifies."]
    if step.event == "resharded":
        return [f"trainjob reshard, a process of its own, wrote a verified copy of the step-{fields.get('step', '?')} "
                f"checkpoint for {fields.get('world_size', '?')} rank(s) (it was written by "
                f"{fields.get('from_world_size', '?')}), at {fields.get('path', '?')}.",
                f"The run's own state stays {told.state or 'as it was'}: the next start goes on as if this line "
                "were not there."]
    if step.source == INITIAL:
        return _why_start(step, fields, told)
    if step.dest == "checkpointed":
        at, loss = fields.get("step", "?"), fields.get("loss_milli", "?")
        before = told.checkpoint
        was = f" (was {before[1]} at step {before[0]})" if before and before[2] == told.attempt else ""
        return [f"The checkpoint guard held after step {at}: a multiple of --ckpt-every, the last step, or the "
                "last step before a SIGTERM.",
                f"Shards, manifest and pointer committed before this line: loss_milli {loss}{was}."]
    if step.dest == "killed":
        signal = fields.get("signal")
        why = f"because a {signal} asked it to" if signal else "(--die-at, or a signal)"
        return [f"The process stopped after step {fields.get('at_step', '?')} {why}: exit 75.",
                "killed ends this process, not the attempt: the next start finds the attempt in flight and "
                "resumes it."]
    if step.event == "artifact_written":
        return ["The drift gate passed.", *_why_published(step, fields)]
    if "holdout.correct" not in fields:
        return []
    correct, total, bcorrect, btotal = (fields[f"{who}.{n}"] for who in ("holdout", "baseline")
                                        for n in ("correct", "total"))
    if step.dest == "completed":
        return [f"The drift gate held: holdout {correct}/{total} against baseline {bcorrect}/{btotal} is within "
                "the allowed drop (--max-drop, not in this line).",
                "The job is done: exit 0, and a relaunch starts nothing."]
    max_drop = fields["max_drop"]
    return [f"The drift gate said no: {correct}*100 = {correct * 100} < {bcorrect}*(100-{max_drop}) = "
            f"{bcorrect * (100 - max_drop)}: the holdout fell more than {max_drop}% below the baseline.",
            "No artifact, exit 1. The attempt has ended: the next start begins a fresh attempt while the retry "
            "budget allows, else logs job_failed."]


def _learn(step: Step, told: _Told) -> None:
    """What the PVC holds once ``step`` is logged."""
    fields = _facts(step)
    if step.event == "job_started":
        told.attempt = fields.get("attempt")
    elif step.event == "job_failed":
        told.attempt = fields.get("attempts")
    elif step.event == "checkpointed" and fields:
        told.checkpoint = (fields["step"], fields["loss_milli"], told.attempt)
        told.points.append(LossPoint(step.line, fields["step"], fields["loss_milli"], told.attempt))
    elif step.event == "checkpoint_rejected":
        told.rejected.append(f"{fields.get('path', '?')} -> {fields.get('moved_to', '?')}")
    elif step.event == "resharded":
        told.resharded.append(f"step {fields.get('step', '?')} for {fields.get('world_size', '?')} rank(s): "
                              f"{fields.get('path', '?')}")
    elif step.event == "artifact_written":
        told.artifacts.append((fields.get("path", "?"), fields.get("sha256", "?")))
    if step.completes and step.dest not in OUT_OF_BAND:
        told.state, told.last = step.dest, step


def frames(run: RunPath, raw: dict[int, str]) -> tuple[list[Frame], list[LossPoint]]:
    """One frame per line of ``run`` (``raw``: each line's text by number), and the loss points."""
    told, shown, out = _Told(), None, []
    for entry in sorted([*run.steps, *run.asides, *run.skipped], key=lambda e: e.line):
        text = raw.get(entry.line, "")
        if isinstance(entry, Step):
            why = _why(entry, told)
            _learn(entry, told)
            shown = entry.dest
            headline = f"{entry.event}: {entry.source} → {entry.dest}, by {_edge_label(entry.source, entry.dest)}"
            out.append(Frame(entry.line, "step", entry.event, text, shown, (entry.source, entry.dest),
                             entry.completes, headline, why, told.holds()))
            continue
        stays = f"the state stays {shown or 'as it was'}"
        if isinstance(entry, Aside):
            kind, event, headline = "aside", entry.event, f"{entry.event}, from {entry.source}"
            why = [f"Written by trainjob {entry.source}, not by the machine: no step, and {stays}."]
        else:
            kind, event, headline = "skipped", "", "skipped: not an event"
            why = [f"{entry.problem}.", f"Skipped, as status does: a line torn by a crash (or edited by hand) is "
                                        f"no step, and {stays}."]
        out.append(Frame(entry.line, kind, event, text, shown, None, False, headline, why, told.holds()))
    if (bad := run.illegal) is not None:
        why = [f"No run of this engine could have logged this line: {bad}.",
               "The replay stops here; status --path exits 1 on this log."]
        out.append(Frame(bad.line, "illegal", bad.event, raw.get(bad.line, ""), shown, None, False,
                         f"illegal: {bad.event}", why, told.holds()))
    return out, told.points


def raw_lines(log: Path, upto: int) -> dict[int, str]:
    """The log's lines 1..``upto`` as text, by number (numbered as ``eventlog.read_log`` does)."""
    shown = {}
    with os_errors(log, "cannot read log", InputError), open(log, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if number > upto:
                break
            if raw.strip():
                shown[number] = raw.rstrip(b"\r\n").decode("utf-8", "replace")
    return shown


def script_json(data: Any) -> str:
    """JSON that an HTML parser cannot end early (no ``</script>``, no ``<!--``): ASCII only, with
    ``<``, ``>`` and ``&`` as JSON escapes. ASCII also keeps a lone surrogate from a hostile log escaped."""
    text = json.dumps(data, separators=(",", ":"))
    return re.sub("[<>&]", lambda m: _UNSAFE_IN_SCRIPT[m[0]], text)


def inline_svg(svg: bytes) -> str:
    """Graphviz's SVG as an element of the page: no XML prolog, sized by the page, not in points."""
    text = svg.decode()
    text = text[text.index("<svg"):]
    return re.sub(r'<svg width="[^"]*" height="[^"]*"', '<svg id="machine" role="img" aria-label="the state machine"',
                  text, count=1)


def _template() -> str:
    return resources.files(__package__).joinpath("replay_page.html").read_text(encoding="utf-8")


def build(run: RunPath, machine_svg: bytes) -> bytes:
    """The page for ``run`` (its log is read again for the lines' text), drawn on ``machine_svg``."""
    last = max(e.line for e in [*run.steps, *run.asides, *run.skipped, *filter(None, [run.illegal])])
    shown, points = frames(run, raw_lines(run.log, last))
    data = {"log": run.log.name, "frames": converter.unstructure(shown), "points": converter.unstructure(points)}
    parts = {"TITLE": html.escape(f"trainjob replay: {run.log.name}"), "SVG": inline_svg(machine_svg),
             "DATA": script_json(data)}
    return re.sub(r"@@(\w+)@@", lambda m: parts[m[1]], _template()).encode("utf-8", "replace")

