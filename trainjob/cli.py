"""The command line: parses arguments, calls the engine, and turns every outcome into an exit code.

The codes themselves, and which error and which final state gets which, are ``exits.py``'s (the
one table, shared with the engine's ``Run``). Output that cannot be written (stdout closed with
``>&-``) is an error too. The same contract read the other ways lives here: how ``supervise``
reads its child's exit code and which code it exits with, which Job action ``k8s render``
gives each code, and what ``slurm after`` answers a rendered batch script (``policy.after_launch``).

``trainjob run`` is one client of the engine's ``Run`` (``train`` below drives a Trainer through
it), as a user's own training script is another.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .defaults import VERSION
from .deploy import k8s, policy, slurm
from .engine.config import DEFAULT_LOG, RunConfig, idempotent_from
from .errors import (InputError, TrainJobError, UsageError, importing, missing_extra, one_line, open_regular,
                     os_errors)
from .exits import (EXIT_FAILED, EXIT_FOR_STATE, EXIT_INTERNAL, EXIT_OK, EXIT_RELAUNCH, EXIT_USAGE,
                    exit_code_for, job_exit)
from .storage.backend import Url, location as _storage_location
from .storage.durable import check_path
from .trainers.builtin import BUILTIN, DATASETS
from .views.diagram import ENGINE as DIAGRAM_FORMATS

# Above: what parsing the command line needs, and nothing more. Every command imports the rest
# (the engine, numpy, transitions' diagrams, YAML, matplotlib) inside its own function, so that
# `trainjob --help` and `trainjob status` start in a blink (tests/test_startup.py pins the set).


# `supervise` reads its child's exit code through this table; any other code (70, a signal, an
# OOM kill) is a crash. It exits with the code for how the last start ended.
SAID_BY_EXIT: dict[int, policy.Said] = {
    EXIT_OK: "ok", EXIT_FAILED: "failed", EXIT_USAGE: "usage", EXIT_RELAUNCH: "relaunch"}
EXIT_FOR_ENDING: dict[str, int] = {
    **EXIT_FOR_STATE, "input_error": EXIT_USAGE,
    # A child that kept crashing, or claimed success its log does not show: never 1.
    "crashed": EXIT_INTERNAL, "inconsistent": EXIT_INTERNAL,
}
# The Job action for each exit code (docs/kubernetes.md explains each): retrying an input error
# cannot help; the rest are counted against backoffLimit, which k8s.py sizes so that the Job ends
# on the pod that logs job_failed. Preemption is ignored before any exit code is looked at.
JOB_ACTION_FOR_EXIT = {EXIT_USAGE: "FailJob", EXIT_FAILED: "Count", EXIT_INTERNAL: "Count",
                       EXIT_RELAUNCH: "Count"}


def shown_default(action: argparse.Action) -> str | None:
    """The default ``--help`` (and the CLI reference, scripts/mkdocs_hooks.py) shows for an
    argument, or None: a flag without a value (``--quiet``), an unset default (None: the help
    says what stands in, such as ``$WORLD_SIZE``) and an empty one (the help says what it means)
    show none."""
    default = action.default
    if action.nargs == 0 or default is None or default == "" or default is argparse.SUPPRESS:
        return None
    return str(default)


class _Help(argparse.HelpFormatter):
    """Each argument's help ends with its default, where it has one to show (``shown_default``)
    and the help does not say it already (``%(default)s``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = shown_default(action)
        if shown is None or "%(default)" in text:
            return text
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: the usage is one --help away.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _weights(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three numbers like 0,0,0, got {text!r}") from None
    if len(values) != 3 or not all(math.isfinite(x) for x in values):
        raise argparse.ArgumentTypeError(f"expected three finite numbers like 0,0,0, got {text!r}")
    return values  # type: ignore[return-value]


def location_arg(text: str) -> object:
    """A ``--pvc``/``--log`` value: a path or ``s3://BUCKET/PREFIX``; a malformed URL is a usage
    error naming what is wrong."""
    try:
        return _storage_location(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainjob", description="A training job that refuses silent success.")
    parser.add_argument("--version", action="version", version=f"trainjob {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("gen", help="write a data set (train, holdout, baseline): the lab's, or digits")
    gen.add_argument("--dataset", choices=list(DATASETS), default="lab",
                     help="lab (the toy data) or digits (scikit-learn's, needs trainjob[digits])")
    gen.add_argument("dir", type=Path, help="directory to write train.jsonl, holdout.jsonl and baseline.json into")

    r = sub.add_parser("run", help="train, checkpoint, gate and publish; resumes a cut-short attempt")
    d = RunConfig()
    r.add_argument("--pvc", type=location_arg, required=True,
                   help="durable directory (or s3://BUCKET/PREFIX) for state, checkpoints, artifacts")
    r.add_argument("--data", type=Path, help="data directory from `trainjob gen` (default: the embedded lab data)")
    r.add_argument("--trainer", default=d.trainer,
                   help=f"the model: {', '.join(BUILTIN)}, or package.module:factory "
                        "(docs/trainers.md)")
    r.add_argument("--log", type=location_arg, help=f"decision log (default: PVC/{DEFAULT_LOG})")
    r.add_argument("--steps", type=int, default=d.steps, help="training steps in all")
    r.add_argument("--ckpt-every", type=int, default=d.ckpt_every,
                   help="checkpoint every this many steps, and at the last one")
    r.add_argument("--lr", type=float, default=d.lr,
                   help="learning rate, passed to the trainer; a resume with another one exits 2")
    r.add_argument("--max-drop", type=int, default=d.max_drop, help="allowed drop vs baseline, percent")
    r.add_argument("--backoff-limit", type=int, default=d.backoff_limit, help="fresh attempts allowed after the first")
    r.add_argument("--die-at", type=int, help="teaching hook: exit 75 after this step (and its checkpoint)")
    r.add_argument("--force-weights", type=_weights, metavar="W0,W1,W2",
                   help="teaching hook (linear trainer only): gate these weights (bias 0) instead of the trained ones")
    r.add_argument("--keep", type=int, default=d.keep, help="committed checkpoints to keep (at least 1)")
    r.add_argument("--world-size", type=int,
                   help="number of ranks (default: $WORLD_SIZE, else 1); without a rank, starts them all here")
    r.add_argument("--rank", type=int,
                   help="this process's rank (default: $RANK, else an srun task's $SLURM_PROCID, else "
                        "$JOB_COMPLETION_INDEX); 0 coordinates")
    r.add_argument("--rank-timeout", type=float, default=d.rank_timeout,
                   help="seconds any wait for another rank may take before exiting 75")
    r.add_argument("--async-checkpoint", action="store_true",
                   help="write each checkpoint on a background thread while training goes on (one extra copy "
                        "of the state in host memory; docs/howto/async.md: when to choose it)")
    r.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (a line rewritten on a terminal, else a line per checkpoint); "
                        "the line saying how the run ended, and any error, are still printed")
    r.add_argument("--idempotent", action="store_true",
                   help="a relaunch of a completed job exits 0 once its artifact verifies, touching nothing "
                        "(what supervise and the k8s Job pass; TRAINJOB_IDEMPOTENT=1 does the same); without it, "
                        "such a relaunch is refused (exit 2)")

    v = sub.add_parser("verify", help="check every checkpoint and artifact on a PVC; exit 0 only if sound")
    v.add_argument("--pvc", type=location_arg, required=True, help="the PVC directory (or s3://BUCKET/PREFIX) to check")
    v.add_argument("--log", type=location_arg, help=f"decision log holding the artifacts' hashes (default: PVC/{DEFAULT_LOG})")
    v.add_argument("--json", action="store_true", help="one JSON object instead of a line per item")

    rs = sub.add_parser("reshard", help="rewrite a checkpoint for another world size (the source is kept)")
    rs.add_argument("--pvc", type=location_arg, required=True, help="the PVC directory (or s3://BUCKET/PREFIX)")
    rs.add_argument("--world-size", type=int, required=True, help="the number of ranks to write the copy for")
    rs.add_argument("--step", type=int, help="the step to reshard (default: the newest that verifies)")
    rs.add_argument("--drop-rank-local", action="store_true",
                    help="reshard a checkpoint holding rank-local state (RNG streams, loader positions) without it")
    rs.add_argument("--log", type=location_arg, help=f"decision log (default: PVC/{DEFAULT_LOG})")

    s = sub.add_parser("status", help="summarise a decision log; exit code says how the job stands")
    s.add_argument("log", type=location_arg,
                   help=f"the decision log (PVC/{DEFAULT_LOG}, or the PVC directory itself, or an s3:// URL)")
    shape = s.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="the summary as one JSON object")
    shape.add_argument("--path", action="store_true",
                       help="print the log's path through the state machine; exit 1 if no run could take it")

    tr = sub.add_parser("torchrun", add_help=False, prefix_chars="\0",  # every argument is torchrun's
                        help="torchrun (same flags) exiting with the job's code: 0, 1, 2, 70 or 75, as `run` does")
    tr.add_argument("torchrun_argv", nargs=argparse.REMAINDER, metavar="TORCHRUN ARGS",
                    help="torchrun's flags, then `-m trainjob run ARGS` or your script and its arguments")

    child = dict(nargs="*", metavar="-- run ARGS", help="the `trainjob run` command line, after --")
    sv = sub.add_parser("supervise", help="run `trainjob run` as a child, relaunch it like a Job controller")
    sv.add_argument("--max-starts", type=int,
                    help=f"starts in all, relaunches included (default: the run's --backoff-limit "
                         f"+ {2 + policy.SPARE_STARTS})")
    sv.add_argument("--backoff-base", type=float, default=10.0,
                    help="seconds before the first relaunch")
    sv.add_argument("--backoff-cap", type=float, default=600.0,
                    help="longest wait between starts, seconds")
    sv.add_argument("--grace", type=float, default=30.0,
                    help="seconds a signalled child gets to checkpoint before SIGKILL")
    sv.add_argument("child", **child)

    pr = sub.add_parser("prove", help="kill your training command at random instants; exit 0 only if every "
                                      "resume reaches the uninterrupted run's bytes")
    pr.add_argument("--kills", type=int, default=4, help="trials, each killed once")
    pr.add_argument("--seed", type=int, default=0, help="seeds the instants within each phase")
    pr.add_argument("--signal", choices=("KILL", "TERM", "both"), default="KILL",
                    help="what each trial receives (both: alternating)")
    pr.add_argument("--twice", action="store_true",
                    help="run the reference twice first: a command that differs from itself is reported as such")
    pr.add_argument("cmd", nargs="*", metavar="-- CMD", help="the command, with {pvc} where its PVC goes")

    kube = sub.add_parser("k8s", help="Kubernetes manifests for running trainjob on a cluster")
    kube_sub = kube.add_subparsers(dest="k8s_command", required=True, parser_class=_Parser)
    kr = kube_sub.add_parser("render", help="print YAML for a PersistentVolumeClaim and a Job")
    t = k8s.Target()
    kr.add_argument("--name", default=t.name, help="Job name (DNS-1123 label); the claim is NAME-data")
    kr.add_argument("--image", default=t.image, help="container image with trainjob installed")
    kr.add_argument("--storage", default=t.storage, help="PVC size, a Kubernetes quantity")
    kr.add_argument("--world-size", type=int, default=t.world_size,
                    help="ranks; above 1 renders an Indexed Job on a ReadWriteMany claim")
    kr.add_argument("--backoff-limit", type=int, default=t.backoff_limit,
                    help="the run's retry budget; the Job's backoffLimit is this + 1")
    kr.add_argument("--grace", type=int, default=t.grace,
                    help="terminationGracePeriodSeconds")
    kr.add_argument("--deadline", type=int, default=t.deadline, help="activeDeadlineSeconds")
    kr.add_argument("--pvc", type=location_arg,
                    help="s3://BUCKET/PREFIX: keep the job's files in a bucket instead of a claim (no PVC rendered)")
    kr.add_argument("--s3-secret", default="",
                    help="with an s3:// --pvc: the Secret whose AWS_* keys the pod gets (default: NAME-s3)")
    kr.add_argument("child", nargs="*", metavar="-- run ARGS | -- python SCRIPT ARGS",
                    help="extra `trainjob run` flags, or an own loop (a script around trainjob.Run, with "
                         "--pvc {pvc}) that the pods run made idempotent (docs/kubernetes.md)")

    sl = sub.add_parser("slurm", help="a Slurm batch script that runs trainjob, requeued by its exit code")
    sl_sub = sl.add_subparsers(dest="slurm_command", required=True, parser_class=_Parser)
    sr = sl_sub.add_parser("render", help="print an sbatch script (docs/howto/slurm.md)")
    st = slurm.Target(pvc="")
    sr.add_argument("--pvc", type=location_arg,
                    help="a directory every node sees (or s3://BUCKET/PREFIX) for the job's files; an own loop "
                         "may name it in its own --pvc instead")
    sr.add_argument("--name", default=st.name, help="the job's name (default %(default)s)")
    sr.add_argument("--nodes", type=int, default=st.nodes, help="nodes (default %(default)s)")
    sr.add_argument("--ntasks-per-node", type=int, default=st.ntasks_per_node,
                    help="srun tasks per node, each a rank (default %(default)s)")
    sr.add_argument("--nproc-per-node", type=int, default=st.nproc_per_node,
                    help="instead: one `trainjob torchrun` per node with this many ranks (c10d rendezvous on the "
                         "first host)")
    sr.add_argument("--time", default=st.time, help="the job's time limit, as sbatch --time takes it")
    sr.add_argument("--partition", default=st.partition, help="the partition(s), as sbatch --partition takes them")
    sr.add_argument("--grace", type=int,
                    help="seconds between SIGTERM and the time limit (--signal=TERM@GRACE), at least a step's and a "
                         "checkpoint's time (default: twice what one short run of the job took here, plus 10; "
                         f"{slurm.DEFAULT_GRACE} for an own loop)")
    sr.add_argument("--backoff-limit", type=int, default=st.backoff_limit,
                    help="the run's retry budget: a failed gate is requeued while it has attempts left")
    sr.add_argument("--max-stalls", type=int, default=st.max_stalls,
                    help="launches in a row without a new checkpoint before the job stops (default %(default)s)")
    sr.add_argument("--trainjob", default=st.trainjob, help="how the nodes start trainjob (default %(default)s)")
    sr.add_argument("child", nargs="*", metavar="-- run ARGS | -- python SCRIPT ARGS",
                    help="extra `trainjob run` flags, or an own loop (a script around trainjob.Run, with "
                         "--pvc {pvc})")
    for name, helped in (("before", "(the rendered script's) count the log's checkpoints before a launch"),
                         ("after", "(the rendered script's) what a launch's exit code makes the job do")):
        judge = sl_sub.add_parser(name, help=helped)
        judge.add_argument("--pvc", type=location_arg, required=True, help="the job's PVC")
        judge.add_argument("--log", type=location_arg, help=f"decision log (default: PVC/{DEFAULT_LOG})")
        judge.add_argument("--backoff-limit", type=int,
                           help="the run's retry budget (absent: an own loop's, read from its log)")
        if name == "after":
            judge.add_argument("--code", type=int, required=True, help="the launch's exit code")
            judge.add_argument("--from-tasks", action="store_true",
                               help="the code is srun's over `trainjob slurm task`s (their ranks' most telling)")
            judge.add_argument("--before", required=True, help="what `slurm before` printed (- if nothing)")
            judge.add_argument("--stalls", type=int, default=0, help="launches in a row without progress so far")
            judge.add_argument("--max-stalls", type=int, default=st.max_stalls, help="the bound on them")

    tk = sl_sub.add_parser("task", help="(the rendered script's) run one srun task's rank; exit with its code's "
                                        "place in trainjob's precedence, so that srun's highest is the job's")
    tk.add_argument("rank_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS", help="the rank's command")

    dg = sub.add_parser("diagram", help="draw the state machine, or the path a logged run took through it")
    dg.add_argument("--format", choices=list(DIAGRAM_FORMATS),
                    help="default: the one -o's suffix names (.mmd .dot .svg .png), else mermaid")
    dg.add_argument("-o", "--output", type=Path, help="write here instead of to stdout")
    dg.add_argument("--log", type=location_arg, help="highlight the path this decision log took")

    p = sub.add_parser("plot", help="plot a logged run (needs trainjob[plot]): losses, kills, resumes, verdict")
    p.add_argument("log", type=Path, help="the decision log to plot")
    p.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    p.add_argument("--max-drop", type=int, help="draw the gate's pass line for completed attempts "
                   "(their log line does not record the allowed drop)")

    rp = sub.add_parser("replay", help="one HTML page that steps through a log on the machine (needs Graphviz's dot)")
    rp.add_argument("log", type=Path, help="the decision log to step through")
    rp.add_argument("-o", "--output", type=Path, required=True, help="HTML file to write")
    return parser


def cmd_gen(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{directory}: exists and is not a directory")
    with importing("the command's modules"):
        from .storage.durable import atomic_write, make_dir

    dataset = DATASETS[args.dataset]
    files = dataset.generate()  # before creating anything: a missing optional package is exit 2
    make_dir(directory)
    for name, data in files.items():  # check all before writing any: refuse to overwrite different data
        path = directory / name
        with os_errors(path, "cannot read", InputError):
            if not os.path.lexists(path):
                continue
            with open(open_regular(path), "rb") as existing:  # a FIFO or a device: refused, not read
                if existing.read(len(data) + 1) != data:
                    raise InputError(f"{path}: exists with different contents; refusing to overwrite it")
    for name, data in files.items():
        atomic_write(directory / name, data)
    emit(f"wrote {dataset.summary} to {directory}")
    return EXIT_OK


def _run_config(args: argparse.Namespace, world_size: int = 1) -> RunConfig:
    return RunConfig(steps=args.steps, ckpt_every=args.ckpt_every, lr=args.lr, max_drop=args.max_drop,
                     backoff_limit=args.backoff_limit, die_at=args.die_at, force_weights=args.force_weights,
                     keep=args.keep, world_size=world_size, rank_timeout=args.rank_timeout, trainer=args.trainer,
                     async_checkpoint=args.async_checkpoint)


def _log_path(args: argparse.Namespace) -> Path:
    return args.log if args.log is not None else args.pvc / DEFAULT_LOG


def _run_argv(child: list[str]) -> list[str]:
    """The flags of the `trainjob run` command line given after --."""
    if not child or child[0] != "run":
        raise UsageError(f"expected `-- run ARGS...` after the flags, got {' '.join(child) or 'nothing'}")
    return child[1:]


def _parse_run(argv: list[str]) -> argparse.Namespace:
    """Parse and check `run` flags before anything starts; bad ones exit 2 here, not in a child."""
    args = build_parser().parse_args(["run", *argv])
    _run_config(args).check()
    return args


def cmd_run(args: argparse.Namespace) -> int:
    with importing("the command's modules"):
        from .engine.job import ARTIFACT_FORMATS, StopFlag
        from .engine.run import Run
        from .ranks.identity import resolve_rank
        from .trainers import protocol

    spec = resolve_rank(args.rank, args.world_size, os.environ)
    cfg = _run_config(args, spec.world_size)
    cfg.check()
    if spec.rank is None:
        with importing("the command's modules"):
            from .ranks.connect import check_pvc
        check_pvc(args.pvc, spec.world_size, os.environ)  # once, here, rather than once per rank
        return launch(spec.world_size, args.argv)
    stop = StopFlag()
    stop.install()  # before the trainer is built: a SIGTERM while it loads still ends in a checkpoint and 75
    trainer = protocol.build(args.trainer, args.data, cfg.lr)
    force = getattr(trainer, "force_weights", None)
    if cfg.force_weights is not None and not callable(force):
        raise UsageError(f"--force-weights: trainer {cfg.trainer!r} does not support it "
                         "(a teaching hook of the linear trainer)")
    artifact_format = getattr(trainer, "artifact_format", "safetensors")
    if artifact_format not in ARTIFACT_FORMATS:
        raise UsageError(f"trainer {cfg.trainer!r}: artifact_format is {artifact_format!r}; "
                         f"use one of {', '.join(ARTIFACT_FORMATS)} (or leave it out: safetensors)")
    run = Run(args.pvc, state=trainer, log=_log_path(args), rank=spec.rank, world_size=spec.world_size,
              idempotent=args.idempotent, artifact_format=artifact_format, data_sha256=trainer.data_sha256,
              progress=not args.quiet,
              raise_errors=True, stop=stop, **_run_settings(cfg))
    with run:
        for step in run:
            run.report(trainer.step(step))
        if run.gate_due:
            if cfg.force_weights is not None:  # teaching hook: make a finished run fail the gate
                force(cfg.force_weights)
            run.gate(export=trainer.export(), holdout=trainer.evaluate(), baseline=trainer.baseline())
    if run.completion is not None:
        emit(f"trainjob run: {run.completion.line()}")
    return run.exit_code


def _run_settings(cfg: RunConfig) -> dict[str, object]:
    """``Run``'s settings from the command line's, by their names there."""
    return dict(steps=cfg.steps, ckpt_every=cfg.ckpt_every, lr=cfg.lr, max_drop=cfg.max_drop,
                backoff_limit=cfg.backoff_limit, die_at=cfg.die_at, keep=cfg.keep, rank_timeout=cfg.rank_timeout,
                name=cfg.trainer, async_checkpoint=cfg.async_checkpoint)


def launch(world_size: int, argv: Sequence[str]) -> int:
    """Run every rank here; the job's exit code is ``exits.job_exit`` of the ranks' codes."""
    with importing("the local launcher"):
        from .ranks.launcher import launch_local

    received, codes = launch_local(world_size, argv, finished=(EXIT_OK, EXIT_FAILED),
                                   published=(EXIT_OK, EXIT_FAILED, EXIT_RELAUNCH))
    code = job_exit(codes)
    if any(c != code for c in codes):
        warn(f"trainjob run: rank exit codes {codes}; the job's is {code}")
    if received and code == EXIT_OK:  # rank 0 exits 0 only once `completed` is logged: that stands
        warn(f"trainjob run: {received} arrived after the job completed; it stays completed")
    return code


def cmd_torchrun(args: argparse.Namespace) -> int:
    """torchrun whose exit code is the job's (ranks/torchrun.py). Running ``-m trainjob run``, it
    first checks the run's flags and the PVC, before any rendezvous: a bad flag is 2, and a job that
    has ended (completed, or failed with its budget spent) ends this launch at once with its code,
    without waiting for peers that may never come (a pod recreated alone). A script (an own loop)
    gets the completion check when its pod names the PVC (``k8s.PVC_ENV``) and is idempotent."""
    with importing("the command's modules"):
        from .engine.completion import completed_job, ended_job
        from .ranks import torchrun
        from .storage.pvc import Pvc

    torchrun.stop_on_signals()
    argv = torchrun.run_args(args.torchrun_argv)
    if argv is not None:
        run_args = _parse_run(argv)
        check_path(run_args.pvc)
        idempotent = run_args.idempotent or idempotent_from(os.environ)  # as the run's own Run would be
        over = ended_job(Pvc(run_args.pvc), _log_path(run_args), run_args.backoff_limit, idempotent)
        if over is not None:
            emit(f"trainjob run: {over.line}")
            return over.code
    elif (where := os.environ.get(k8s.PVC_ENV)) and idempotent_from(os.environ):
        # A rendered own loop's pod: its Run would find the job completed once its ranks met;
        # a pod recreated alone would wait for peers that finished. Completion only: the script's
        # own budget is not known here, and a log elsewhere than PVC/log.jsonl is not found
        # (the launch then goes ahead, and the Run decides).
        location = _storage_location(where)
        check_path(location)
        if (done := completed_job(Pvc(location), location / DEFAULT_LOG)) is not None:
            emit(f"trainjob: {done.line()}")
            return EXIT_OK
    return torchrun.launch(args.torchrun_argv)


def cmd_verify(args: argparse.Namespace) -> int:
    with importing("the command's modules"):
        import attrs
        from .storage.pvc import Pvc
        from .views.verify import verify_pvc

    pvc = Pvc(args.pvc)
    report = verify_pvc(pvc, _log_path(args))
    if args.json:
        emit(json.dumps({"ok": report.ok, "items": [attrs.asdict(i) for i in report.items]}, sort_keys=True))
    else:
        emit([*(f"{i.verdict:<9} {i.kind:<10} {i.path}  {i.detail}".rstrip() for i in report.items),
              f"verdict: {'ok' if report.ok else 'FAILED'}"])
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_reshard(args: argparse.Namespace) -> int:
    with importing("the command's modules"):
        from .engine.reshard import Reshard
        from .ranks.identity import resolve_rank
        from .storage.eventlog import EventLog, check_writable
        from .storage.pvc import Pvc

    spec = resolve_rank(0, args.world_size, {})
    if args.step is not None and args.step < 0:
        raise UsageError(f"--step must be 0 or more, got {args.step}")
    pvc = Pvc(args.pvc)
    if not pvc.local:
        pvc.create()  # a bucket: it exists, the credentials work, it honours If-None-Match
    elif not pvc.root.is_dir():
        raise InputError(f"{pvc.root}: not a PVC directory")
    check_writable(_log_path(args))
    with pvc.lock():
        job = Reshard(pvc, EventLog(_log_path(args)), spec.world_size, args.step, args.drop_rank_local)
        if job.target_exists():
            emit(f"checkpoints/{job.target.name} already exists and verifies; nothing to do")
            return EXIT_OK
        job.reshard()
    emit(f"wrote checkpoints/{job.target.name} (step {job.target.step}, world size {job.target.world_size}) "
         f"from checkpoints/{job.source.name}, which stays until rotation removes it")
    return EXIT_OK


def emit(output: str | Sequence[str] | bytes) -> None:
    """Print to stdout: a line, or lines, each escaped by ``one_line`` (a log's event, detail or
    key, a directory's name may hold a newline or an escape sequence: it must not forge a line or
    drive the terminal); bytes as they are (a picture). A reader that went away (``| head``) must
    not turn into exit 70. A stdout that was closed (``>&-``: Python then has no ``sys.stdout``)
    or that cannot be written is an error, as ``ls >&-`` says: the output was asked for and is lost."""
    if sys.stdout is None:
        raise UsageError("stdout is closed: nothing was written (redirect it to a file)")
    with os_errors("stdout", "cannot write", UsageError):
        try:
            if isinstance(output, bytes):
                sys.stdout.buffer.write(output)
            else:
                lines = [output] if isinstance(output, str) else output
                sys.stdout.write("".join(one_line(line) + "\n" for line in lines))
            sys.stdout.flush()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def warn(text: str) -> None:
    """Print to stderr. When stderr itself cannot be written (a full or failing disk), the
    message is lost but the exit code must survive: a failed print would otherwise end the
    process with Python's own exit 1, which here means "honest failure"."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


def _print_path(log: Path) -> int:
    with importing("the command's modules"):
        from .storage.eventlog import more_skipped
        from .views.history import replay

    found = replay(log)
    skipped = [*map(str, found.skipped), *more_skipped(found.more_skipped)]
    emit([*found.lines(), *(f"skipped: {problem}" for problem in skipped)])
    if found.illegal is not None:  # a verdict on the log, like drift_failed on a model: exit 1
        warn(one_line(f"trainjob status: {log} {found.illegal}"))
        return EXIT_FAILED
    return EXIT_FOR_STATE.get(found.last_event or "", EXIT_RELAUNCH)


def cmd_status(args: argparse.Namespace) -> int:
    if isinstance(args.log, Path) and args.log.is_dir():  # a PVC directory: its log, as `run` writes it
        args.log = args.log / DEFAULT_LOG
    if args.path:
        return _print_path(args.log)
    with importing("the command's modules"):
        import attrs
        from .views.status import summarize

    status = summarize(args.log)
    if args.json:
        emit(json.dumps(attrs.asdict(status), sort_keys=True))
    else:
        emit([
            f"lines: {status.lines}",
            f"last_event: {status.last_event}",
            f"attempts: {status.attempts}",
            f"artifact: {status.artifact or 'none'}",
            f"drift: {status.drift}",
            *([f"supervisor: {status.supervisor}"] if status.supervisor is not None else []),
            *(f"skipped: {problem}" for problem in status.skipped),
        ])
    return EXIT_FOR_STATE.get(status.last_event or "", EXIT_RELAUNCH)


def cmd_supervise(args: argparse.Namespace) -> int:
    with importing("the command's modules"):
        from .deploy.supervise import SuperviseSettings, supervise
        from .engine.job import StopFlag
        from .storage.eventlog import EventLog, check_writable

    argv = _run_argv(args.child)
    run_args = _parse_run(argv)
    max_starts = args.max_starts
    if max_starts is None:
        max_starts = policy.default_max_starts(run_args.backoff_limit)
    settings = SuperviseSettings(max_starts=max_starts, backoff_base=args.backoff_base,
                                 backoff_cap=args.backoff_cap, grace=args.grace)
    settings.check()
    stop = StopFlag()
    stop.install()
    check_writable(_log_path(run_args))
    log = EventLog(_log_path(run_args), source=policy.SOURCE)
    # --idempotent: a start after the job completed (a late kill, a second supervisor) finds it
    # done and exits 0, instead of the refusal (2) a person at a terminal gets.
    end = supervise([sys.executable, "-m", "trainjob", "run", *argv, "--idempotent"], log, settings,
                    SAID_BY_EXIT.get, stop)
    return EXIT_FOR_ENDING[end]


def cmd_prove(args: argparse.Namespace) -> int:
    with importing("the command's modules"):
        from .deploy.prove import prove

    code, lines = prove(args.cmd, args.kills, args.seed, args.signal, args.twice, warn)
    emit(lines)
    return code


def cmd_k8s(args: argparse.Namespace) -> int:
    bucket = str(args.pvc) if isinstance(args.pvc, Url) else ""
    if args.pvc is not None and not bucket:
        raise UsageError("k8s render --pvc takes an s3://BUCKET/PREFIX; a claim is rendered without it")
    settings = dict(name=args.name, image=args.image, storage=args.storage, world_size=args.world_size,
                    backoff_limit=args.backoff_limit, grace=args.grace, deadline=args.deadline,
                    secret=args.s3_secret)
    if args.child and k8s.is_python(args.child[0]):  # an own loop: its Run is made idempotent by the pod's env
        loop = k8s.own_loop(args.child, bucket)
        if loop.bucket:
            _storage_location(loop.bucket)  # a malformed URL: the same one line as render --pvc's
        target = k8s.Target(**settings, loop=loop, bucket=loop.bucket, mount=loop.mount or k8s.MOUNT)
        target.check()
        emit(k8s.render(k8s.manifests(target, JOB_ACTION_FOR_EXIT)).splitlines())
        return EXIT_OK
    if args.child and args.child[0] != "run":
        raise UsageError(f"expected `-- run ARGS...` or `-- python SCRIPT ARGS...` after the flags, got "
                         f"{' '.join(args.child)}")
    target = k8s.Target(**settings, run_args=tuple(args.child[1:]), bucket=bucket)
    target.check()
    # Every pod's command line must pass run's own checks. The Job owns --pvc and --backoff-limit;
    # argparse lets a later flag win, so the user's arguments after -- must not override them.
    ran = _parse_run(target.run_flags())
    if (str(ran.pvc), ran.backoff_limit) != (target.pvc, target.backoff_limit):
        raise UsageError("the Job sets the run's --pvc and --backoff-limit itself (use `k8s render "
                         "--backoff-limit`); drop them after --")
    emit(k8s.render(k8s.manifests(target, JOB_ACTION_FOR_EXIT)).splitlines())
    return EXIT_OK


def cmd_slurm(args: argparse.Namespace) -> int:
    if args.slurm_command == "render":
        return _slurm_render(args)
    if args.slurm_command == "task":
        return _slurm_task(args.rank_command[1:] if args.rank_command[:1] == ["--"] else args.rank_command)
    with importing("the command's modules"):
        from .storage.eventlog import log_exists, read_log
    log = args.log if args.log is not None else args.pvc / DEFAULT_LOG
    try:  # the checkpoints the log records; storage that cannot be read answers "-" (no progress)
        checkpoints = sum(1 for line in read_log(log) if line.event is not None
                          and line.event.event == "checkpointed" and line.event.source is None) \
            if log_exists(log) else 0
    except (TrainJobError, OSError) as exc:
        warn(f"trainjob slurm {args.slurm_command}: cannot count checkpoints in {log}: {one_line(str(exc))}")
        checkpoints = None
    if args.slurm_command == "before":
        emit("-" if checkpoints is None else str(checkpoints))
        return EXIT_OK
    before = int(args.before) if args.before.isdigit() else None
    progressed = before is not None and checkpoints is not None and checkpoints > before
    code = slurm.launch_code(args.code) if args.from_tasks else args.code
    verdict = policy.after_launch(code, _over(args.pvc, log, args.backoff_limit), progressed, args.stalls,
                                  args.max_stalls, str(log), str(args.pvc))
    warn(f"trainjob slurm: {one_line(verdict.line)}")
    emit(f"{verdict.action} {verdict.code} {verdict.stalls}")
    return EXIT_OK


def _slurm_task(command: list[str]) -> int:
    """One srun task: run its rank's command, and exit with ``slurm.task_status`` of its code.
    Slurm signals every process of the step itself (scancel, a requeue, a preemption, the time
    limit), so the rank gets its SIGTERM from Slurm: this process only outlives it, to report."""
    import subprocess

    if not command:
        raise UsageError("slurm task needs the rank's command after --")
    for signum in (signal.SIGTERM, signal.SIGINT):  # a handler, not SIG_IGN, which the rank would inherit
        signal.signal(signum, lambda *_: None)
    try:
        with os_errors(command[0], "cannot start the rank", otherwise=InputError):
            code = subprocess.call(command)
    except TrainJobError as exc:
        warn(f"trainjob slurm task: {one_line(str(exc))}")
        code = exit_code_for(type(exc))
    status = slurm.task_status(code)
    if code != EXIT_OK:
        ended = f"exited {code}" if code >= 0 else f"was ended by signal {-code}"
        warn(f"trainjob slurm task: rank {os.environ.get('SLURM_PROCID', '?')} {ended}; this task exits "
             f"{status}, so that srun's highest code is the job's (docs/howto/slurm.md)")
    return status


def _over(pvc: Path | Url, log: Path | Url, backoff_limit: int | None) -> policy.Over | None:
    """Would the next launch end at once, and with which code? ``ended_job``'s answer for ``run``
    (its budget known); for an own loop, completion, or a log that ends in ``job_failed``.
    Storage that cannot answer says nothing (None): the launch's own code decides."""
    with importing("the command's modules"):
        from .engine.completion import completed_job, ended_job
        from .storage.eventlog import EventLog
        from .storage.pvc import Pvc

    try:
        if backoff_limit is not None:
            ended = ended_job(Pvc(pvc), log, backoff_limit, idempotent=True)
            return None if ended is None else policy.Over(ended.code, ended.line)
        if (done := completed_job(Pvc(pvc), log)) is not None:
            return policy.Over(EXIT_OK, done.line())
        if EventLog(log).last_event() == "job_failed":
            return policy.Over(EXIT_FAILED, f"the job failed: {log} ends in job_failed, its retry budget spent")
    except TrainJobError as exc:
        if exit_code_for(type(exc)) == EXIT_USAGE:  # a job whose next launch would be refused: it ends here
            return policy.Over(EXIT_USAGE, one_line(str(exc)))
        warn(f"trainjob slurm after: cannot read the job's state: {one_line(str(exc))}")
    return None


def _slurm_render(args: argparse.Namespace) -> int:
    import attrs  # loaded already: deploy/slurm.py's records are attrs classes

    location = None if args.pvc is None else args.pvc if isinstance(args.pvc, Url) else args.pvc.absolute()
    settings = dict(name=args.name, nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                    nproc_per_node=args.nproc_per_node, time=args.time, partition=args.partition, grace=args.grace,
                    backoff_limit=args.backoff_limit, max_stalls=args.max_stalls, trainjob=args.trainjob)
    if args.child and k8s.is_python(args.child[0]):  # an own loop: its Run is made idempotent by the job's env
        bucket = str(location) if isinstance(location, Url) else ""
        loop = k8s.own_loop(args.child, bucket, mount=str(location or k8s.MOUNT))
        where = loop.bucket or loop.mount
        if location is not None and where != str(location):
            raise UsageError(f"the script's --pvc {where} is not slurm render's --pvc {location}; give one, or pass "
                             f"the script --pvc {k8s.PVC_PLACEHOLDER}")
        if loop.bucket:
            _storage_location(loop.bucket)  # a malformed URL: the same one line as render --pvc's
        target = slurm.Target(**settings, pvc=where, loop=loop)
        target.check()
        emit(slurm.script(_sized(target, None, "an own loop's checkpoint is not measured")).splitlines())
        return EXIT_OK
    if args.child and args.child[0] != "run":
        raise UsageError(f"expected `-- run ARGS...` or `-- python SCRIPT ARGS...` after the flags, got "
                         f"{' '.join(args.child)}")
    if location is None:
        raise UsageError("slurm render needs --pvc: a directory every node sees, or s3://BUCKET/PREFIX")
    target = slurm.Target(**settings, pvc=str(location), run_args=tuple(args.child[1:]))
    target.check()
    # Every rank's command line must pass run's own checks. The script owns --pvc and --backoff-limit;
    # argparse lets a later flag win, so the user's arguments after -- must not override them.
    ran = _parse_run(target.run_flags())
    if (str(ran.pvc), ran.backoff_limit) != (target.pvc, target.backoff_limit):
        raise UsageError("the script sets the run's --pvc and --backoff-limit itself (use `slurm render --pvc` "
                         "and `--backoff-limit`); drop them after --")
    if ran.world_size is not None or ran.rank is not None:
        raise UsageError("the script gives each rank its place (--nodes, --ntasks-per-node, --nproc-per-node); "
                         "drop --world-size and --rank after --")
    if ran.log is not None:
        target = attrs.evolve(target, log=str(ran.log))
    if target.grace is None:
        stop, unmeasured = _measure_stop(target)
        target = _sized(target, stop, unmeasured)
    emit(slurm.script(target).splitlines())
    return EXIT_OK


def _sized(target: slurm.Target, stop: float | None, unmeasured: str) -> slurm.Target:
    """The target with its grace: the one given, else sized from the measured ``stop``."""
    import attrs

    if target.grace is not None:
        return target
    grace, why = slurm.grace_for(stop, slurm.time_seconds(target.time) if target.time else None, unmeasured)
    return attrs.evolve(target, grace=grace, grace_why=why)


def _measure_stop(target: slurm.Target) -> tuple[float | None, str]:
    """Seconds one step and a checkpoint of the job take: a `trainjob run` of its own flags for one
    step, timed, on a scratch PVC beside the job's (its filesystem), removed after. It also writes
    the artifact and starts Python: more than a stop costs, the safe side. None where it cannot
    run, with why (a bucket PVC, a directory that cannot be written, a run that failed)."""
    import shutil
    import subprocess
    import tempfile
    import time

    if target.pvc.startswith("s3://"):
        return None, "a bucket PVC's checkpoint is not measured"
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".trainjob-grace-", dir=Path(target.pvc).parent))
    except OSError as exc:
        warn(f"trainjob slurm render: cannot measure a checkpoint beside {target.pvc}: {exc.strerror}")
        return None, f"nothing could be written beside {target.pvc}"
    try:
        probe = [sys.executable, "-m", "trainjob", "run", *target.run_args, "--pvc", str(scratch / "pvc"),
                 "--log", str(scratch / "log.jsonl"), "--steps", "1", "--ckpt-every", "1", "--backoff-limit", "0"]
        started = time.monotonic()
        done = subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        took = time.monotonic() - started
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode not in (EXIT_OK, EXIT_FAILED):  # 1: the gate failed, after the checkpoint
        said = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        warn(f"trainjob slurm render: a one-step run to measure the grace failed: {one_line(said[0])}")
        return None, f"a one-step run to measure it exited {done.returncode}"
    return took, ""


def _write_output(data: bytes, output: Path | None) -> None:
    if output is None:
        emit(data)
        return
    with os_errors(output, "cannot write", InputError):
        output.write_bytes(data)


def cmd_diagram(args: argparse.Namespace) -> int:
    with importing("the command's modules"):
        from .views import diagram
        from .views.history import legal_path

    fmt = diagram.format_for(args.format, args.output)
    if args.output is None and fmt in diagram.BINARY and sys.stdout.isatty():
        raise UsageError(f"--format {fmt} is binary; write it to a file with -o FILE")
    if args.log is None:
        data = diagram.render(fmt)
    else:
        found = legal_path(args.log)
        data = diagram.render(fmt, found, diagram.run_title(found))
    _write_output(data, args.output)
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    if args.max_drop is not None and not 0 <= args.max_drop <= 100:
        raise UsageError(f"--max-drop is a percentage from 0 to 100, got {args.max_drop}")
    with importing("the command's modules"):
        from .views import plot
        from .views.history import legal_path

    told = plot.story(legal_path(args.log))
    _write_output(plot.draw(told, f"trainjob: the run in {args.log.name}", args.max_drop), args.output)
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    with importing("the command's modules"):
        from .views import diagram, replay_page
        from .views.history import replay

    found = replay(args.log)
    _write_output(replay_page.build(found, diagram.render("svg")), args.output)
    if found.illegal is not None:  # the page shows it, marked; the exit code says it, as status --path does
        warn(one_line(f"trainjob replay: {args.log} {found.illegal}"))
        return EXIT_FAILED
    return EXIT_OK


def _check_paths(args: argparse.Namespace) -> None:
    """Every path argument, before any work (``durable.check_path``)."""
    for value in vars(args).values():
        if isinstance(value, Path):
            check_path(value)


COMMANDS = {"gen": cmd_gen, "run": cmd_run, "torchrun": cmd_torchrun, "status": cmd_status, "supervise": cmd_supervise,
            "k8s": cmd_k8s, "slurm": cmd_slurm, "diagram": cmd_diagram, "plot": cmd_plot, "verify": cmd_verify, "reshard": cmd_reshard,
            "replay": cmd_replay, "prove": cmd_prove}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the local launcher hands the same arguments to every rank
    try:
        _check_paths(args)
        return COMMANDS[args.command](args)
    except TrainJobError as exc:
        warn(f"trainjob {args.command}: {one_line(str(exc))}")
        return exit_code_for(type(exc))
    except ImportError as exc:  # an optional package the command needs (errors.EXTRA_FOR): say which extra
        if (missing := missing_extra(exc)) is None:
            return _internal(args.command)
        warn(f"trainjob {args.command}: {one_line(str(missing))}")
        return exit_code_for(type(missing))
    except Exception:  # a bug: say so loudly, and never look like an honest failure (1)
        return _internal(args.command)


def _internal(command: str) -> int:
    """A bug (the exception being handled): its traceback and one line saying so; exit 70."""
    warn(traceback.format_exc().rstrip())
    warn(f"trainjob {command}: internal error (exit {EXIT_INTERNAL}); please report it")
    return EXIT_INTERNAL


def entry() -> NoReturn:
    """The process's entry point (the ``trainjob`` script, ``python -m trainjob``).

    Once ``main`` has returned, the outcome is decided (and, for ``run``, logged). Python puts the
    default signal handlers back while it shuts down, so a SIGTERM arriving then would end the
    process by the signal (143 to Kubernetes) instead of with the decided code: a run that had
    logged ``completed`` would look killed, be relaunched, and be refused. So late ones are
    ignored: for the whole process, as numpy's BLAS threads would take a signal the main thread
    blocked, and Python leaves an ignored signal ignored at shutdown. The same holds when the run
    ends the process itself (a trainer's ``sys.exit()``: ``Run`` raises ``SystemExit`` with the
    run's code).
    """
    try:
        code = main()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    try:
        with importing("the exit report"):
            from .ranks import torchrun  # after the command, so that start-up does not pay for it
    except TrainJobError:  # a fault loading it costs the report's precision, never the code
        sys.exit(code)
    torchrun.report(code)  # a worker of `trainjob torchrun`: the code it decided, whatever stops it now
    sys.exit(code)


if __name__ == "__main__":
    entry()
