"""The checkpoint store in a real run: rotation bounds, the free-space check, cleanup, --keep; and
its readers: loads in place and by offsets, every manifest proven by its shards' headers, one
verification for every reader, a read error as storage trouble.

In-process runs (``cli.main``) with a wrapped commit, so every commit is observed as it happens.
"""

from __future__ import annotations

import shutil
from collections import namedtuple

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import events, snapshot, trainjob
from trainjob import cli
from trainjob.checkpoint import store as checkpoints
from trainjob.storage import local
from trainjob.checkpoint.plan import Ref
from trainjob.views.history import replay
from trainjob.storage.pvc import Pvc
from trainjob.records import MANIFEST_SCHEMA, Manifest


def committed(pvc):
    return sorted(p.name for p in (pvc / "checkpoints").iterdir() if Ref.parse(p.name))


@pytest.mark.parametrize("keep", [1, 3])
def test_rotation_never_exceeds_k_plus_one_and_never_loses_the_newest(tmp_path, monkeypatch, keep):
    pvc, seen = tmp_path / "pvc", []
    real_commit = local.commit_dir

    def observed(staging, final, *args):  # at every commit: K committed at most, plus this one in flight
        on_disk = [p.name for p in (pvc / "checkpoints").iterdir()]
        seen.append(len([n for n in on_disk if Ref.parse(n) or n.startswith(".tmp-")]))
        real_commit(staging, final, *args)
        assert final.name == committed(pvc)[-1]  # the newest is the one just committed

    monkeypatch.setattr(local, "commit_dir", observed)
    assert cli.main(["run", "--pvc", str(pvc), "--ckpt-every", "1", "--keep", str(keep)]) == 0
    assert len(seen) == 10 and max(seen) == keep + 1
    assert committed(pvc) == [f"step-{s:08d}-a0001-w001" for s in range(11 - keep, 11)]


@pytest.mark.process
def test_keep_below_one_is_a_usage_error_saying_what_to_change(tmp_path):
    result = trainjob("run", "--pvc", tmp_path / "pvc", "--keep", 0)
    assert result.returncode == 2 and "--keep must be at least 1" in result.stderr


@pytest.mark.process
def test_a_save_that_cannot_fit_exits_75_and_keeps_every_checkpoint(tmp_path, monkeypatch, capsys):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    before = snapshot(pvc / "checkpoints")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(local.shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 100, 100))
    assert cli.main(["run", "--pvc", str(pvc)]) == 75
    assert "bytes free, but the next checkpoint needs about" in capsys.readouterr().err
    assert snapshot(pvc / "checkpoints") == before
    monkeypatch.undo()
    assert cli.main(["run", "--pvc", str(pvc)]) == 0  # with room again, it simply goes on


@pytest.mark.process
def test_abandoned_staging_and_trash_are_removed_on_the_next_start_and_logged(tmp_path):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    for name in (".tmp-step-00000006-a0001-w001.g00000000", ".trash-step-00000002-a0001-w001"):
        (pvc / "checkpoints" / name).mkdir()
        (pvc / "checkpoints" / name / "shard-00000-of-00001.safetensors").write_bytes(b"half")
    assert trainjob("run", "--pvc", pvc).returncode == 0
    assert not [p for p in (pvc / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    log = events(pvc / "log.jsonl")
    cleaned = [d for e, d in log if e == "cleaned_up"]
    assert cleaned == ["removed=2 paths=checkpoints/.tmp-step-00000006-a0001-w001.g00000000,"
                       "checkpoints/.trash-step-00000002-a0001-w001"]
    assert log[log.index(("cleaned_up", cleaned[0])) + 1] == ("resumed", "from_step=4")
    assert replay(pvc / "log.jsonl").illegal is None  # cleaned_up is a note the table knows


@pytest.mark.process
def test_an_old_format_checkpoint_json_is_refused_not_loaded(tmp_path):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    (pvc / "checkpoint.json").write_text('{"step":4,"weights":[0,0,0],"bias":0,"loss_milli":241}\n')
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and "checkpoint.json" in result.stderr and "weights" in result.stderr


@pytest.mark.process
def test_a_vanished_newest_checkpoint_is_not_mistaken_for_no_checkpoint(tmp_path):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 2).returncode == 75
    shutil.rmtree(pvc / "checkpoints")
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and "missing, but checkpoint.json names it" in result.stderr


# --- loading in place ------------------------------------------------------------------------------

def saved(tmp_path, state) -> tuple[checkpoints.Committer, Ref]:
    store = checkpoints.Committer(Pvc(tmp_path / "pvc"))
    store.pvc.create()
    ref = Ref(attempt=1, step=1, world_size=1)
    staging = store.create_staging(ref, 1)
    entry = store.write_shard(staging, 0, 1, 1, state)
    store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=1, attempt=1, world_size=1, loss_milli=0,
                                        tensors=checkpoints.tensor_specs(state), shards=[entry]))
    return store, ref


