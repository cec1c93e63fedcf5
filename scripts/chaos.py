#!/usr/bin/env python3
"""Reliability campaign: inject real faults into real trainjob processes, many times, and count.

    python scripts/chaos.py [--kills N] [--sigterms N] [--faults N] [--inputs N] [--races N] [--s3 N]
                            [--reads N] [--verdicts N] [--forged N] [--seed S] [--launcher local|torchrun]

Sections (each trial is a fresh PVC; everything is seeded, so a failure can be replayed; one module
each in scripts/campaign/):

  kill storm      SIGKILL the run at uniformly random instants, relaunch until done; one more
                  launch per trial (the first in even trials, so it has a run to chase; else
                  the last) is killed the instant `completed` is logged (a late kill); also on
                  a torch trainer (``--torch``: scripts/bench_torch.py's model, sync and async)
  sigterm storm   SIGTERM at random instants: each must checkpoint and exit 75
  io faults       libfiu (fiu-run/fiu-ctrl) makes write/fsync/rename/open fail mid-run
  read faults     libfiu fails a resume's shard reads (EIO, ETIMEDOUT) at W=1, W=2, and in rank 1
                  alone in an FSDP verdict round: 75, nothing set aside, then the relaunch resumes
  import faults   libfiu makes open fail (EMFILE, ENOMEM, EIO) while `run` loads its command's modules
  full disk       a real tiny tmpfs as the PVC (skipped, with the reason, if it cannot mount)
  hostile inputs  corrupted data, baseline, state, attempts, log and checkpoint files, or, in half
                  the trials, special files in their place (FIFOs, sockets, devices, links to
                  /dev/zero, sparse gigabytes), absurd manifest sizes, hostile log lines
  forged manifests  an older manifest edited so its slices land elsewhere (digests intact), behind
                  a damaged newest; or the newest, then resharded: never resumed, never resharded
  races           several runs started at once on one PVC
  security        no unpickling or eval, no group/world-writable files, no forged log lines
  s3 faults       a run on ``--pvc s3://BUCKET/PREFIX`` while its server (a local SeaweedFS) is
                  SIGKILLed, SIGTERMed (and restarted) or SIGSTOPped (and SIGCONTed) during saves
                  and loads (skipped, with a note, without the ``weed`` binary)
  scheduler stops the vision, HF Trainer and Lightning examples with two workers on every data
                  loader, stopped as Slurm preempts (SIGTERM to every process, twice) and as
                  Kubernetes ends a grace (SIGTERM, then SIGKILL to all): 75 and `killed`, never 70,
                  then the uninterrupted bytes (``--examples`` trials each; skipped per framework
                  not installed)

Every run the sections start through the harness is also judged as it ends: its exit code must be
what its log says, as `trainjob status` reads it (the last row, "status == exit").

``--launcher torchrun`` runs the two-rank kill and SIGTERM sections (launches and recoveries)
under torchrun, whose ranks agree through its store, as a W > 1 pod runs it: ``trainjob torchrun``,
which exits with the job's code (the product's rule, ``trainjob.exits.job_exit``).

Kill-storm launches and every recovery are ``run ... --idempotent``, as ``supervise`` and the
rendered Job run them. After every trial the PVC must recover: a clean relaunch exits 0 with the same artifact bytes as
an uninterrupted run, the kill cost no attempt, and no tmp litter remains. Prints one summary table
and exits 1 on any violation. The defaults are CI-sized; see docs/explanation/reliability.md for the full run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from campaign import bucket, examples, faults, inputs, races, security, signals
from campaign.harness import ASYNC, ASYNC_STEPS, AUDIT, ROOT, TORCH_DIM, TORCH_STEPS, W2_ASYNC_STEPS, W2_STEPS, \
    W2_TORCHRUN_STEPS, Campaign


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=4,
                        help="kill-storm trials (3 random kills and one late kill each)")
    parser.add_argument("--sigterms", type=int, default=4)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--inputs", type=int, default=40)
    parser.add_argument("--races", type=int, default=2)
    parser.add_argument("--reads", type=int, default=2,
                        help="shard-read-fault trials at W=1 and at W=2 each (EIO and ETIMEDOUT in turn)")
    parser.add_argument("--verdicts", type=int, default=1,
                        help="FSDP verdict-round read-fault trials (skipped, with a note, without torch)")
    parser.add_argument("--forged", type=int, default=2, help="forged-manifest trials")
    parser.add_argument("--ranks", type=int, default=2, help="two-rank kill and SIGTERM trials, reshard kills")
    parser.add_argument("--asyncs", type=int, default=2,
                        help="--async-checkpoint trials: kill storms and SIGTERMs at W=1 and W=2, io faults (x2)")
    parser.add_argument("--torch", type=int, default=2,
                        help="kill storms on a torch trainer (skipped, with a note, without torch)")
    parser.add_argument("--examples", type=int, default=1,
                        help="scheduler stops on each example with workers on every loader (minutes each)")
    parser.add_argument("--s3", type=int, default=3,
                        help="S3 server-fault trials (SIGKILL, SIGTERM, SIGSTOP in turn; saves and loads in turn)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                        help="how the two-rank sections start their ranks (torchrun: they agree through its store)")
    args = parser.parse_args()
    try:
        import torch  # noqa: F401  (only to know whether the torch storms can run)
    except ImportError:
        print("note: torch is not installed; the torch kill storms are skipped", file=sys.stderr)
        args.torch = 0
    # The torch trainer's module, for every `trainjob run` this campaign starts.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))
    os.environ["BENCH_TORCH_DIM"], os.environ["OMP_NUM_THREADS"] = TORCH_DIM, "1"

    with tempfile.TemporaryDirectory(prefix="trainjob-chaos-") as tmp:
        campaign = Campaign(Path(tmp), args.seed, args.launcher)
        w2 = W2_TORCHRUN_STEPS if args.launcher == "torchrun" else W2_STEPS
        sections = [
            signals.kill_storm(campaign, args.kills),
            signals.kill_storm(campaign, args.ranks, w2),
            signals.sigterm_storm(campaign, args.sigterms),
            signals.sigterm_storm(campaign, args.ranks, w2),
            races.reshard_kills(campaign, args.ranks * 2),
            faults.io_faults(campaign, args.faults),
            faults.import_faults(campaign, max(1, args.faults // 4)),
            faults.read_faults(campaign, args.reads),
            faults.read_faults(campaign, args.reads, w2),
            faults.verdict_read_faults(campaign, args.verdicts),
            signals.kill_storm(campaign, args.asyncs, ASYNC_STEPS),
            signals.kill_storm(campaign, args.asyncs, W2_ASYNC_STEPS),
            signals.sigterm_storm(campaign, args.asyncs, ASYNC_STEPS),
            signals.sigterm_storm(campaign, args.asyncs, W2_ASYNC_STEPS),
            faults.io_faults(campaign, args.asyncs * 2, ASYNC_STEPS),
            signals.kill_storm(campaign, args.torch, TORCH_STEPS),
            signals.kill_storm(campaign, args.torch, [*TORCH_STEPS, ASYNC]),
            faults.full_disk(campaign),
            inputs.hostile_inputs(campaign, args.inputs),
            inputs.forged_manifests(campaign, args.forged, w2),
            races.races(campaign, args.races),
            races.reshard_races(campaign, args.races),
            security.security(campaign),
            bucket.s3_storm(campaign, args.s3),
            *examples.scheduler_stops(campaign, args.examples),
            AUDIT.section(),  # last: every run above, judged as it ended
        ]
    print(f"{'section':<28}{'trials':>8}{'injected':>10}{'late':>6}{'violations':>12}{'bytes lost':>12}  note")
    for s in sections:
        print(f"{s.name:<28}{s.trials:>8}{s.injected:>10}{s.late:>6}{len(s.violations):>12}{s.bytes_lost:>12}  "
              f"{s.note}")
    violations = [v for s in sections for v in s.violations]
    for v in violations:
        print(f"VIOLATION {v}")
    print(f"seed={args.seed} uninterrupted run={campaign.run_seconds:.2f}s")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
