"""The trainer section (needs torch): a real torch model under trainjob against the same loop without.

scripts/bench_torch.py's model: one ``Linear(--trainer-dim, --trainer-dim)``, SGD with momentum,
batch 64, one thread; 128 MiB of state at 4096. Each figure is a ratio to the same loop without
trainjob, measured in the same repeat: seconds per step with no checkpoint due (the median
interval from one step's start to the next, timed in one process under ``trainjob.Run`` and in a
bare loop, alternating blocks: bench_torch.py's ``steps``); a whole run with a checkpoint every
``every`` steps against the bare loop saving model and optimizer with ``torch.save`` + fsync as
often, wall time and peak RSS; and the peers on the same live state in one process: trainjob's
save and verified load, torch.distributed.checkpoint's save/load and torch.save/torch.load.
"""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

from .common import MiB, SCRIPTS, bench_torch, fmt, measured, summary, targets_lines, torch_env


def run_section(work: Path, repeat: int, dim: int, steps: int, every: int) -> dict:
    env = torch_env(dim)

    def trainjob(n: int, ckpt_every: int) -> tuple[float, int]:
        pvc = work / "trainer-pvc"
        shutil.rmtree(pvc, ignore_errors=True)
        out = measured([sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc), "--steps", str(n),
                        "--ckpt-every", str(ckpt_every), "--keep", "2", "--trainer", "bench_torch:make"], env)
        shutil.rmtree(pvc, ignore_errors=True)
        return out

    def bare(n: int, save_every: int) -> tuple[float, int]:
        directory = work / "trainer-bare"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        out = measured([sys.executable, str(SCRIPTS / "bench_torch.py"), "bare", str(n), str(save_every),
                        str(directory)], env)
        shutil.rmtree(directory, ignore_errors=True)
        return out

    runs: dict[str, list[float]] = {}
    for rep in range(repeat):  # interleaved within each repeat, so both see the same machine
        # Per step, timed inside one process (bench_torch.py steps): a difference of two whole
        # runs was dominated by process start-up noise (it once gave a negative step time).
        per = bench_torch("steps", work / "trainer-steps", str(steps), "2", env=env)
        tj, b = statistics.median(per["trainjob"]), statistics.median(per["bare"])
        runs.setdefault("step_ratio", []).append(tj / b)
        runs.setdefault("trainjob_ms_per_step", []).append(tj * 1e3)
        runs.setdefault("bare_ms_per_step", []).append(b * 1e3)
        tj_run, tj_peak = trainjob(steps, every)
        b_run, b_peak = bare(steps, every)
        runs.setdefault("run_ratio", []).append(tj_run / b_run)
        runs.setdefault("trainjob_run_s", []).append(tj_run)
        runs.setdefault("bare_run_s", []).append(b_run)
        runs.setdefault("trainjob_peak_mib", []).append(tj_peak / MiB)
        runs.setdefault("bare_peak_mib", []).append(b_peak / MiB)
        print(f"trainer repeat {rep + 1}/{repeat} done", file=sys.stderr, flush=True)
    peers = bench_torch("peers", work / "trainer-peers", str(repeat), env=env)
    state = peers.pop("state_bytes")[0]
    out = {"dim": dim, "steps": steps, "every": every, "state_mib": state / MiB,
           **{k: summary(v) for k, v in runs.items()},
           "peers_s": {k: summary(v) for k, v in peers.items()}}
    budget = [b + (1.1 * state) / MiB + 64 for b in runs["bare_peak_mib"]]
    out["targets"] = {
        "trainer: steps with no checkpoint due <= 1.02x bare": out["step_ratio"]["median"] <= 1.02,
        "trainer: peak RSS <= bare + 1.1x state + 64MiB": all(t <= b for t, b in zip(runs["trainjob_peak_mib"],
                                                                                    budget)),
        f"trainer: run, checkpoint every {every} <= 1.1x bare torch.save": out["run_ratio"]["median"] <= 1.1,
        "trainer: save at least as fast as DCP": (out["peers_s"]["save trainjob"]["median"]
                                                  <= out["peers_s"]["save dcp"]["median"]),
        "trainer: verified load at least as fast as DCP": (out["peers_s"]["load trainjob"]["median"]
                                                           <= out["peers_s"]["load dcp"]["median"]),
    }
    return out


def table(tr: dict, targets: bool = True) -> str:
    lines = [f"trainer: Linear({tr['dim']}, {tr['dim']}), SGD momentum, batch 64, one thread: "
             f"{tr['state_mib']:.0f} MiB of state; median (min..max)",
             "", "| | trainjob | bare loop | ratio |", "| --- | --- | --- | --- |",
             f"| ms per step, no checkpoint due | {fmt(tr['trainjob_ms_per_step'], 0)} | "
             f"{fmt(tr['bare_ms_per_step'], 0)} | {fmt(tr['step_ratio'], 3)} |",
             f"| s per run of {tr['steps']} steps, a checkpoint every {tr['every']} (bare: torch.save + fsync) | "
             f"{fmt(tr['trainjob_run_s'], 1)} | {fmt(tr['bare_run_s'], 1)} | {fmt(tr['run_ratio'], 3)} |",
             f"| peak RSS of the whole process, MiB | {fmt(tr['trainjob_peak_mib'], 0)} | "
             f"{fmt(tr['bare_peak_mib'], 0)} | |", "",
             "| peers on the same live state, seconds | save | load |", "| --- | --- | --- |"]
    for who, label in (("trainjob", "trainjob (load verifies every sha256, into the live tensors)"),
                       ("dcp", "torch.distributed.checkpoint (verifies nothing)"),
                       ("torch", "torch.save + fsync / torch.load (verifies nothing)")):
        lines.append(f"| {label} | {fmt(tr['peers_s'][f'save {who}'], 3)} | {fmt(tr['peers_s'][f'load {who}'], 3)} |")
    if targets:
        lines += ["", *targets_lines(tr["targets"])]
    return "\n".join(lines)
