"""The lab checker can fail: against the seed's starter stubs it reports exactly their four FAILs."""

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.process  # every test here starts the CLI or another process


def run_checks(trainjob_cmd: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "TRAINJOB": trainjob_cmd, "PY": sys.executable}
    return subprocess.run(["bash", str(ROOT / "scripts/check.sh")], capture_output=True, text=True,
                          env=env, timeout=120)


def test_starter_stubs_fail_the_four_checks_they_break():
    result = run_checks(f"{sys.executable} {ROOT / 'scripts/starter.py'}")
    assert result.returncode == 1
    failed = [line.split()[1] for line in result.stdout.splitlines() if line.endswith(" FAIL")]
    assert failed == ["resume_after_kill", "artifact_sha_matches", "drift_fails_honestly", "backoff_limit_honoured"]
    assert "backoff: exits=0,2,2 drift_failed=0 job_failed=0 attempts_file=1" in result.stderr


def test_reference_passes_all_nine():
    result = run_checks(f"{sys.executable} -m trainjob")
    assert result.returncode == 0
    assert [line.split()[2] for line in result.stdout.splitlines()] == ["PASS"] * 9
