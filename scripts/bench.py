#!/usr/bin/env python3
"""Benchmark trainjob's checkpoints against the disk's limit and against what users would use instead.

    python scripts/bench.py [--size 1GiB] [--world-size 1,2,4] [--repeat 5] [--json OUT] [--plot [PNG]]

The state is synthetic: float32 matrices split across W ranks by trainjob's own rule
(``plan.plan_shards``). Every figure comes from fresh processes (``multiprocessing`` spawn), so
peak RSS (``VmHWM``) is the contender's own. trainjob is driven through the same library calls
``trainjob run`` makes (``Committer.create_staging/write_slices/write_receipt/commit`` for a
save, ``CheckpointStore.load`` for a resume), the engine overhead through the real CLI.

The disk is shared and noisy, so nothing is reported alone: within each repeat every contender
runs between two runs of its reference (R A R B R C R ...), and its time is divided by the mean of
those two neighbours. The table gives the median of those ratios with min..max over repeats.
(This virtual disk switches between about 300 MB/s and 1.3 GB/s from one run to the next, as a
cache beneath it fills and drains: a reference measured once per repeat favoured whoever ran
at a fast moment, by up to 1.4x.)

- save: W processes, each writes its own shard; wall time from the first start to the last end.
  Limit: raw ``write`` + ``fsync`` of the same bytes to W files by W processes.
- load: one process reads every shard of the checkpoint just written (warm page cache: the files
  were just written, so this measures the CPU work of a resume, hashing included, not the disk).
  trainjob twice: in place, as a resume does (into a state built before the clock starts), and
  into new arrays, as the peers do. Limit: ``read`` + ``hashlib.sha256`` of the same files on one
  thread. Peers verify nothing.
- engine: ``trainjob run --ckpt-every 1``, seconds per step from two runs (N and 2N steps, so
  start-up and the final gate cancel), against the same training loop saving the same tensors
  with a bare ``pvc.atomic_write`` per step. Twice: with the built-in linear model (a 32-byte
  state, so only the checkpoint's fixed costs show) and with ``bench_trainer.py``'s state of
  ``--engine-mib`` (where the bytes dominate, as in real training).
- status: ``trainjob status`` on a log of ``--log-lines`` events, one run: seconds and peak RSS.
- trainer (needs torch): a real torch model written to the Stateful protocol (scripts/bench_torch.py:
  one ``Linear(--trainer-dim, --trainer-dim)``, SGD with momentum, batch 64, one thread; 128 MiB of
  state at 4096), each figure a ratio to the same loop without trainjob, measured in the same
  repeat: seconds per step with no checkpoint due (the median interval from one step's start to
  the next, timed in one process under ``trainjob.Run`` and in a bare loop, alternating blocks of
  ``--trainer-steps``: bench_torch.py's ``steps``); a whole run of ``--trainer-steps`` with a checkpoint every ``--trainer-every`` against
  the bare loop saving model and optimizer with ``torch.save`` + fsync as often (and the model at
  the end, as trainjob publishes it), wall time and peak RSS of the whole process; and the peers
  on the same live state in one process: trainjob's save (snapshot, shard, commit) and load
  (every sha256 verified, into the live tensors), torch.distributed.checkpoint's save/load (one
  process, no process group) and torch.save/torch.load.
- async (needs torch; ``--only async`` runs it alone): the same model run by ``trainjob run`` three
  ways in each repeat, fresh processes: no checkpoint but the final one, synchronous and
  ``--async-checkpoint`` every ``--async-every`` steps. The loop's stall per checkpoint is timed on
  the loop's own thread (bench_torch.py engine) against one in-memory copy of the state (the copy
  limit) and the synchronous save; the async run's wall time against the run without checkpoints;
  peak RSS against the bare loop's; and, on one live state, trainjob's background saver against
  torch.distributed.checkpoint's async_save (stall and end to end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from trainjob.checkpoint import plan
from trainjob.checkpoint import shards
from trainjob.checkpoint.store import CheckpointStore, Committer
from trainjob.checkpoint.plan import Ref
from trainjob.storage.pvc import Pvc, atomic_write
from trainjob.records import MANIFEST_SCHEMA, Manifest, TensorSpec
from trainjob.trainers.protocol import build

HERE = Path(__file__).resolve().parent
ENGINE_TRAINERS = {"linear": "linear", "big": "bench_trainer:make"}

MiB = 1 << 20
COLS = 1024  # columns of each synthetic matrix; rows are what ranks split
TENSORS = 8  # matrices in the state (a model's layers, say)
CHUNK = 8 << 20
POLL = 0.001

SAVES = ("raw", "trainjob", "safetensors", "numpy", "torch", "gather")
LOADS = ("limit", "trainjob", "trainjob-new", "safetensors", "numpy", "torch")
LABEL = {
    "save": {"raw": "raw write+fsync (limit)", "trainjob": "trainjob", "safetensors": "safetensors save_file+fsync",
             "numpy": "numpy.save+fsync", "torch": "torch.save+fsync",
             "gather": "gather to rank 0, then trainjob W=1"},
    "load": {"limit": "read+sha256, 1 thread (limit)",
             "trainjob": "trainjob, in place (verifies every sha256)",
             "trainjob-new": "trainjob, into new arrays (verifies)",
             "safetensors": "safetensors load_file (no check)", "numpy": "numpy.load (no check)",
             "torch": "torch.load weights_only (no check)"},
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]i?B?)?", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MiB, 1GiB)")
    unit = (m.group(2) or "B")[0].upper()
    return int(m.group(1)) << {"B": 0, "K": 10, "M": 20, "G": 30}[unit]


def specs(size: int) -> tuple[TensorSpec, ...]:
    rows = max(1, size // (TENSORS * COLS * 4))
    return tuple(TensorSpec(name=f"layer{i:02d}", dtype="F32", shape=(rows, COLS)) for i in range(TENSORS))


def state_bytes(spec: tuple[TensorSpec, ...]) -> int:
    return sum(4 * t.shape[0] * t.shape[1] for t in spec)


def rank_state(spec: tuple[TensorSpec, ...], rank: int, world: int) -> tuple[tuple, dict[str, np.ndarray]]:
    """This rank's slices, filled (so every page is resident before the clock starts)."""
    holds = plan.plan_shards(spec, world)[rank]
    mine = {}
    for i, h in enumerate(holds):
        a = np.empty(h.shape, dtype=np.float32)
        a.fill(rank * 100 + i + 0.5)
        mine[h.name] = a
    return holds, mine


