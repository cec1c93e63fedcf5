"""A Slurm batch script that runs trainjob on a cluster: ``trainjob slurm render``.

Owns how trainjob's contract becomes an sbatch script. The job is requeueable and appends to its
output (``--requeue --open-mode=append``); ``--signal=TERM@GRACE`` warns the tasks GRACE seconds
before the time limit; the batch shell traps SIGTERM and keeps waiting, and never forwards it to
``srun`` (that kills the tasks at once, their checkpoint unwritten): Slurm signals the tasks
itself on ``scancel``, a requeue, a preemption and the time limit. When the launch ends, the
script asks ``trainjob slurm after`` what its code means (``policy.after_launch``: complete, fail,
or requeue) and requeues itself with ``scontrol requeue`` (array-aware), so a 75 runs again on a
cluster whose admin set no ``RequeueExit=75``. The count of launches in a row that committed no
checkpoint, which bounds requeues, lives in the job's own ``Comment`` (it survives requeues and
needs no storage, which may be what is failing); ``trainjob slurm before`` counts the log's
checkpoints before the launch.

The ranks: W = nodes x tasks per node ``srun`` tasks, each one rank (``SLURM_PROCID``: ranks/
identity.py), coordinating through files on the shared PVC; or, with ``nproc_per_node``, one
``trainjob torchrun`` per node, meeting at a c10d rendezvous on the job's first host
(``--rdzv-id=$SLURM_JOB_ID``), its shutdown timeout at least the grace, so torchrun does not
SIGKILL workers that Slurm still lets checkpoint. An own loop (``-- python SCRIPT ARGS``) runs
under torchrun at W > 1 (it reads torchrun's ``RANK``), with ``TRAINJOB_IDEMPOTENT=1`` as in a pod.

A launch of several tasks is read by trainjob's rule, not srun's: srun exits with the highest code
its tasks exited with (128 + the highest signal if one was killed by a signal), where trainjob's
``exits.job_exit`` lets the most telling code win (a 2 on one rank beside another's 75 is bad
input, not a kill). So each task runs under ``trainjob slurm task``, which exits with its rank's
code's place in that precedence (``task_status``): srun's highest is then the job's code, which
``launch_code`` reads back.

The grace (``--signal=TERM@GRACE``), when not given, is sized by ``grace_for`` from a measured
stop: ``cli.py`` times one short run of the job (a step and a checkpoint) on the PVC's filesystem.
Slurm sends the signal and ends a job at its time limit on slurmctld's 30 s timer
(``PERIODIC_TIMEOUT``), so the signal comes up to 30 s earlier than asked, and a grace must leave a
launch time to train.

It builds text only: it never talks to a cluster or reads a file. Every value that reaches the
shell is quoted with ``shlex.quote``. ``cli.py`` checks the run's flags with ``run``'s own parser
before rendering. docs/howto/slurm.md explains each line.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence

import attrs

from ..defaults import BACKOFF_LIMIT, IDEMPOTENT_ENV, VERSION
from ..errors import UsageError
from ..exits import EXIT_OK, PRECEDENCE, rank_exit
from .k8s import PVC_ENV, OwnLoop
from .policy import MAX_STALLS

# The job's Comment while it runs: launches in a row without a new checkpoint (policy.after_launch).
STALLS = "trainjob-stalls"
RDZV_PORT_BASE = 29400  # torchrun's default; the job id is added (mod PORT_SPAN), so jobs sharing a node differ
PORT_SPAN = 1000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+")  # sbatch's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_PARTITION = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")

DEFAULT_GRACE = 60  # seconds, when no stop was measured (an own loop, a bucket PVC)
MIN_GRACE = 10
SCRIPT_SECONDS = 10  # after the tasks stop: the script's `slurm after` and its `scontrol requeue`
SLURMCTLD_PERIOD = 30  # slurmctld's timer for --signal and time limits (PERIODIC_TIMEOUT)


def time_seconds(time: str) -> int:
    """sbatch's --time (``_TIME``'s forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    days, _, clock = time.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:  # M, M:S, H:M:S
        hours, minutes, seconds = ([0] + parts + [0])[:3] if len(parts) < 3 else parts
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def grace_for(stop: float | None, limit: int | None, unmeasured: str = "nothing was measured") -> tuple[int, str]:
    """The grace when ``--grace`` is not given, and why: twice ``stop`` (seconds a measured run of
    a step and a checkpoint took: the storage of a busy node may be slower) plus the script's own
    verdict and requeue, at least ``MIN_GRACE``; ``DEFAULT_GRACE`` when nothing was measured.
    Under a time limit of ``limit`` seconds at most half of what the limit leaves after slurmctld's
    timer (a launch then trains at least as long as it may take to stop); UsageError when that is
    less than the measured stop itself. ``unmeasured`` says why nothing was measured."""
    if stop is None:
        grace, why = DEFAULT_GRACE, f"the default, as {unmeasured}"
    else:
        # Up to the tenth the reason shows, so that the grace is what a reader of it would compute
        # (3.54 s shown as "3.5" gave 18, not 2 * 3.5 + 10 = 17: the clean-clone CI caught it).
        stop = math.ceil(round(stop * 10, 6)) / 10
        grace = max(MIN_GRACE, math.ceil(2 * stop) + SCRIPT_SECONDS)
        why = f"twice the {stop:.1f} s a step and a checkpoint took at render, plus {SCRIPT_SECONDS} s"
    if limit is None:
        return grace, why
    room = (limit - SLURMCTLD_PERIOD) // 2
    if room < max(1, math.ceil(stop or 0)):
        need = f"a stop measured {stop:.1f} s" if stop is not None else "any stop"
        raise UsageError(f"--time of {limit} s leaves no room for {need} (Slurm may signal up to "
                         f"{SLURMCTLD_PERIOD} s early, and a launch should train at least as long as it takes to "
                         "stop): ask for more --time, or give --grace")
    if grace > room:
        return room, f"{why}, cut to half of what the time limit leaves"
    return grace, why


