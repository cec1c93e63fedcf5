#!/usr/bin/env python3
"""The torchrun side of scripts/bench.py's fsdp section: one FSDP2 model, saved and loaded by one method.

    torchrun --standalone --nproc-per-node 2 scripts/bench_fsdp.py METHOD DIR REPEAT MIB OUT

The model: ``Linear(1024, 1024)`` blocks, each ``fully_shard``-ed, the whole too, with AdamW state
created by one step; MIB (the state: weights plus two moments, float32) decides how many blocks.
METHOD ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` of ``get_state_dict`` (what
torchtitan does), then ``set_state_dict``; no hash is checked. METHOD ``dcp+sha256``: the same,
and each rank's load then runs ``hashlib.sha256`` over every byte of its local shards: the floor
of any load that checks each byte it uses once (DCP's work plus one hash pass, split across the
ranks, with nothing else: no manifest, no verdict, no second buffer). METHOD ``trainjob``: what a
checkpoint and a resume of ``trainjob.Run`` do, through the same calls: each rank snapshots its
shards (``HostState``) and writes its shard (``ShardWriter.write_shard``, sha256 while writing),
rank 0 commits the manifest; at the load, every rank reads its part by offsets (``load_local``,
each shard it reads hashed; rank 0 hashes every shard in the same pass, as its resume does to
pick the checkpoint for all) into the live tensors and ``load_state_dict`` puts it in place. Each save and load is
timed from a barrier to a barrier, REPEAT times; every rank writes its seconds and its peak RSS
(VmHWM, once before the first save: the model alone, and at the end) as JSON to OUT.<rank>.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks.common import vm_hwm  # noqa: E402

method, root, repeat, mib, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
blocks = max(1, round(mib / 12))  # 4 MiB of weight per block, times 3 with AdamW's two moments
model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(blocks)))
for block in model:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 1024)).sum().backward()
opt.step()
opt.zero_grad()
base_rss = vm_hwm()
state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def sha256_local(sd: dict) -> None:
    """Hash every local byte of a (nested) state dict: a DTensor's local shard, a tensor's bytes."""
    import hashlib

    from torch.distributed.tensor import DTensor
    for v in sd.values():
        if isinstance(v, dict):
            sha256_local(v)
        elif isinstance(v, torch.Tensor):
            local = v.to_local() if isinstance(v, DTensor) else v
            hashlib.sha256(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).digest()


saves, loads = [], []
if method in ("dcp", "dcp+sha256"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for i in range(repeat):
        where = root / f"dcp-{i}"

        def save() -> None:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where))

        def load() -> None:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(where))
            if method == "dcp+sha256":
                sha256_local(sd)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        saves.append(timed(save))
        loads.append(timed(load))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where)
else:
    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.snapshot import HostState
    from trainjob.checkpoint.store import Committer
    from trainjob.records import MANIFEST_SCHEMA, Manifest
    from trainjob.storage.pvc import Pvc
    from trainjob.torch import TrainingState

    state = TrainingState(model=model, optimizer=opt, rng=False)
    pvc = Pvc(root / "pvc")
    if rank == 0:
        pvc.create()
    dist.barrier()
    store = Committer(pvc)
    for i in range(repeat):
        ref = Ref(attempt=1, step=i + 1, world_size=world)
        host = HostState()

        def save() -> None:
            arrays = host.snapshot(state.state_dict(), ref.step)
            staging = store.create_staging(ref, 1) if rank == 0 else store.staging(ref, 1)
            dist.barrier()  # the staging directory exists (the engine's peers wait for it)
            entry = store.write_shard(staging, rank, world, ref.step, arrays)
            entries = [None] * world
            dist.all_gather_object(entries, entry)  # the receipts (the engine: the store or the PVC)
            if rank == 0:
                store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=ref.step, attempt=1,
                                                    world_size=world, loss_milli=0, tensors=host.specs,
                                                    shards=entries))

        def load() -> None:
            initial = host.snapshot(state.state_dict(), ref.step)
            # Rank 0 hashes every shard as its resume does (it picks the checkpoint for all), in one pass.
            loaded = store.load_local(ref, host.specs, host.wanted(), rank, into=initial, verify_all=rank == 0)
            state.load_state_dict(host.live(loaded.tensors, *loaded.documents(rank)))

        saves.append(timed(save))
        loads.append(timed(load))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(store.path(ref))
Path(f"{out}.{rank}.json").write_text(json.dumps(
    {"save": saves, "load": loads, "base_rss": base_rss, "peak_rss": vm_hwm(), "state_bytes": state_bytes}))
dist.destroy_process_group()