def vm_hwm() -> int:
    """Peak resident set of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def byte_views(mine: dict[str, np.ndarray]):
    for a in mine.values():
        flat = memoryview(a.reshape(-1)).cast("B")
        for i in range(0, len(flat), CHUNK):
            yield flat[i:i + CHUNK]


# --- the contenders, each run inside a fresh worker process ---------------------------------------

def save_trainjob(root: Path, rank: int, world: int, holds, mine, spec, step: int) -> None:
    """What persist_checkpoint and _follow_generation do for one checkpoint, minus the log/pointer."""
    store = Committer(Pvc(root))  # rank 0's role; the other ranks use only ShardWriter's methods
    ref = Ref(attempt=1, step=step, world_size=world)
    staging = store.staging(ref, 1)
    if rank == 0:
        store.create_staging(ref, 1)
    while not staging.is_dir():
        time.sleep(POLL)
    entry = store.write_slices(staging, rank, world, step, holds, mine)
    if rank:
        store.write_receipt(staging, entry)
        return
    entries = [entry]
    for r in range(1, world):
        while not store.receipt_path(staging, r, world).exists():
            time.sleep(POLL)
        entries.append(store.read_receipt(staging, r, world))
    store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=step, attempt=1, world_size=world,
                                        loss_milli=0, tensors=spec, shards=entries))


def save_peer(kind: str, root: Path, rank: int, mine: dict[str, np.ndarray]) -> None:
    path = root / f"{kind}-{rank:05d}"
    if kind == "raw":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for view in byte_views(mine):
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    if kind == "safetensors":
        from safetensors.numpy import save_file
        save_file(mine, str(path))
    elif kind == "numpy":
        with open(path, "wb") as f:
            for a in mine.values():
                np.save(f, a)
    elif kind == "torch":
        import torch
        torch.save({k: torch.from_numpy(a) for k, a in mine.items()}, path)
    fsync_path(path)


def worker(op: str, kind: str, root: str, rank: int, world: int, size: int, step: int,
           barrier, results, pipe) -> None:
    try:
        spec = specs(size)
        root_path = Path(root)
        if kind == "torch":
            import torch  # noqa: F401  (imported before the clock starts, like the others' imports)
        if op == "save":
            holds, mine = rank_state(spec, rank, world)
            state = sum(a.nbytes for a in mine.values())
            if kind == "gather" and rank == 0:  # receive buffers for the whole state
                full = {t.name: np.empty(t.shape, dtype=np.float32) for t in spec}
                for name, a in mine.items():
                    full[name][:a.shape[0]] = a  # rank 0 owns the first rows
                state = state_bytes(spec)
            barrier.wait()
            t0 = time.perf_counter()
            if kind == "trainjob":
                save_trainjob(root_path, rank, world, holds, mine, spec, step)
            elif kind == "gather":
                if rank:  # ship every byte to rank 0 through a pipe
                    for view in byte_views(mine):
                        pipe.send_bytes(view)
                else:
                    for conn, r in zip(pipe, range(1, world)):
                        for h in plan.plan_shards(spec, world)[r]:
                            dest = memoryview(full[h.name][h.start:h.start + h.shape[0]].reshape(-1)).cast("B")
                            got = 0
                            while got < len(dest):
                                got += conn.recv_bytes_into(dest[got:])
                    save_trainjob(root_path, 0, 1, plan.plan_shards(spec, 1)[0], full, spec, step)
            else:
                save_peer(kind, root_path, rank, mine)
            t1 = time.perf_counter()
        else:
            state = state_bytes(spec)
            files = sorted(p for p in root_path.glob(f"{kind}-*")) if not kind.startswith(("trainjob", "limit")) else []
            # What `trainjob run` does on a resume: the trainer builds its state first (touched, as a
            # model's initialised weights are) and the checkpoint is read into those arrays.
            initial = rank_state(spec, 0, 1)[1] if kind == "trainjob" else None
            barrier.wait()
            t0 = time.perf_counter()
            if kind.startswith("trainjob"):
                loaded = CheckpointStore(Pvc(root_path)).load(Ref(attempt=1, step=step, world_size=world), into=initial)
                assert loaded.tensors["layer00"].shape == spec[0].shape
                assert initial is None or loaded.tensors["layer00"] is initial["layer00"]
            elif kind == "limit":
                shard_dir = root_path / "checkpoints" / Ref(attempt=1, step=step, world_size=world).name
                buf = memoryview(bytearray(CHUNK))
                for path in sorted(shard_dir.glob("shard-*")):
                    digest = hashlib.sha256()
                    with open(path, "rb", buffering=0) as f:
                        while n := f.readinto(buf):
                            digest.update(buf[:n])
            elif kind == "safetensors":
                from safetensors.numpy import load_file
                out = [load_file(str(p)) for p in files]
            elif kind == "numpy":
                out = []
                for p in files:
                    with open(p, "rb") as f:
                        out += [np.load(f) for _ in spec]
            elif kind == "torch":
                import torch
                out = [torch.load(p, weights_only=True) for p in files]
            t1 = time.perf_counter()
        results.put({"rank": rank, "t0": t0, "t1": t1, "hwm": vm_hwm(), "state": state})
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{op} {kind} rank {rank}: {type(exc).__name__}: {exc}"})
        raise


def run_workers(ctx, op: str, kind: str, root: Path, world: int, size: int, step: int) -> dict:
    """Start the W (or 1) processes of one contender, release them together, return wall time and peak RSS."""
    procs_n = world if op == "save" else 1
    barrier, results = ctx.Barrier(procs_n), ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)] if (op, kind) == ("save", "gather") else []
    procs = []
    for rank in range(procs_n):
        pipe = [r for r, _ in pipes] if rank == 0 else (pipes[rank - 1][1] if pipes else None)
        procs.append(ctx.Process(target=worker, args=(op, kind, str(root), rank, world, size, step,
                                                      barrier, results, pipe if pipes else None)))
    for p in procs:
        p.start()
    got = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        raise SystemExit("; ".join(errors))
    return {"seconds": max(g["t1"] for g in got) - min(g["t0"] for g in got),
            "rss": max(g["hwm"] for g in got), "rss_state": max(g["state"] for g in got),
            "rss_rank0": next(g["hwm"] for g in got if g["rank"] == 0)}


# --- engine overhead ---------------------------------------------------------------------------

def trainer_env(mib: int) -> dict:
    """Lets ``--trainer bench_trainer:make`` import, and tells it the state's size."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
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
    sys.path.insert(0, str(HERE))
    trainer = build(ENGINE_TRAINERS[trainer_name], None, 0.05)
    path = Path(directory) / "bare.safetensors"
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.step(step)
        atomic_write(path, shards.encode(trainer.state_dict(), {"step": str(step)}))
    results.put(time.perf_counter() - t0)


