"""``trainjob prove``: kill a user's training command at random instants and say where its resume diverges.

One uninterrupted run (the reference), then N trials: each is stopped once, at an instant chosen in
one of four phases of the run (between checkpoints, during a checkpoint write, before the first
checkpoint, after ``completed``, in that order), and relaunched as a supervisor would (while the launch's
code, read by ``exits.job_exit``, says relaunch; at most ``MAX_LAUNCHES``). A trial is stopped as
schedulers stop jobs (``launches.Stop``): a KILL trial as a node dies (SIGKILL to every process);
the TERM trials in turn as Slurm preempts (SIGTERM to every process of the launch, the data
loader's workers included, twice, half a second apart) and as Kubernetes ends a pod's grace
(SIGTERM to the first process, then SIGKILL to every process after a grace drawn within the
reference's time between two checkpoints: it often lands while the stop is being saved).

A trial whose signal never landed (the run had ended first) tested nothing: it is drawn again at
an earlier instant, at most ``MAX_DRAWS`` times in all, then reported untested, and an untested
trial is never PROVEN. A trial passes when its signal landed and it ends with the reference's
code, publishes the reference's artifact bytes, leaves a PVC that ``trainjob verify`` accepts,
and every launch of it left a log that says its exit code (``launches.disagreement``). A launch
that crashed (70) is a verdict of its own, CRASHED, never taken for a command that differs from
itself. When a trial diverges, ``divergence`` reads both PVCs: the first step whose logged loss
differs, and the state that differs at the first checkpoint after the resume that both still hold,
from which ``hints`` names the piece that did not resume. Pure decisions (draws, verdicts, hints)
are apart from the launches.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from ..errors import InputError, UsageError, importing, one_line
from ..exits import EXIT_INTERNAL, EXIT_OK, EXIT_RELAUNCH, job_exit, rank_exit
from .divergence import describe, divergence
from .launches import (NODE_DIES, PREEMPTED, Stop, artifacts, disagreement, events, grace_ended, kill_launch, kill_when,
                       last_event, spawn)

PHASES = ("before the first checkpoint", "between checkpoints", "during a checkpoint write", "after completed")
# The order trials take them in: first where a resume from a checkpoint can go wrong, so that two
# trials already test one; a kill before any checkpoint only restarts the run.
ORDER = (PHASES[1], PHASES[2], PHASES[0], PHASES[3])
SIGNALS = {"KILL": ("KILL",), "TERM": ("TERM",), "both": ("KILL", "TERM")}
TERMS = ("preempted", "grace ended")  # how the TERM trials are stopped, in turn (module docstring)
GRACE = 120  # seconds a signalled launch gets to checkpoint and exit before it is killed whole
MAX_LAUNCHES = 20  # a trial that still says "relaunch" after this many launches is a loop, not a resume
MAX_DRAWS = 3  # instants drawn for one trial whose signal the run keeps outrunning, before it is reported untested
# A relaunch still running after this many times the reference's time (and at least GRACE) has hung
# (ranks waiting on one another in a collective whose default timeout is 30 minutes): it is killed
# whole and its trial fails, rather than prove waiting as long as the command would.
HUNG_AFTER = 10
STACKS_SECONDS = 3  # a hung launch's time to write its stacks (SIGABRT) before it is killed whole
PVC = "{pvc}"


@attrs.frozen
class Outcome:
    """One run of the command (several launches when killed): how it ended and what it left."""

    pvc: Path
    codes: tuple[int, ...]
    code: int  # the job's code: the last launch's, read by exits.job_exit
    seconds: float
    artifacts: dict[str, bytes] = attrs.field(repr=False)
    phase: str = ""
    signal: str = ""
    landed: str = ""  # the last logged event when the signal landed
    checkpoint_times: tuple[float, ...] = ()
    first_line: float = 0.0  # seconds until the log's first line: start-up (imports) before it
    delivered: bool = True  # the signal reached a launch that had not ended by itself
    draws: int = 1  # instants drawn until it was delivered (or MAX_DRAWS, when it never was)
    disagreements: tuple[str, ...] = ()  # launches whose exit code their log does not say
    hung: tuple[int, float] | None = None  # the launch that hung and the seconds it was given, if one did


@attrs.frozen
class Verdict:
    trial: int
    problems: tuple[str, ...]
    untested: bool = False  # its signal was never delivered: it neither passes nor fails

    @property
    def passed(self) -> bool:
        return not self.problems and not self.untested


# --- the command -------------------------------------------------------------------------------------

def check_command(cmd: Sequence[str], kills: int) -> None:
    """Bad usage, found before anything runs (exit 2)."""
    if kills < 1:
        raise UsageError(f"--kills must be at least 1, got {kills}")
    if not cmd:
        raise UsageError("no command: trainjob prove [options] -- CMD ... (with {pvc} where its PVC goes)")
    if not any(PVC in arg for arg in cmd):
        raise UsageError(f"{PVC} appears nowhere in the command: put it where the command takes its PVC directory")
    if shutil.which(cmd[0]) is None:
        raise UsageError(f"{cmd[0]}: command not found")


def for_pvc(cmd: Sequence[str], pvc: Path) -> list[str]:
    return [arg.replace(PVC, str(pvc)) for arg in cmd]


# --- draws and targets: when a trial's signal goes (pure but for the clock and the PVC it watches) ------

@attrs.frozen
class Draw:
    """An instant within a phase: the checkpoint counted from (``nth``) and a delay after the phase's
    start, in seconds; which of the two a phase reads is ``target``'s."""

    nth: int
    delay: float


