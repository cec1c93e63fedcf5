"""The fsdp section: an FSDP2 model's sharded state saved and loaded at each world size, trainjob
against DCP and against the floors of a save and of a load that verify.

``scripts/bench_fsdp.py`` under torchrun (W ranks, gloo, one thread each) builds the same model in
every launch (``--fsdp-mib`` of state, one size or several: weights and AdamW's two moments,
float32, every one a DTensor sharded along its first axis) and times ``repeat`` saves and loads by
one method, each from a barrier to a barrier (the slower rank's time). For each size and each world
size (``--fsdp-world-sizes``), launches take turns, DCP, trainjob, the floor, then again (``rounds``
of each), so all three see the machine as it was; the figure is the median over every repeat of
every round. The floor (bench_fsdp.py says how) is a raw write + fsync of each rank's bytes with one
sha256 pass beside it for the save, DCP's load then one sha256 pass over each rank's bytes for the
load: ``trainjob / floor`` is trainjob's own cost on top of what any verifying save or load must
do on this machine. Each rank's bytes read during a load (its ``/proc/self/io`` ``rchar`` delta) are
given as a fraction of the checkpoint's size on disk. Peak RSS (VmHWM) per rank is the excess over
the same launch's peak once the model and its optimizer state exist (the model alone).

W=4 on this 2-core machine is oversubscribed: four ranks (each with its hashing and fsync threads)
share two cores, so its times say how the protocols behave when the ranks wait for a core, not
what W=4 costs on a machine with a core per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from .common import SCRIPTS, fmt, summary

METHODS = ("dcp", "trainjob", "floor")  # launched in this order in every round


def launch(method: str, work: Path, world: int, repeat: int, mib: int) -> list[dict]:
    where = work / f"fsdp-{method}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(SCRIPTS / "bench_fsdp.py"), method, str(where), str(repeat), str(mib),
                           str(where / "out")], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"bench_fsdp.py {method} at W={world} failed: {proc.stderr[-2000:]}")
    ranks = [json.loads((where / f"out.{r}.json").read_text()) for r in range(world)]
    shutil.rmtree(where, ignore_errors=True)
    return ranks


def measure(work: Path, world: int, rounds: int, repeat: int, mib: int) -> dict:
    """One size at one world size: every method, ``rounds`` launches each, taking turns."""
    got: dict[str, dict[str, list]] = {m: {"save": [], "load": [], "rss": [], "read": [], "phases": []}
                                       for m in METHODS}
    state = 0
    for _ in range(rounds):
        for method in METHODS:
            ranks = launch(method, work, world, repeat, mib)
            state = ranks[0]["state_bytes"]
            g = got[method]
            for op in ("save", "load"):
                g[op] += [max(r[op][i] for r in ranks) for i in range(repeat)]
            g["rss"].append([(r["peak_rss"] - r["base_rss"]) / (1 << 20) for r in ranks])
            size = ranks[0]["checkpoint_bytes"]
            g["read"] += [[r["read_bytes"][i] / size[i] for r in ranks] for i in range(repeat)]
            g["phases"] += [r["phases"] for r in ranks if r["phases"]]
    out: dict = {"world_size": world, "state_mib": state / (1 << 20), "rounds": rounds, "repeat": repeat}
    for method, g in got.items():
        out[method] = {"save_s": summary(g["save"]), "load_s": summary(g["load"]),
                       "rss_excess_mib_by_rank": [max(r[k] for r in g["rss"]) for k in range(world)],
                       "read_fraction_by_rank": [statistics.median(r[k] for r in g["read"]) for k in range(world)]}
        if g["phases"]:
            out[method]["phases_ms"] = g["phases"]
    med = lambda m, op: out[m][f"{op}_s"]["median"]  # noqa: E731
    out["ratio"] = {"save / dcp": med("trainjob", "save") / med("dcp", "save"),
                    "load / dcp": med("trainjob", "load") / med("dcp", "load"),
                    "floor / save": med("floor", "save") / med("trainjob", "save"),
                    "load / floor": med("trainjob", "load") / med("floor", "load"),
                    "floor load / dcp": med("floor", "load") / med("dcp", "load")}
    return out


def run_section(work: Path, rounds: int, repeat: int, mibs: list[int], worlds: list[int]) -> dict:
    runs = [measure(work, w, rounds, repeat, mib) for mib in mibs for w in worlds]
    targets = {}
    for s in runs:
        at = f"fsdp {s['state_mib']:.0f} MiB W={s['world_size']}"
        targets[f"{at}: verified load <= 1.15x the dcp+sha256 floor"] = s["ratio"]["load / floor"] <= 1.15
        if s["world_size"] == 2:
            targets[f"{at}: save >= 0.8x the save floor"] = s["ratio"]["floor / save"] >= 0.8
    return {"runs": runs, "targets": targets}


def table(section: dict) -> list[str]:
    first = section["runs"][0]
    lines = [f"FSDP2 (gloo, CPU, one thread per rank), {first['rounds']} rounds x {first['repeat']} repeats, "
             "seconds median (min..max); W=4 on 2 cores is oversubscribed", "",
             "| state | W | method | save s | load s | bytes read per rank, x the checkpoint | "
             "peak RSS above the model per rank (MiB) |", "| --- | ---: | --- | --- | --- | --- | --- |"]
    for s in section["runs"]:
        for method in METHODS:
            m = s[method]
            lines.append(f"| {s['state_mib']:.0f} MiB | {s['world_size']} | {method} | {fmt(m['save_s'], 3)} | "
                         f"{fmt(m['load_s'], 3)} | {' / '.join(f'{x:.2f}' for x in m['read_fraction_by_rank'])} | "
                         f"{' / '.join(f'{x:.0f}' for x in m['rss_excess_mib_by_rank'])} |")
    lines += ["", "| state | W | save: floor / trainjob (x the floor; target >= 0.8 at W=2) | "
              "load: trainjob / floor (target <= 1.15) | save: trainjob / dcp | load: trainjob / dcp | "
              "load floor / dcp |", "| --- | ---: | --- | --- | --- | --- | --- |"]
    for s in section["runs"]:
        r = s["ratio"]
        lines.append(f"| {s['state_mib']:.0f} MiB | {s['world_size']} | {r['floor / save']:.2f}x | "
                     f"{r['load / floor']:.2f}x | {r['save / dcp']:.2f}x | {r['load / dcp']:.2f}x | "
                     f"{r['floor load / dcp']:.2f}x |")
    return lines