# --- a torch trainer: trainjob against the same loop without it ------------------------------------

PEAK_CHILD = """
import resource, subprocess, sys, time
t0 = time.perf_counter()
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
print(rc, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def measured(cmd: list[str], env: dict) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of ``cmd``, a fresh process, from a wrapper that runs only it."""
    proc = subprocess.run([sys.executable, "-c", PEAK_CHILD, *cmd], capture_output=True, text=True, env=env)
    rc, seconds, peak = proc.stdout.split() if proc.returncode == 0 else ("?", 0, 0)
    if rc != "0":
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return float(seconds), int(peak)


def trainer_section(work: Path, repeat: int, dim: int, steps: int, every: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
           "BENCH_TORCH_DIM": str(dim), "OMP_NUM_THREADS": "1"}

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
        out = measured([sys.executable, str(HERE / "bench_torch.py"), "bare", str(n), str(save_every),
                        str(directory)], env)
        shutil.rmtree(directory, ignore_errors=True)
        return out

    runs: dict[str, list[float]] = {}
    for rep in range(repeat):  # interleaved within each repeat, so both see the same machine
        # Per step, timed inside one process (bench_torch.py steps): a difference of two whole
        # runs was dominated by process start-up noise (it once gave a negative step time).
        directory = work / "trainer-steps"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        proc = subprocess.run([sys.executable, str(HERE / "bench_torch.py"), "steps", str(directory), str(steps), "2"],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"trainer steps failed: {proc.stderr[-2000:]}")
        per = json.loads(proc.stdout.splitlines()[-1])
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
    directory = work / "trainer-peers"
    directory.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(HERE / "bench_torch.py"), "peers", str(directory), str(repeat)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"trainer peers failed: {proc.stderr[-2000:]}")
    peers = json.loads(proc.stdout.splitlines()[-1])
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


