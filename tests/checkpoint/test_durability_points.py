"""Every fsync and rename a checkpoint makes is announced: docs/checkpoints.md's table of durability
points is compared, row by row, with the calls a real run makes (traced in process).

A point that appears (a new fsync, say) or disappears without the table changing fails here, so
the cost of a checkpoint and the failure each call guards against stay written down.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fstrace
from conftest import ROOT
from trainjob import cli
from trainjob.storage import deletion

# The traced processes import this checkout and tests/fstrace.py, whatever the caller's PYTHONPATH.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}

Point = tuple[str, str]
Round = list[Point]  # points that run at the same time: sorted, their order is free


def documented() -> list[Round]:
    """The table under "Durability points of one checkpoint (W=1)", as its rounds in order: the
    (call, on) columns of the rows of each round, sorted."""
    text = (ROOT / "docs/checkpoints.md").read_text()
    section = text.split("### Durability points of one checkpoint (W=1)", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| \d+ \| (\d+) \| (fsync|rename) \| `([^`]+)` \|", section, re.M)
    assert len(rows) >= 5, "the table is gone"
    rounds: dict[int, Round] = {}
    for number, call, on in rows:
        rounds.setdefault(int(number), []).append((call, on))
    return [sorted(rounds[n]) for n in sorted(rounds)]


def as_rounds(points: list[Point], like: list[Round]) -> list[Round]:
    """``points`` (a trace, in the order the calls began) cut into rounds of ``like``'s sizes,
    each sorted; the points left over, if any, as one more round."""
    out, at = [], 0
    for r in like:
        out.append(sorted(points[at:at + len(r)]))
        at += len(r)
    return out + ([points[at:]] if points[at:] else [])


def traced(monkeypatch: pytest.MonkeyPatch, pvc: Path, *flags: str) -> list[Point]:
    """Every fsync, rename and replace ``trainjob run`` makes (tests/fstrace.py's tracer)."""
    seen: list[Point] = []
    fstrace.record(str(pvc), seen, lambda name, wrapper: monkeypatch.setattr(os, name, wrapper))
    assert cli.main(["run", "--pvc", str(pvc), *flags]) == 0
    monkeypatch.undo()
    return seen


def checkpoints(points: list[Point]) -> list[list[Point]]:
    """The run's points cut into one list per checkpoint: from the first fsync in its staging
    directory (whichever of round 1's began first) to the log line that announces it, and what
    comes right after that line: the fsync of `.` beside it (the pool's thread may begin it
    later) and the renames of its rotation."""
    found, current, announced = [], None, False
    for point in points:
        if announced and not (point == ("fsync", ".") or point[0] == "rename" and "-> checkpoints/.trash-" in point[1]):
            current, announced = None, False
        if current is None and point[0] == "fsync" and point[1].startswith("checkpoints/.tmp-"):
            current = []
            found.append(current)
        if current is not None:
            current.append(point)
            announced = announced or point == ("fsync", "log.jsonl")
    return found


def test_a_steady_checkpoint_makes_exactly_the_documented_fsyncs_and_renames(tmp_path, monkeypatch):
    points = traced(monkeypatch, tmp_path / "pvc", "--steps", "3", "--ckpt-every", "1", "--keep", "1")
    made = checkpoints(points)
    assert len(made) == 3
    table = documented()
    assert as_rounds(made[-1], table) == table  # the third: the state is already `checkpointed`, one to rotate


def test_the_first_checkpoint_adds_only_the_state_record_before_its_log_line(tmp_path, monkeypatch):
    """No rotation yet; the state record's tmp file is fsynced beside the pointer's fsync of `.`
    (round 5, which then holds no log line yet), renamed, its own `.` fsynced, then the line."""
    first = checkpoints(traced(monkeypatch, tmp_path / "pvc", "--steps", "3", "--ckpt-every", "1", "--keep", "1"))[0]
    table = documented()
    assert table[4] == [("fsync", "."), ("fsync", "log.jsonl")] and ".trash-" in table[5][0][1]
    expected = table[:4] + [[("fsync", "."), ("fsync", "state.json.tmp.N")],
                            [("rename", "state.json.tmp.N -> state.json")], [("fsync", ".")], [("fsync", "log.jsonl")]]
    assert as_rounds(first, expected) == expected


def timeline(monkeypatch: pytest.MonkeyPatch, pvc: Path, slow: str, slow_deletes: bool = False) -> list[tuple[str, str]]:
    """A synchronous run's fsyncs (their start and their return), renames, log lines (their
    detail, when the append begins and once it returned, fsynced) and rotation's deletes (their
    start and end), from any thread, in order, paths relative to the PVC (``.`` the PVC itself);
    each fsync of a path ``slow`` (a regex) finds first sleeps 0.1 s, and so does each delete
    with ``slow_deletes``, so an order that is not enforced shows (a race lost by luck would not)."""
    import threading
    import time

    from trainjob.storage.eventlog import EventLog

    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fsync, real_rename, real_replace, real_rmtree = os.fsync, os.rename, os.replace, deletion._rmtree
    real_append = EventLog.append

    def note(kind: str, on: str) -> None:
        with lock:
            events.append((kind, on))

    def fsync(fd: int) -> None:
        on = os.readlink(f"/proc/self/fd/{fd}")
        note("fsync", os.path.relpath(on, pvc))
        if re.search(slow, on):
            time.sleep(0.1)
        real_fsync(fd)
        note("fsynced", os.path.relpath(on, pvc))

    def renamer(real):
        def rename(src, dst, **kwargs):
            note("rename", os.path.relpath(src, pvc))
            real(src, dst, **kwargs)
        return rename

    def rmtree(trash):
        note("delete", os.path.relpath(trash, pvc))
        if slow_deletes:
            time.sleep(0.1)
        try:
            return real_rmtree(trash)
        finally:
            note("deleted", os.path.relpath(trash, pvc))

    def append(log, event, detail, **kwargs):
        note("log", f"{event} {detail}")
        out = real_append(log, event, detail, **kwargs)
        note("logged", f"{event} {detail}")
        return out

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", renamer(real_rename))
    monkeypatch.setattr(os, "replace", renamer(real_replace))
    monkeypatch.setattr(deletion, "_rmtree", rmtree)
    monkeypatch.setattr(EventLog, "append", append)
    assert cli.main(["run", "--pvc", str(pvc), "--steps", "3", "--ckpt-every", "1", "--keep", "1"]) == 0
    deletion.settle_deletions()
    monkeypatch.undo()
    return events


def running_at(events: list[tuple[str, str]]) -> list[tuple[int, list[str]]]:
    """Each event's index with the fsyncs running when it happened (begun, not yet returned)."""
    running: list[str] = []
    out = []
    for i, (kind, on) in enumerate(events):
        out.append((i, list(running)))
        if kind == "fsync":
            running.append(on)
        elif kind == "fsynced":
            running.remove(on)
    return out


def committed_step(on: str) -> int:
    """The step of a commit's rename (``checkpoints/.tmp-step-00000002-...``)."""
    return int(re.search(r"step-(\d+)", on).group(1))


def test_no_rename_happens_while_an_fsync_begun_before_it_is_still_running(tmp_path, monkeypatch):
    """The rounds of the table: a rename waits for every fsync of the round before it, those
    run at the same time on the fsync pool (the shard's, the manifest's, the staging directory's
    before the commit's rename; `checkpoints/`'s and the pointer file's before the pointer's).
    The one exception: `state.json`'s rename (first checkpoint) may pass the pointer's fsync of
    `.`, which it does not depend on (docs/checkpoints.md)."""
    events = timeline(monkeypatch, tmp_path / "pvc", slow=r"\.safetensors$|/checkpoints$")
    for i, running in running_at(events):
        kind, on = events[i]
        if kind == "rename":
            allowed = ["."] if on.startswith("state.json.tmp.") else []
            assert [r for r in running if r not in allowed] == [], f"{on} renamed while {running} were being fsynced"
    # And they do run at once: the manifest's fsync begins while the (slowed) shard's runs.
    for i, (kind, on) in enumerate(events):
        if kind == "fsync" and on.endswith("/manifest.json"):
            shard = re.sub(r"manifest\.json$", "shard-00000-of-00001.safetensors", on)
            assert ("fsynced", shard) in events[i:]


def test_rotation_renames_only_once_the_pointers_rename_is_durable_and_the_line_is_fsynced_beside_it(
        tmp_path, monkeypatch):
    """Round 5 and 6: the `checkpointed` line's fsync begins while the fsync of `.` (the
    pointer's rename, slowed) still runs, and rotation's rename waits for that fsync: a power
    loss must never leave the old pointer naming a checkpoint already hidden."""
    events = timeline(monkeypatch, tmp_path / "pvc", slow=r"/pvc$")
    running = dict(running_at(events))
    rotations = [i for i, (kind, on) in enumerate(events) if kind == "rename" and on.startswith("checkpoints/step-")]
    assert len(rotations) == 2  # steps 1 and 2, rotated away by steps 2 and 3 (--keep 1)
    for i in rotations:
        assert "." not in running[i], f"{events[i][1]} hidden while `.` was being fsynced"
        # The line's fsync does not wait for the pointer's `.`: it begins before that (slowed)
        # fsync ends. Not "they overlap": on a loaded machine the pool's thread may start its
        # fsync only after the line's has ended, and did.
        line = max(j for j in range(i) if events[j] == ("fsync", "log.jsonl"))
        dot = max(j for j in range(i) if events[j] == ("fsync", "."))
        dot_done = next(j for j in range(dot, len(events)) if events[j] == ("fsynced", "."))
        assert line < dot_done, events[min(line, dot) - 2:i + 1]


def test_the_checkpointed_line_follows_the_pointers_rename_and_the_commits_fsync(tmp_path, monkeypatch):
    """After a kill, the pointer names the logged step (the lab reads it): the line is written
    only after the pointer's rename (its tmp file's fsync slowed: a pointer that were written
    later, or on another thread, would show), and after the commit's rename is durable."""
    events = timeline(monkeypatch, tmp_path / "pvc", slow=r"checkpoint\.json\.tmp\.\d+$")
    lines = [i for i, (kind, on) in enumerate(events) if kind == "log" and on.startswith("checkpointed ")]
    assert len(lines) == 3
    for i in lines:
        commit = max(j for j in range(i) if events[j][0] == "rename" and events[j][1].startswith("checkpoints/.tmp-"))
        assert f"step={committed_step(events[commit][1])} " in events[i][1]  # the line announces that commit
        after = events[commit:i]
        assert ("fsynced", "checkpoints") in after and any(
            kind == "rename" and on.startswith("checkpoint.json.tmp.") for kind, on in after), after


def test_a_rotated_checkpoint_is_deleted_only_once_the_checkpointed_line_is_durable(tmp_path, monkeypatch):
    """Rotation hides an old checkpoint by a rename; its delete (journal work that would land in
    a line's fsync) starts only after the line announcing the checkpoint that rotated it has
    been fsynced (the append returned), and runs during no `checkpointed` line's append (both
    slowed; a later event's line may overlap it, as the gate's do at the end of a run)."""
    events = timeline(monkeypatch, tmp_path / "pvc", slow=r"/log\.jsonl$", slow_deletes=True)
    deletes = [i for i, (kind, _) in enumerate(events) if kind == "delete"]
    assert len(deletes) == 2  # steps 1 and 2, rotated away by steps 2 and 3 (--keep 1)
    lines = [(a, events.index(("logged", on), a)) for a, (kind, on) in enumerate(events)
             if kind == "log" and on.startswith("checkpointed ")]
    for i in deletes:
        name = events[i][1].rsplit("/.trash-", 1)[1]
        hidden = max(j for j in range(i) if events[j] == ("rename", f"checkpoints/{name}"))
        commit = max(j for j in range(hidden) if events[j][0] == "rename"
                     and events[j][1].startswith("checkpoints/.tmp-"))
        step = committed_step(events[commit][1])
        assert any(kind == "logged" and on.startswith(f"checkpointed step={step} ")
                   for kind, on in events[commit:i]), events[commit:i + 1]
        end = events.index(("deleted", events[i][1]), i)
        assert not [(a, b) for a, b in lines if a < end and i < b], events[i:end + 1]


@pytest.mark.process
@pytest.mark.torchrun
def test_under_torchrun_rank_0_makes_the_documented_points_and_every_other_rank_one_fsync(tmp_path):
    """At W=2 through torchrun's store (the receipts go through the store, not the PVC), rank 0's
    checkpoint is the W=1 table's, and rank 1's is its shard's fsync and nothing else."""
    out = tmp_path / "trace"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.1", str(ROOT / "tests/fstrace.py"), str(out), "run", "--pvc",
                           str(tmp_path / "pvc"), "--steps", "3", "--ckpt-every", "1", "--keep", "1"],
                          capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    rank0, rank1 = ([tuple(p) for p in json.loads(Path(f"{out}-rank{r}.json").read_text())] for r in (0, 1))
    table = documented()
    assert as_rounds(checkpoints(rank0)[-1], table) == table
    assert rank1 == [("fsync", "checkpoints/.tmp-step-N-aN-wN.gN/shard-N-of-N.safetensors")] * 3