def draw(phase: str, reference: Outcome, rng: random.Random, outran: Draw | None = None) -> Draw:
    """An instant for a trial in ``phase``, from the reference's pace. ``outran``: the instant the
    previous draw of this trial took, which the run outran (it ended before the signal): the new
    one is earlier (an earlier checkpoint, a shorter delay), never later. Pure but for ``rng``."""
    times = reference.checkpoint_times
    count = len(times)
    gap = (times[-1] - times[0]) / (count - 1) if count > 1 else reference.seconds / 2
    if outran is not None:
        return Draw(rng.randint(1, max(1, outran.nth - 1)), rng.uniform(0, outran.delay / 2))
    nth = rng.randint(1, max(1, count - 1))  # a checkpoint to resume from, not the last one
    if phase == PHASES[0]:  # a delay after the run's first log line (start-up is not the run)
        return Draw(nth, rng.uniform(0, max(0.0, (times[0] if times else reference.seconds) - reference.first_line)))
    if phase == PHASES[1]:  # a delay after the nth checkpoint, within the reference's gap between two
        return Draw(nth, rng.uniform(0, gap))
    return Draw(nth, 0.0)


def target(phase: str, at: Draw, pvc: Path) -> Callable[[], bool]:
    """A predicate that turns true at the instant ``at`` of ``phase`` in a trial, judged from the
    trial's own log, so a loaded machine does not shift the phase."""
    def checkpoints() -> int:
        return sum(e["event"] == "checkpointed" for e in events(pvc))

    def writing() -> bool:
        return any(p.name.startswith(".tmp-") for p in _listing(pvc / "checkpoints"))

    if phase == PHASES[0]:
        ready = _after(lambda: bool(events(pvc)), at.delay)
        return lambda: ready() or writing() or checkpoints() > 0  # at the latest, as the first one is written
    if phase == PHASES[1]:  # after the nth checkpoint, and before the next one commits
        ready = _after(lambda: checkpoints() >= at.nth, at.delay)
        return lambda: ready() or checkpoints() > at.nth
    if phase == PHASES[2]:
        return lambda: checkpoints() >= at.nth and writing()
    return lambda: last_event(pvc) == "completed"


def _after(started: Callable[[], bool], delay: float) -> Callable[[], bool]:
    """True from ``delay`` seconds after ``started()`` first held."""
    since: list[float] = []

    def ready() -> bool:
        if not since and started():
            since.append(time.monotonic())
        return bool(since) and time.monotonic() - since[0] >= delay
    return ready


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


# --- running -----------------------------------------------------------------------------------------