# --- --async-checkpoint: the loop's stall and the run's time against the same run without ----------

def async_section(work: Path, repeat: int, dim: int, steps: int, every: int) -> dict:
    """The torch trainer run three ways in each repeat, in fresh processes, interleaved: with no
    checkpoint but the final one every run writes (``--ckpt-every STEPS``), synchronous and
    asynchronous with a checkpoint every ``every`` steps; and the bare loop for peak RSS. The loop's
    own time in its checkpoint calls is timed inside the process (bench_torch.py engine). Then
    the copy limit and DCP's async_save on one live state (bench_torch.py async-peers)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
           "BENCH_TORCH_DIM": str(dim), "OMP_NUM_THREADS": "1"}

    def engine(mode: str, ckpt_every: int) -> tuple[dict, int]:
        directory, out = work / f"async-{mode}", work / f"async-{mode}.json"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        _, peak = measured([sys.executable, str(HERE / "bench_torch.py"), "engine", mode, str(directory), str(steps),
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
        _, bare_peak = measured([sys.executable, str(HERE / "bench_torch.py"), "bare", str(steps), "0",
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
    directory = work / "async-peers"
    directory.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(HERE / "bench_torch.py"), "async-peers", str(directory), str(repeat)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"async peers failed: {proc.stderr[-2000:]}")
    peers = json.loads(proc.stdout.splitlines()[-1])
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


def async_table(a: dict, targets: bool = True) -> str:
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
        lines += [""] + [f"- [{'x' if ok else ' '}] {name}" for name, ok in a["targets"].items()]
    return "\n".join(lines)


# --- status on a long log ------------------------------------------------------------------------

STATUS_CHILD = """
import sys, time, io, contextlib
from trainjob.cli import main
out = io.StringIO()
t0 = time.perf_counter()
try:
    with contextlib.redirect_stdout(out):
        main(["status", sys.argv[1]])
