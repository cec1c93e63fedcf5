"""Scheduler stops on the examples the issues were accepted on, with worker processes on every data
loader: ``examples/vision.py`` (its loader), ``examples/hf_trainer.py`` (the train loader, and an
evaluation every four steps over a loader of its own) and ``examples/lightning_trainer.py`` (its
train and validation loaders), each with two workers a loader.

Each trial stops a launch the way a scheduler does (``launches.Stop``), alternately: SIGTERM to
every process of it, the loaders' workers included, twice, half a second apart (Slurm's
preemption), and SIGTERM to the script then SIGKILL to every process after a grace drawn within a
checkpoint's interval (the end of Kubernetes's grace period). The launch must end 75 with
``killed`` logged (or -9 once the grace ended first), never 70 (a worker that died of the signal
surfaced as a crash); relaunched until done, it must publish the uninterrupted run's bytes, and
`verify` must accept its PVC. Each example is a variant written beside the campaign's PVCs
(workers, an evaluation), the example itself untouched. An example whose framework is not
installed is skipped, with a note.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from trainjob.deploy.launches import PREEMPTED, artifact, events, grace_ended, kill_when, last_event

from .harness import ROOT, Campaign, Launch, Section, trainjob

LOADERS = 2  # worker processes on every loader
# Each example: the modules it needs, its text replacements (each must match once), its flags.
EXAMPLES: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...], tuple[str, ...]]] = {
    "vision": (("torch", "torchdata"), (), ("--workers", str(LOADERS))),
    "hf_trainer": (("torch", "transformers"), (
        ("dataloader_num_workers=args.workers)",
         "dataloader_num_workers=args.workers, eval_strategy='steps', eval_steps=4, per_device_eval_batch_size=16)"),
        ("train_dataset=train)", "train_dataset=train, eval_dataset=holdout)"),
    ), ("--workers", str(LOADERS))),
    "lightning_trainer": (("torch", "torchdata", "lightning"), (
        ("shuffle=True, drop_last=True,", f"shuffle=True, drop_last=True, num_workers={LOADERS},"),
        ("batch_size=40)", f"batch_size=40, num_workers={LOADERS})"),
    ), ()),
}


def variant(name: str, into: Path) -> Path:
    """The example with workers on every loader (and, for the HF Trainer, an evaluation)."""
    _, replacements, _ = EXAMPLES[name]
    text = (ROOT / "examples" / f"{name}.py").read_text()
    for old, new in replacements:
        assert text.count(old) == 1, f"examples/{name}.py changed: {old!r} is not there once; update the campaign"
        text = text.replace(old, new)
    script = into / f"{name}_workers_everywhere.py"
    script.write_text(text)
    return script


def launch(script: Path, pvc: Path, flags: tuple[str, ...]) -> Launch:
    """The script on ``pvc``; its stderr kept in a file beside the PVC (a framework says a lot)."""
    pvc.parent.mkdir(parents=True, exist_ok=True)
    n = len(list(pvc.parent.glob("launch-*.stderr"))) + 1
    with open(pvc.parent / f"launch-{n}.stderr", "w") as err:
        return Launch([sys.executable, str(script), "--pvc", str(pvc), *flags], pvc, f"{script.name} --pvc {pvc}",
                      stderr=err)


def said(pvc: Path) -> str:
    """The last lines a launch on ``pvc`` wrote to stderr."""
    last = sorted(pvc.parent.glob("launch-*.stderr"), key=lambda p: int(p.stem.split("-")[1]))
    return last[-1].read_text(errors="replace").strip()[-300:] if last else ""


def scheduler_stops(campaign: Campaign, trials: int) -> list[Section]:
    return [_stops(campaign, name, trials) for name in EXAMPLES]


def _stops(campaign: Campaign, name: str, trials: int) -> Section:
    section = Section(f"scheduler stops {name}", note=f"{LOADERS} workers on every loader")
    needs, _, flags = EXAMPLES[name]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing or not trials:
        section.note = f"skipped: {', '.join(missing)} not installed" if missing else "skipped"
        return section
    script = variant(name, campaign.work)
    reference = campaign.pvc(f"{name}-reference")
    started = time.monotonic()
    ref = launch(script, reference, flags)
    if ref.wait(timeout=900) != 0:
        section.violation(0, f"the uninterrupted run exited {ref.returncode}: {said(reference)}")
        return section
    seconds = time.monotonic() - started
    checkpoints = sum(e["event"] == "checkpointed" for e in events(reference))
    gap = seconds / max(checkpoints, 1)
    graces_cut = 0
    for trial in range(trials):
        section.trials += 1
        pvc = campaign.pvc(name)
        how = PREEMPTED if trial % 2 == 0 else grace_ended(campaign.rng.uniform(0, gap))
        proc = launch(script, pvc, flags)
        # A random instant after a random checkpoint but the last (prove's "between checkpoints"):
        # the workers run, a resume is at stake, and mostly a validation has run (its loader's
        # workers are alive).
        nth, delay = campaign.rng.randint(1, max(1, checkpoints - 1)), campaign.rng.uniform(0, gap)
        since: list[float] = []

        def ready() -> bool:
            if not since and sum(e["event"] == "checkpointed" for e in events(pvc)) >= nth:
                since.append(time.monotonic())
            return bool(since) and time.monotonic() - since[0] >= delay

        if kill_when(proc, ready, how):
            section.injected += 1
        code, event = proc.wait(timeout=900), last_event(pvc)
        if how.kill_after is not None and code == -9:
            graces_cut += 1
        elif code == 75:
            if event != "killed":
                section.violation(trial, f"{how.name}: exit 75 but the log ends with {event}")
        elif not (code == 0 and event == "completed"):
            section.violation(trial, f"{how.name}: exit {code}, log at {event}: {said(pvc)}")
        _recover(section, trial, script, pvc, flags, artifact(reference))
    section.note += f"; {trials} stops, to all twice and with a grace in turn ({graces_cut} graces ended mid-stop)"
    return section


def _recover(section: Section, trial: int, script: Path, pvc: Path, flags: tuple[str, ...], expected: bytes) -> None:
    """Relaunch until done, as a Job controller does: the uninterrupted run's bytes, a PVC verify accepts."""
    code = None
    for _ in range(5):
        if last_event(pvc) == "completed":
            break
        code = launch(script, pvc, flags).wait(timeout=900)
        if code != 75:
            break
    if last_event(pvc) != "completed":
        section.violation(trial, f"the relaunches did not complete (last exit {code}): {said(pvc)}")
        return
    if artifact(pvc) != expected:
        section.violation(trial, "published other bytes than the uninterrupted run")
        section.bytes_lost += len(expected)
    verify = trainjob("verify", "--pvc", pvc)
    if verify.returncode != 0:
        section.violation(trial, f"verify exited {verify.returncode}: {verify.stdout.strip()[-300:]}")
    status = trainjob("status", pvc / "log.jsonl")
    if status.returncode != 0:
        section.violation(trial, f"status exited {status.returncode}")