def _launch(cmd: list[str], pvc: Path, n: int) -> subprocess.Popen:
    """Start one launch, its stdout and stderr kept beside the PVC (the stdout's per-step loss
    lines, if it prints any, are read by ``divergence``; the stderr is named in the report)."""
    with open(pvc.parent / f"launch-{n:02d}.stdout", "w") as out, \
            open(pvc.parent / f"launch-{n:02d}.stderr", "w") as err:
        # faulthandler: a Python process that aborts (a hung launch's SIGABRT) writes every
        # thread's stack to its stderr first; it changes nothing else a run does.
        return spawn(cmd, stdout=out, stderr=err, env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def run_reference(cmd: Sequence[str], work: Path, name: str = "reference") -> Outcome:
    """The uninterrupted run, timing each checkpoint line as it appears (the trials' pace)."""
    pvc = work / name / "pvc"
    pvc.parent.mkdir(parents=True)
    started = time.monotonic()
    proc = _launch(for_pvc(cmd, pvc), pvc, 1)
    times: list[float] = []
    first_line = None
    while proc.poll() is None:
        logged = events(pvc)
        if first_line is None and logged:
            first_line = time.monotonic() - started
        seen = sum(e["event"] == "checkpointed" for e in logged)
        times += [time.monotonic() - started] * (seen - len(times))
        time.sleep(0.005)
    seen = sum(e["event"] == "checkpointed" for e in events(pvc))
    times += [time.monotonic() - started] * (seen - len(times))
    code = proc.returncode
    return Outcome(pvc, (code,), job_exit([code]), time.monotonic() - started, artifacts(pvc),
                   checkpoint_times=tuple(times), first_line=first_line or 0.0)


def stop_for(kind: str, reference: Outcome, rng: random.Random) -> Stop:
    """The ``Stop`` of a trial of ``kind`` (``plan``'s); a grace is drawn within the reference's
    time between two checkpoints."""
    if kind == "KILL":
        return NODE_DIES
    if kind == TERMS[0]:
        return PREEMPTED
    times = reference.checkpoint_times
    gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else reference.seconds / 2
    return grace_ended(rng.uniform(0, gap))


def run_trial(cmd: Sequence[str], work: Path, index: int, phase: str, kind: str, reference: Outcome,
              rng: random.Random, progress: Callable[[str], None] = lambda _: None) -> Outcome:
    """One trial: drawn again, earlier, while the run outruns its signal (at most ``MAX_DRAWS``
    runs, each on a PVC of its own); the last outcome, with how many draws it took."""
    at: Draw | None = None
    for n in range(1, MAX_DRAWS + 1):
        at = draw(phase, reference, rng, at)
        how = stop_for(kind, reference, rng)
        folder = work / (f"trial-{index:02d}" if n == 1 else f"trial-{index:02d}-draw-{n}")
        outcome = attrs.evolve(_signalled(cmd, folder / "pvc", phase, how, at, hung_after(reference)), draws=n)
        if outcome.delivered:
            return outcome
        progress(f"prove: trial {index}: the run ended before its signal landed; "
                 + (f"drawing an earlier instant ({n + 1} of {MAX_DRAWS})" if n < MAX_DRAWS else "untested"))
    return outcome


def hung_after(reference: Outcome) -> float:
    """Seconds a relaunch may run before it counts as hung (``HUNG_AFTER``)."""
    return max(float(GRACE), HUNG_AFTER * reference.seconds)


def _signalled(cmd: Sequence[str], pvc: Path, phase: str, how: Stop, at: Draw, limit: float) -> Outcome:
    """Stop the first launch at the instant ``at``, then relaunch while the job says relaunch; a
    relaunch still running after ``limit`` seconds is killed whole and the trial ends there."""
    pvc.parent.mkdir(parents=True)
    started = time.monotonic()
    ready = target(phase, at, pvc)
    proc = _launch(for_pvc(cmd, pvc), pvc, 1)
    delivered = kill_when(proc, ready, how)
    logged = events(pvc)
    landed = f"after {logged[-1]['event']} {logged[-1]['detail']}".strip() if logged else "before the first log line"
    writing = [m.group(1) for p in _listing(pvc / "checkpoints") if (m := re.match(r"\.tmp-step-0*(\d+)", p.name))]
    if not delivered:
        landed = "not delivered: the launch had ended before it"
    elif writing:
        landed += f", mid-write of step {writing[0]}"
    try:
        codes = [proc.wait(timeout=GRACE)]
    except subprocess.TimeoutExpired:  # a SIGTERM the command ignored: as the kubelet, kill it
        kill_launch(proc)
        codes = [proc.wait()]
    said = [f"launch 1 {problem}" for problem in [disagreement(codes[0], events(pvc))] if problem]
    code = job_exit(codes)
    hung = None
    while code == EXIT_RELAUNCH and len(codes) < MAX_LAUNCHES:
        if last_event(pvc) == "completed":
            code = EXIT_OK  # killed after completing: the job is done, nothing to relaunch
            break
        before = len(events(pvc))
        proc = _launch(for_pvc(cmd, pvc), pvc, len(codes) + 1)
        try:
            codes.append(proc.wait(timeout=limit))
        except subprocess.TimeoutExpired:
            kill_launch(proc, sig=signal.SIGABRT)  # each Python process's stacks, into the launch's stderr
            time.sleep(STACKS_SECONDS)
            kill_launch(proc)
            codes.append(proc.wait())
            hung = (len(codes), limit)
            code = codes[-1]
            break
        if problem := disagreement(codes[-1], events(pvc), before):
            said.append(f"launch {len(codes)} {problem}")
        code = job_exit(codes[-1:])
    return Outcome(pvc, tuple(codes), code, time.monotonic() - started, artifacts(pvc),
                   phase, how.name, landed, delivered=delivered, disagreements=tuple(said), hung=hung)


def judge(index: int, trial: Outcome, reference: Outcome, verify: Callable[[Path], str | None]) -> Verdict:
    """Whether the trial resumed to the reference; a trial whose signal never landed was an
    uninterrupted run, which says nothing of a resume: untested, whatever it published."""
    if not trial.delivered:
        return Verdict(index, (), untested=True)
    problems = []
    if trial.hung is not None:
        problems.append(f"launch {trial.hung[0]} hung: still running after {trial.hung[1]:.0f} s, killed")
    if trial.code != reference.code:
        problems.append(f"ended {trial.code} (launches {list(trial.codes)}), the reference {reference.code}")
    if trial.artifacts != reference.artifacts:
        if set(trial.artifacts) != set(reference.artifacts):
            problems.append(f"published {sorted(trial.artifacts) or 'nothing'}, the reference "
                            f"{sorted(reference.artifacts)}")
        else:
            problems.append("published other bytes than the reference")
    if (refused := verify(trial.pvc)) is not None:
        problems.append(f"trainjob verify refuses its PVC: {refused}")
    problems += [f"`trainjob status` disagrees: {said}" for said in trial.disagreements]
    return Verdict(index, tuple(problems))


def verify_problem(pvc: Path) -> str | None:
    """What ``trainjob verify`` would say is wrong with the PVC, or None when it accepts it."""
    with importing("trainjob verify"):
        from ..storage.pvc import Pvc
        from ..views.verify import verify_pvc
    try:
        report = verify_pvc(Pvc(pvc), pvc / "log.jsonl")
    except InputError as exc:
        return str(exc)
    if report.ok:
        return None
    bad = [i for i in report.items if i.verdict not in ("ok", "partial")] or report.items
    return f"{bad[0].path}: {bad[0].verdict} {bad[0].detail}" if bad else "not sound"


# --- the whole proof -----------------------------------------------------------------------------------

def plan(kills: int, signals: str) -> list[tuple[str, str]]:
    """Each trial's phase and how it is stopped: the phases in turn (``ORDER``), the signals
    alternating when both are asked for, the TERM trials stopped each way of ``TERMS`` in turn.
    The seed picks the instants within them."""
    kinds = SIGNALS[signals]
    trials = [(ORDER[i % len(ORDER)], kinds[i % len(kinds)]) for i in range(kills)]
    terms = iter(range(kills))
    return [(phase, TERMS[next(terms) % len(TERMS)] if kind == "TERM" else kind) for phase, kind in trials]


def prove(cmd: Sequence[str], kills: int, seed: int, signals: str, twice: bool,
          progress: Callable[[str], None]) -> tuple[int, list[str]]:
    """The exit code (0 proven, 1 a resume diverged or the command is not deterministic) and the report."""
    check_command(cmd, kills)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="trainjob-prove-"))
    progress("prove: reference run (uninterrupted)")
    reference = run_reference(cmd, work)
    if reference.code != EXIT_OK or not reference.artifacts:
        raise UsageError(f"the uninterrupted reference run exited {reference.code} and published "
                         f"{sorted(reference.artifacts) or 'nothing'}: prove needs a command that completes "
                         f"(its output: {reference.pvc.parent / 'launch-01.stderr'})")
    progress(f"prove: reference done in {reference.seconds:.1f} s, {len(reference.checkpoint_times)} checkpoints")
    if twice:
        progress("prove: second reference run (--twice)")
        again = run_reference(cmd, work, "reference-again")
        if again.artifacts != reference.artifacts or again.code != reference.code:
            lines = ["trainjob prove: NOT DETERMINISTIC: two uninterrupted runs of the command published different "
                     "bytes, so a resume cannot be judged; set the seeds and torch.use_deterministic_algorithms(True) "
                     "(docs/prove.md)", *describe(divergence(reference.pvc, again.pvc), "the first run"),
                     f"runs kept in {work}"]
            return 1, lines
    trials, verdicts = [], []
    for index, (phase, kind) in enumerate(plan(kills, signals), 1):
        trial = run_trial(cmd, work, index, phase, kind, reference, rng, progress)
        verdict = judge(index, trial, reference, verify_problem)
        trials.append(trial)
        verdicts.append(verdict)
        progress(f"prove: trial {index}/{kills} {trial.signal} {phase}: launches {list(trial.codes)}: "
                 + ("untested" if verdict.untested else "ok" if verdict.passed else "; ".join(verdict.problems)))
    lines = report(reference, trials, verdicts, work)
    if not proven(verdicts):
        return 1, lines
    shutil.rmtree(work, ignore_errors=True)  # kept only when there is something to look at
    return 0, lines