def test_a_resume_reads_into_the_trainers_own_arrays_where_they_fit(tmp_path):
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(3, dtype=np.float64)}
    store, ref = saved(tmp_path, state)
    fits = np.zeros((3, 4), dtype=np.float32)
    wrong_dtype = np.zeros(3, dtype=np.float32)
    loaded = store.load(ref, into={"w": fits, "b": wrong_dtype})
    assert loaded.tensors["w"] is fits and np.array_equal(fits, state["w"])  # read in place
    assert loaded.tensors["b"] is not wrong_dtype and np.array_equal(loaded.tensors["b"], state["b"])
    assert not wrong_dtype.any()  # an array that does not fit is left alone


def test_arrays_that_share_memory_are_never_both_read_into(tmp_path):
    state = {"a": np.ones(4, dtype=np.float32), "b": np.full(4, 2, dtype=np.float32)}
    store, ref = saved(tmp_path, state)
    shared = np.zeros(4, dtype=np.float32)  # a trainer that hands out one buffer under two names
    loaded = store.load(ref, into={"a": shared, "b": shared[:]})
    assert np.array_equal(loaded.tensors["a"], state["a"]) and np.array_equal(loaded.tensors["b"], state["b"])
    assert not np.may_share_memory(loaded.tensors["a"], loaded.tensors["b"])


# --- a sharded state (DTensor local shards): written with offsets, read back by offsets --------

