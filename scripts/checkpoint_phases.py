"""Where the fixed cost of one small checkpoint goes (issue 30): a probe, not a benchmark.

    PYTHONPATH=. python scripts/checkpoint_phases.py --size 8MiB --checkpoints 20 [--world-size 2]
        [--ranks-via store|files] [--gap 0] [--dir /tmp] [--each]

The bench's synthetic state (scripts/benchmarks/checkpoints.py), one process per rank (spawned).
Each makes ``--checkpoints`` whole checkpoints back to back as the bench's ``save_trainjob`` does
(what a rank of ``trainjob run`` does at each: shard, at W > 1 the ranks' agreement through their
real coordination objects, commit, pointer, rotation with ``--keep 1``, the ``checkpointed`` log
line) and, before each, a raw write+fsync of the same bytes by every rank at once, the reference.
Each phase is timed with ``time.perf_counter`` (one clock for every process) around the library
call, and every fsync, rename and rmtree inside it is timed too (by wrapping ``os.fsync``,
``os.rename``, ``os.replace`` and ``shutil.rmtree``, on any thread: the fsync pool's, rotation's
helper). Medians in milliseconds; "starts at" is a phase's start after the checkpoint's (the
first rank's), "after gap" the time since the rank's phase before it ended (work between two
library calls: building the manifest, say). "Delete" (overlapped by a delete) is the share of checkpoints in which rotation's background
delete of an older checkpoint ran during some of the phase.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.checkpoints import host_store, join, rank_state, save_peer, save_trainjob, specs
from benchmarks.common import parse_size

from trainjob.storage import deletion

Span = tuple[float, float]


def trace(calls: list) -> None:
    """Record (call, on, start, end) of every fsync, rename, replace and rmtree, on any thread."""
    def traced(name: str, real):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                on = os.readlink(f"/proc/self/fd/{args[0]}") if name == "fsync" else str(args[0])
                calls.append((name, os.path.basename(on), t0, time.perf_counter()))
        return call

    for name in ("fsync", "rename", "replace"):
        setattr(os, name, traced(name, getattr(os, name)))
    shutil.rmtree = traced("rmtree", shutil.rmtree)


def worker(rank: int, world: int, args: argparse.Namespace, root: Path, barrier, results, store) -> None:
    try:
        calls: list = []
        spec = specs(args.size)
        holds, mine = rank_state(spec, rank, world)
        peers = join(root, rank, world, store)
        raw_dir = root / "raw"
        raw_dir.mkdir(exist_ok=True)
        save_trainjob(root, rank, world, holds, mine, spec, 1, whole=True, peers=peers)  # untimed, as the bench's first
        trace(calls)
        raw, whole, phases = [], [], defaultdict(list)

        def phase(name: str, fn):
            t0 = time.perf_counter()
            out = fn()
            phases[name].append((t0, time.perf_counter()))
            return out

        for step in range(2, args.checkpoints + 2):
            (raw_dir / f"raw-{rank:05d}").unlink(missing_ok=True)  # new files every time, as the bench's reference
            barrier.wait()
            t0 = time.perf_counter()
            save_peer("raw", raw_dir, rank, mine)
            raw.append((t0, time.perf_counter()))
            barrier.wait()
            time.sleep(args.gap)
            t0 = time.perf_counter()
            save_trainjob(root, rank, world, holds, mine, spec, step, whole=True, peers=peers, phase=phase)
            whole.append((t0, time.perf_counter()))
            if args.gap:
                deletion.settle_deletions()
        results.put({"rank": rank, "raw": raw, "whole": whole, "phases": dict(phases), "calls": calls})
    except BaseException as exc:
        results.put({"rank": rank, "error": f"rank {rank}: {type(exc).__name__}: {exc}"})
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("8MiB"))
    ap.add_argument("--checkpoints", type=int, default=20)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--ranks-via", choices=("store", "files"), default="store",
                    help="at W > 1: a TCPStore as under torchrun (default), or files on the PVC")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds of 'training' between checkpoints")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--each", action="store_true",
                    help="also print every checkpoint's time in order: a launch's first ones differ (docs/benchmarks.md)")
    args = ap.parse_args()
    root = args.dir / f"phases-{os.getpid()}"
    root.mkdir(parents=True)
    ctx, world = mp.get_context("spawn"), args.world_size
    server = host_store() if world > 1 and args.ranks_via == "store" else None
    store = None if server is None else ("127.0.0.1", server.port, f"phases-{os.getpid()}")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, args, root, barrier, results, store)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        got = sorted((results.get(timeout=600) for _ in procs), key=lambda g: g["rank"])
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        raise SystemExit("; ".join(errors))
    report(args, got)


def report(args: argparse.Namespace, got: list[dict]) -> None:
    ms = lambda xs: f"{1000 * statistics.median(xs):.2f}"  # noqa: E731
    n = args.checkpoints
    span = lambda key, i: (min(g[key][i][0] for g in got), max(g[key][i][1] for g in got))  # noqa: E731
    raw = [t1 - t0 for t0, t1 in (span("raw", i) for i in range(n))]
    starts = [span("whole", i)[0] for i in range(n)]
    whole = [t1 - t0 for t0, t1 in (span("whole", i) for i in range(n))]
    if args.each:
        print("each checkpoint, ms:", " ".join(f"{1000 * w:.1f}" for w in whole))
    via = f" through {args.ranks_via}" if args.world_size > 1 else ""
    print(f"size {args.size >> 20} MiB, W={args.world_size}{via}, {n} checkpoints, gap {args.gap}s, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"raw write+fsync {ms(raw)} ms; whole checkpoint {ms(whole)} ms; raw/whole "
          f"{statistics.median(raw) / statistics.median(whole):.2f}")
    print(f"{'rank':4} {'phase':12} {'starts at':>9} {'after gap':>9} {'median ms':>9} {'delete':>6}   calls begun "
          "inside it (median ms; * on the helper thread)")
    for g in got:
        deletes = [(c0, c1) for call, _, c0, c1 in g["calls"] if call == "rmtree"]
        before = list(zip(*g["whole"]))[0]  # the end of the phase before each phase: first, the checkpoint's start
        for name, spans in g["phases"].items():
            gap = [t0 - b for (t0, _), b in zip(spans, before)]
            before = [t1 for _, t1 in spans]
            inside: dict[str, list[float]] = defaultdict(list)
            for call, on, c0, c1 in g["calls"]:
                if any(t0 <= c0 < t1 for t0, t1 in spans):
                    inside[f"{call} {re.sub(r'[0-9]+', 'N', on)}{'*' if call == 'rmtree' else ''}"].append(c1 - c0)
            overlapped = sum(any(d0 < t1 and t0 < d1 for d0, d1 in deletes) for t0, t1 in spans) / len(spans)
            detail = ", ".join(f"{k} {ms(v)}" for k, v in inside.items())
            offset = [t0 - s for (t0, _), s in zip(spans, starts)]
            print(f"{g['rank']:4} {name:12} {ms(offset):>9} {ms(gap):>9} {ms([t1 - t0 for t0, t1 in spans]):>9} "
                  f"{overlapped:>6.0%}   {detail}")


if __name__ == "__main__":
    main()
