"""Log appends survive torn lines; details cannot forge lines; the reader streams."""

import json

from trainjob.storage.eventlog import EventLog, read_log


def test_append_after_a_torn_line_starts_a_new_line(tmp_path):
    path = tmp_path / "log.jsonl"
    log = EventLog(path)
    log.append("job_started", "steps=10 attempt=1")
    with open(path, "a") as f:
        f.write('{"ts":"2026-11-06T15:29:56Z","event":"checkpo')  # killed mid-append
    log.append("resumed", "from_step=0")
    lines = list(read_log(path))
    assert [line.event.event if line.event else None for line in lines] == ["job_started", None, "resumed"]
    assert lines[1].number == 2 and "invalid JSON" in lines[1].problem


def test_a_detail_with_newlines_cannot_forge_an_event(tmp_path):
    path = tmp_path / "log.jsonl"
    EventLog(path).append("killed", 'at_step=1\n{"event":"completed","detail":"x","ts":"y"}')
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["event"] == "killed"


def test_lines_with_unknown_fields_or_wrong_types_are_reported_not_fatal(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"ts":"t","event":"killed","detail":"at_step=4","extra":1}\n{"ts":1,"event":"x","detail":""}\n')
    problems = [line.problem for line in read_log(path)]
    assert "extra" in problems[0] and "ts" in problems[1]


def test_an_append_is_fsynced_unless_its_event_claims_nothing_on_disk(tmp_path, monkeypatch):
    import os

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    log = EventLog(tmp_path / "log.jsonl")
    log.append("checkpointed", "step=2 loss_milli=310")
    assert len(synced) == 1
    log.append("snapshotted", "step=4 loss_milli=241", fsync=False)
    assert len(synced) == 1 and [line.event.event for line in read_log(tmp_path / "log.jsonl")] == [
        "checkpointed", "snapshotted"]