def write_sharded(pvc_root, whole: dict[str, np.ndarray], world: int, shard_dim: dict[str, int], step: int = 4):
    """Commit a checkpoint as ``world`` ranks of an FSDP-like run write it: each its torch.chunk
    shard of every tensor along ``shard_dim[name]`` (a name not in it: held whole by all)."""
    from trainjob.checkpoint import plan
    from trainjob.checkpoint.snapshot import HostArrays
    from trainjob.tensors import tensor_specs
    store = checkpoints.Committer(Pvc(pvc_root))
    Pvc(pvc_root).create()
    ref = Ref(attempt=1, step=step, world_size=world)
    staging = store.create_staging(ref, 1)
    specs, entries = tensor_specs(whole), []
    for rank in range(world):
        arrays, boxes = {}, {}
        for name, a in whole.items():
            if name not in shard_dim:
                arrays[name] = a
                continue
            d, n = shard_dim[name], a.shape[shard_dim[name]]
            size = -(-n // world)
            lo, hi = min(rank * size, n), min((rank + 1) * size, n)
            origin = tuple(lo if i == d else 0 for i in range(a.ndim))
            index = tuple(slice(lo, hi) if i == d else slice(None) for i in range(a.ndim))
            arrays[name] = np.ascontiguousarray(a[index])
            boxes[name] = plan.Local(origin=origin, shape=arrays[name].shape, replica=0, replicas=1)
        entries.append(store.write_shard(staging, rank, world, step,
                                         HostArrays(arrays, boxes=boxes, specs=specs)))
    manifest = Manifest(schema=MANIFEST_SCHEMA, step=step, attempt=1, world_size=world, loss_milli=0,
                        tensors=specs, shards=entries)
    store.commit(staging, ref, manifest)
    return store, ref, specs


@pytest.fixture
def traced_reads(monkeypatch):
    """Bytes read from each shard file, by name, counted where every read of a local shard goes
    (front to back and by offset)."""
    read: dict[str, int] = {}
    File = checkpoints.shards._File
    for method in ("readinto", "read_at"):
        real = getattr(File, method)

        def counted(self, view, *at, real=real):
            n = real(self, view, *at)
            read[self.name] = read.get(self.name, 0) + n
            return n
        monkeypatch.setattr(File, method, counted)
    return read


def test_a_sharded_checkpoint_loads_into_another_sharding_reading_only_the_slices_that_overlap(tmp_path, traced_reads):
    whole = {"w": np.arange(33 * 4, dtype=np.float32).reshape(33, 4), "v": np.arange(6.0).reshape(2, 3),
             "step": np.array([7.0])}
    store, ref, specs = write_sharded(tmp_path / "pvc", whole, 4, {"w": 0, "v": 1})
    manifest, _ = store.read_manifest(ref)
    assert [h.offsets for h in manifest.shards[1].holds if h.name == "v"] == [(0, 1)]  # Shard(1): offsets kept
    assert store.verify(ref).reason is None  # `trainjob verify`'s check passes on it
    for rank, (lo, hi) in enumerate([(0, 11), (11, 22), (22, 33)]):  # 4 -> 3 ranks, Shard(0) everywhere
        wanted = {"w": ((lo, 0), (hi - lo, 4)), "v": ((0, 0), (2, 3)), "step": ((0,), (1,))}
        loaded = store.load_local(ref, specs, wanted, rank)
        assert np.array_equal(loaded.tensors["w"], whole["w"][lo:hi])
        assert np.array_equal(loaded.tensors["v"], whole["v"]) and loaded.tensors["step"][0] == 7.0
    store2, ref2, specs2 = write_sharded(tmp_path / "pvc2", {"w": whole["w"]}, 4, {"w": 0})
    m2, _ = store2.read_manifest(ref2)
    traced_reads.clear()
    loaded = store2.load_local(ref2, specs2, {"w": ((11, 0), (10, 4))}, 9)  # rows 11..20: shards 1 and 2 (a rank 9 of no shard)
    assert np.array_equal(loaded.tensors["w"], whole["w"][11:21])
    # Rank 0's header (the plain values), and of shards 1 and 2 the header (which says where
    # their slices sit) and the slice that overlaps rows 11..20 (9 rows of 16 bytes each), every
    # byte read once; nothing else of any file, shard 3 never.
    assert traced_reads == {m2.shards[0].file: m2.shards[0].header, m2.shards[1].file: m2.shards[1].header + 9 * 16,
                            m2.shards[2].file: m2.shards[2].header + 9 * 16}


def test_a_rank_resuming_at_its_own_sharding_reads_its_own_shard_rank_0s_header_and_the_small_entries(tmp_path, traced_reads):
    """The resume at scale: with the sharding that wrote it, rank r reads its own shard whole and
    of rank 0's only the header and the small plain entries (written whole there): about 1/W of
    the checkpoint, never another rank's shard."""
    world = 4
    whole = {"w": np.arange(64 * 256, dtype=np.float32).reshape(64, 256), "step": np.array([7.0]),
             "bias": np.arange(5.0, dtype=np.float32)}
    store, ref, specs = write_sharded(tmp_path / "pvc", whole, world, {"w": 0})
    manifest, _ = store.read_manifest(ref)
    small = [h for h in manifest.shards[0].holds if h.name in ("step", "bias")]
    assert [h.shape[0] for h in small] == [5, 1]  # written whole by rank 0...
    assert all(h.shape[0] == 0 for s in manifest.shards[1:] for h in s.holds if h.name in ("step", "bias"))  # ...only
    for rank in range(world):
        traced_reads.clear()
        rows = (rank * 16, 16)
        loaded = store.load_local(ref, specs, {"w": ((rows[0], 0), (16, 256)), "step": ((0,), (1,)),
                                               "bias": ((0,), (5,))}, rank)
        assert np.array_equal(loaded.tensors["w"], whole["w"][rank * 16:rank * 16 + 16])
        assert loaded.tensors["step"][0] == 7.0 and np.array_equal(loaded.tensors["bias"], whole["bias"])
        mine = manifest.shards[rank]
        expect = {mine.file: mine.size}
        if rank:
            expect[manifest.shards[0].file] = manifest.shards[0].header + sum(checkpoints.plan.slice_bytes(h) for h in small)
        assert traced_reads == expect
        assert sum(traced_reads.values()) <= sum(s.size for s in manifest.shards) * 1.25 / world + (1 << 20)


def test_a_sharded_load_refuses_another_shape_before_reading_and_a_flipped_byte_of_a_shard_it_reads(tmp_path, monkeypatch):
    from trainjob.errors import InputError
    from trainjob.records import TensorSpec
    whole = {"w": np.arange(40, dtype=np.float32).reshape(10, 4)}
    store, ref, specs = write_sharded(tmp_path / "pvc", whole, 2, {"w": 0})
    monkeypatch.setattr(checkpoints.shards, "read_verified", lambda *a, **k: pytest.fail("read before the check"))
    other = (TensorSpec(name="w", dtype="F32", shape=(12, 4)),)
    with pytest.raises(InputError, match=r"w is F32\[10, 4\] there, F32\[12, 4\] in the live state"):
        store.load_local(ref, other, {"w": ((0, 0), (6, 4))}, 0)
    monkeypatch.undo()
    shard = store.path(ref) / "shard-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    into = {"w": np.zeros((5, 4), dtype=np.float32)}
    with pytest.raises(InputError, match="sha256"):
        store.load_local(ref, specs, {"w": ((5, 0), (5, 4))}, 1, into=into)
    assert np.array_equal(store.load_local(ref, specs, {"w": ((0, 0), (5, 4))}, 0).tensors["w"], whole["w"][:5])


def test_a_plain_checkpoint_loads_into_shards_and_a_sharded_one_loads_whole():
    """The two layouts are one format: FSDP loads what plain ranks wrote (or `reshard` rewrote),
    and a plain resume (or `reshard`) loads what FSDP wrote, each by the slices' offsets."""
    whole = {"w": np.arange(9 * 5, dtype=np.float32).reshape(9, 5)}
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        plain_store, plain_ref, specs = write_sharded(Path(tmp) / "plain", whole, 2, {})  # rows 0..3 | 4..8
        sharded_store, sharded_ref, _ = write_sharded(Path(tmp) / "fsdp", whole, 3, {"w": 1})  # columns 2 | 2 | 1
        assert plain_store.read_manifest(plain_ref)[0].shards[1].holds[0].start == 4
        got = plain_store.load_local(plain_ref, specs, {"w": ((3, 2), (4, 2))}, 0).tensors["w"]
        assert np.array_equal(got, whole["w"][3:7, 2:4])  # a box across both plain shards
        assert np.array_equal(sharded_store.load(sharded_ref).tensors["w"], whole["w"])


def test_a_checkpoint_written_before_part_digests_still_verifies_loads_and_refuses_a_flipped_byte(tmp_path):
    from old_formats import as_schema_1
    from trainjob.errors import InputError
    whole = {"w": np.arange(33 * 4, dtype=np.float32).reshape(33, 4), "step": np.array([7.0])}
    store, ref, specs = write_sharded(tmp_path / "pvc", whole, 3, {"w": 0})
    as_schema_1(store, ref)
    manifest, _ = store.read_manifest(ref)
    assert manifest.schema == 1 and manifest.shards[0].header is None
    assert store.verify(ref).reason is None
    assert np.array_equal(store.load(ref).tensors["w"], whole["w"])
    for rank in range(3):  # each rank's part, by offsets: whole shards hashed, as schema 1 needs
        loaded = store.load_local(ref, specs, {"w": ((rank * 11, 0), (11, 4)), "step": ((0,), (1,))}, rank)
        assert np.array_equal(loaded.tensors["w"], whole["w"][rank * 11:rank * 11 + 11])
    shard = store.path(ref) / manifest.shards[2].file
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert "sha256" in store.verify(ref).reason
    with pytest.raises(InputError, match="sha256"):
        store.load_local(ref, specs, {"w": ((22, 0), (11, 4)), "step": ((0,), (1,))}, 2)


def test_a_manifest_mixing_the_schemas_is_refused_naming_the_shard(tmp_path):
    from trainjob.errors import InputError
    from trainjob.records import dumps
    store, ref, _ = write_sharded(tmp_path / "pvc", {"w": np.arange(8.0).reshape(4, 2)}, 2, {"w": 0})
    manifest, _ = store.read_manifest(ref)
    half = attrs.evolve(manifest, shards=[manifest.shards[0], attrs.evolve(manifest.shards[1], header=None)])
    (store.path(ref) / "manifest.json").write_text(dumps(half) + "\n")
    with pytest.raises(InputError, match=f"rank 1's shard lacks the part digests schema {MANIFEST_SCHEMA} has"):
        store.read_manifest(ref)
    (store.path(ref) / "manifest.json").write_text(dumps(attrs.evolve(manifest, schema=1)) + "\n")
    with pytest.raises(InputError, match="rank 0's shard has part digests, which schema 1 has not"):
        store.read_manifest(ref)


# --- every manifest proven by what its shards hold (issue 54, item 3) -------------------------

def rewrite(store, ref, change) -> str:
    """Apply ``change`` to ``ref``'s manifest as parsed JSON, write it back; its new sha256."""
    import hashlib
    import json
    path = store.path(ref) / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def swap_places(name: str, a: int = 0, b: int = 1):
    """Swap where ranks ``a`` and ``b``'s slices of ``name`` sit (``start`` and ``offsets``): the
    shards and every digest untouched, the slices still a partition of the tensor."""
    def change(m):
        x, y = (next(h for h in m["shards"][r]["holds"] if h["name"] == name) for r in (a, b))
        for key in ("start", "offsets"):
            if key in x or key in y:
                x[key], y[key] = y.get(key), x.get(key)
    return change


def refusals(store, ref, specs, wanted: list[dict], expect: str | None = None) -> list[str]:
    """What each reader says of ``ref``: verify's reason, then load's and each rank's load_local's
    error (every one must refuse: pytest.raises)."""
    from trainjob.errors import InputError
    said = [store.verify(ref, expect).reason]
    assert said[0] is not None
    for read in (lambda: store.load(ref, expect),
                 *(lambda rank=rank, w=w: store.load_local(ref, specs, w, rank, expect)
                   for rank, w in enumerate(wanted))):
        with pytest.raises(InputError) as refused:
            read()
        said.append(str(refused.value))
    return said


ROWS = [{"w": ((0, 0), (4, 3))}, {"w": ((4, 0), (4, 3))}]  # what each of two ranks holds of an (8, 3) tensor


def test_a_manifest_that_puts_a_slice_elsewhere_is_refused_by_every_reader_bound_or_not(tmp_path):
    """Each shard's header (hashed with it) says where each of its slices sits, so no edit of any
    manifest, the newest or an older one, makes a reader put bytes in another place."""
    whole = {"w": np.arange(24, dtype=np.float32).reshape(8, 3)}
    store, ref, specs = write_sharded(tmp_path / "pvc", whole, 2, {})
    sha = rewrite(store, ref, swap_places("w"))
    for expect in (None, sha):  # whether or not checkpoint.json names it
        assert all("its header puts w" in said for said in refusals(store, ref, specs, ROWS, expect))
    columns = {"v": np.arange(6.0).reshape(2, 3)}  # a DTensor's Shard(1): offsets along the second axis
    store, ref, specs = write_sharded(tmp_path / "fsdp", columns, 3, {"v": 1})
    rewrite(store, ref, swap_places("v", 0, 2))
    wanted = [{"v": ((0, c), (2, 1))} for c in range(3)]
    assert all("its header puts v" in said for said in refusals(store, ref, specs, wanted))


def test_shards_swapped_between_ranks_in_the_manifest_are_refused_by_the_rank_their_headers_name(tmp_path):
    """Each entry moved to the other rank, its slice moved to that rank's rows: a partition in
    rank order, every digest matching its file; only the headers' ranks tell (any schema)."""
    from old_formats import as_schema_2
    whole = {"w": np.arange(24, dtype=np.float32).reshape(8, 3)}
    store, ref, specs = write_sharded(tmp_path / "pvc", whole, 2, {})
    as_schema_2(store, ref)

    def swap_entries(m):
        a, b = m["shards"]
        m["shards"] = [dict(b, rank=0), dict(a, rank=1)]
        m["shards"][0]["holds"][0]["start"], m["shards"][1]["holds"][0]["start"] = 0, 4
    rewrite(store, ref, swap_entries)
    assert all("its header says rank 1" in said or "its header says rank 0" in said
               for said in refusals(store, ref, specs, ROWS))


def test_an_older_schema_proves_what_its_headers_pin_down_and_only_the_pointer_vouches_for_the_rest(tmp_path):
    """Schema 2 (and 1) shard headers give each slice's rank and shape, not its place: a tensor
    whose slices are whole rows back to back in rank order (the documented split, Shard(0) on one
    mesh axis) is pinned down and loads wherever it is; a forged order, or a place only a
    manifest says (Shard(1), a 2-D mesh), is refused unless checkpoint.json's sha256 vouches for
    that very manifest."""
    from old_formats import as_schema_2
    whole = {"w": np.arange(24, dtype=np.float32).reshape(8, 3)}
    store, ref, specs = write_sharded(tmp_path / "pvc", whole, 2, {})
    as_schema_2(store, ref)
    assert store.read_manifest(ref)[0].schema == 2 and store.verify(ref).reason is None
    assert np.array_equal(store.load(ref).tensors["w"], whole["w"])
    assert np.array_equal(store.load_local(ref, specs, ROWS[1], 1).tensors["w"], whole["w"][4:])
    sha = rewrite(store, ref, swap_places("w"))
    assert all("cannot say where" in said for said in refusals(store, ref, specs, ROWS))
    assert store.verify(ref, sha).reason is None  # a manifest checkpoint.json vouches for is taken as it says

    columns = {"v": np.arange(6.0).reshape(2, 3)}
    store, ref, specs = write_sharded(tmp_path / "fsdp", columns, 3, {"v": 1})
    as_schema_2(store, ref)
    wanted = [{"v": ((0, c), (2, 1))} for c in range(3)]
    assert all("cannot say where" in said for said in refusals(store, ref, specs, wanted))
    sha = rewrite(store, ref, lambda m: None)  # the manifest's own sha256, as checkpoint.json records it
    assert store.verify(ref, sha).reason is None  # the newest, named by the pointer: loads as before
    assert np.array_equal(store.load(ref, sha).tensors["v"], columns["v"])
    assert np.array_equal(store.load_local(ref, specs, wanted[2], 2, sha).tensors["v"], columns["v"][:, 2:])


# --- one verification for every reader (issue 54, item 4) -------------------------------------

def crafted(root, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]):
    """A one-rank checkpoint whose one shard holds ``tensors`` (name: dtype, shape, raw bytes),
    every digest right: what a hand-made or damaged-then-rehashed checkpoint can say."""
    import hashlib
    import json
    from trainjob.checkpoint import plan
    from trainjob.records import ShardEntry, TensorSlice, TensorSpec
    from trainjob.storage.digest import root as digest_root
    specs = [TensorSpec(name=n, dtype=d, shape=s) for n, (d, s, _) in sorted(tensors.items())]
    holds = tuple(TensorSlice(name=t.name, dtype=t.dtype, shape=t.shape, start=0) for t in specs)
    meta = {"rank": "0", "world_size": "1", "step": "1", plan.SLICES_KEY: plan.placement_text(holds, specs)}
    header, at = {"__metadata__": meta}, 0
    for name, (dtype, shape, data) in sorted(tensors.items()):
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(data)]}
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    head = len(text + b" " * (-len(text) % 8)).to_bytes(8, "little") + text + b" " * (-len(text) % 8)
    body = [data for _, (_, _, data) in sorted(tensors.items())]
    store = checkpoints.Committer(Pvc(root))
    store.pvc.create()
    ref = Ref(attempt=1, step=1, world_size=1)
    staging = store.create_staging(ref, 1)
    (staging / plan.shard_file(0, 1)).write_bytes(head + b"".join(body))
    digests = [hashlib.sha256(b).hexdigest() for b in (head, *body)]
    entry = ShardEntry(rank=0, file=plan.shard_file(0, 1), size=len(head) + at, sha256=digest_root(digests),
                       holds=tuple(attrs.evolve(h, sha256=d) for h, d in zip(holds, digests[1:])),
                       header=len(head), header_sha256=digests[0])
    store.commit(staging, ref, Manifest(schema=MANIFEST_SCHEMA, step=1, attempt=1, world_size=1, loss_milli=0,
                                        tensors=specs, shards=[entry]))
    return store, ref, specs


