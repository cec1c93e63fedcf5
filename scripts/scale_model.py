"""The scale page's model (docs/explanation/scale.md): per rank, per checkpoint, the bytes read and
written and the store requests of a save and of a resume, at W = 8 ... 1024, for a 1 TB checkpoint.

    PYTHONPATH=. .venv/bin/python scripts/scale_model.py [--json docs/scale-model.json]

A model, labelled as one: nothing here runs at W = 1024. What it measures, on this machine, is
what does not grow with the state, using trainjob's own code: a sharded (FSDP-like) state of
``--layers`` blocks is checkpointed in process at small world sizes by the real writer
(``ShardWriter``/``Committer``), and the manifest's bytes and each shard header's bytes are fitted
as a line in their entry counts; each rank's resume (``CheckpointStore.load_local``) is traced at
the one place shard reads go through, to check that what a rank reads beyond its own shard is
rank 0's header and the small entries and nothing else; and the store requests each role makes
per checkpoint and per resume are counted by driving the real store transport (``ranks/store.py``
over torch's TCPStore, one thread per rank, as ``tests/ranks/test_store_transport.py`` does) at W
= 2, 4 and 8 and fitted as a line in W. Those per-rank costs are then extrapolated to a 1 TB
checkpoint of a 70B-class model (the shapes below), whose bulk (the shards) is exactly 1/W per
rank by construction.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainjob.checkpoint import plan, shards  # noqa: E402
from trainjob.checkpoint.plan import Ref  # noqa: E402
from trainjob.checkpoint.snapshot import HostArrays  # noqa: E402
from trainjob.checkpoint.store import Committer  # noqa: E402
from trainjob.records import MANIFEST_SCHEMA, Manifest, Session, ShardEntry  # noqa: E402
from trainjob.storage.pvc import Pvc  # noqa: E402
from trainjob.tensors import tensor_specs  # noqa: E402

TB = 10 ** 12
# A 70B-class decoder: 80 blocks of 9 weight tensors, plus embeddings, final norm and head. Each
# parameter is a DTensor with two AdamW moments (fp32: 12 bytes a parameter) and a step counter.
BLOCK = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down", "norm1", "norm2")
BIG_PARAMS = 80 * len(BLOCK) + 3


def state(layers: int, world: int, rank: int, rows: int = 64) -> tuple[dict, dict, tuple]:
    """Rank ``rank``'s part of an FSDP-like state: per parameter a weight and two moments sharded
    along their first axis (boxes), and a plain 1-element step counter (held whole by all)."""
    whole = {}
    for layer in range(layers):
        for name in BLOCK:
            p = f"model.layers.{layer}.{name}.weight"
            for part in ("", ".exp_avg", ".exp_avg_sq"):
                whole[f"{p}{part}"] = np.zeros((rows, 8), dtype=np.float32)
            whole[f"{p}.step"] = np.array([3.0], dtype=np.float32)
    arrays, boxes = {}, {}
    for name, a in whole.items():
        if name.endswith(".step"):
            arrays[name] = a
            continue
        lo, hi = plan.split_rows(a.shape[0], world)[rank]
        arrays[name] = np.ascontiguousarray(a[lo:hi])
        boxes[name] = plan.Local(origin=(lo, 0), shape=arrays[name].shape, replica=0, replicas=1)
    return arrays, boxes, tensor_specs(whole)


def checkpoint(root: Path, layers: int, world: int) -> tuple[Committer, Ref, Manifest]:
    store = Committer(Pvc(root))
    Pvc(root).create()
    ref = Ref(attempt=1, step=4, world_size=world)
    staging = store.create_staging(ref, 1)
    entries = []
    for rank in range(world):
        arrays, boxes, specs = state(layers, world, rank)
        entries.append(store.write_shard(staging, rank, world, 4, HostArrays(arrays, plain_text='{"epoch": 0}',
                                                                             boxes=boxes, specs=specs)))
    manifest = Manifest(schema=MANIFEST_SCHEMA, step=4, attempt=1, world_size=world, loss_milli=0, tensors=specs,
                        shards=entries)
    store.commit(staging, ref, manifest)
    return store, ref, manifest


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line through (x, y): (intercept, slope)."""
    slope, intercept = np.polyfit([x for x, _ in points], [y for _, y in points], 1)
    return float(intercept), float(slope)


