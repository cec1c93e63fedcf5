"""`trainjob status LOG --path`: the path a log took, and the rejection of paths no run could take."""

from __future__ import annotations

import json
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import PREFORK, events, trainjob
from trainjob.views import history
from trainjob.engine.machine import ANNOUNCED_WITHIN, EVENT_FOR_STATE, STATE_FOR_EVENT, TRANSITIONS
from trainjob.views.history import replay

WALKTHROUGH_PATH = [
    ("pending", "started", "job_started"),
    ("started", "checkpointed", "checkpointed"),
    ("checkpointed", "checkpointed", "checkpointed"),
    ("checkpointed", "killed", "killed"),
    ("pending", "resumed", "resumed"),
    ("resumed", "checkpointed", "checkpointed"),
    ("checkpointed", "checkpointed", "checkpointed"),
    ("checkpointed", "checkpointed", "checkpointed"),
    ("checkpointed", "completed", "artifact_written"),
    ("checkpointed", "completed", "completed"),
]
PATH_LINE = re.compile(r"line +(\d+)  (\w+) -> (\w+) +(\w+) \| (.*)")


def write_log(where: Path, *names: str) -> Path:
    log = where / "log.jsonl"
    log.write_text("".join(json.dumps({"ts": "2026-11-06T15:29:56Z", "event": name, "detail": "x=1"}) + "\n"
                           for name in names))
    return log


@pytest.fixture
def fresh_table_cache():
    """Legality is cached per position; a test that edits the table must not leak its answers."""
    history._candidates.cache_clear()
    yield
    history._candidates.cache_clear()


# --- real runs through the CLI ------------------------------------------------------------------

@pytest.mark.process
def test_walkthrough_path_one_line_per_event_with_its_detail(walkthrough_log):
    result = trainjob("status", walkthrough_log, "--path")
    assert result.returncode == 0 and result.stderr == ""
    steps = [PATH_LINE.fullmatch(line).groups() for line in result.stdout.splitlines()]
    assert [(source, dest, event) for _, source, dest, event, _ in steps] == WALKTHROUGH_PATH
    assert [int(number) for number, *_ in steps] == list(range(1, 11))
    details = [detail for *_, detail in steps]
    assert details[1] == "step=2 loss_milli=310" and details[3] == "at_step=4" and details[4] == "from_step=4"


@pytest.mark.process
def test_spent_retry_budget_is_a_legal_path_with_exit_1_and_no_complaint(pvc):
    for _ in range(3):
        trainjob("run", "--pvc", pvc, "--backoff-limit", 1, "--force-weights", "0,0,0")
    result = trainjob("status", pvc / "log.jsonl", "--path")
    assert result.returncode == 1 and result.stderr == ""
    moves = [PATH_LINE.fullmatch(line).group(2, 3) for line in result.stdout.splitlines()]
    assert moves.count(("pending", "started")) == 2 and moves.count(("checkpointed", "drift_failed")) == 2
    assert moves[-1] == ("pending", "job_failed")


@pytest.mark.process
def test_supervisor_lines_are_shown_beside_the_path_not_part_of_it(tmp_path):
    supervised = trainjob("supervise", "--backoff-base", "0.01", "--", "run", "--pvc", tmp_path / "P", "--die-at", "4")
    assert supervised.returncode == 0, supervised.stderr
    result = trainjob("status", tmp_path / "P" / "log.jsonl", "--path")
    assert result.returncode == 0 and result.stderr == ""
    out = result.stdout.splitlines()
    assert [PATH_LINE.fullmatch(line).group(2, 3, 4) for line in out if PATH_LINE.fullmatch(line)] == WALKTHROUGH_PATH
    asides = [line.split("  ", 3)[-1] for line in out if "(supervisor)" in line]
    assert [aside.split(" | ")[0] for aside in asides] == ["relaunch", "stop"]
    assert out.index(next(line for line in out if "(supervisor)  relaunch" in line)) == 4  # in log order


@pytest.mark.process
def test_spliced_logs_of_two_jobs_are_rejected_at_the_seam(tmp_path, walkthrough_log):
    other = tmp_path / "other"
    assert trainjob("run", "--pvc", other, "--force-weights", "0,0,0").returncode == 1
    spliced = tmp_path / "spliced.jsonl"
    spliced.write_text(walkthrough_log.read_text() + (other / "log.jsonl").read_text())
    result = trainjob("status", spliced, "--path")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"trainjob status: {spliced} line 11: illegal step from completed: job_started (nothing may follow it)"]
    assert len(result.stdout.splitlines()) == 10  # the legal prefix is still shown