def test_a_shape_no_array_can_have_is_refused_by_verify_and_every_load_never_a_crash(tmp_path):
    """A 0-byte tensor of shape [0, 2**62]: every digest right, and numpy cannot make even an
    empty array of it. verify called it ok and the resume then crashed (70); now both refuse it."""
    from trainjob.errors import InputError
    store, ref, specs = crafted(tmp_path / "pvc", {"params": ("F64", (2,), np.arange(2.0).tobytes()),
                                                   "z": ("F64", (0, 2**62), b"")})
    said = store.verify(ref).reason
    assert said is not None and "z's shape [0, 4611686018427387904] is beyond what an array can hold" in said
    with pytest.raises(InputError, match="beyond what an array can hold"):
        store.load(ref)
    with pytest.raises(InputError, match="beyond what an array can hold"):
        store.load_local(ref, specs, {"params": ((0,), (2,)), "z": ((0, 0), (0, 2**62))}, 0)
    store, ref, _ = crafted(tmp_path / "fine", {"params": ("F64", (2,), np.arange(2.0).tobytes()),
                                                "z": ("F64", (0, 7), b"")})
    assert store.verify(ref).reason is None and store.load(ref).tensors["z"].shape == (0, 7)


ONE_CHECKPOINT = {"w": np.arange(21, dtype=np.float32).reshape(7, 3),  # Shard(0): rows 3 | 3 | 1
                  "v": np.arange(8.0).reshape(2, 4),                   # Shard(1): columns 2 | 2 | none
                  "b": np.arange(5.0)}                                 # small and plain: rank 0 writes it whole
