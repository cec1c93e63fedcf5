"""The suite's own machinery: the fast tier's guard in tests/conftest.py, run on a tiny suite of
its own (pytester: a test is failed only when both its CPU time and its wall time are over the
limit), ``built_once``, and tests/prefork.py's launcher against real interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefork import Prefork

pytest_plugins = ["pytester"]
CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


@pytest.mark.process  # a second pytest session in this one, about a second of busy CPU: slow tier
def test_a_fast_tier_test_is_listed_over_its_time_and_fails_only_far_over_on_both_cpu_and_wall(pytester):
    assert "FAST_TEST_SECONDS = 2.0\n" in CONFTEST and "FAST_TEST_FAIL_FACTOR = 3\n" in CONFTEST
    pytester.makeconftest(CONFTEST.replace("FAST_TEST_SECONDS = 2.0\n", "FAST_TEST_SECONDS = 0.25\n"))
    pytester.makepyfile(test_inner='''
        import hashlib, threading, time
        import pytest

        def busy(seconds):
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass

        def test_busy():  # over three times the limit on both: fails
            busy(0.9)

        def test_a_little_slow():  # over the limit, under three times it: listed, passes
            busy(0.4)

        def test_asleep():  # wall time only: a loaded machine
            time.sleep(0.9)

        def hash_for(seconds):  # hashlib lets go of the GIL: threads add up to more than one core
            data, end = bytes(1 << 20), time.monotonic() + seconds
            while time.monotonic() < end:
                hashlib.sha256(data)

        def test_leaves_two_hashing_threads_behind():
            for _ in range(2):
                threading.Thread(target=hash_for, args=(1.5,), daemon=True).start()

        def test_short_beside_them():  # up to twice its wall time in process CPU, all of it theirs
            time.sleep(0.2)

        @pytest.mark.process
        def test_busy_in_the_slow_tier():
            busy(0.8)
    ''')
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["*::test_busy used * s of CPU in * s: a fast-tier test takes under 0.25 s*"])
    result.stdout.fnmatch_lines(["*fast-tier tests over their time*",
                                 "*::test_a_little_slow used * s of CPU in * s: over 0.25 s (fails over 0.75 s)*"])
    out = result.stdout.str()
    assert "test_short_beside_them used" not in out and "test_asleep used" not in out


def test_built_once_builds_once_and_a_failed_build_is_tried_again_from_scratch(tmp_path_factory):
    from conftest import built_once

    calls: list[Path] = []

    def build(directory: Path) -> None:
        calls.append(directory)
        (directory / "made").write_text(str(len(calls)))

    def broken(directory: Path) -> None:
        (directory / "half").write_text("left by a build that failed")
        raise AssertionError("the build failed")

    first = built_once(tmp_path_factory, "tiers-ok", build)
    assert built_once(tmp_path_factory, "tiers-ok", build) == first and len(calls) == 1
    assert (first / "made").read_text() == "1"
    with pytest.raises(AssertionError, match="the build failed"):
        built_once(tmp_path_factory, "tiers-retried", broken)
    again = built_once(tmp_path_factory, "tiers-retried", build)
    assert not (again / "half").exists() and (again / "made").read_text() == "2"


@pytest.mark.process  # a second pytest session, in a process of its own (its launcher forks the CLI)
def test_a_test_that_starts_the_cli_without_the_process_marker_fails_spawned_or_forked(pytester, monkeypatch):
    """The guard sees every command of ``conftest.trainjob``, whether tests/prefork.py's launcher
    forks it or, with TRAINJOB_TEST_PREFORK=0, a real interpreter is spawned."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(prefork=(Path(__file__).parent / "prefork.py").read_text())
    pytester.makepyfile(test_inner='''
        import pytest
        from conftest import killpoint, trainjob

        @pytest.mark.process
        def test_marked():  # starts the launcher
            assert trainjob("--help").returncode == 0

        def test_unmarked():
            trainjob("--help")

        @pytest.mark.process
        def test_a_killpoint_without_its_kind(tmp_path):
            killpoint(-1, "run", "--pvc", tmp_path / "pvc")
    ''')
    for prefork in ("1", "0"):
        monkeypatch.setenv("TRAINJOB_TEST_PREFORK", prefork)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly")
        result.assert_outcomes(passed=1, failed=2)
        result.stdout.fnmatch_lines(["*test_a_killpoint_without_its_kind starts *killpoint.py*: mark it "
                                     "@pytest.mark.killpoint*",  # the process tests run first
                                     "*test_unmarked starts *: mark it @pytest.mark.process*"])


@pytest.mark.process
def test_a_forked_command_ends_as_a_new_interpreter_would(tmp_path):
    """Command for command, tests/prefork.py's child and a real interpreter: the same exit code
    (a signal's included), output, cwd, argv, path (PYTHONPATH too) and last line of stderr (a
    traceback's frames differ: the child's start in the launcher); a timeout as subprocess.run's."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/on_path.py").write_text("WHERE = 'lib'\n")
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), "
                      "os.getcwd(), os.environ.get('SAID'))\nsys.stderr.write('to stderr\\n')\nsys.exit(int(sys.argv[1]))\n")
    commands = [
        (["-m", "trainjob", "--help"], {}),
        (["-m", "trainjob", "status", tmp_path / "missing.jsonl"], {}),
        ([script, "3"], {"SAID": "yes"}),
        (["-c", "import os, signal, sys; print(sys.argv, repr(sys.path[0])); sys.stdout.flush(); "
                "os.kill(os.getpid(), signal.SIGKILL)", "x"], {}),
        (["-c", "import on_path; print(on_path.WHERE); raise ValueError('bad')"], {"PYTHONPATH": str(tmp_path / "lib")}),
    ]
    forked = Prefork()
    try:
        for argv, extra in commands:
            env, argv = {**os.environ, **extra}, [str(a) for a in argv]
            real = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=60)
            child = forked.run(argv, cwd=tmp_path, env=env, timeout=60)
            assert (child.returncode, child.stdout) == (real.returncode, real.stdout), argv
            assert child.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:], argv
        with pytest.raises(subprocess.TimeoutExpired):
            forked.run(["-c", "import time; time.sleep(30)"], timeout=0.5)
        assert forked.run(["-c", "print('next')"]).stdout == "next\n"  # the launcher serves on
    finally:
        forked.close()