# Where a log and the PVC can disagree: the engine persists a state, then announces it. This runs
# the CLI with a SIGKILL just before or just after its n-th log append.
KILL_AROUND_APPEND = """
import os, signal, sys
from trainjob import cli
from trainjob.storage import eventlog
target, when, real, appended = int(sys.argv[1]), sys.argv[2], eventlog.EventLog.append, []
def append(log, event, detail, **how):
    if len(appended) == target and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    appended.append(real(log, event, detail, **how))
    if len(appended) == target + 1 and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
eventlog.EventLog.append = append
sys.exit(cli.main(sys.argv[3:]))
"""


def kill_around_every_append(tmp_path: Path, prepare: list[str], flags: list[str]) -> list[Path]:
    """Logs of a job whose process is SIGKILLed around each of its announcements in turn, then
    relaunched until it ends. ``prepare`` runs once, unharmed, before the killed process."""
    start, clean = tmp_path / "start", tmp_path / "clean"
    start.mkdir()
    if prepare:
        trainjob("run", "--pvc", start, *prepare)
    shutil.copytree(start, clean, dirs_exist_ok=True)
    trainjob("run", "--pvc", clean, *flags)
    appends = len(events(clean / "log.jsonl")) - (len(events(start / "log.jsonl")) if prepare else 0)

    def job(n: int, when: str) -> Path:
        pvc = tmp_path / f"{when}{n}"
        shutil.copytree(start, pvc, dirs_exist_ok=True)
        died = PREFORK.run(["-c", KILL_AROUND_APPEND, str(n), when, "run", "--pvc", str(pvc), *flags])
        assert died.returncode == -signal.SIGKILL
        while trainjob("run", "--pvc", pvc, *flags).returncode == 75:
            pass
        return pvc / "log.jsonl"

    trials = [(n, when) for n in range(appends) for when in ("before", "after")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(job, *zip(*trials)))


@pytest.mark.parametrize("prepare, flags", [
    ([], ["--steps", "1"]),  # a run that completes
    (["--steps", "1", "--force-weights", "0,0,0"],  # the fresh attempt after a drift_failed
     ["--steps", "1", "--force-weights", "0,0,0", "--backoff-limit", "1"]),
    ([], ["--steps", "3", "--async-checkpoint"]),  # snapshotted, then checkpointed once it landed
])
@pytest.mark.process
def test_every_log_a_sigkill_around_an_announcement_leaves_is_a_legal_path(tmp_path, prepare, flags):
    logs = kill_around_every_append(tmp_path, prepare, flags)
    assert len(logs) >= 6
    illegal = {log.parent.name: replay(log).illegal for log in logs}
    assert {name: str(step) for name, step in illegal.items() if step} == {}


@pytest.mark.process
def test_torn_line_is_reported_and_the_path_goes_on(tmp_path, walkthrough_log):
    lines = walkthrough_log.read_text().splitlines(keepends=True)
    torn = tmp_path / "torn.jsonl"
    torn.write_text("".join(lines[:4]) + '{"ts":"2026-11-06T15:29:56Z","event":"check\n' + "".join(lines[4:]))
    result = trainjob("status", torn, "--path")
    assert result.returncode == 0
    out = result.stdout.splitlines()
    assert len([line for line in out if PATH_LINE.fullmatch(line)]) == 10
    assert out[-1].startswith("skipped: line 5: ")
    assert "line   6  pending -> resumed" in result.stdout


@pytest.mark.parametrize("names, dest", [
    (["job_started", "killed", "cleaned_up", "cleaned_up", "checkpoint_rejected", "resumed"], "resumed"),
    (["job_started", "killed", "cleaned_up", "resharded"], "resharded"),
    (["job_started", "checkpointed", "drift_failed", "cleaned_up", "job_started"], "started"),
])
@pytest.mark.process
def test_notes_name_the_transition_the_next_event_of_their_process_took(tmp_path, names, dest):
    lines = trainjob("status", write_log(tmp_path, *names), "--path").stdout.splitlines()
    notes = [PATH_LINE.fullmatch(line).group(2, 3) for line in lines if "cleaned_up" in line or "rejected" in line]
    assert notes and set(notes) == {("pending", dest)}


@pytest.mark.parametrize("args, message", [
    (["--path", "--json"], "not allowed with argument"),
    (["--path"], "not found"),
])
@pytest.mark.process
def test_usage_and_missing_log_exit_2(tmp_path, args, message):
    result = trainjob("status", tmp_path / "nope.jsonl", *args)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.process
