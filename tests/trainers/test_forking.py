"""A fork while another thread holds the interpreter's thread-list lock (trainjob/trainers/torch/forking.py).

CPython 3.11 before 3.11.10 deletes a forked child's stale thread states under that lock before
it re-creates it (gh-112275): a child forked while the lock was held blocks forever inside
``os.fork()``. A DataLoader worker of a W=2 Lightning DDP run did so twice under load, holding the
whole run until gloo's 30-minute timeout; gdb on the stuck worker showed it waiting for that lock
in ``_PyThreadState_DeleteExcept``, called from ``PyOS_AfterFork_Child``.
tests/helpers/fork_with_head_lock_held.py holds the lock from a native thread across a fork, so
the deadlock happens every time, not once in hundreds of launches."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("torch")  # the package holding the module needs it, though the module does not

from trainjob.trainers.torch import forking  # noqa: E402

HELPER = ROOT / "tests/helpers/fork_with_head_lock_held.py"
STRESS = ROOT / "tests/helpers/fork_from_threads.py"
GUARDED = pytest.mark.skipif(not forking.affected() or forking._lock_slot() is None,
                             reason="this interpreter re-creates the lock before it needs it (or its layout is unknown)")


@pytest.mark.parametrize(("version", "implementation", "expected"), [
    ((3, 11, 2), "cpython", True),  # Debian 12's
    ((3, 11, 7), "cpython", True),
    ((3, 11, 9), "cpython", True),
    ((3, 11, 10), "cpython", False),  # took the fix
    ((3, 12, 1), "cpython", False),
    ((3, 13, 0), "cpython", False),
    ((3, 11, 7), "pypy", False),
])
def test_only_the_interpreters_with_the_bug_get_the_handler(version, implementation, expected):
    assert forking.affected(version, implementation) is expected


def fork_with_the_lock_held(mode: str) -> dict:
    done = subprocess.run([sys.executable, str(HELPER), mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.process
@GUARDED
def test_a_child_forked_while_another_thread_holds_the_lock_starts_once_the_handler_is_in_place():
    """Without the handler the child is still inside fork() 5 s later (the bug, on this
    interpreter); with it the fork waits for the holder to let go (0.7 s later) and the child exits."""
    bare = fork_with_the_lock_held("bare")
    assert bare["child"] == "stuck", bare
    guarded = fork_with_the_lock_held("guard")
    assert guarded["child"] == "exited" and 0.4 < guarded["fork_seconds"] < 5, guarded


@pytest.mark.process
@GUARDED
def test_a_fork_that_bypasses_os_fork_is_not_held_up_by_the_handler():
    """The handlers are registered for one os.fork() at a time and removed after it: libc's fork()
    called directly, after an os.fork(), forks at once though the lock is held, and its child exits."""
    raw = fork_with_the_lock_held("raw")
    assert raw["child"] == "exited" and raw["fork_seconds"] < 0.3, raw


@pytest.mark.process
@GUARDED
def test_forks_from_three_threads_beside_native_threads_making_thread_states_all_start():
    """The handler's own safety under contention: 300 os.fork() calls from three threads at once,
    while native threads make thread states without the GIL and Python threads start and end.
    Every child exits, none is left inside fork(), collection is back on in parent and children.
    (Two sets of handlers registered at once made a fork wait on itself; a set removed by another
    thread's after-fork hook between a fork's prepare and parent steps left the lock held.)"""
    done = subprocess.run([sys.executable, str(STRESS), "guard", "100"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) | {"callbacks": None} == {"exited": 300, "stuck": 0, "callbacks": None}, done.stdout


@pytest.mark.process
@GUARDED
@pytest.mark.parametrize("collecting", [True, False])
def test_a_fork_leaves_automatic_collection_as_the_script_had_it(collecting):
    """Collection is off across a guarded fork, and back as it was after it, in both processes."""
    script = f"""
import gc, os, sys
sys.path.insert(0, {str(ROOT / "tests/helpers")!r})
from forking_alone import forking
assert forking.install()
gc.enable() if {collecting} else gc.disable()
pid = os.fork()
if pid == 0:
    os._exit(0 if gc.isenabled() == {collecting} else 3)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the child's collection"
assert gc.isenabled() == {collecting}, "the parent's collection"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]


def test_importing_trainjobs_torch_adapter_installs_the_handler_where_it_applies():
    import trainjob.torch  # noqa: F401  (the package installs it on import)

    assert forking.install() == (forking.affected() and forking._lock_slot() is not None
                                 and sys.platform == "linux")
    assert forking.install.cache_info().currsize == 1  # installed once, by the import