@pytest.mark.process
@pytest.mark.torchrun
def test_ranks_coordinating_through_the_pvc_add_one_unsynced_rename_per_checkpoint_on_the_others(tmp_path):
    """Ranks started on their own (no launcher's store) hand rank 0 their receipts as files: rank
    0's checkpoint is still the table's, and rank 1 adds one rename, its receipt's, with no fsync
    (the manifest that copies it is what becomes durable; a crash before that abandons it all)."""
    out, pvc = tmp_path / "trace", tmp_path / "pvc"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/fstrace.py"), str(out), "run", "--pvc", str(pvc),
                               "--steps", "3", "--ckpt-every", "1", "--keep", "1", "--world-size", "2",
                               "--rank", str(r)], stderr=subprocess.PIPE, text=True,
                              env=ENV)
             for r in (0, 1)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
        p.stderr.close()
    rank0, rank1 = ([tuple(p) for p in json.loads(Path(f"{out}-rank{r}.json").read_text())] for r in (0, 1))
    table = documented()
    assert as_rounds(checkpoints(rank0)[-1], table) == table
    staged = "checkpoints/.tmp-step-N-aN-wN.gN/shard-N-of-N.safetensors"
    receipt = ("rename", f"{staged}.receipt.json.tmp.N -> {staged}.receipt.json")
    assert rank1[rank1.index(("fsync", staged)):] == [("fsync", staged), receipt] * 3