except SystemExit:
    pass
elapsed = time.perf_counter() - t0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(elapsed, hwm)
"""


def status_bench(work: Path, lines: int) -> dict:
    log = work / "long.jsonl"
    first = '{"ts":"2026-11-30T00:00:00Z","event":"job_started","detail":"attempt=1 steps=10"}\n'
    line = '{"ts":"2026-11-30T00:00:00Z","event":"checkpointed","detail":"step=4 loss_milli=241"}\n'
    with open(log, "w") as f:
        f.write(first)
        block = line * 10000
        for _ in range((lines - 1) // 10000):
            f.write(block)
        f.write(line * ((lines - 1) % 10000))
    proc = subprocess.run([sys.executable, "-c", STATUS_CHILD, str(log)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"status benchmark failed: {proc.stderr[-2000:]}")
    seconds, hwm = proc.stdout.split()
    log.unlink()
    return {"lines": lines, "seconds": float(seconds), "peak_mib": int(hwm) / MiB}


# --- the run ---------------------------------------------------------------------------------------

def bracketed(run, ref: str, kinds: list[str]) -> dict[str, list[dict]]:
    """Run ``ref``, then each contender followed by ``ref`` again (R A R B R ...).

    Each contender's run gets ``ref_seconds``: the mean of the reference runs on either side, so
    its ratio is to the disk as it was while it ran, not at some other moment of the repeat.
    """
    before = run(ref)
    before["ref_seconds"] = before["seconds"]
    out = {ref: [before]}
    for kind in kinds:
        r = run(kind)
        after = run(ref)
        after["ref_seconds"] = after["seconds"]
        r["ref_seconds"] = (before["seconds"] + after["seconds"]) / 2
        out[ref].append(after)
        out[kind] = [r]
        before = after
    return out


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def have_torch() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


def cpu_probe() -> dict:
    """How much a second thread buys right now: sha256 of 64 MiB on one thread, then on two at once.

    The cores are shared with other tenants; when the second core is busy, overlapping hashing
    with I/O (what trainjob does) cannot beat doing both in series, and this says so.
    """
    import threading
    buf = os.urandom(1 << 20) * 64
    one, two = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        hashlib.sha256(buf)
        one.append(time.perf_counter() - t0)
        threads = [threading.Thread(target=hashlib.sha256, args=(buf,)) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        two.append(time.perf_counter() - t0)
    return {"sha256_mb_per_s_one_thread": len(buf) / 1e6 / statistics.median(one),
            "two_thread_speedup": 2 * statistics.median(one) / statistics.median(two)}


def machine(work: Path) -> dict:
    mem = next((int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal:")), 0)
    dev = fs = "?"
    best = ""
    for line in open("/proc/mounts"):
        d, mnt, kind = line.split()[:3]
        if str(work.resolve()).startswith(mnt) and len(mnt) > len(best):
            best, dev, fs = mnt, d, kind
    versions = {}
    for pkg in ("numpy", "safetensors", "torch", "transitions", "attrs", "cattrs"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cores": os.cpu_count(), "memory_gib": round(mem / (1 << 30), 1), "disk": f"{dev} ({fs}) at {best}",
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="state size (default 1GiB)")
    ap.add_argument("--world-size", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--plot", nargs="?", const=Path("docs/benchmarks.png"), type=Path,
                    help="draw throughput vs world size (default docs/benchmarks.png)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write (default /tmp)")
    ap.add_argument("--steps", type=int, default=100,
                    help="engine: N in the N vs 2N steps runs (N/5 with the large state)")
    ap.add_argument("--engine-mib", type=int, default=64, help="engine: the large state's size in MiB")
    ap.add_argument("--log-lines", type=int, default=1_000_000, help="status: lines in the log")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch peer even when it is installed")
    ap.add_argument("--trainer-dim", type=int, default=4096,
                    help="trainer: the Linear's width (4096: a 128 MiB state with momentum; 0 skips the section)")
    ap.add_argument("--trainer-steps", type=int, default=40, help="trainer: steps in the whole run")
    ap.add_argument("--trainer-every", type=int, default=10, help="trainer: a checkpoint every this many steps")
    ap.add_argument("--async-steps", type=int, default=32,
                    help="async: steps in each run (enough checkpoints that the first landing's one-off state.json write is amortised)")
    ap.add_argument("--async-every", type=int, default=4,
                    help="async: a checkpoint every this many steps (pick it so the writer keeps up: the table says)")
    ap.add_argument("--only", choices=("all", "trainer", "async"), default="all", help="run every section, or one")
    args = ap.parse_args(argv)
    if args.only != "all":  # one torch section alone: its table, and its figures with --json
        if not have_torch():
            raise SystemExit(f"--only {args.only} needs torch (pip install 'trainjob[torch]')")
        run_section, section_table, steps, every = {
            "async": (async_section, async_table, args.async_steps, args.async_every),
            "trainer": (trainer_section, trainer_table, args.trainer_steps, args.trainer_every)}[args.only]
        work = Path(tempfile.mkdtemp(prefix="trainjob-bench-", dir=args.dir))
        try:
            figures = run_section(work, args.repeat, args.trainer_dim, steps, every)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                  "machine": machine(args.dir), "repeat": args.repeat, args.only: figures}
        print(section_table(figures))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    worlds = [int(w) for w in args.world_size.split(",")]
    torch_ok = have_torch() and not args.no_torch
    saves = [k for k in SAVES if k != "torch" or torch_ok]
    loads = [k for k in LOADS if k != "torch" or torch_ok]
    ctx = mp.get_context("spawn")
    spec = specs(args.size)
    size = state_bytes(spec)
    work = Path(tempfile.mkdtemp(prefix="trainjob-bench-", dir=args.dir))
    probes = [cpu_probe()]
    t: dict = {"save": {}, "load": {}}  # op -> W -> kind -> list of runs
    engine: dict = {"linear": ([], []), "big": ([], [])}  # trainer -> (engine, bare) seconds per step
    try:
        for rep in range(args.repeat):
            for w in worlds:
                root = work / f"w{w}"

                def save(kind: str) -> dict:
                    if kind == "raw":  # new files every time, like every contender's
                        shutil.rmtree(root / "raw", ignore_errors=True)
                    target = root / kind if kind in ("trainjob", "gather", "raw") else root
                    target.mkdir(parents=True, exist_ok=True)
                    return run_workers(ctx, "save", kind, target, w, size, rep + 1)

                def load(kind: str) -> dict:
                    target = root / "trainjob" if kind in ("trainjob", "trainjob-new", "limit") else root
                    return run_workers(ctx, "load", kind, target, w, size, rep + 1)

                savers = [k for k in saves if k != "raw" and (k != "gather" or w > 1)]  # W=1 gather is trainjob
                loaders = [k for k in loads if k != "limit"]
                for op, run, ref, kinds in (("save", save, "raw", savers), ("load", load, "limit", loaders)):
                    for kind, runs in bracketed(run, ref, kinds).items():
                        t[op].setdefault(w, {}).setdefault(kind, []).extend(runs)
                shutil.rmtree(root)
                print(f"repeat {rep + 1}/{args.repeat} W={w} done", file=sys.stderr, flush=True)
        n = args.steps
        for rep in range(args.repeat):  # interleaved: engine, bare, engine, bare ...
            for name, (eng, bare) in engine.items():
                mib = args.engine_mib if name == "big" else 0
                steps = n if name == "linear" else max(2, n // 5)
                eng.append((engine_seconds(work, 2 * steps, name, mib) - engine_seconds(work, steps, name, mib))
                           / steps)
                q = ctx.Queue()
                p = ctx.Process(target=bare_loop, args=(str(work), steps, name, mib, q))
                p.start()
                bare.append(q.get(timeout=1800) / steps)
                p.join()
        status = status_bench(work, args.log_lines)
        trainer = (trainer_section(work, args.repeat, args.trainer_dim, args.trainer_steps, args.trainer_every)
                   if torch_ok and args.trainer_dim > 0 else None)
        asy = (async_section(work, args.repeat, args.trainer_dim, args.async_steps, args.async_every)
               if torch_ok and args.trainer_dim > 0 else None)
        probes.append(cpu_probe())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "machine": machine(args.dir), "state_bytes": size, "repeat": args.repeat, "world_sizes": worlds,
                 "cpu_probe": {"before": probes[0], "after": probes[1]},
                 "notes": [] if torch_ok else ["torch.save/torch.load and the trainer section skipped "
                                               "(not installed, or --no-torch)"],
                 "save": {}, "load": {}}
    for op, ref in (("save", "raw"), ("load", "limit")):
        for w in worlds:
            runs = t[op][w]
            out[op][str(w)] = {
                kind: {"mb_per_s": summary([size / 1e6 / r["seconds"] for r in rs]),
                       # throughput ratio: the bracketing reference runs' mean time / contender time
                       "ratio_to_limit": summary([r["ref_seconds"] / r["seconds"] for r in rs]),
                       "peak_rss_over_state": summary([r["rss"] / r["rss_state"] for r in rs]),
                       "peak_rss_mib": summary([r["rss"] / MiB for r in rs])}
                for kind, rs in runs.items()}
    out["engine"] = {name: {"engine_ms_per_step": summary([e * 1e3 for e in eng]),
                            "bare_ms_per_step": summary([b * 1e3 for b in bare]),
                            "ratio": summary([e / b for e, b in zip(eng, bare)]),
                            "state_mib": args.engine_mib if name == "big" else 32 / MiB}
                     for name, (eng, bare) in engine.items()}
    out["status"] = status
    w1 = str(worlds[0])
    budget = lambda op: (out[op][w1]["trainjob"]["peak_rss_mib"]["max"] * MiB
                         <= 1.1 * t[op][worlds[0]]["trainjob"][0]["rss_state"] + 64 * MiB)
    out["targets"] = {
        "save >= 0.9x raw at every W": all(out["save"][str(w)]["trainjob"]["ratio_to_limit"]["median"] >= 0.9
                                           for w in worlds),
        "load >= 0.9x read+sha256 at W=1": out["load"][w1]["trainjob"]["ratio_to_limit"]["median"] >= 0.9,
        "load > 1x single-thread limit at W>=2": all(out["load"][str(w)]["trainjob"]["ratio_to_limit"]["median"] > 1
                                                     for w in worlds if w >= 2),
        "save peak RSS <= 1.1x state + 64MiB": budget("save"),
        "load peak RSS <= 1.1x state + 64MiB": budget("load"),
        "engine <= 1.25x bare loop (built-in model)": out["engine"]["linear"]["ratio"]["median"] <= 1.25,
        f"engine <= 1.25x bare loop ({args.engine_mib} MiB state)": out["engine"]["big"]["ratio"]["median"] <= 1.25,
        "status < 100MiB": status["peak_mib"] < 100,
    }
    if trainer is not None:
        out["trainer"] = trainer
        out["targets"].update(trainer["targets"])
    if asy is not None:
        out["async"] = asy
        out["targets"].update(asy["targets"])
    if 2 in worlds:
        s2 = out["save"]["2"]
        out["targets"]["W=2 save faster than gather"] = (s2["trainjob"]["ratio_to_limit"]["median"]
                                                         > s2["gather"]["ratio_to_limit"]["median"])
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        plot(out, args.plot)
    return 0


def fmt(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def table(out: dict) -> str:
    mib = out["state_bytes"] / MiB
    lines = [f"state {mib:.0f} MiB float32, {out['repeat']} repeats; median (min..max); "
             "ratio = mean time of the two limit runs around it / contender time (higher is faster)", ""]
    for op, head in (("save", "save (W processes in parallel, write+fsync)"),
                     ("load", "load (one process; warm page cache; only trainjob verifies)")):
        lines += [f"| {head} | W | MB/s | x limit | peak RSS / state |", "| --- | --- | --- | --- | --- |"]
        for w, kinds in out[op].items():
            for kind, s in kinds.items():
                name = LABEL[op][kind]
                lines.append(f"| {name} | {w} | {fmt(s['mb_per_s'], 0)} | {fmt(s['ratio_to_limit'])} | "
                             f"{fmt(s['peak_rss_over_state'])} |")
        lines.append("")
    for name, e in out["engine"].items():
        what = "built-in model, 32 B state" if name == "linear" else f"{e['state_mib']} MiB state"
        lines.append(f"engine, --ckpt-every 1, {what}: {fmt(e['engine_ms_per_step'])} ms/step vs bare loop "
                     f"{fmt(e['bare_ms_per_step'])} ms/step: ratio {fmt(e['ratio'])}")
    s = out["status"]
    lines.append(f"status on {s['lines']:,} lines: {s['seconds']:.1f} s, peak RSS {s['peak_mib']:.0f} MiB")
    if "trainer" in out:
        lines += ["", trainer_table(out["trainer"], targets=False)]
    if "async" in out:
        lines += ["", async_table(out["async"], targets=False)]
    lines.append("")
    lines += [f"- [{'x' if ok else ' '}] {name}" for name, ok in out["targets"].items()]
    for when, p in out["cpu_probe"].items():
        lines.append(f"cpu {when}: sha256 {p['sha256_mb_per_s_one_thread']:.0f} MB/s on one thread; "
                     f"two threads at once do {p['two_thread_speedup']:.2f}x the work of one")
    lines += [f"note: {n}" for n in out["notes"]]
    return "\n".join(lines)


def trainer_table(tr: dict, targets: bool = True) -> str:
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
        lines += [""] + [f"- [{'x' if ok else ' '}] {name}" for name, ok in tr["targets"].items()]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=90)
    for ax, op, ref in ((axes[0], "save", "raw"), (axes[1], "load", "limit")):
        worlds = [int(w) for w in out[op]]
        kinds = list(next(iter(out[op].values())).keys() | set().union(*(k.keys() for k in out[op].values())))
        for kind in sorted(kinds, key=lambda k: (k != ref, k != "trainjob", k)):
            ws = [w for w in worlds if kind in out[op][str(w)]]
            ys = [out[op][str(w)][kind]["mb_per_s"]["median"] for w in ws]
            style = dict(color="black", linestyle="--", marker=None) if kind == ref else \
                dict(linewidth=2.5 if kind == "trainjob" else 1, marker="o", markersize=3)
            ax.plot(ws, ys, label=LABEL[op][kind],
                    **style)
        ax.set_xticks(worlds)
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("MB/s (median)")
        ax.set_title(f"{op}, {out['state_bytes'] / MiB:.0f} MiB", fontsize=9)
        ax.legend(fontsize=6)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