OWN_BOXES = [{"w": ((0, 0), (3, 3)), "v": ((0, 0), (2, 2)), "b": ((0,), (5,))},
             {"w": ((3, 0), (3, 3)), "v": ((0, 2), (2, 2)), "b": ((0,), (5,))},
             {"w": ((6, 0), (1, 3)), "v": ((0, 4), (2, 0)), "b": ((0,), (5,))}]
WHOLE = {n: ((0,) * a.ndim, a.shape) for n, a in ONE_CHECKPOINT.items()}


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    """A three-rank DTensor checkpoint, written once: its manifest is what each example edits."""
    store, ref, specs = write_sharded(tmp_path_factory.mktemp("one") / "pvc", ONE_CHECKPOINT, 3, {"w": 0, "v": 1})
    return store, ref, specs, (store.path(ref) / "manifest.json").read_bytes()


def leaves(value, path=()):
    """Every path to a value inside parsed JSON (the containers' own paths too)."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from leaves(inner, (*path, key))


def at(doc, path):
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def edits(draw, original: dict):
    """One to three edits of a manifest, each of a kind a forgery or a damaged file makes: a field
    swapped between two slices of one tensor (their places, digests, shapes) or between two shards
    (files, digests, sizes, ranks, what they hold), a number or a list changed, one hex digit of
    a digest changed, a key dropped."""
    import copy
    doc = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in leaves(doc) if p and isinstance(p[-1], str)]
        kind = draw(st.sampled_from(["slices", "shards", "number", "digit", "drop"]))
        if kind in ("slices", "shards"):
            depth = 4 if kind == "slices" else 2  # shards/R/holds/I/field or shards/R/field
            pairs = [(a, b) for a in paths for b in paths if len(a) == len(b) == depth + 1 and a < b
                     and a[-1] == b[-1] and a[0] == b[0] == "shards"
                     and (kind == "shards" or at(doc, a[:-1]).get("name") == at(doc, b[:-1]).get("name"))]
            if not pairs:
                continue
            a, b = draw(st.sampled_from(pairs))
            at(doc, a[:-1])[a[-1]], at(doc, b[:-1])[b[-1]] = at(doc, b), at(doc, a)
            continue
        path = draw(st.sampled_from(paths))
        parent, key, value = at(doc, path[:-1]), path[-1], at(doc, path)
        if kind == "drop":
            del parent[key]
        elif kind == "digit" and isinstance(value, str) and value:
            i = draw(st.integers(0, len(value) - 1))
            parent[key] = value[:i] + draw(st.sampled_from("0f9a")) + value[i + 1:]
        elif isinstance(value, int) and not isinstance(value, bool):
            parent[key] = draw(st.sampled_from([0, 1, 2, 3, 4, 7, value + 1, value - 1, 2**31, 2**62, -1]))
        elif isinstance(value, list) and all(isinstance(x, int) for x in value):
            parent[key] = draw(st.sampled_from([value[:-1], [*value, 0], value[::-1], [0, 2**62],
                                                [2**62] * len(value)]))
    return doc


@given(data=st.data())
@settings(max_examples=30)
def test_what_verify_calls_ok_every_reader_loads_with_the_very_bytes_and_nothing_else(one_checkpoint, data):
    """One verification for every reader: whatever edit a manifest suffers, `verify`, a whole
    load (a resume at W = 1 or of a plain state), each rank's load of its own share (the verdict
    round: together they refuse what verify refuses) and a load into another sharding (reshard)
    all accept it, with the very bytes that were saved, or all refuse it (InputError: never a
    crash), whether or not checkpoint.json vouches for the edited manifest."""
    import hashlib
    import json
    from trainjob.errors import InputError
    store, ref, specs, original = one_checkpoint
    path = store.path(ref) / "manifest.json"
    path.write_text(json.dumps(data.draw(edits(json.loads(original)))))
    try:
        for expect in (None, hashlib.sha256(path.read_bytes()).hexdigest()):
            def outcome(read, boxes):
                try:
                    tensors = read().tensors
                except InputError:
                    return False
                for name, (origin, shape) in boxes.items():  # accepted: the very bytes saved
                    want = ONE_CHECKPOINT[name][tuple(slice(o, o + n) for o, n in zip(origin, shape))]
                    assert tensors[name].shape == want.shape and np.array_equal(tensors[name], want), name
                return True
            ok = store.verify(ref, expect).reason is None
            assert outcome(lambda: store.load(ref, expect), WHOLE) == ok
            assert all(outcome(lambda r=r: store.load_local(ref, specs, OWN_BOXES[r], r, expect), OWN_BOXES[r])
                       for r in range(3)) == ok
            assert outcome(lambda: store.load_local(ref, specs, WHOLE, 0, expect, verify_all=True), WHOLE) == ok
            if ok:  # another sharding (a reshard's new shard) reads by parts what verify vouched for
                assert outcome(lambda: store.load_local(ref, specs, WHOLE, 5, expect), WHOLE)
    finally:
        path.write_bytes(original)


# --- a read error is storage trouble, not damage (issue 54, item 1) -----------------------------

@pytest.fixture
def failing_reads(monkeypatch):
    """Every read of a shard (front to back and by offset, the two ways a shard is read) fails
    with ``failing_reads.errno``, as a failing disk or an NFS server gone quiet fails it."""
    import errno as errnos
    import os

    class Failing:
        errno = errnos.EIO

    def fail(self, view, *at):
        raise OSError(Failing.errno, os.strerror(Failing.errno))
    for method in ("readinto", "read_at"):
        monkeypatch.setattr(checkpoints.shards._File, method, fail)
    return Failing


@pytest.mark.parametrize("code", ["EIO", "ETIMEDOUT", "ESTALE"])
def test_a_shard_read_failing_is_storage_trouble_for_every_reader_never_a_verdict(tmp_path, failing_reads, code):
    """verify, a whole load and a load by parts (each rank's share) raise the storage error
    (exit 75): none calls the checkpoint damaged, which would set it aside for ever."""
    import errno as errnos
    from trainjob.errors import TryAgainLater
    failing_reads.errno = getattr(errnos, code)
    store, ref, specs = write_sharded(tmp_path / "pvc", ONE_CHECKPOINT, 3, {"w": 0, "v": 1})
    for read in (lambda: store.verify(ref), lambda: store.load(ref),
                 lambda: store.load_local(ref, specs, OWN_BOXES[1], 1),
                 lambda: store.load_local(ref, specs, WHOLE, 5)):  # by parts from every shard
        with pytest.raises(TryAgainLater, match=r"shard-0000\d-of-00003.safetensors: .*storage"):
            read()
