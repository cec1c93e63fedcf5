"""Ranks: ``trainjob torchrun``, torchrun whose exit code is the job's, not the launcher's.

    trainjob torchrun [torchrun's flags] -m trainjob run ARGS...    what a W > 1 pod runs
    trainjob torchrun [torchrun's flags] your_loop.py ARGS...       your own ``trainjob.Run`` loop

Plain torchrun exits 1 when any worker fails, whatever that worker's code (2, 70 and 75 all look
alike), and ends by the signal (143 in a container) when it is sent SIGTERM. This runs torch's own
launcher (``torch.distributed.run``, the same flags and the same agent) in this process and exits
with ``exits.job_exit`` of its workers' codes instead.

Each worker says which code it decided (``report``: ``trainjob run`` and ``Run`` call it) in a
file of a directory this launcher names in ``$TRAINJOB_EXIT_DIR``, because torch's launcher API
loses the codes exactly when they matter most: after a signal (it stops its workers and raises
``SignalException``) and after it lost the rendezvous store (a peer's node died). A worker's report
beats its process status (an outcome decided stays decided, whatever stops the process then);
a worker that reported nothing is read by its status (1 there is a crash: 70), and one that
torch's launcher stopped, or a launch that never started its workers (the rendezvous timed out,
a signal came first), is 75.

Must not import torch at module level (``trainjob --help`` stays light); ``launch`` does.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import TrainJobError, TryAgainLater
from ..exits import EXIT_FAILED, EXIT_INTERNAL, EXIT_OK, job_exit
from ..storage.durable import atomic_write
from .parent import LAUNCHER_PID

REPORT_DIR = "TRAINJOB_EXIT_DIR"


def report(code: int, env: Mapping[str, str] = os.environ) -> None:
    """(a worker of ``trainjob torchrun``) Say which exit code this process decided on; a no-op
    under any other launcher. A report that cannot be written costs its precision (the launcher
    falls back to the process's status), never the process's own exit code."""
    where = env.get(REPORT_DIR)
    if not where:
        return
    try:
        atomic_write(Path(where) / f"local-rank-{int(env.get('LOCAL_RANK', '0'))}", f"{code}\n".encode())
    except (TrainJobError, ValueError):
        pass


def _reported(where: Path) -> dict[int, int]:
    codes = {}
    for path in where.glob("local-rank-*"):
        try:
            codes[int(path.name.removeprefix("local-rank-"))] = int(path.read_text())
        except ValueError:
            pass  # a torn report: the process's status speaks for it
    return codes


def run_args(argv: Sequence[str]) -> list[str] | None:
    """The ``trainjob run`` arguments of a torchrun command line that runs ``-m trainjob run``,
    else None (a script of the user's own). Read without torch's parser, whose import alone takes
    seconds: a pod on a finished job must not wait for it."""
    for i in range(len(argv) - 1):
        if argv[i:i + 2] == ["trainjob", "run"] and {"-m", "--module"} & set(argv[:i]):
            return list(argv[i + 2:])
    return None


def _stopped(signum: int, _frame: object) -> None:
    raise TryAgainLater(f"stopped by {signal.Signals(signum).name} before any worker started")


def stop_on_signals() -> None:
    """(first) A SIGTERM or SIGINT before the agent starts its workers (and installs handlers of
    its own, which stop them) ends the launch with 75, not by the signal (143 in a container)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stopped)


def launch(argv: Sequence[str]) -> int:
    """Run torchrun with ``argv`` in this process; the job's exit code (module docstring)."""
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = torchrun.parse_args(list(argv))
    statuses: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="trainjob-exits-") as where:
        os.environ[REPORT_DIR] = where  # the workers inherit it
        os.environ[LAUNCHER_PID] = str(os.getpid())  # the agent runs here: its workers die with it (parent.py)
        succeeded = False
        try:
            torchrun.run(args)
            succeeded, ended = True, "every worker succeeded"
        except ChildFailedError as exc:
            statuses = {failure.local_rank: failure.exitcode for failure in exc.failures.values()}
            ended = "a worker failed"
        except (SignalException, TryAgainLater, RendezvousError, RuntimeError) as exc:  # RuntimeError: DistError
            ended = f"stopped: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):  # decided now: a late signal must not change it
                signal.signal(sig, signal.SIG_IGN)
        reported = _reported(Path(where))
    codes = {**statuses, **reported}
    code = launch_code(succeeded, statuses, reported)
    print(f"trainjob torchrun: {ended}; workers' codes {dict(sorted(codes.items()))}; the job's is {code}",
          file=sys.stderr, flush=True)
    return code


def launch_code(succeeded: bool, statuses: Mapping[int, int], reported: Mapping[int, int]) -> int:
    """The job's code from what the agent said (``succeeded``: every worker exited 0), the
    failed workers' ``statuses`` and the codes workers ``reported``, which win. An unreported 1 is
    a crash (Python's exit on an uncaught exception), never an honest failure. A worker neither
    reported nor failed exited 0 when the agent succeeded; otherwise the agent stopped it, or it
    never started: 75 (``job_exit`` of no code at all)."""
    codes = {**{r: EXIT_INTERNAL if s == EXIT_FAILED else s for r, s in statuses.items()}, **reported}
    return job_exit([*codes.values(), EXIT_OK] if succeeded else codes.values())
