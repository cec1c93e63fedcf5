"""The checkpoint section: trainjob's save and resume against the disk's limit and the peers.

The state is synthetic: float32 matrices split across W ranks by trainjob's own rule
(``plan.plan_shards``). Every figure comes from fresh processes (``multiprocessing`` spawn), so
peak RSS (``VmHWM``) is the contender's own. trainjob is driven through the same library calls
``trainjob run`` makes (``save_trainjob``: the Committer's and ShardWriter's for a save, and at
W > 1 the ranks' own coordination objects, through a store this process hosts as torchrun's agent
does, or through files with ``--ranks-via files``, so the ranks wait for each other as the engine's
do; ``CheckpointStore.load`` for a resume). A save is timed after one untimed save by the same
process, as a run's checkpoints after its first are. Within each repeat every contender runs between two
runs of its reference (``common.bracketed``). ``raw+sha256`` is no contender but a floor: the raw
write+fsync with a sha256 of the same bytes on a second thread, so its ratio says how close to the
raw limit any save that hashes every byte can come on this machine at that W.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

from trainjob.checkpoint import plan
from trainjob.checkpoint.plan import Ref
from trainjob.checkpoint.store import CheckpointStore, Committer, ShardWriter
from trainjob.records import MANIFEST_SCHEMA, Manifest, TensorSpec
from trainjob.storage.eventlog import EventLog
from trainjob.storage.pvc import Pvc

from .common import MiB, bracketed, fmt, fsync_path, summary, vm_hwm

COLS = 1024  # columns of each synthetic matrix; rows are what ranks split
WARM = 1000  # the untimed save before a "trainjob" save is of this many steps later
TENSORS = 8  # matrices in the state (a model's layers, say)
CHUNK = 8 << 20

SAVES = ("raw", "raw+sha256", "trainjob", "trainjob-step", "safetensors", "numpy", "torch", "gather")
LOADS = ("limit", "trainjob", "trainjob-new", "safetensors", "numpy", "torch")
LABEL = {
    "save": {"raw": "raw write+fsync (limit)",
             "raw+sha256": "raw write+fsync, sha256 of every byte beside it (floor of a hashing save)",
             "trainjob": "trainjob (shards + commit)",
             "trainjob-step": "trainjob, a whole checkpoint (+ pointer, rotation, log line)",
             "safetensors": "safetensors save_file+fsync",
             "numpy": "numpy.save+fsync", "torch": "torch.save+fsync",
             "gather": "gather to rank 0, then trainjob W=1"},
    "load": {"limit": "read+sha256, 1 thread (limit)",
             "trainjob": "trainjob, in place (verifies every sha256)",
             "trainjob-new": "trainjob, into new arrays (verifies)",
             "safetensors": "safetensors load_file (no check)", "numpy": "numpy.load (no check)",
             "torch": "torch.load weights_only (no check)"},
}


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


def byte_views(mine: dict[str, np.ndarray]):
    for a in mine.values():
        flat = memoryview(a.reshape(-1)).cast("B")
        for i in range(0, len(flat), CHUNK):
            yield flat[i:i + CHUNK]


# --- the contenders, each run inside a fresh worker process ---------------------------------------

def join(root: Path, rank: int, world: int, store: tuple[str, int, str] | None):
    """This worker's side of the ranks' agreement, joined and begun, as ``trainjob run``'s rank
    makes it (``Run._lead``, ``Run._follow``): through a store like the one torchrun's agent hosts
    (``store``: its host, port and a run id unique to this launch), else through files on the PVC
    (the local launcher's way). None at W=1, where the engine agrees with nobody."""
    if world == 1:
        return None
    from trainjob.ranks import connect
    from trainjob.records import Session

    env = {} if store is None else {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": store[0],
                                    "MASTER_PORT": str(store[1]), "TORCHELASTIC_RUN_ID": store[2]}
    env["TRAINJOB_COORDINATION"] = "files" if store is None else "store"
    pvc, no_signal = Pvc(root), lambda: None
    if rank:
        peers = connect.follower(pvc, rank, world, 60.0, no_signal, env=env)
        peers.join("bench", set())
        return peers
    peers = connect.coordinator(pvc, world, 60.0, no_signal, env=env)
    peers.publish(lambda g: Session(generation=g, world_size=world, attempt=1, from_step=0, checkpoint=None,
                                    manifest_sha256=None, settings="bench"))
    peers.wait_joined()
    peers.begin()
    return peers


# An A/B run of this bench against a tree from before issue 30's second round (the library on
# PYTHONPATH) re-enacts that tree's engine: its calls had other names and another order.
BEFORE = not hasattr(ShardWriter, "settle")
# A tree from before issue 54's headers (they say where each slice sits) writes a shard without
# the tensors' whole shapes.
PLACED = "tensors" in inspect.signature(ShardWriter.write_slices).parameters


def _write_slices(store, staging, rank: int, world: int, step: int, spec, holds, mine, **kw):
    whole = (spec,) if PLACED else ()
    return store.write_slices(staging, rank, world, step, *whole, holds, mine, **kw)


def _timed(name: str, fn):
    return fn()


def save_trainjob(root: Path, rank: int, world: int, holds, mine, spec, step: int, whole: bool = False,
                  peers=None, phase=_timed) -> None:
    """What a rank of ``trainjob run`` does for one checkpoint, call for call: rank 0 what
    ``Job.write_checkpoint`` does (free-space check, staging, its shard, the others' receipts
    through ``peers``, the commit), the others what ``Run._write_shard`` does (wait for the
    staging through ``peers``, the shard, the receipt). With ``whole``, rank 0 also does what the
    rest of the ``checkpoint`` transition does (the pointer, ``Job.announce``'s ``checkpointed``
    line, rotation with ``--keep 1`` and the start of its delete): every durability point of
    docs/checkpoints.md's table. ``phase(name, fn)`` runs each
    step (the probe, scripts/checkpoint_phases.py, times them)."""
    store = Committer(Pvc(root))  # rank 0's role; the other ranks use only ShardWriter's methods
    ref = Ref(attempt=1, step=step, world_size=world)
    generation = peers.generation if peers is not None else 1
    if rank:
        staging = store.staging(ref, generation)
        phase("wait staging", lambda: peers.wait_staging(staging, step))
        if not BEFORE:
            entry = phase("shard", lambda: _write_slices(store, staging, rank, world, step, spec, holds, mine,
                                                        fsync_later=True))
            phase("deliver", lambda: peers.deliver(step, entry, lambda e: store.write_receipt(staging, e), store.settle))
        else:
            entry = phase("shard", lambda: _write_slices(store, staging, rank, world, step, spec, holds, mine))
            phase("deliver", lambda: peers.deliver(step, entry, lambda e: store.write_receipt(staging, e)))
        return
    phase("space", lambda: store.check_space(1))
    staging = phase("staging", lambda: store.create_staging(ref, generation))
    if hasattr(peers, "staged"):  # a library from before issue 45, which told the others to write
        phase("staged", lambda: peers.staged(step))
    later = {"committing" if BEFORE else "fsync_later": True}
    entries = [phase("shard", lambda: _write_slices(store, staging, 0, world, step, spec, holds, mine, **later))]
    if peers is not None:
        entries += phase("gather", lambda: peers.gather(
            lambda r: store.receipt_path(staging, r, world).exists(),
            lambda r: store.read_receipt(staging, r, world), step))
    manifest = Manifest(schema=MANIFEST_SCHEMA, step=step, attempt=1, world_size=world, loss_milli=0,
                        tensors=spec, shards=entries)
    others = {} if BEFORE or peers is None else {"others": lambda: peers.durable(step)}
    phase("commit", lambda: store.commit(staging, ref, manifest, point=whole, **others))
    if not whole:
        return
    log = lambda: EventLog(root / "log.jsonl").append("checkpointed", f"step={step} loss_milli=0")  # noqa: E731
    if not BEFORE:  # as Job.announce: the line, then rotation (after the pointer's durability)
        phase("log", log)
        phase("rotate", lambda: store.rotate(1, world, protect=ref))
    else:  # rotation, then the line
        phase("rotate", lambda: store.rotate(1, world, protect=ref))
        phase("log", log)
    phase("release", store.start_deletions)  # the old checkpoint's delete follows the line


def write_fsync(path: Path, mine: dict[str, np.ndarray]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in byte_views(mine):
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsync_hashed(path: Path, mine: dict[str, np.ndarray]) -> str:
    """The floor of any save that hashes every byte: the raw write+fsync on this thread and the
    sha256 of the same bytes on another, started together (hashlib releases the GIL), so the two
    overlap as well as the cores allow and the save takes the longer of them, nothing more."""
    digest = hashlib.sha256()

    def hash_all() -> None:
        for view in byte_views(mine):
            digest.update(view)

    hasher = threading.Thread(target=hash_all)
    hasher.start()
    write_fsync(path, mine)
    hasher.join()
    return digest.hexdigest()


def save_peer(kind: str, root: Path, rank: int, mine: dict[str, np.ndarray]) -> None:
    path = root / f"{kind}-{rank:05d}"
    if kind == "raw":
        write_fsync(path, mine)
        return
    if kind == "raw+sha256":
        write_fsync_hashed(path, mine)
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
           barrier, results, pipe, store: tuple[str, int, str] | None = None) -> None:
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
            # Every contender saves once untimed first: the timed save is a steady-state one, as
            # the checkpoints of a run after its first are (thread pools, lazily built converters
            # and first-touch costs are a launch's, once). trainjob-step's also gives the timed
            # save's rotation a checkpoint to delete.
            peers = join(root_path, rank, world, store) if kind.startswith("trainjob") else None
            if kind == "trainjob-step":
                save_trainjob(root_path, rank, world, holds, mine, spec, step, whole=True, peers=peers)
            elif kind == "trainjob":
                # Another step: one launch never saves a step twice, and the ranks' keys name it.
                (root_path / "warm-trainjob").mkdir(exist_ok=True)  # a PVC exists before its first save
                save_trainjob(root_path / "warm-trainjob", rank, world, holds, mine, spec, step + WARM, peers=peers)
            elif kind != "gather":
                (root_path / f"warm-{kind}").mkdir(exist_ok=True)
                save_peer(kind, root_path / f"warm-{kind}", rank, mine)
            barrier.wait()
            t0 = time.perf_counter()
            if kind.startswith("trainjob"):
                whole = kind == "trainjob-step"
                save_trainjob(root_path, rank, world, holds, mine, spec, step + whole, whole=whole, peers=peers)
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


_launches = itertools.count(1)


def host_store():
    """A TCPStore in this process, as torchrun's agent hosts one for its workers (they connect as
    clients): the ranks of a W > 1 trainjob save agree through it, as under ``trainjob torchrun``."""
    import datetime

    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))


