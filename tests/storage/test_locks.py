"""The PVC's locks: one holder at a time, a busy lock that names its holder, no forked child that
keeps a dead holder's lock (storage/locks.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainjob.errors import PvcBusy
from trainjob.storage import locks
from trainjob.storage.pvc import Pvc


def test_second_lock_holder_is_told_to_relaunch(tmp_path):
    store = Pvc(tmp_path)
    with store.lock():
        with pytest.raises(PvcBusy, match="another trainjob run"):
            with Pvc(tmp_path).lock():
                pass
    with store.lock():  # released on exit
        pass


def test_lock_is_released_when_the_holder_dies(tmp_path):
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.close(fd)
    with Pvc(tmp_path).lock():
        pass


# --- issue 31: a lock no forked child keeps, and a busy lock that names its holder -------------

def test_a_busy_lock_names_its_holder_pid_host_and_since_when(tmp_path):
    with Pvc(tmp_path).lock():
        with pytest.raises(PvcBusy) as busy:
            with Pvc(tmp_path).lock():
                pass
    text = str(busy.value)
    assert f"pid {os.getpid()} on {socket.gethostname()} (" in text and "running since 20" in text, text
    assert "\n" not in text and text.endswith("; relaunch when it has exited")
    with Pvc(tmp_path).lock(1):
        with pytest.raises(PvcBusy, match=f"rank-1 process .* pid {os.getpid()} on "):
            with Pvc(tmp_path).lock(1):
                pass


def test_proc_locks_names_the_granted_holder_not_a_waiter():
    device = os.makedev(0xfe, 0)
    text = ("1: POSIX  ADVISORY  WRITE 700 08:01:55 0 EOF\n"
            "2: FLOCK  ADVISORY  WRITE 15064 fe:00:2155453 0 EOF\n"
            "2: -> FLOCK  ADVISORY  WRITE 999 fe:00:2155453 0 EOF\n")
    assert locks.holder_of(text, device, 2155453) == 15064
    assert locks.holder_of(text, device, 55) is None  # another device's inode 55


def test_lock_descriptors_are_close_on_exec(tmp_path):
    with Pvc(tmp_path).lock():
        held = [fd for fd in locks._HELD]
        assert len(held) == 2 and all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in held)
    assert not locks._HELD


HOLDER = '''
import multiprocessing, sys, time
from pathlib import Path
from trainjob.storage.pvc import Pvc

class Slow:
    def __len__(self): return 100
    def __getitem__(self, i): time.sleep(120); return i

(pvc := Pvc(Path(sys.argv[1]))).create()
with pvc.lock():
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    child.start()
    pids = [child.pid]
    if sys.argv[2] == "dataloader":
        from torch.utils.data import DataLoader
        workers = iter(DataLoader(Slow(), num_workers=2, multiprocessing_context="fork"))
        pids += [w.pid for w in workers._workers]
    print(*pids, flush=True)
    time.sleep(120)
'''


@pytest.mark.process
@pytest.mark.parametrize("children", ["fork", "dataloader"])
def test_a_sigkilled_holders_forked_children_do_not_keep_the_pvc_locked(tmp_path, children):
    """A multiprocessing fork, and DataLoader(num_workers=2) workers busy in a slow item: the
    holder is SIGKILLed, and the lock is free at once while its children live on."""
    if children == "dataloader":
        pytest.importorskip("torch")
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(tmp_path / "pvc"), children],
                              stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in holder.stdout.readline().split()]
    try:
        assert len(pids) == (3 if children == "dataloader" else 1), pids
        # A child closes its copies in Python's after-fork hook, which runs once the child is
        # scheduled: on a loaded machine that can be after the parent printed its pid.
        locked = {str(tmp_path / "pvc"), str(tmp_path / "pvc" / ".lock")}
        deadline = time.monotonic() + 30
        while any(open_paths(pid) & locked for pid in pids):
            assert time.monotonic() < deadline, "a forked child still holds the PVC's lock descriptors"
            time.sleep(0.05)
        holder.kill()
        holder.wait(30)
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)  # the children still run
        with Pvc(tmp_path / "pvc").lock():
            pass
    finally:
        holder.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def open_paths(pid: int) -> set[str]:
    """What the process's file descriptors point at."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            found.add(os.readlink(fd))
    return found


STALE = '''
import ctypes, os, sys, time
from pathlib import Path
from trainjob.storage.pvc import Pvc

(pvc := Pvc(Path(sys.argv[1]))).create()
with pvc.lock():
    child = ctypes.CDLL(None).fork()  # fork() from C, as a native library may: no Python at-fork hook runs
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    time.sleep(120)
'''


@pytest.mark.process
def test_a_lock_kept_by_a_child_forked_outside_python_names_the_holder_that_is_gone(tmp_path):
    script = tmp_path / "stale.py"
    script.write_text(STALE)
    holder = subprocess.Popen([sys.executable, str(script), str(tmp_path / "pvc")], stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        holder.kill()
        holder.wait(30)
        with pytest.raises(PvcBusy, match=f"pid {holder.pid} on .*, which has exited: a process it forked"):
            with Pvc(tmp_path / "pvc").lock():
                pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("rank", [0, 2])
def test_a_tidy_release_takes_away_only_the_lock_file_it_created(tmp_path, rank):
    """A refused launch (``tidy`` true) leaves the PVC as it found it: its own new lock file
    goes, one that was there before stays, and an untidy release keeps what it made."""
    name = ".lock" if rank == 0 else f".lock.rank-{rank:05d}"
    with Pvc(tmp_path).lock(rank, tidy=lambda: True):
        assert (tmp_path / name).is_file()
    assert list(tmp_path.iterdir()) == []
    with Pvc(tmp_path).lock(rank, tidy=lambda: False):
        pass
    inode = (tmp_path / name).stat().st_ino
    with Pvc(tmp_path).lock(rank, tidy=lambda: True):
        pass
    assert [p.name for p in tmp_path.iterdir()] == [name] and (tmp_path / name).stat().st_ino == inode