def test_log_without_events_exits_2(tmp_path):
    (tmp_path / "log.jsonl").write_text("not json\n")
    result = trainjob("status", tmp_path / "log.jsonl", "--path")
    assert result.returncode == 2 and "holds no events from trainjob run" in result.stderr


# --- the rule, on hand-written logs -------------------------------------------------------------

@pytest.mark.parametrize("names, line, after, event", [
    (["checkpointed"], 1, None, "checkpointed"),
    (["job_started", "killed", "job_started"], 3, "killed", "job_started"),  # a kill is resumed, not restarted
    (["job_started", "completed"], 2, "started", "completed"),  # nothing trained, nothing gated
    (["job_started", "checkpointed", "completed"], 3, "checkpointed", "completed"),  # artifact line deleted
    (["job_started", "checkpointed", "artifact_written", "job_started"], 4, "checkpointed -> completed", "job_started"),
    (["job_started", "checkpointed", "drift_failed", "checkpointed"], 4, "drift_failed", "checkpointed"),
    (["job_started", "killed", "killed"], 3, "killed", "killed"),
    (["job_started", "teleported"], 2, "started", "teleported"),
])
def test_illegal_step_is_named_by_line_state_and_event(tmp_path, names, line, after, event):
    illegal = replay(write_log(tmp_path, *names)).illegal
    assert (illegal.line, illegal.after, illegal.event) == (line, after, event)


@pytest.mark.parametrize("names", [
    ["resumed", "checkpointed"],  # the log is younger than the PVC
    ["job_started", "resumed"],  # SIGKILL before the first checkpoint, unlogged
    ["job_started", "checkpointed", "job_started"],  # drift_failed persisted, then SIGKILL before its line
    ["job_started", "checkpointed", "drift_failed", "resumed"],  # job_started persisted, then SIGKILL
    ["job_started", "checkpointed", "artifact_written"],  # SIGKILL between the artifact and completed
    ["job_started", "checkpointed", "artifact_written", "artifact_written", "completed"],  # ...then relaunched
    ["job_failed", "job_failed"],
])
def test_paths_that_unlogged_kills_make_possible_are_legal(tmp_path, names):
    assert replay(write_log(tmp_path, *names)).illegal is None


# Who may begin after each state, per history.py's docstring (persist-before-announce included).
NEW_PROCESS_MAY_LOG = {  # `trainjob reshard` (resharded) may run between any two processes
    "started": {"resumed", "resharded"}, "killed": {"resumed", "resharded"},
    "resumed": {"resumed", "job_started", "job_failed", "artifact_written", "resharded"},
    "checkpointed": {"resumed", "job_started", "job_failed", "artifact_written", "resharded"},
    "drift_failed": {"resumed", "job_started", "job_failed", "resharded"},
    "job_failed": {"resumed", "job_started", "job_failed", "resharded"},
    "completed": set(),
}
REACH = {  # a shortest log that ends in each state
    "started": ["job_started"], "killed": ["job_started", "killed"], "resumed": ["resumed"],
    "checkpointed": ["job_started", "checkpointed"], "drift_failed": ["resumed", "drift_failed"],
    "job_failed": ["job_failed"], "completed": ["resumed", "artifact_written", "completed"],
}


@pytest.mark.parametrize("state", sorted(REACH))
def test_next_event_is_legal_exactly_when_the_table_or_a_new_process_allows_it(tmp_path, state):
    edges = {(source, row["dest"]) for row in TRANSITIONS
             for source in ([row["source"]] if isinstance(row["source"], str) else row["source"])}
    for event in [*STATE_FOR_EVENT, *ANNOUNCED_WITHIN]:
        dest = STATE_FOR_EVENT.get(event) or ANNOUNCED_WITHIN[event]
        needs_announcement_first = event == EVENT_FOR_STATE[dest] and dest in ANNOUNCED_WITHIN.values()
        expected = ((state, dest) in edges and not needs_announcement_first) or event in NEW_PROCESS_MAY_LOG[state]
        result = replay(write_log(tmp_path, *REACH[state], event))
        assert (result.illegal is None) == expected, f"{event} after {state}"


def test_legality_is_derived_from_the_table(tmp_path, monkeypatch, fresh_table_cache):
    log = write_log(tmp_path, "job_started", "artifact_written", "completed")
    assert replay(log).illegal.line == 2
    monkeypatch.setattr(history, "TRANSITIONS",
                        [*TRANSITIONS, dict(trigger="gate", source="started", dest="completed")])
    history._candidates.cache_clear()
    assert replay(log).illegal is None