def proven(verdicts: Sequence[Verdict]) -> bool:
    """PROVEN: every trial counted had its signal delivered and resumed to the reference."""
    return bool(verdicts) and all(v.passed for v in verdicts)


def report(reference: Outcome, trials: list[Outcome], verdicts: list[Verdict], work: Path) -> list[str]:
    failed = [v for v in verdicts if v.problems]
    untested = [v for v in verdicts if v.untested]
    delivered = sum(t.delivered for t in trials)
    lines = [f"trainjob prove: {len(trials)} trials, {delivered} signals delivered, reference "
             f"{reference.seconds:.1f} s, {len(reference.checkpoint_times)} checkpoints",
             f"{'trial':<6}{'signal':<17}{'phase':<28}{'launches':<14}result"]
    for t, v in zip(trials, verdicts):
        lines.append(f"{v.trial:<6}{t.signal:<17}{t.phase:<28}{' '.join(map(str, t.codes)):<14}"
                     + ("UNTESTED" if v.untested else "same bytes, verified" if v.passed else "DIFFERS"))
        redrawn = f" (drawn {t.draws} times: the run outran the earlier instants)" if t.draws > 1 else ""
        lines.append(f"{'':<6}landed {t.landed}" + (redrawn if t.delivered else f", in each of {t.draws} draws"))
    if not failed and untested:
        which = ", ".join(str(v.trial) for v in untested)
        lines.append(f"verdict: UNPROVEN: the signal of trial {which} never landed (the run had ended each time, "
                     f"{MAX_DRAWS} draws, each earlier), so those trials tested no resume; a run of a few "
                     "seconds with a checkpoint at least every second gives the signals time to land")
        lines.append(f"runs kept in {work}")
        return lines
    if not failed:
        name, blob = next(iter(reference.artifacts.items()))
        lines.append(f"verdict: PROVEN: every trial resumed to the reference's {name} "
                     f"(sha256 {hashlib.sha256(blob).hexdigest()[:12]}...)")
        return lines
    if hanging := [(v, t) for v, t in zip(verdicts, trials) if t.hung is not None]:
        # A hang, like a crash, says nothing of how the command resumes.
        v, t = hanging[0]
        n, limit = t.hung  # type: ignore[misc]
        lines.append(f"verdict: HUNG: trial {v.trial}'s launch {n} was still running after {limit:.0f} s "
                     f"({HUNG_AFTER} times the reference's time, at least {GRACE} s) and was killed: ranks waiting "
                     "on one another, or a wait with no timeout, in the command or in trainjob")
        lines.append(f"runs kept in {work} ({t.pvc.parent.relative_to(work)}/launch-{n:02d}.stderr: all it "
                     "said, and each Python process's stacks when it was stopped)")
        return lines
    if crashed := [(v, t) for v, t in zip(verdicts, trials) if v.problems and crash(t) is not None]:
        # A crash says nothing of how the command resumes: neither a divergence nor a command
        # that differs from itself, whatever it published.
        v, t = crashed[0]
        n, said = crash(t)  # type: ignore[misc]
        lines.append(f"verdict: CRASHED: trial {v.trial}'s launch {n} exited 70, an internal error (a bug in the "
                     f"command or in trainjob), not a resume that went elsewhere: {said}")
        lines.append(f"runs kept in {work} ({t.pvc.parent.relative_to(work)}/launch-{n:02d}.stderr: all it said)")
        return lines
    first = failed[0]
    trial = trials[first.trial - 1]
    found = divergence(reference.pvc, trial.pvc)
    unresumed = [(v, t) for v, t in zip(verdicts, trials) if v.problems and len(t.codes) == 1]
    parted_early = len(trial.codes) == 2 and found.resumed_from is not None and (
        found.tensors_at_resume is False
        or (found.first_loss_step is not None and found.first_loss_step <= found.resumed_from))
    if unresumed or parted_early:
        # The runs parted before any resume: the command is not deterministic, and a hint about
        # what a resume loses would mislead.
        if unresumed:
            v, t = unresumed[0]
            why, trial, found = (f"trial {v.trial} was never resumed (its signal landed {t.landed}) and still "
                                 "published other bytes than the reference", t, divergence(reference.pvc, t.pvc))
        elif found.tensors_at_resume is False:
            why = (f"trial {first.trial}'s checkpoint at step {found.resumed_from}, written before its one "
                   "kill, already holds other tensors than the reference's")
        else:
            why = (f"trial {first.trial}'s loss at step {found.first_loss_step}, logged before its one kill (it "
                   f"resumed from step {found.resumed_from}), already differs from the reference's")
        lines.append(f"verdict: NOT DETERMINISTIC: {why}: two runs of the command part before any resume, so no "
                     "resume can be judged. Seed every generator before the model is built (torch.manual_seed, "
                     "transformers.set_seed, or the Trainer's model_init=) and set "
                     "torch.use_deterministic_algorithms(True); --twice checks this first (docs/prove.md)")
        lines += describe(attrs.evolve(found, hints=()))
    else:
        lines.append(f"verdict: DIVERGES: {len(failed)} of {len(trials)} trials; trial {first.trial}: "
                     + "; ".join(first.problems))
        lines += describe(found)
    lines.append(f"runs kept in {work} (reference/pvc, {trial.pvc.relative_to(work)}, each launch's output)")
    return lines


def crash(trial: Outcome) -> tuple[int, str] | None:
    """The first launch of ``trial`` that crashed (70: a bug, not a stop or a refusal), and the
    last line it wrote to stderr; None when none did."""
    n = next((i for i, code in enumerate(trial.codes, 1) if rank_exit(code) == EXIT_INTERNAL), None)
    if n is None:
        return None
    try:
        said = (trial.pvc.parent / f"launch-{n:02d}.stderr").read_text(errors="replace").strip().splitlines()
    except OSError:
        said = []
    return n, one_line(said[-1])[:300] if said else "it wrote nothing to stderr"
