"""`trainjob verify` of a PVC that holds nothing to verify: exit 2 and one line saying where it
looked, never "verdict: ok" (a mistyped path must not look verified). In-process (``cli.main``):
no launch is needed to make an empty directory. The bucket's empty prefix is in
tests/storage/test_s3.py."""

from __future__ import annotations

import json

import pytest

from conftest import untouched
from trainjob import cli


def verify(capsys, *argv):
    code = cli.main(["verify", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err.strip()


def test_an_empty_directory_is_nothing_to_verify_exit_2_one_line(tmp_path, capsys):
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    before = untouched(pvc)
    code, out, err = verify(capsys, "--pvc", pvc)
    assert (code, out) == (2, "")
    assert err == (f"trainjob verify: {pvc}: nothing to verify: no checkpoints/, checkpoint.json or artifacts/ "
                   f"there, and {pvc}/log.jsonl logs no artifact (it is empty); is this the job's --pvc?")
    assert untouched(pvc) == before  # read-only: not even a lock file
    assert verify(capsys, "--pvc", pvc, "--json")[0] == 2  # no {"ok": true, "items": []} either


def test_a_pvc_with_only_a_log_and_state_names_what_it_holds(tmp_path, capsys):
    """A run killed before its first checkpoint: nothing of it has a hash to check."""
    pvc = tmp_path / "pvc"
    (pvc / "checkpoints").mkdir(parents=True)
    (pvc / "log.jsonl").write_text(json.dumps({"ts": "2026-12-06T00:00:00Z", "event": "job_started",
                                               "detail": "steps=10 attempt=1"}) + "\n")
    (pvc / "attempts").write_text("1\n")
    code, out, err = verify(capsys, "--pvc", pvc)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert "nothing to verify" in err and "(it holds only attempts, checkpoints, log.jsonl)" in err


def test_a_missing_directory_stays_exit_2(tmp_path, capsys):
    code, out, err = verify(capsys, "--pvc", tmp_path / "nope")
    assert (code, out) == (2, "") and err == f"trainjob verify: {tmp_path / 'nope'}: not a PVC directory"
    assert not (tmp_path / "nope").exists()
