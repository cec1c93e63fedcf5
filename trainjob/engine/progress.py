"""What a launch tells the person watching it, on stderr: its progress, and one line saying how it ended.

For people, never a record: none of it goes to the decision log, and it cannot change how a run
ends (a write that fails is dropped). Rank 0 of a launch says it (``Run``); the other ranks say
nothing, so a launch of W ranks reads as one.

- On a terminal: one line, rewritten in place as steps end (at most ten times a second): step/total,
  loss, steps/s, ETA.
- Off a terminal (a pod's log, CI, a Slurm output file): a line when the launch begins and one
  per checkpoint (its step and loss, the rate and ETA), so a log stays short and each line stands
  alone.
- Always: the final line, how the launch ended, told from the events it logged (``Narrated``):
  completed with the artifact and its SHA-256, drift_failed with the numbers, killed at step N
  with where a relaunch resumes, job_failed with the budget. A launch that ends on an error says
  the error instead, in its own one line (``Run``'s, or the command line's).

``progress=False`` (``trainjob run --quiet``; the HF and Lightning integrations, whose frameworks
draw their own bar) keeps the final line only.

Hand-written rather than tqdm's or rich's bar: the line is a few lines of code, neither library
writes the one-line-per-checkpoint log a pod or CI wants off a terminal, and the engine would pay
their import on every start (tqdm about 60 ms, rich about 250 ms here, against a run's 0.2 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from . import machine
from ..records import Event, Metric
from ..states import State
from ..storage.eventlog import EventLog


# The terminal line is redrawn at most this often (seconds), and at the last step: a loop of
# thousands of steps a second pays a clock reading per step, not a write to the terminal.
REDRAW = 0.1


def line(step: int, steps: int, loss_milli: int, done: int, elapsed: float) -> str:
    """The text for ``step`` of ``steps``, ``done`` steps having taken ``elapsed`` seconds here."""
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = f"{(steps - step) / rate:.0f}s" if rate > 0 else "?"
    return f"step {step}/{steps}  loss {loss_milli / 1000:.3f}  {rate:.2f} steps/s  ETA {eta}"


def metric_verdict(metric: Metric, max_drop: int) -> str:
    """How the final line states a metric's verdict: the two values and the bound the gate held
    the metric to (``decisions.metric_counts``' rule, as a person reads it)."""
    keep = (100 - max_drop) / 100
    if metric.higher_is_better:
        bound = f"at least {metric.baseline * keep:.6g} passes"
    else:
        bound = f"at most {metric.baseline / keep:.6g} passes" if keep > 0 else "any value passes"
    way = "higher" if metric.higher_is_better else "lower"
    return f"{metric} ({way} is better; {bound} with max_drop {max_drop}%)"


def final_line(state: str, facts: dict[str, dict[str, Any]], where: str, code: int, *, saved: int = 0,
               verdict: str | None = None) -> str:
    """The launch's last line: how it ended (``state``) and what to know next, from ``facts``, the
    parsed details of the events it logged by event name; ``where`` the job's directory (or s3://
    prefix), ``code`` its exit code, ``saved`` the newest step the attempt holds a checkpoint of
    (0: none), ``verdict`` the gate's numbers as a metric states them, in place of the Scores."""
    said = f"trainjob: {state} (exit {code})"
    if state == State.completed:
        artifact, gated = facts.get("artifact_written", {}), facts.get("completed", {})
        scores = verdict or (f"holdout {gated['holdout.correct']}/{gated['holdout.total']} vs baseline "
                             f"{gated['baseline.correct']}/{gated['baseline.total']}" if gated else "")
        published = f"published {where}/{artifact['path']}, sha256 {artifact['sha256']}" if artifact else ""
        return f"{said}: {'; '.join(part for part in (published, scores) if part)}"
    if state == State.drift_failed and (failed := facts.get("drift_failed")):
        total, allowed = failed["holdout.total"], failed["max_drop"]
        needed = -(-failed["baseline.correct"] * (100 - allowed) // 100)  # the rule's least count, rounded up
        scores = verdict or (f"holdout {failed['holdout.correct']}/{total} vs baseline {failed['baseline.correct']}/"
                             f"{failed['baseline.total']}, below the {allowed}% allowed drop (it needs {needed}/{total})")
        return f"{said}: {scores}; nothing published"
    if state == State.killed and (killed := facts.get("killed")):
        by = f" by {killed['signal']}" if killed.get("signal") else ""
        resume = (f"a relaunch resumes from step {saved}" if saved
                  else "no checkpoint yet: a relaunch starts the attempt over")
        return f"trainjob: killed at step {killed['at_step']}{by} (exit {code}): {resume}"
    if state == State.job_failed and (spent := facts.get("job_failed")):
        return (f"{said}: {spent['attempts']} attempts, the retry budget (backoff limit {spent['backoff_limit']}) "
                "is spent; no attempt will start on this job again")
    return said


class Narrator:
    """Rank 0's voice on ``stream``: the progress of ``steps`` steps (``progress``: on a terminal a
    line rewritten in place, else a line per checkpoint), then the final line."""

    def __init__(self, stream: TextIO | None, steps: int, where: str, *, progress: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.steps, self.where, self.clock = stream, steps, where, clock
        self.tty = progress and _is_terminal(stream)
        self.lines = progress and not self.tty  # a line per checkpoint
        self.details: dict[str, str] = {}  # the newest detail of each event logged, by name (parsed at the end)
        self.saved: tuple[str, str] | None = None  # the newest `checkpointed` or `resumed`: the step a relaunch resumes
        self.verdict: str | None = None  # the gate's numbers as a metric states them
        self.started = clock()
        self.first: int | None = None  # the step before this launch's first
        self.done = 0  # steps trained in this launch
        self.open = False  # a terminal line is being rewritten
        self.drawn = float("-inf")  # when it was last drawn
        self.undrawn: tuple[int, int] | None = None  # the newest step and loss, when not drawn yet

    def step(self, step: int, loss_milli: int) -> None:
        """After each step of this launch."""
        if self.first is None:  # a resumed launch's rate counts only the steps done in this launch
            self.first = step - 1
        self.done = step - self.first
        if not self.tty:
            return
        now = self.clock()
        if step < self.steps and now - self.drawn < REDRAW:
            self.undrawn = step, loss_milli
            return
        self._draw(step, loss_milli, now)

    def _draw(self, step: int, loss_milli: int, now: float) -> None:
        self.drawn, self.open, self.undrawn = now, step < self.steps, None
        self._write(f"\r{line(step, self.steps, loss_milli, self.done, now - self.started)}\x1b[K"
                    + ("" if self.open else "\n"))

    def told(self, event: str, detail: str) -> None:
        """After each event the launch logs: kept for the final line (read only then: a checkpoint
        costs a dictionary entry); off a terminal, a line for the launch's start and each checkpoint."""
        self.details[event] = detail
        if event in ("checkpointed", "resumed"):
            self.saved = event, detail
        if not self.lines:
            return
        facts = machine.parse_detail(event, detail) or {}
        if event == "job_started":
            self._write(f"trainjob: attempt {facts.get('attempt', '?')} started: {self.steps} steps\n")
        elif event == "resumed":
            self._write(f"trainjob: resumed from step {facts.get('from_step', '?')} of {self.steps}\n")
        elif event == "checkpointed" and "step" in facts:
            text = line(facts["step"], self.steps, facts["loss_milli"], self.done, self.clock() - self.started)
            self._write(f"trainjob: checkpointed {text}\n")

    def close(self) -> None:
        """End a line left open on the terminal, so that what is printed next starts on its own;
        it shows the newest step first."""
        if self.undrawn is not None:
            self._draw(*self.undrawn, self.clock())
        if self.open:
            self.open = False
            self._write("\n")

    def ending(self, state: str, code: int) -> None:
        """The final line: how the launch ended."""
        self.close()
        facts = {event: machine.parse_detail(event, detail) or {} for event, detail in self.details.items()}
        saved = (machine.parse_detail(*self.saved) if self.saved else None) or {}
        self._write(final_line(state, facts, self.where, code, saved=saved.get("step", saved.get("from_step", 0)),
                               verdict=self.verdict) + "\n")

    def _write(self, text: str) -> None:
        if self.stream is None:  # stderr closed (2>&-): Python's sys.stderr is None
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or failing stderr must never change how the run ends
            pass


class Narrated(EventLog):
    """The launch's decision log, telling each event to a ``Narrator`` once it is appended."""

    def __init__(self, path: Path, narrator: Narrator) -> None:
        super().__init__(path)
        self.narrator = narrator

    def append(self, event: str, detail: str, fsync: bool = True) -> Event:
        record = super().append(event, detail, fsync=fsync)
        self.narrator.told(event, detail)
        return record


def _is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