# What `trainjob slurm task` exits with for its rank's code: 0 for 0 (any other code is a bad
# exit to srun --kill-on-bad-exit), then trainjob's codes from the least telling up, from 96: clear
# of trainjob's own codes and of 128 + N, which srun reports for a task killed by a signal (a task
# SIGKILLed when KillWait ran out: a kill, 75, whatever its peers said).
TASK_BASE = 96
TASK_STATUS = {EXIT_OK: 0, **{code: TASK_BASE + place for place, code in
                              enumerate(c for c in reversed(PRECEDENCE) if c != EXIT_OK)}}
_CODE_OF_TASK_STATUS = {status: code for code, status in TASK_STATUS.items()}


def task_status(code: int) -> int:
    """What a task exits with for its rank's exit status (negative: a signal), read by ``rank_exit``."""
    return TASK_STATUS[rank_exit(code)]


def launch_code(status: int) -> int:
    """trainjob's code for srun's exit status over ``trainjob slurm task``s: the most telling rank's,
    except that a 0 beside a 75 reads 75 (0 is the least of srun's codes; the log's ``completed``
    then ends the job, ``policy.after_launch``). Any other status (srun's own failure, a task killed
    by a signal) is read as a rank's."""
    return _CODE_OF_TASK_STATUS.get(status, rank_exit(status))


