"""The async section (needs torch): ``--async-checkpoint``'s stall and run time against the same run without.

The trainer section's model run by ``trainjob run`` three ways in each repeat, fresh processes:
no checkpoint but the final one, synchronous and ``--async-checkpoint`` every ``every`` steps. The
loop's stall per checkpoint is timed on the loop's own thread (bench_torch.py engine) against one
in-memory copy of the state (the copy limit) and the synchronous save; the async run's wall time
against the run without checkpoints; peak RSS against the bare loop's; and, on one live state,
trainjob's background saver against torch.distributed.checkpoint's async_save.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

from .common import MiB, SCRIPTS, bench_torch, fmt, measured, summary, targets_lines, torch_env


def run_section(work: Path, repeat: int, dim: int, steps: int, every: int) -> dict:
    """The torch trainer run three ways in each repeat, in fresh processes, interleaved: with no
    checkpoint but the final one every run writes (``--ckpt-every STEPS``), synchronous and
    asynchronous with a checkpoint every ``every`` steps; and the bare loop for peak RSS. The loop's
    own time in its checkpoint calls is timed inside the process (bench_torch.py engine). Then
    the copy limit and DCP's async_save on one live state (bench_torch.py async-peers)."""
    env = torch_env(dim)

    def engine(mode: str, ckpt_every: int) -> tuple[dict, int]:
        directory, out = work / f"async-{mode}", work / f"async-{mode}.json"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        _, peak = measured([sys.executable, str(SCRIPTS / "bench_torch.py"), "engine", mode, str(directory), str(steps),
                            str(ckpt_every), str(out)], env)
        shutil.rmtree(directory, ignore_errors=True)
        return json.loads(out.read_text()), peak

    runs: dict[str, list[float]] = {}
    add = lambda k, v: runs.setdefault(k, []).append(v)
    for rep in range(repeat):
        none, _ = engine("sync", steps)
        sync, _ = engine("sync", every)
        asy, asy_peak = engine("async", every)
        directory = work / "async-bare"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        _, bare_peak = measured([sys.executable, str(SCRIPTS / "bench_torch.py"), "bare", str(steps), "0",
                                 str(directory)], env)
        # Intermediate checkpoints only: the last one (the final step's) is in every run alike.
        n = len(asy["save_s"]) - 1
        stall = (sum(asy["save_s"][:-1]) + asy["between_s"]) / n
        add("async_stall_ms", stall * 1e3)
        add("sync_save_ms", statistics.median(sync["save_s"][:-1]) * 1e3)
        add("stall_vs_sync", stall / statistics.median(sync["save_s"][:-1]))
        add("async_run_s", asy["wall_s"])
        add("sync_run_s", sync["wall_s"])
        add("none_run_s", none["wall_s"])
        add("async_run_ratio", asy["wall_s"] / none["wall_s"])
        add("sync_run_ratio", sync["wall_s"] / none["wall_s"])
        add("ms_per_step", (none["wall_s"] - none["end_s"]) / steps * 1e3)
        add("async_peak_mib", asy_peak / MiB)
        add("bare_peak_mib", bare_peak / MiB)
        print(f"async repeat {rep + 1}/{repeat} done", file=sys.stderr, flush=True)
    peers = bench_torch("async-peers", work / "async-peers", str(repeat), env=env)
    state = peers.pop("state_bytes")[0]
    copy_ms = statistics.median(peers["copy"]) * 1e3
    out = {"dim": dim, "steps": steps, "every": every, "state_mib": state / MiB, "copy_ms": copy_ms,
           **{k: summary(v) for k, v in runs.items()},
           "peers_s": {k: summary(v) for k, v in peers.items()}}
    out["stall_vs_copy"] = summary([s / copy_ms for s in runs["async_stall_ms"]])
    # The writer's share of the time between two checkpoints: below 1, the disk keeps up.
    out["writer_busy"] = summary([statistics.median(peers["end-to-end trainjob"]) * 1e3 / (every * ms)
                                  for ms in runs["ms_per_step"]])
    budget = [b + (1.1 * state) / MiB + 64 for b in runs["bare_peak_mib"]]
    out["targets"] = {
        "async: loop stall per checkpoint <= 1.5x one in-memory copy of the state":
            out["stall_vs_copy"]["median"] <= 1.5,
        "async: loop stall per checkpoint <= 0.2x the synchronous save": out["stall_vs_sync"]["median"] <= 0.2,
        f"async: run checkpointing every {every} steps <= 1.1x the run without": out["async_run_ratio"]["median"] <= 1.1,
        "async: peak RSS <= 2.1x state + 64MiB (above the bare loop's own, which holds the state once)":
            all(t <= b for t, b in zip(runs["async_peak_mib"], budget)),
        "async: stall no worse than DCP async_save": (out["peers_s"]["stall trainjob"]["median"]
                                                       <= out["peers_s"]["stall dcp"]["median"]),
    }
    return out


def table(a: dict, targets: bool = True) -> str:
    p = a["peers_s"]
    lines = [f"async: the trainer section's model, {a['state_mib']:.0f} MiB of state, {a['steps']} steps, a "
             f"checkpoint every {a['every']} ({fmt(a['ms_per_step'], 0)} ms per step; the writer is busy "
             f"{fmt(a['writer_busy'])} of the time between two checkpoints: below 1 the disk keeps up); "
             "median (min..max)", "",
             "| | figure | ratio |", "| --- | --- | --- |",
             f"| one in-memory copy of the state (the copy limit), ms | {a['copy_ms']:.0f} | |",
             f"| loop stall per checkpoint, async (copy, log, landing, back-pressure), ms | "
             f"{fmt(a['async_stall_ms'], 0)} | {fmt(a['stall_vs_copy'])}x the copy |",
             f"| synchronous save per checkpoint, ms | {fmt(a['sync_save_ms'], 0)} | stall {fmt(a['stall_vs_sync'], 3)}x |",
             f"| run, async, s | {fmt(a['async_run_s'], 1)} | {fmt(a['async_run_ratio'], 3)}x no checkpoints |",
             f"| run, synchronous, s | {fmt(a['sync_run_s'], 1)} | {fmt(a['sync_run_ratio'], 3)}x no checkpoints |",
             f"| run, no checkpoint but the final one, s | {fmt(a['none_run_s'], 1)} | |",
             f"| peak RSS, async run / bare loop, MiB | {fmt(a['async_peak_mib'], 0)} / {fmt(a['bare_peak_mib'], 0)} | |",
             "", "| peers on the same live state, seconds | stall | end to end | verified on load |",
             "| --- | --- | --- | --- |",
             f"| trainjob BackgroundSaver | {fmt(p['stall trainjob'], 3)} | {fmt(p['end-to-end trainjob'], 3)} | "
             "yes: every sha256 |",
             f"| torch.distributed.checkpoint.async_save | {fmt(p['stall dcp'], 3)} | {fmt(p['end-to-end dcp'], 3)} | "
             "no: nothing to check against |"]
    if targets:
        lines += ["", *targets_lines(a["targets"])]
    return "\n".join(lines)
