#!/usr/bin/env python3
"""The torchrun side of scripts/bench.py's fsdp section: one FSDP2 model, saved and loaded by one method.

    torchrun --standalone --nproc-per-node W scripts/bench_fsdp.py METHOD DIR REPEAT MIB OUT

The model: ``BLOCKS`` square ``Linear`` blocks, each ``fully_shard``-ed, the whole too, with AdamW
state created by one step; MIB (the state: weights plus two moments, float32) decides how many
blocks and how wide, so that 8 and 64 MiB are both about right. Three methods:

- ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` of ``get_state_dict`` (what torchtitan
  does), then ``set_state_dict``; no hash is checked. The reference of the ratios to DCP.
- ``floor``: the floors of a save and of a load that verify. Save: each rank writes its own local
  bytes raw into a new file of its own while a second thread runs one sha256 pass over the same
  bytes, then fsyncs it (``write_fsync_hashed``, the checkpoints section's floor): every byte made
  durable and hashed once, with no manifest, no commit and no word between the ranks, so any save
  that verifies and commits does at least this. (DCP's save plus a hash is no floor: DCP's own
  save, a collective plan and per-item metadata, is slower than trainjob's.) Load: DCP's load
  (of a ``dcp.save`` made untimed beforehand) then each rank's ``hashlib.sha256`` over every byte
  of its local shards: DCP's work plus one hash pass split across the ranks, nothing else.
- ``trainjob``: what a checkpoint and a resume of ``trainjob.Run`` do, through the same calls and
  the ranks' own coordination (``ranks.connect``: under torchrun, the agent's store). The save is
  a whole checkpoint: rank 0 what ``Job.write_checkpoint`` does (free space, staging, its shard,
  the others' receipts, the manifest, the commit and the pointer) then ``Job.announce`` (the
  ``checkpointed`` line, rotation with ``--keep 1``), the other ranks what ``Run._write_shard``
  does. The load: every rank reads and verifies its own share by offsets (``load_local``) into
  the live tensors, as a resume through the store does; the ranks' verdict round is stood in for
  by one ``all_gather_object`` of the verdicts (one round trip, as the store's); then
  ``load_state_dict``.

Each save and load is timed from a barrier to a barrier, REPEAT times. Around each load every rank
also reads its ``/proc/self/io`` ``rchar``: the bytes its ``read`` calls returned, on every thread
(the checkpoint's files, plus the few KiB the launch's sockets carry meanwhile). Every rank writes
its seconds, its bytes read, the checkpoint's size on disk and its peak RSS (VmHWM, once before the
first save: the model alone, and at the end) as JSON to OUT.<rank>.json. With
``BENCH_FSDP_PHASES=1`` the trainjob save also records when each of its library calls began and ended
(``time.perf_counter``, one clock for every process).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks.checkpoints import write_fsync_hashed  # noqa: E402
from benchmarks.common import vm_hwm  # noqa: E402

method, root, repeat, mib, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
# A block of width d holds 3 (4 d^2 + 4 d) bytes with AdamW's two moments; d a multiple of 16 so
# that every W in 1, 2, 4, 8 shards it evenly. 72 MiB gives six 1024-wide blocks, as before.
blocks = max(2, round(mib / 12))
width = 16 * max(1, round(math.sqrt(mib * (1 << 20) / 12 / blocks) / 16))
model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(blocks)))
for block in model:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, width)).sum().backward()
opt.step()
opt.zero_grad()
base_rss = vm_hwm()
state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
PHASES = os.environ.get("BENCH_FSDP_PHASES") == "1"
phases: list[dict[str, float]] = []


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def read_while(fn) -> tuple[float, int]:
    """``fn`` timed (barrier to barrier), and the bytes this process read during it."""
    box: list[int] = []

    def counted() -> None:
        before = rchar()
        fn()
        box.append(rchar() - before)

    seconds = timed(counted)
    return seconds, box[0]


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def local_tensors(sd: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict by a flat name: a DTensor's local shard, a tensor."""
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            elif isinstance(v, torch.Tensor):
                local = v.to_local() if isinstance(v, DTensor) else v
                flat[f"{prefix}{k}"] = local.detach().contiguous()
    walk("", sd)
    return flat


def sha256_local(sd: dict) -> None:
    """Hash every local byte of a (nested) state dict."""
    for t in local_tensors(sd).values():
        hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).digest()


saves, loads, read_bytes, sizes = [], [], [], []
if method in ("dcp", "floor"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for i in range(repeat):
        where, raw = root / f"dcp-{i}", root / f"raw-{i}"

        def save() -> None:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where))

        def save_floor(name: str = "rank") -> None:
            t0 = time.perf_counter()
            # The live tensors themselves (no get_state_dict: its collectives and copies are DCP's).
            live = {"model": model.state_dict(), "optim": opt.state_dict()["state"]}
            mine = {k: t.numpy() for k, t in local_tensors(live).items()}
            t1 = time.perf_counter()
            write_fsync_hashed(raw / f"{name}-{rank}.bin", mine)
            phases.append({"tensors": (t0, t1), "write+sha256+fsync": (t1, time.perf_counter())})

        def load() -> None:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(where))
            if method == "floor":
                sha256_local(sd)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        if rank == 0:
            raw.mkdir()
        dist.barrier()
        if i == 0:  # untimed, as trainjob's first save: the launch's one-off costs (the first gc, say)
            save_floor("warm-up") if method == "floor" else dcp.save(
                dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=str(root / "warm-up"))
        if method == "floor":
            saves.append(timed(save_floor))
            save()  # untimed: what the load floor loads
        else:
            saves.append(timed(save))
        seconds, nbytes = read_while(load)
        loads.append(seconds)
        read_bytes.append(nbytes)
        sizes.append(tree_size(where))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where)
            shutil.rmtree(raw, ignore_errors=True)
