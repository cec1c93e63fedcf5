"""A run's story in one picture: loss per checkpointed step across attempts, and the verdict.

Owns: collecting what the picture shows from a replayed log (``story``), and drawing it with
matplotlib on the Agg backend into PNG bytes (``draw``). Every event that is not a checkpoint
(a kill, a resume, a rejected checkpoint, a verdict, events added later) is marked where it
happened, so the plot needs no change when the table grows.

Must not: import matplotlib before it is asked to draw (it is the optional ``plot`` extra, and
``trainjob`` must run without it), write files, or choose exit codes.
"""

from __future__ import annotations

import io
from collections import Counter

import attrs

from ..engine.machine import parse_detail
from ..errors import InputError, UsageError, importing
from .history import RunPath, Step

STEP_FIELDS = ("step", "at_step", "from_step")
# How the usual events are marked; any other event gets the last style.
MARK = {"killed": ("X", "red"), "resumed": (">", "green"), "job_started": ("o", "gray"),
        "artifact_written": ("P", "green"),
        "completed": ("*", "green"), "drift_failed": ("*", "red"), "job_failed": ("s", "red")}
OTHER_MARK = ("D", "darkorange")


@attrs.frozen
class Marker:
    """A logged event that is not a checkpoint, placed at the step where it happened."""

    line: int
    event: str
    attempt: int | None
    step: int


@attrs.frozen
class GateVerdict:
    """The gate's answer for one attempt: holdout and baseline counts, and the allowed drop."""

    attempt: int | None
    event: str
    correct: int
    total: int
    bcorrect: int
    btotal: int
    max_drop: int | None  # logged only by drift_failed

    def threshold(self, max_drop: int | None) -> float | None:
        """The fewest holdout answers that pass: ``bcorrect * (100 - max_drop) / 100``."""
        drop = self.max_drop if self.max_drop is not None else max_drop
        return None if drop is None else self.bcorrect * (100 - drop) / 100


@attrs.define
class Story:
    losses: dict[int | None, list[tuple[int, int]]] = attrs.Factory(dict)  # attempt -> (step, loss_milli)
    markers: list[Marker] = attrs.Factory(list)
    verdicts: list[GateVerdict] = attrs.Factory(list)


def _number(run: RunPath, step: Step, fields: dict, key: str) -> int:
    value = fields.get(key)
    if value is None:
        raise InputError(f"{run.log}:{step.line}: {step.event} detail has no {key}=<number>: {step.detail!r}")
    return value


def story(run: RunPath) -> Story:
    """What the plot shows, read from a legal path. A log that starts mid-attempt has attempt None."""
    told, attempt, step = Story(), None, 0
    for s in run.steps:
        fields = parse_detail(s.event, s.detail) or {}
        if s.event == "job_started":
            attempt, step = _number(run, s, fields, "attempt"), 0
        step = next((fields[k] for k in STEP_FIELDS if k in fields), step)
        if s.event == "checkpointed":
            told.losses.setdefault(attempt, []).append((step, _number(run, s, fields, "loss_milli")))
            continue
        told.markers.append(Marker(s.line, s.event, attempt, step))
        if "holdout.correct" in fields:  # completed or drift_failed: the gate's verdict
            told.verdicts.append(GateVerdict(attempt, s.event, fields["holdout.correct"], fields["holdout.total"],
                                             fields["baseline.correct"], fields["baseline.total"],
                                             fields.get("max_drop")))
    return told


def _attempt_name(attempt: int | None) -> str:
    return f"attempt {attempt}" if attempt is not None else "attempt ?"


def draw(told: Story, title: str, max_drop: int | None = None) -> bytes:
    """The story as PNG bytes: losses and events on the left, the verdicts on the right."""
    try:
        with importing("matplotlib"):
            import matplotlib
    except ImportError:
        raise UsageError("plot needs matplotlib: pip install 'trainjob[plot]'") from None
    matplotlib.use("Agg")  # files only: no display, same pixels everywhere
    with importing("matplotlib"):
        from matplotlib import pyplot as plt

    fig, (losses, gate) = plt.subplots(1, 2, figsize=(11, 4.5), width_ratios=(3, 1), layout="constrained")
    fig.suptitle(title)
    _draw_losses(losses, told)
    _draw_verdicts(gate, told, max_drop)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out.getvalue()


def _draw_losses(ax, told: Story) -> None:  # noqa: ANN001 (a matplotlib Axes)
    for attempt, points in told.losses.items():
        steps, losses = zip(*points)
        ax.plot(steps, losses, marker="o", label=f"{_attempt_name(attempt)}: loss_milli")
    at_step: Counter[int] = Counter()
    for marker in told.markers:
        shape, color = MARK.get(marker.event, OTHER_MARK)
        ax.axvline(marker.step, color=color, alpha=0.35, linestyle=":")
        ax.plot([marker.step], [0], marker=shape, color=color, linestyle="none", clip_on=False)
        # Events at one step (killed at 4, resumed from 4) get side-by-side vertical captions.
        ax.annotate(f"{marker.event} ({_attempt_name(marker.attempt)})", (marker.step, 0),
                    xycoords=("data", "axes fraction"), rotation=90, fontsize=8, color=color,
                    xytext=(3 + 10 * at_step[marker.step], 8), textcoords="offset points")
        at_step[marker.step] += 1
    ax.set_xlabel("step")
    ax.set_ylabel("loss_milli at checkpoint")
    ax.set_ylim(bottom=0)
    if told.losses:
        ax.legend(loc="upper right", fontsize=8)


def _draw_verdicts(ax, told: Story, max_drop: int | None) -> None:  # noqa: ANN001
    ax.set_title("drift gate: holdout correct", fontsize=10)
    if not told.verdicts:
        ax.text(0.5, 0.5, "no verdict in this log", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for i, v in enumerate(told.verdicts):
        color = MARK.get(v.event, OTHER_MARK)[1]
        ax.bar(2 * i, v.correct, color=color, label="holdout" if i == 0 else None)
        ax.bar(2 * i + 0.8, v.bcorrect, color="lightgray", label="baseline" if i == 0 else None)
        threshold = v.threshold(max_drop)
        if threshold is None:
            ax.annotate("pass line unknown:\nmax drop not logged\n(see --max-drop)", (2 * i + 0.4, v.btotal),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 14), textcoords="offset points")
        else:
            ax.hlines(threshold, 2 * i - 0.5, 2 * i + 1.3, colors="black", linestyles="--",
                      label="pass line (max drop)" if i == 0 else None)
        ax.annotate(f"{v.correct}/{v.total}", (2 * i, v.correct), ha="center", va="bottom", fontsize=8)
    ax.set_xticks([2 * i + 0.4 for i in range(len(told.verdicts))],
                  [f"{_attempt_name(v.attempt)}\n{v.event}" for v in told.verdicts], fontsize=8)
    ax.set_ylim(0, max(v.btotal for v in told.verdicts) * 1.5)
    ax.legend(loc="upper left", fontsize=8)