@attrs.frozen
class Target:
    """What to render: the ``slurm render`` flags, with the run's arguments already checked."""

    pvc: str  # a shared directory (absolute) or s3://BUCKET/PREFIX
    log: str = ""  # the run's --log, when not PVC/log.jsonl
    name: str = "trainjob"
    nodes: int = 1
    ntasks_per_node: int = 1  # srun tasks per node, each a rank
    nproc_per_node: int = 0  # > 0: one `trainjob torchrun` per node, this many ranks each
    time: str = ""
    partition: str = ""
    grace: int | None = None  # None: not given, so sized (grace_for) before the script is built
    grace_why: str = ""  # how a sized grace was chosen, for the script's comment
    backoff_limit: int = BACKOFF_LIMIT
    max_stalls: int = MAX_STALLS
    run_args: tuple[str, ...] = ()  # extra `trainjob run` flags, after --pvc, --backoff-limit and --idempotent
    loop: OwnLoop | None = None  # an own loop's script, in place of `trainjob run`
    trainjob: str = "trainjob"  # how the nodes start trainjob

    @property
    def world_size(self) -> int:
        return self.nodes * (self.nproc_per_node or self.ntasks_per_node)

    @property
    def torchrun(self) -> bool:
        return self.nproc_per_node > 0

    @property
    def tasks(self) -> int:
        """The launch's srun tasks: one per rank, or one ``trainjob torchrun`` per node."""
        return self.nodes if self.torchrun else self.world_size

    def check(self) -> None:
        """Raise UsageError for a flag sbatch would reject or that breaks the contract."""
        if not _NAME.fullmatch(self.name):
            raise UsageError(f"--name must be letters, digits, '.', '_' or '-' (at most 128), got {self.name!r}")
        for flag, value in (("--nodes", self.nodes), ("--ntasks-per-node", self.ntasks_per_node)):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1, got {value}")
        if self.nproc_per_node < 0:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.torchrun and self.ntasks_per_node != 1:
            raise UsageError("--nproc-per-node runs one `trainjob torchrun` per node: drop --ntasks-per-node")
        if self.time and not _TIME.fullmatch(self.time):
            raise UsageError(f"--time must be sbatch's MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS or "
                             f"DAYS-HOURS[:MINUTES[:SECONDS]], got {self.time!r}")
        if self.partition and not _PARTITION.fullmatch(self.partition):
            raise UsageError(f"--partition must be a partition name (or several, comma-separated), "
                             f"got {self.partition!r}")
        if self.grace is not None and self.grace < 1:  # 0: SIGKILL at once, no checkpoint, the step lost
            raise UsageError(f"--grace must be at least 1 second, long enough to checkpoint, got {self.grace}")
        if self.grace is not None and self.time and self.grace + SLURMCTLD_PERIOD >= time_seconds(self.time):
            raise UsageError(f"--grace {self.grace} with --time {self.time}: Slurm may signal up to "
                             f"{SLURMCTLD_PERIOD} s before the grace, which is as the job starts; ask for more "
                             "--time or a shorter --grace")
        if self.max_stalls < 1:
            raise UsageError(f"--max-stalls must be at least 1, got {self.max_stalls}")
        if self.world_size > 1 and not self.torchrun:
            if self.loop is not None:
                raise UsageError("an own loop reads its rank from torchrun: at W > 1 give --nproc-per-node "
                                 "(one `trainjob torchrun` per node), not --ntasks-per-node")
            if self.pvc.startswith("s3://"):
                raise UsageError(f"{self.pvc}: a bucket PVC runs W > 1 ranks under torchrun (they agree through "
                                 "its store): give --nproc-per-node; srun tasks agree through files on a directory")
        if self.world_size > 1:
            from ..checkpoint.plan import world_size_problem  # records and cattrs: only when W > 1

            if (problem := world_size_problem(self.world_size)) is not None:
                raise UsageError(problem)

    def run_flags(self) -> list[str]:
        """The `trainjob run` flags every rank passes: the job's PVC and budget, idempotent (a
        launch after the job completed verifies the artifact and exits 0, never the refusal)."""
        return ["--pvc", self.pvc, "--backoff-limit", str(self.backoff_limit), "--idempotent", *self.run_args]

    def program(self) -> list[str]:
        """What each rank runs: ``trainjob run`` (under torchrun: ``-m trainjob run``), or the loop."""
        ranks = ["--world-size", str(self.world_size)] if self.world_size > 1 else []
        if self.loop is not None:
            return ([] if self.torchrun else [self.loop.python]) + [*self.loop.program, *self.loop.args]
        run = ["-m", "trainjob", "run"] if self.torchrun else [self.trainjob, "run"]
        return [*run, *self.run_flags(), *ranks]

    def step(self) -> list[str]:
        """The launch: ``srun`` (a task's non-zero exit ends the step's other tasks), each task a
        rank, or one ``trainjob torchrun`` per node; several tasks each under ``trainjob slurm task``."""
        srun = ["srun", "--kill-on-bad-exit=1", *(["--ntasks-per-node=1"] if self.torchrun else []),
                *([self.trainjob, "slurm", "task", "--"] if self.tasks > 1 else [])]
        if not self.torchrun:
            return [*srun, *self.program()]
        return [*srun, self.trainjob, "torchrun", "--nnodes", str(self.nodes),
                "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", '"$head:$port"', "--rdzv-id", '"$SLURM_JOB_ID"', "--max-restarts", "0",
                # torchrun SIGKILLs its workers this long after passing SIGTERM on: not before Slurm would.
                "--shutdown-timeout", str(self.grace), *self.program()]

    def judge(self) -> list[str]:
        """Where the after-launch judgment reads the job: the PVC, its log, the budget (``run``
        only: an own loop's budget is its script's, and its log says when it is spent)."""
        where = ["--pvc", self.pvc, *(["--log", self.log] if self.log else [])]
        return where if self.loop is not None else [*where, "--backoff-limit", str(self.backoff_limit)]