else:
    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.snapshot import HostState
    from trainjob.checkpoint.store import Committer
    from trainjob.ranks import connect
    from trainjob.records import MANIFEST_SCHEMA, Manifest, Session
    from trainjob.storage.eventlog import EventLog
    from trainjob.storage.pvc import Pvc
    from trainjob.torch import TrainingState

    state = TrainingState(model=model, optimizer=opt, rng=False)
    pvc = Pvc(root / "pvc")
    if rank == 0:
        pvc.create()
    dist.barrier()
    store = Committer(pvc)
    # The ranks agree as a torchrun launch of ``trainjob run`` does (``Run._lead``, ``Run._follow``).
    no_signal = lambda: None  # noqa: E731
    if rank:
        peers = connect.follower(pvc, rank, world, 60.0, no_signal)
        peers.join("bench", set())
    else:
        peers = connect.coordinator(pvc, world, 60.0, no_signal)
        peers.publish(lambda g: Session(generation=g, world_size=world, attempt=1, from_step=0, checkpoint=None,
                                        manifest_sha256=None, settings="bench"))
        peers.wait_joined()
        peers.begin()
    log = EventLog(pvc.root / "log.jsonl")
    host = HostState()

    def phase(times: dict[str, tuple[float, float]], name: str, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            times[name] = (t0, time.perf_counter())  # one clock for every process: spans line up

    def save_checkpoint(ref: Ref, times: dict[str, tuple[float, float]]):
        """One whole checkpoint, call for call as ``Job.write_checkpoint`` and ``Job.announce``
        (rank 0) and ``Run._write_shard`` (the others) make it."""
        step = ref.step
        arrays = phase(times, "snapshot", lambda: host.snapshot(state.state_dict(), step))
        if rank:
            staging = store.staging(ref, peers.generation)
            phase(times, "wait staging", lambda: peers.wait_staging(staging, step))
            entry = phase(times, "shard", lambda: store.write_shard(staging, rank, world, step, arrays,
                                                                     fsync_later=True))
            phase(times, "deliver", lambda: peers.deliver(step, entry, lambda e: store.write_receipt(staging, e),
                                                          store.settle))
            return
        phase(times, "space", lambda: store.check_space(state_bytes))
        staging = phase(times, "staging", lambda: store.create_staging(ref, peers.generation))
        if hasattr(peers, "staged"):  # a library from before issue 45 (an A/B run), whose followers waited for it
            phase(times, "staged", lambda: peers.staged(step))
        entries = [phase(times, "shard", lambda: store.write_shard(staging, 0, world, step, arrays,
                                                                    fsync_later=True))]
        entries += phase(times, "gather", lambda: peers.gather(
            lambda r: store.receipt_path(staging, r, world).exists(),
            lambda r: store.read_receipt(staging, r, world), step))
        manifest = Manifest(schema=MANIFEST_SCHEMA, step=step, attempt=1, world_size=world, loss_milli=0,
                            tensors=host.specs, shards=entries)
        phase(times, "commit", lambda: store.commit(staging, ref, manifest, point=True,
                                                    others=lambda: peers.durable(step)))
        phase(times, "log", lambda: log.append("checkpointed", f"step={step} loss_milli=0"))
        phase(times, "rotate", lambda: store.rotate(1, world, protect=ref))
        store.start_deletions()

    ref = Ref(attempt=1, step=1, world_size=world)
    save_checkpoint(ref, {})  # untimed: the launch's first (its one-off costs), and one for rotation
    for i in range(repeat):
        ref = Ref(attempt=1, step=i + 2, world_size=world)
        times: dict[str, tuple[float, float]] = {}

        def load() -> None:
            initial = host.snapshot(state.state_dict(), ref.step)
            # Each rank verifies its own share, as a resume through the store does; the ranks'
            # verdict round (ranks/store.py's verify_round, one round trip) stood in for by one
            # all_gather of the verdicts, before any rank touches its state.
            try:
                loaded, verdict = store.load_local(ref, host.specs, host.wanted(), rank, into=initial), None
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                loaded, verdict = None, repr(exc)
            verdicts: list = [None] * world
            dist.all_gather_object(verdicts, verdict)
            if any(verdicts) or loaded is None:
                raise SystemExit(f"a rank refused the checkpoint: {verdicts}")
            state.load_state_dict(host.live(loaded.tensors, *loaded.documents(rank)))

        saves.append(timed(lambda: save_checkpoint(ref, times)))
        phases.append(times)
        seconds, nbytes = read_while(load)
        loads.append(seconds)
        read_bytes.append(nbytes)
        sizes.append(tree_size(store.path(ref)))
Path(f"{out}.{rank}.json").write_text(json.dumps(
    {"save": saves, "load": loads, "read_bytes": read_bytes, "checkpoint_bytes": sizes, "base_rss": base_rss,
     "peak_rss": vm_hwm(), "state_bytes": state_bytes, "phases": phases[-repeat:] if PHASES else []}))
dist.destroy_process_group()
