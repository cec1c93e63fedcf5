"""Where the fixed cost of one small checkpoint goes (issue 30): a probe, not a benchmark.

    PYTHONPATH=. python scripts/checkpoint_phases.py --size 8MiB --checkpoints 20 [--dir /tmp]

One process, W=1, the bench's synthetic state (scripts/benchmarks/checkpoints.py). It makes
``--checkpoints`` whole checkpoints back to back (shard, commit, pointer, rotation with
``--keep 1``, the ``checkpointed`` log line: what ``trainjob run`` does at each) and, between
two of them, a raw write+fsync of the same bytes, the reference. Each phase is timed with
``time.perf_counter`` around the library call, and every fsync, rename and rmtree inside it is
timed too (by wrapping ``os.fsync``, ``os.rename``, ``os.replace`` and ``shutil.rmtree``, whose
calls on the rotation's helper thread are listed with the phase they overlapped). Medians in
milliseconds. "Overlapped by a delete" is the share of checkpoints in which rotation's background
delete of an older checkpoint ran during some of the phase.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.checkpoints import rank_state, save_peer, specs
from benchmarks.common import parse_size

from trainjob.checkpoint.plan import Ref
from trainjob.checkpoint.store import Committer
from trainjob.records import MANIFEST_SCHEMA, Manifest
from trainjob.storage import pvc as pvc_module
from trainjob.storage.eventlog import EventLog
from trainjob.storage.pvc import Pvc

calls: list[tuple[str, str, float, float]] = []  # (call, on, start, end), any thread
remove_tree = shutil.rmtree  # the probe's own deletes, untraced


def traced(name: str, real):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            on = os.readlink(f"/proc/self/fd/{args[0]}") if name == "fsync" else str(args[0])
            calls.append((name, os.path.basename(on), t0, time.perf_counter()))
    return call


def trace() -> None:
    for name in ("fsync", "rename", "replace"):
        setattr(os, name, traced(name, getattr(os, name)))
    shutil.rmtree = traced("rmtree", shutil.rmtree)


def checkpoint(store: Committer, log: EventLog, step: int, holds, mine, spec, phases: dict) -> None:
    """One whole checkpoint as Job.write_checkpoint and the announce make it, phase by phase."""
    ref = Ref(attempt=1, step=step, world_size=1)

    def phase(name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        phases[name].append((t0, time.perf_counter(), None))
        return out

    phase("space", lambda: store.check_space(1))
    staging = phase("staging", lambda: store.create_staging(ref, 1))
    kw = {"committing": True} if hasattr(store, "start_deletions") else {}  # this branch: fsync runs into the commit
    entry = phase("shard", lambda: store.write_slices(staging, 0, 1, step, holds, mine, **kw))
    manifest = Manifest(schema=MANIFEST_SCHEMA, step=step, attempt=1, world_size=1, loss_milli=0,
                        tensors=spec, shards=[entry])
    if hasattr(store, "start_deletions"):  # this branch: the pointer within the commit, deletes after the line
        phase("commit", lambda: store.commit(staging, ref, manifest, point=True))
        phase("rotate", lambda: store.rotate(1, 1, protect=ref))
        phase("log", lambda: log.append("checkpointed", f"step={step} loss_milli=0"))
        phase("release", store.start_deletions)
        return
    sha = phase("commit", lambda: store.commit(staging, ref, manifest))
    phase("pointer", lambda: store.pvc.write_checkpoint(store.pointer(manifest, ref, sha)))
    phase("rotate", lambda: store.rotate(1, 1, protect=ref))
    phase("log", lambda: log.append("checkpointed", f"step={step} loss_milli=0"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("8MiB"))
    ap.add_argument("--checkpoints", type=int, default=20)
    ap.add_argument("--gap", type=float, default=0.0, help="seconds of 'training' between checkpoints")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    root = args.dir / f"phases-{os.getpid()}"
    spec = specs(args.size)
    holds, mine = rank_state(spec, 0, 1)
    store, log = Committer(Pvc(root)), EventLog(root / "log.jsonl")
    (root / "raw").mkdir(parents=True)
    trace()
    phases: dict[str, list] = defaultdict(list)
    raw, whole = [], []
    checkpoint(store, log, 1, holds, mine, spec, defaultdict(list))  # untimed, as the bench's first
    for step in range(2, args.checkpoints + 2):
        remove_tree(root / "raw")  # new files every time, as the bench's reference
        (root / "raw").mkdir()
        t0 = time.perf_counter()
        save_peer("raw", root / "raw", step, mine)
        raw.append(time.perf_counter() - t0)
        time.sleep(args.gap)
        t0 = time.perf_counter()
        checkpoint(store, log, step, holds, mine, spec, phases)
        whole.append(time.perf_counter() - t0)
        if args.gap:
            pvc_module.settle_deletions()
        time.sleep(args.gap)
    report(args, raw, whole, phases)
    remove_tree(root)


def report(args, raw: list[float], whole: list[float], phases: dict) -> None:
    ms = lambda xs: f"{1000 * statistics.median(xs):.2f}"
    deletes = [(c0, c1) for call, _, c0, c1 in calls if call == "rmtree"]
    print(f"size {args.size >> 20} MiB, W=1, {args.checkpoints} checkpoints, gap {args.gap}s, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"raw write+fsync {ms(raw)} ms; whole checkpoint {ms(whole)} ms; raw/whole "
          f"{statistics.median(raw) / statistics.median(whole):.2f}")
    print(f"{'phase':8} {'median ms':>9} {'overlapped by a delete':>22}   calls begun inside it (median ms; "
          "* on the helper thread)")
    for name, spans in phases.items():
        inside: dict[str, list[float]] = defaultdict(list)
        for call, on, c0, c1 in calls:
            if any(t0 <= c0 < t1 for t0, t1, _ in spans):
                inside[f"{call} {re.sub(r'[0-9]+', 'N', on)}{'*' if call == 'rmtree' else ''}"].append(c1 - c0)
        overlapped = sum(any(d0 < t1 and t0 < d1 for d0, d1 in deletes) for t0, t1, _ in spans) / len(spans)
        detail = ", ".join(f"{k} {ms(v)}" for k, v in inside.items())
        print(f"{name:8} {ms([t1 - t0 for t0, t1, _ in spans]):>9} {overlapped:>22.0%}   {detail}")


if __name__ == "__main__":
    main()