def measure_bytes(work: Path) -> dict:
    manifest_points, header_points, extra = [], [], []
    for layers in (2, 4):
        for world in (2, 4, 8):
            store, ref, m = checkpoint(work / f"l{layers}-w{world}", layers, world)
            tensors = len(m.tensors)
            manifest_points.append((world * tensors, (store.path(ref) / "manifest.json").stat().st_size))
            header_points += [(tensors, s.header) for s in m.shards[1:]]  # rank 0's also holds the plain values
            read: dict[str, int] = {}
            real = {k: getattr(shards._File, k) for k in ("readinto", "read_at")}

            def counting(method: str):
                def counted(self, view, *at):
                    n = real[method](self, view, *at)
                    read[self.name] = read.get(self.name, 0) + n
                    return n
                return counted
            for k in real:
                setattr(shards._File, k, counting(k))
            try:
                for rank in range(world):
                    arrays, boxes, specs = state(layers, world, rank)
                    wanted = {t.name: ((b.origin, b.shape) if (b := boxes.get(t.name)) else ((0,) * len(t.shape),
                                                                                              t.shape))
                              for t in specs}
                    read.clear()
                    store.load_local(ref, specs, wanted, rank)
                    own = m.shards[rank]
                    beyond = sum(n for f, n in read.items() if f != own.file)
                    small = sum(plan.slice_bytes(h) for h in m.shards[0].holds if h.name.endswith(".step"))
                    assert read.get(own.file) == own.size, (rank, read)
                    assert beyond == (0 if rank == 0 else m.shards[0].header + small), (rank, read)
                    extra.append(beyond)
            finally:
                for k, f in real.items():
                    setattr(shards._File, k, f)
    return {"manifest": fit(manifest_points), "header": fit(header_points), "checked_ranks": len(extra)}


class Counting:
    """A store client that counts the requests made through it (and through its clones)."""

    def __init__(self, kv, tally: dict[str, int]) -> None:
        self.kv, self.tally = kv, tally

    def clone(self):
        return Counting(self.kv.clone(), self.tally)

    def set_timeout(self, timeout) -> None:
        self.kv.set_timeout(timeout)

    def __getattr__(self, name: str):
        method = getattr(self.kv, name)

        def counted(*args, **kwargs):
            self.tally[name] = self.tally.get(name, 0) + 1
            return method(*args, **kwargs)
        return counted


def count_requests(work: Path, world: int) -> dict[str, dict[str, int]]:
    """Store requests by role for one resume (one verdict round, join, begin) and one checkpoint,
    driving the store transport's calls in the engine's order (``Job._discover``/``Run._follow``,
    ``Job.write_checkpoint``/``Run._write_shard``)."""
    import torch.distributed as dist

    from trainjob.ranks.store import StoreCoordinator, StoreFollower

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    tallies = [{} for _ in range(world)]

    def client(rank: int) -> Counting:
        return Counting(dist.PrefixStore("scale", dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                                wait_for_workers=False,
                                                                timeout=datetime.timedelta(seconds=30))),
                        tallies[rank])

    pvc = Pvc(work / f"store-w{world}")
    pvc.create()
    rank0 = StoreCoordinator(client(0), pvc, world, 30.0, lambda: None)
    followers = [StoreFollower(client(r), r, world, 30.0, lambda: None) for r in range(1, world)]
    for t in tallies:
        t.clear()  # connecting is not a request of the protocol
    phases: dict[str, list[dict[str, int]]] = {}

    def mark(name: str) -> None:
        phases[name] = [dict(t) for t in tallies]

    def follow(f: StoreFollower) -> None:
        f.join("s", set(), lambda candidate: None)

    joiners = [threading.Thread(target=follow, args=(f,)) for f in followers]
    for t in joiners:
        t.start()
    rank0.verify_round("step-00000004-a0001-w%03d" % world, None, True, lambda: None)
    rank0.publish(lambda g: Session(generation=g, world_size=world, attempt=1, from_step=4,
                                    checkpoint=None, manifest_sha256=None, settings="s"))
    rank0.wait_joined()
    rank0.begin()
    for t in joiners:
        t.join(30)
    mark("resume")
    for step in (8, 12):  # the second checkpoint also drops the first's keys, as every later one does
        entries = {r: ShardEntry(rank=r, file=plan.shard_file(r, world), size=8, sha256="ab" * 32, holds=())
                   for r in range(1, world)}

        def write(f: StoreFollower, step: int = step) -> None:
            f.wait_staging(Path("staging"), step)
            f.deliver(step, entries[f.rank], lambda e: None)

        writers = [threading.Thread(target=write, args=(f,)) for f in followers]
        for t in writers:
            t.start()
        rank0.gather(lambda r: True, lambda r: entries[r], step)
        rank0.durable(step)
        for t in writers:
            t.join(30)
        mark(f"checkpoint {step}")
    per = lambda a, b, r: sum(phases[b][r].values()) - sum(phases[a][r].values()) if a else sum(phases[b][r].values())  # noqa: E731
    return {"rank 0": {"resume": per(None, "resume", 0), "checkpoint": per("checkpoint 8", "checkpoint 12", 0)},
            "rank r > 0": {"resume": per(None, "resume", 1), "checkpoint": per("checkpoint 8", "checkpoint 12", 1)}}