def run_workers(ctx, op: str, kind: str, root: Path, world: int, size: int, step: int,
                transport: str = "files") -> dict:
    """Start the W (or 1) processes of one contender, release them together, return wall time and
    peak RSS. A W > 1 trainjob save's ranks agree through ``transport``: "store" (a store this
    process hosts, torchrun's way) or "files" (on the PVC, the local launcher's way)."""
    procs_n = world if op == "save" else 1
    barrier, results = ctx.Barrier(procs_n), ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)] if (op, kind) == ("save", "gather") else []
    server = host_store() if transport == "store" and op == "save" and kind.startswith("trainjob") and world > 1 else None
    store = None if server is None else ("127.0.0.1", server.port, f"bench-{os.getpid()}-{next(_launches)}")
    procs = []
    for rank in range(procs_n):
        pipe = [r for r, _ in pipes] if rank == 0 else (pipes[rank - 1][1] if pipes else None)
        procs.append(ctx.Process(target=worker, args=(op, kind, str(root), rank, world, size, step,
                                                      barrier, results, pipe if pipes else None, store)))
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


def run_section(ctx, work: Path, worlds: list[int], repeat: int, size: int, torch_ok: bool,
                transport: str = "files") -> dict:
    """Every contender's save and load at every world size, ``repeat`` times, bracketed by the
    reference; the runs by op -> W -> kind. ``transport``: how trainjob's ranks agree (``run_workers``)."""
    saves = [k for k in SAVES if k != "torch" or torch_ok]
    loads = [k for k in LOADS if k != "torch" or torch_ok]
    t: dict = {"save": {}, "load": {}}
    for rep in range(repeat):
        for w in worlds:
            root = work / f"w{w}"

            def save(kind: str) -> dict:
                if kind.startswith("raw"):  # new files every time, like every contender's
                    shutil.rmtree(root / kind, ignore_errors=True)
                target = root / kind if kind in ("trainjob", "trainjob-step", "gather", "raw", "raw+sha256") else root
                target.mkdir(parents=True, exist_ok=True)
                return run_workers(ctx, "save", kind, target, w, size, rep + 1, transport)

            def load(kind: str) -> dict:
                target = root / "trainjob" if kind in ("trainjob", "trainjob-new", "limit") else root
                return run_workers(ctx, "load", kind, target, w, size, rep + 1)

            savers = [k for k in saves if k != "raw" and (k != "gather" or w > 1)]  # W=1 gather is trainjob
            loaders = [k for k in loads if k != "limit"]
            for op, run, ref, kinds in (("save", save, "raw", savers), ("load", load, "limit", loaders)):
                for kind, runs in bracketed(run, ref, kinds).items():
                    t[op].setdefault(w, {}).setdefault(kind, []).extend(runs)
            shutil.rmtree(root)
            print(f"repeat {rep + 1}/{repeat} W={w} done", file=sys.stderr, flush=True)
    return t


def figures(t: dict, size: int, worlds: list[int]) -> dict:
    """Throughput, ratio to the limit and peak RSS per op, W and contender."""
    out: dict = {"save": {}, "load": {}}
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
    return out


def table(out: dict) -> list[str]:
    mib = out["state_bytes"] / MiB
    lines = [f"state {mib:.0f} MiB float32, {out['repeat']} repeats; median (min..max); "
             "ratio = mean time of the two limit runs around it / contender time (higher is faster); "
             f"trainjob's ranks agree through {out.get('ranks_via', 'files')}", ""]
    for op, head in (("save", "save (W processes in parallel, write+fsync)"),
                     ("load", "load (one process; warm page cache; only trainjob verifies)")):
        lines += [f"| {head} | W | MB/s | x limit | peak RSS / state |", "| --- | --- | --- | --- | --- |"]
        for w, kinds in out[op].items():
            for kind, s in kinds.items():
                name = LABEL[op][kind]
                lines.append(f"| {name} | {w} | {fmt(s['mb_per_s'], 0)} | {fmt(s['ratio_to_limit'])} | "
                             f"{fmt(s['peak_rss_over_state'])} |")
        lines.append("")
    return lines


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