def _words(words: Sequence[str]) -> str:
    """A command line for the shell: each word quoted, except the script's own "$variables"."""
    return " ".join(w if w.startswith('"$') else shlex.quote(w) for w in words)


def script(target: Target) -> str:
    """The sbatch script, ``#SBATCH`` lines first (sbatch reads them only before the first command)."""
    assert target.grace is not None, "size the grace (grace_for) before building the script"
    options = [f"--job-name={target.name}", f"--nodes={target.nodes}",
               f"--ntasks-per-node={1 if target.torchrun else target.ntasks_per_node}",
               "--requeue", "--open-mode=append", f"--signal=TERM@{target.grace}",
               *([f"--time={target.time}"] if target.time else []),
               *([f"--partition={target.partition}"] if target.partition else [])]
    tj = shlex.quote(target.trainjob)
    judge = _words(target.judge())
    env = [f"export {IDEMPOTENT_ENV}=1"]
    if target.loop is not None and target.torchrun:
        env.append(f"export {PVC_ENV}={shlex.quote(target.pvc)}")  # trainjob torchrun's completion check
    rendezvous = []
    if target.torchrun:
        rendezvous = ['head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                      f"port=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))"]
    lines = [
        "#!/bin/bash",
        f"# Rendered by `trainjob slurm render` (trainjob {VERSION}); docs/howto/slurm.md explains each line.",
        *(f"#SBATCH {option}" for option in options),
        *([f"# The grace, TERM@{target.grace}: {target.grace_why} (render --grace S to choose it)."]
          if target.grace_why else []),
        "set -u",
        *env,
        "# The job as scontrol names it: an array task's own ARRAYJOB_TASK, else the job.",
        'job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}',
        'job=${job:-$SLURM_JOB_ID}',
        "# SIGTERM (scancel, a requeue, a preemption) reaches the tasks from Slurm itself. This shell",
        "# survives its own and keeps waiting for their verdict; it never forwards it to srun, which",
        "# would kill them at once, their checkpoint unwritten.",
        "trap 'echo \"trainjob slurm: SIGTERM: waiting for the tasks to checkpoint and exit\" >&2' TERM",
        *rendezvous,
        "# The log's checkpoints before this launch: a launch that adds none has made no progress.",
        f"before=$({tj} slurm before {judge} || echo -)",
        *(["# Each task under `trainjob slurm task`: srun's highest code is then the most telling rank's."]
          if target.tasks > 1 else []),
        f"{_words(target.step())} &",
        "launch=$!",
        'while kill -0 "$launch" 2>/dev/null; do wait "$launch"; done',
        'wait "$launch"; code=$?',
        "# What the launch's code makes the job do; launches without progress so far, from the job's Comment.",
        f"stalls=$(scontrol show job \"$job\" -o 2>/dev/null | sed -n 's/.*Comment={STALLS}=\\([0-9]*\\).*/\\1/p')",
        f"verdict=$({tj} slurm after --code \"$code\"{' --from-tasks' if target.tasks > 1 else ''} "
        f"--before \"$before\" --stalls \"${{stalls:-0}}\" --max-stalls {target.max_stalls} {judge})",
        'read -r action exit stalls <<<"$verdict"',
        'case "${action:-}" in',
        "    complete|fail) exit \"$exit\" ;;",
        f"    requeue) scontrol update JobId=\"$job\" Comment=\"{STALLS}=$stalls\" || true",
        '             scontrol requeue "$job" || echo "trainjob slurm: scontrol requeue $job failed; the job '
        'ends here (submit it again to resume)" >&2',
        '             exit "$exit" ;;',
        '    *) echo "trainjob slurm: the launch exited $code and trainjob slurm after could not judge it; '
        'not requeued" >&2; exit 70 ;;',
        "esac",
    ]
    return "\n".join(lines) + "\n"
