"""The engine section: ``trainjob run --ckpt-every 1`` per step against the same loop without trainjob.

Seconds per step from two runs (N and 2N steps, so start-up and the final gate cancel), against
the same training loop saving the same tensors with a bare ``durable.atomic_write`` per step. Twice:
with the built-in linear model (a 32-byte state, so only the checkpoint's fixed costs show) and
with ``bench_trainer.py``'s state of ``--engine-mib`` (where the bytes dominate).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trainjob.checkpoint import shards
from trainjob.storage.durable import atomic_write
from trainjob.trainers.protocol import build

from .common import MiB, SCRIPTS, fmt, summary

ENGINE_TRAINERS = {"linear": "linear", "big": "bench_trainer:make"}


def trainer_env(mib: int) -> dict:
    """Lets ``--trainer bench_trainer:make`` import, and tells it the state's size."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "BENCH_STATE_MIB": str(mib)}


def engine_seconds(work: Path, steps: int, trainer: str, mib: int) -> float:
    pvc = work / f"engine-{steps}"
    shutil.rmtree(pvc, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc), "--steps", str(steps),
                           "--ckpt-every", "1", "--trainer", ENGINE_TRAINERS[trainer]],
                          capture_output=True, text=True, env=trainer_env(mib))
    elapsed = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # 1: the drift gate failed at this step count, still a full run
        raise SystemExit(f"trainjob run exited {proc.returncode}: {proc.stderr[-2000:]}")
    shutil.rmtree(pvc, ignore_errors=True)
    return elapsed


def bare_loop(directory: str, steps: int, trainer_name: str, mib: int, results) -> None:
    """The same training loop (the same trainer, built the same way) saving the same state each
    step with one bare atomic write."""
    os.environ.update(trainer_env(mib))
    sys.path.insert(0, str(SCRIPTS))
    trainer = build(ENGINE_TRAINERS[trainer_name], None, 0.05)
    path = Path(directory) / "bare.safetensors"
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.step(step)
        atomic_write(path, shards.encode(trainer.state_dict(), {"step": str(step)}))
    results.put(time.perf_counter() - t0)


def run_section(ctx, work: Path, repeat: int, n: int, engine_mib: int) -> dict:
    """Interleaved in each repeat: engine, bare, engine, bare ...; the figures per trainer."""
    engine: dict = {"linear": ([], []), "big": ([], [])}  # trainer -> (engine, bare) seconds per step
    for _ in range(repeat):
        for name, (eng, bare) in engine.items():
            mib = engine_mib if name == "big" else 0
            steps = n if name == "linear" else max(2, n // 5)
            eng.append((engine_seconds(work, 2 * steps, name, mib) - engine_seconds(work, steps, name, mib)) / steps)
            q = ctx.Queue()
            p = ctx.Process(target=bare_loop, args=(str(work), steps, name, mib, q))
            p.start()
            bare.append(q.get(timeout=1800) / steps)
            p.join()
    return {name: {"engine_ms_per_step": summary([e * 1e3 for e in eng]),
                   "bare_ms_per_step": summary([b * 1e3 for b in bare]),
                   "ratio": summary([e / b for e, b in zip(eng, bare)]),
                   "state_mib": engine_mib if name == "big" else 32 / MiB}
            for name, (eng, bare) in engine.items()}


def table(engine: dict) -> list[str]:
    lines = []
    for name, e in engine.items():
        what = "built-in model, 32 B state" if name == "linear" else f"{e['state_mib']} MiB state"
        lines.append(f"engine, --ckpt-every 1, {what}: {fmt(e['engine_ms_per_step'])} ms/step vs bare loop "
                     f"{fmt(e['bare_ms_per_step'])} ms/step: ratio {fmt(e['ratio'])}")
    return lines
