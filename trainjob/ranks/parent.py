"""Ranks: a rank process does not outlive the launcher that started it.

torchrun starts each worker in a session of its own, so a SIGKILL of the launcher (its process
group, or the launcher alone: an OOM kill, a node agent) leaves the workers running: waiting on a
store that is gone, holding the PVC's locks, so relaunches find the PVC busy, and an orphan may
even finish the job while its relaunch is refused. So a rank asks the kernel to SIGKILL it the
moment its parent dies (Linux's ``prctl(PR_SET_PDEATHSIG)``, through ctypes; a no-op elsewhere),
at ``import trainjob`` (``trainjob/__init__.py`` calls ``die_with_launcher`` only when the
environment names a launcher), before the seconds a rank spends loading torch and joining.
SIGKILL, not SIGTERM: the launcher is gone, and with it (under torchrun) the store the ranks
would agree a last checkpoint through; every checkpoint already committed stands.

Which process is the launcher: ``$TRAINJOB_LAUNCHER_PID``, set by trainjob's own launchers (the
local launcher, ``trainjob torchrun``) for the ranks they start; under plain torchrun
(``$TORCHELASTIC_RUN_ID``, no pid), a worker is a session leader (torchrun starts each in a
session of its own) whose parent is torchrun, and one whose parent is not torchrun any more was
reparented: its agent is gone. A process that inherited the environment but is not a rank (a
DataLoader worker, a ``trainjob status`` a loop starts: its parent is alive and is not the
launcher, or it leads no session) is left alone. The race: a launcher that
died before the death signal was set cannot deliver it, so right after setting it the rank checks
that its parent is still the launcher, and ends at once (75) when the launcher is gone.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

LAUNCHER_PID = "TRAINJOB_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TORCHRUN = (b"torchrun", b"torch.distributed.run")


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[-1].split()[:1] != [b"Z"]  # a zombie has exited: only its entry is left


def _is_torchrun(pid: int) -> bool:
    try:
        command = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return any(part.endswith(name) for part in command[:3] for name in TORCHRUN)


def launcher_of_this_rank(env: Mapping[str, str], parent: int) -> int | None:
    """The launcher's pid when this process is a rank it started and it is alive (its parent);
    0 when the launcher this process belongs to is gone; None when no launcher is involved, or
    this process is not one of its ranks (a child of a rank)."""
    named = env.get(LAUNCHER_PID, "")
    if named.isdigit():
        pid = int(named)
        if pid == parent:
            return pid
        return None if _alive(pid) else 0  # alive but not the parent: a rank's child, not a rank
    if env.get("TORCHELASTIC_RUN_ID") and os.getsid(0) == os.getpid():
        # torchrun starts each worker as a session leader; a worker's own children are not (a
        # DataLoader worker), so this is a rank: its parent is the agent, or it was reparented
        # (to init, or to a subreaper: a container's init, a service manager) when the agent died.
        return parent if _is_torchrun(parent) else 0
    return None


def _set_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``; False where there is no such call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # only here: most processes never need it

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher(env: Mapping[str, str] = os.environ) -> None:
    """(a rank, first thing) Die with the launcher; SystemExit(75) now if it is already gone."""
    launcher = launcher_of_this_rank(env, os.getppid())
    if launcher is None:
        return
    if launcher and _set_death_signal() and os.getppid() == launcher:
        return  # set while the launcher lived: its death now ends this process
    if launcher and not sys.platform.startswith("linux"):
        return  # nothing to set here: the launcher's own stop is all there is
    print(f"trainjob: rank process {os.getpid()}: its launcher{f' (pid {launcher})' if launcher else ''} is gone; "
          "ending now so a relaunch finds the PVC free (exit 75)", file=sys.stderr, flush=True)
    raise SystemExit(75)
