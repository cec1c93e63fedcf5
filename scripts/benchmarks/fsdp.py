"""The fsdp section: an FSDP2 model's sharded state saved and loaded at W=2, trainjob against DCP.

``scripts/bench_fsdp.py`` under torchrun (2 ranks, gloo, one thread each) builds the same model
in every launch (``--fsdp-mib`` of state: weights and AdamW's two moments, float32, every one a
DTensor sharded along its first axis) and times ``repeat`` saves and loads by one method, each from
a barrier to a barrier (the slower rank's time). Launches take turns, DCP, trainjob, DCP+sha256, then again
(``rounds`` of each), so all three see the machine as it was; the figure is the median over every
repeat of every round, and trainjob's ratio to DCP's. Peak RSS (VmHWM) per rank is reported as the
excess over the same launch's peak once the model and its optimizer state exist (the model alone).
DCP checks no hash; trainjob's load hashes every shard (rank 0 every one, as its resume does).
A third method, ``dcp+sha256`` (DCP's load, then each rank hashes its local bytes once), is the
floor of any load that checks what it uses: its ratio to DCP says how close to DCP's unverified
load a verifying one can come on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .common import SCRIPTS, fmt, summary

METHODS = ("dcp", "trainjob", "dcp+sha256")  # launched in this order in every round


def launch(method: str, work: Path, repeat: int, mib: int) -> list[dict]:
    where = work / f"fsdp-{method}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "bench_fsdp.py"), method, str(where), str(repeat), str(mib),
                           str(where / "out")], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"bench_fsdp.py {method} failed: {proc.stderr[-2000:]}")
    ranks = [json.loads((where / f"out.{r}.json").read_text()) for r in range(2)]
    shutil.rmtree(where, ignore_errors=True)
    return ranks


def run_section(work: Path, rounds: int, repeat: int, mib: int) -> dict:
    got: dict[str, dict[str, list]] = {m: {"save": [], "load": [], "rss": []} for m in METHODS}
    state = 0
    for _ in range(rounds):
        for method in METHODS:
            ranks = launch(method, work, repeat, mib)
            state = ranks[0]["state_bytes"]
            for op in ("save", "load"):
                got[method][op] += [max(r[op][i] for r in ranks) for i in range(repeat)]
            got[method]["rss"].append([(r["peak_rss"] - r["base_rss"]) / (1 << 20) for r in ranks])
    out: dict = {"state_mib": state / (1 << 20), "rounds": rounds, "repeat": repeat}
    for method, g in got.items():
        out[method] = {"save_s": summary(g["save"]), "load_s": summary(g["load"]),
                       "rss_excess_mib_by_rank": [max(r[k] for r in g["rss"]) for k in range(2)]}
    ratio = {op: out["trainjob"][f"{op}_s"]["median"] / out["dcp"][f"{op}_s"]["median"] for op in ("save", "load")}
    ratio["load floor"] = out["dcp+sha256"]["load_s"]["median"] / out["dcp"]["load_s"]["median"]
    out["ratio"] = ratio
    out["targets"] = {"fsdp W=2: trainjob save <= DCP save": ratio["save"] <= 1.0,
                      "fsdp W=2: trainjob verified load <= 1.2x DCP load": ratio["load"] <= 1.2}
    return out


def table(s: dict) -> list[str]:
    lines = [f"FSDP2 at W=2 (gloo, CPU), {s['state_mib']:.0f} MiB of sharded state, {s['rounds']} rounds x "
             f"{s['repeat']} repeats, seconds median (min..max)", "",
             "| method | save s | load s | peak RSS above the model, rank 0 / rank 1 (MiB) |", "| --- | --- | --- | --- |"]
    for method in METHODS:
        m = s[method]
        lines.append(f"| {method} | {fmt(m['save_s'], 3)} | {fmt(m['load_s'], 3)} | "
                     f"{m['rss_excess_mib_by_rank'][0]:.0f} / {m['rss_excess_mib_by_rank'][1]:.0f} |")
    lines.append(f"| trainjob / dcp | {s['ratio']['save']:.2f}x | {s['ratio']['load']:.2f}x | |")
    lines.append(f"| dcp+sha256 / dcp (the floor of a verifying load) | | {s['ratio']['load floor']:.2f}x | |")
    return lines