def model(measured: dict, worlds: list[int], size: float = TB) -> list[dict]:
    m0, m_entry = measured["manifest"]
    h0, h_entry = measured["header"]
    requests = measured["requests"]
    tensors = BIG_PARAMS * 4  # weight, two moments, step counter
    small = BIG_PARAMS * 4  # the step counters' bytes (fp32, one element each)
    rows = []
    for w in worlds:
        manifest = m0 + m_entry * w * tensors
        header = h0 + h_entry * tensors
        share = size / w
        req = {role: {k: a + b * w for k, (a, b) in kinds.items()} for role, kinds in requests.items()}
        rows.append({
            "world_size": w, "share_GB": share / 1e9, "manifest_MB": manifest / 1e6,
            "save_written_GB": {"rank 0": (share + header + small + manifest) / 1e9, "rank r > 0": (share + header) / 1e9},
            "resume_read_GB": {"rank 0": (manifest + share + header) / 1e9,
                               "rank r > 0": (manifest + share + 2 * header + small) / 1e9},
            "resume_read_share": {"rank 0": (manifest + share + header) / share,
                                  "rank r > 0": (manifest + share + 2 * header + small) / share},
            "store_requests": req,
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the measurements and the model here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure_bytes(Path(tmp))
        counts = {w: count_requests(Path(tmp), w) for w in (2, 4, 8)}
    # Rank 0's requests grow with W (one key per rank to read, and to drop): a line. A follower's
    # name no other rank, so they do not; what varies is how often it polled while waiting (to
    # join, or for a key another call found already set): the most counted at any W stands for it.
    measured["requests"] = {
        "rank 0": {kind: fit([(w, counts[w]["rank 0"][kind]) for w in counts]) for kind in ("resume", "checkpoint")},
        "rank r > 0": {kind: (max(counts[w]["rank r > 0"][kind] for w in counts), 0.0)
                       for kind in ("resume", "checkpoint")}}
    measured["request_counts"] = {str(w): c for w, c in counts.items()}
    rows = model(measured, [8, 16, 64, 256, 1024])
    print(f"measured: manifest = {measured['manifest'][0]:.0f} + {measured['manifest'][1]:.1f} B x (W x tensors); "
          f"a shard header = {measured['header'][0]:.0f} + {measured['header'][1]:.1f} B x tensors")
    print(f"store requests counted at W = 2, 4, 8: {json.dumps(measured['request_counts'])}")
    print("| W | share of 1 TB | manifest | save writes, rank 0 / r>0 | resume reads, rank 0 / r>0 (x share) | "
          "store requests per checkpoint, rank 0 / r>0 | per resume, rank 0 / r>0 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        q = r["store_requests"]
        print(f"| {r['world_size']} | {r['share_GB']:.2f} GB | {r['manifest_MB']:.1f} MB | "
              f"{r['save_written_GB']['rank 0']:.2f} / {r['save_written_GB']['rank r > 0']:.2f} GB | "
              f"{r['resume_read_share']['rank 0']:.3f} / {r['resume_read_share']['rank r > 0']:.3f} | "
              f"{q['rank 0']['checkpoint']:.0f} / {q['rank r > 0']['checkpoint']:.0f} | "
              f"{q['rank 0']['resume']:.0f} / {q['rank r > 0']['resume']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "model": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
