"""The chaos campaign's S3 section (scripts/campaign/bucket.py) judges what it is shown: its checks,
on a real bucket, flag each kind of violation the oracle names (an untruthful exit, a committed
checkpoint that does not verify, a recovery to other bytes). The campaign itself runs in the test
command (scripts/test.sh), not here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import trainjob
from trainjob.storage.backend import location
from trainjob.storage.pvc import Pvc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from campaign import bucket  # noqa: E402  (scripts/ is not a package on sys.path)
from campaign.harness import Section  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.s3]
LAB = ("--steps", "3", "--ckpt-every", "1")


def test_the_s3_sections_checks_flag_each_violation_of_its_oracle(s3_pvc):
    """Each check shown a truthful launch and an untruthful one. Over 20 s under load: five
    launches against the bucket (two runs, the recoveries' relaunches), each a fresh interpreter's
    S3 client, rather than one test per check."""
    assert trainjob("run", "--pvc", s3_pvc, *LAB).returncode == 0
    done, section = bucket.Bucket(s3_pvc), Section("s3")
    assert done.events()[-1] == "completed" and done.unsound() == []
    bucket.check_launch(section, 0, "fine", done, 0, "")
    bucket.check_launch(section, 0, "fine", done, 75, "trainjob: taking over\ntrainjob run: x: unreachable\n")
    assert section.violations == []

    for code, stderr in ((70, "Traceback ...\ntrainjob run: internal error (exit 70)"), (2, "trainjob run: no bucket"),
                         (1, ""), (-9, ""), (75, "Traceback (most recent call last):\n  ...")):
        bucket.check_launch(section, 1, f"exit {code}", done, code, stderr)
    assert [v.split(": ", 1)[0] for v in section.violations] == ["s3 #1"] * 5

    killed = bucket.Bucket(s3_pvc + "-killed")
    assert trainjob("run", "--pvc", killed.url, *LAB, "--die-at", "2").returncode == 75
    section = Section("s3")
    bucket.check_launch(section, 2, "exit 0 unfinished", killed, 0, "")
    assert len(section.violations) == 1 and "exit 0 but the log ends with ['killed']" in section.violations[0]

    # A committed checkpoint whose shard no longer matches its manifest: counted, so flagged.
    import obstore as obs

    store = Pvc(location(killed.url)).backend.store
    shard = next(o["path"] for page in obs.list(store, "checkpoints/step-00000002-a0001-w001") for o in page
                 if not o["path"].endswith("manifest.json"))
    data = bytearray(obs.get(store, shard).bytes())
    data[-1] ^= 1
    obs.put(store, shard, bytes(data))
    assert any("corrupt" in problem for problem in killed.unsound())

    # Recovery: the reference's bytes, one attempt; other bytes are a violation, with bytes lost.
    reference = done.artifact()
    section = Section("s3")
    bucket.recover(section, 3, done, reference)
    assert section.violations == []
    bucket.recover(section, 4, done, reference + b" ")
    assert section.violations == ["s3 #4: artifact differs from the uninterrupted run"]
    assert section.bytes_lost == len(reference) + 1
