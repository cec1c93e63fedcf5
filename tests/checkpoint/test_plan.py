"""The pure checkpoint policies: split, reshard plan, resume pick, rotation, manifest checks."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainjob.checkpoint import plan
from trainjob.checkpoint.plan import Ref
from trainjob.records import Manifest, ShardEntry, TensorSlice, TensorSpec

worlds = st.integers(1, plan.MAX_WORLD_SIZE)


@given(st.integers(0, 1000), worlds)
def test_split_covers_every_row_once_in_order_and_balanced(rows, world):
    ranges = plan.split_rows(rows, world)
    assert len(ranges) == world and ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no gap, no overlap
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_the_built_in_model_split_is_the_documented_one():
    spec = [TensorSpec(name="params", dtype="F64", shape=(4,))]  # [w0, w1, w2, bias]
    assert [[(s.start, s.shape) for s in r] for r in plan.plan_shards(spec, 2)] == [[(0, (2,))], [(2, (2,))]]
    assert [r[0].start for r in plan.plan_shards(spec, 4)] == [0, 1, 2, 3]
    assert [r[0].shape for r in plan.plan_shards(spec, 5)] == [(0,), (1,), (1,), (1,), (1,)]


def manifest_for(tensors: dict[str, np.ndarray], world: int) -> Manifest:
    specs = [TensorSpec(name=n, dtype="F64", shape=a.shape) for n, a in sorted(tensors.items())]
    shards = [ShardEntry(rank=r, file=plan.shard_file(r, world), size=8 + sum(map(plan.slice_bytes, holds)),
                         sha256="0" * 64, holds=holds)  # the smallest size that can hold its tensors
              for r, holds in enumerate(plan.plan_shards(specs, world))]
    return Manifest(schema=1, step=1, attempt=1, world_size=world, loss_milli=0, tensors=specs, shards=shards)


@given(st.dictionaries(st.sampled_from(["a", "b", "params"]), st.integers(0, 40), min_size=1),
       st.integers(1, 9), st.integers(1, 9))
def test_reshard_plan_moves_every_value_to_where_a_native_save_would_put_it(rows, src_world, dest_world):
    tensors = {n: np.arange(r * 2, dtype=np.float64).reshape(r, 2) + hash(n) % 7 for n, r in rows.items()}
    src = manifest_for(tensors, src_world)
    src_parts = {s.rank: {h.name: tensors[h.name][h.start:h.start + h.shape[0]] for h in s.holds}
                 for s in src.shards}
    dest_layout = plan.plan_shards(src.tensors, dest_world)
    for rank, pieces in enumerate(plan.plan_reshard(src, dest_world)):
        built = {h.name: np.full(h.shape, np.nan) for h in dest_layout[rank]}
        for p in pieces:
            built[p.tensor][p.dest_index] = src_parts[p.src_rank][p.tensor][p.src_index]
        for h in dest_layout[rank]:  # every row filled, with exactly the value a native save holds
            assert np.array_equal(built[h.name], tensors[h.name][h.start:h.start + h.shape[0]])
    assert plan.manifest_problems(manifest_for(tensors, dest_world)) == []


refs = st.builds(Ref, attempt=st.integers(1, 3), step=st.integers(0, 12), world_size=st.integers(1, 4))


@given(st.sets(refs, max_size=12), st.sets(refs), st.integers(1, 3), st.integers(1, 4))
def test_pick_resume_is_the_newest_sound_step_and_never_falls_back_past_a_mismatch(all_refs, bad, attempt, world):
    tried = []

    def verify(ref):
        tried.append(ref)
        return "bad" if ref in bad else None

    pick = plan.pick_resume(sorted(all_refs), attempt, world, verify)
    sound = [r for r in all_refs if r.attempt == attempt and r not in bad]
    newest = max((r.step for r in sound), default=None)
    assert [r for r, _ in pick.rejected] == [r for r in tried if r in bad]
    if newest is None:
        assert pick.chosen is None and pick.mismatch is None
    elif any(r.step == newest and r.world_size == world for r in sound):
        assert pick.chosen == Ref(attempt=attempt, step=newest, world_size=world)
    else:
        assert pick.chosen is None and pick.mismatch is not None and pick.mismatch.step == newest
    assert all(r.step >= (newest or 0) for r in tried)  # lazy: nothing older than the answer is read


def test_pick_resume_falls_back_past_a_corrupt_newest_and_reports_it():
    r2, r4 = Ref(1, 2, 1), Ref(1, 4, 1)
    pick = plan.pick_resume([r2, r4], 1, 1, lambda r: "flipped byte" if r == r4 else None)
    assert pick.chosen == r2 and pick.rejected == ((r4, "flipped byte"),)


@given(st.sets(refs, max_size=12), st.integers(1, 5), st.integers(1, 4), st.data())
def test_rotation_keeps_the_k_newest_and_never_the_protected_one(all_refs, keep, world, data):
    all_refs = sorted(all_refs)
    protect = data.draw(st.sampled_from(all_refs)) if all_refs else None
    doomed = plan.to_rotate(all_refs, keep, world, protect)
    kept = [r for r in all_refs if r not in doomed]
    assert protect is None or protect in kept
    assert len(kept) <= keep + 1 and len(kept) >= min(keep, len(all_refs))
    assert plan.newest_first(all_refs, world)[:keep] == plan.newest_first(kept, world)[:keep]
    with pytest.raises(ValueError):
        plan.to_rotate(all_refs, 0, world, protect)


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", ".", "..", ".hidden", "", "a\0b", "a b"])
def test_file_names_that_could_leave_the_directory_are_not_plain(name):
    assert not plan.plain_name(name)


def test_names_round_trip_and_manifest_must_agree_with_its_directory():
    ref = Ref(attempt=2, step=4, world_size=3)
    assert Ref.parse(ref.name) == ref and Ref.parse("step-4") is None
    m = manifest_for({"params": np.zeros(4)}, 3)
    assert plan.manifest_problems(m, Ref(attempt=1, step=1, world_size=3).name) == []
    assert "disagrees" in plan.manifest_problems(m, ref.name)[0]
    swapped = m.shards[1].__class__(rank=1, file=m.shards[1].file, size=0, sha256="0" * 64, holds=m.shards[2].holds)
    bad = Manifest(schema=1, step=1, attempt=1, world_size=3, loss_milli=0, tensors=m.tensors,
                   shards=(m.shards[0], swapped, m.shards[2]))
    assert any("gap or an overlap" in p for p in plan.manifest_problems(bad))


@pytest.mark.parametrize(("dtype", "width"), [("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2), ("I64", 8), ("U8", 1),
                                              ("BOOL", 1)])
def test_a_slice_claims_the_width_of_its_dtype_bf16_included(dtype, width):
    # BF16's digits are not its width alone: reading them as one made every bfloat16 manifest a crash (70).
    assert plan.slice_bytes(TensorSlice(name="w", dtype=dtype, shape=(3, 2), start=0)) == 6 * width


# --- DTensor layouts: local shards with offsets, read back by offsets ---------------------------

def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's rule, as DTensor's Shard(d) uses it: ceil(n/parts) per part, the last ones short or empty."""
    size = -(-n // parts)
    return min(i * size, n), min((i + 1) * size, n)


def dtensor_local(shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[int | None, ...],
                  coord: tuple[int, ...]) -> plan.Local:
    """What DTensor's compute_local_shape_and_global_offset gives (Shard(d) as d, Replicate as
    None), and which replica of its box this mesh coordinate is."""
    lo, hi = [0] * len(shape), list(shape)
    replica, replicas = 0, 1
    for size, place, c in zip(mesh, placements, coord):
        if place is None:
            replica, replicas = replica * size + c, replicas * size
        else:
            a, b = chunk(hi[place] - lo[place], size, c)
            lo[place], hi[place] = lo[place] + a, lo[place] + b
    return plan.Local(origin=tuple(lo), shape=tuple(h - l for l, h in zip(lo, hi)), replica=replica, replicas=replicas)


@st.composite
def layouts(draw):
    """A tensor, a 1-D or 2-D mesh and placements (Shard along any axis, or Replicate)."""
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    placements = tuple(draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh)
    return shape, mesh, placements


def coords(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(int(c) for c in np.unravel_index(r, mesh)) for r in range(int(np.prod(mesh)))]


def dtensor_manifest(shape, mesh, placements) -> Manifest:
    spec = TensorSpec(name="w", dtype="F64", shape=shape)
    world = int(np.prod(mesh))
    shards = []
    for rank, c in enumerate(coords(mesh)):
        holds = plan.rank_holds([spec], world, rank, {"w": dtensor_local(shape, mesh, placements, c)})
        shards.append(ShardEntry(rank=rank, file=plan.shard_file(rank, world),
                                 size=8 + sum(map(plan.slice_bytes, holds)), sha256="0" * 64, holds=holds))
    return Manifest(schema=1, step=1, attempt=1, world_size=world, loss_milli=0, tensors=[spec], shards=shards)


@given(layouts(), layouts())
def test_a_dtensor_checkpoint_partitions_its_tensor_and_loads_into_any_other_sharding_by_offsets(saved, loading):
    shape, mesh, placements = saved
    m = dtensor_manifest(shape, mesh, placements)
    assert plan.manifest_problems(m) == []  # the local shards, replicas split: no gap, no overlap
    whole = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    stored = {s.rank: whole[s.holds[0].box] for s in m.shards}  # what each rank's shard file holds
    _, mesh2, placements2 = loading
    for c in coords(mesh2):  # every rank of another mesh gets exactly its own box
        want = dtensor_local(shape, mesh2, tuple(p if p is None or p < len(shape) else None for p in placements2), c)
        got = np.full(want.shape, np.nan)
        pieces = plan.plan_reads(m, {"w": (want.origin, want.shape)})
        for p in pieces:
            got[p.dest_index] = stored[p.src_rank][p.src_index]
        assert np.array_equal(got, whole[tuple(slice(o, o + n) for o, n in zip(want.origin, want.shape))])
        assert sum(p.size for p in pieces) == int(np.prod(want.shape))  # each element read once, none beside
        assert all(p.size for p in pieces)  # no shard is opened for nothing


def test_a_plain_tensor_is_held_as_the_documented_split_and_offsets_stay_out_of_its_manifest():
    spec = TensorSpec(name="w", dtype="F32", shape=(5, 3))
    assert [plan.rank_holds([spec], 2, r) for r in range(2)] == plan.plan_shards([spec], 2)
    assert all(h.offsets is None for r in plan.plan_shards([spec], 2) for h in r)
    shard1 = plan.rank_holds([spec], 2, 1, {"w": plan.Local(origin=(0, 2), shape=(5, 1), replica=0, replicas=1)})
    assert shard1 == (TensorSlice(name="w", dtype="F32", shape=(5, 1), start=0, offsets=(0, 2)),)


def test_overlapping_or_escaping_dtensor_slices_are_problems():
    m = dtensor_manifest((6, 4), (2,), (1,))  # Shard(1): columns 0..1 and 2..3
    h = m.shards[1].holds[0]
    for bad, says in ((attrs.evolve(h, offsets=(0, 1)), "same elements"),
                      (attrs.evolve(h, shape=(6, 1)), "gap or an overlap"),
                      (attrs.evolve(h, offsets=(0, 3)), "does not fit"),
                      (attrs.evolve(h, name="v"), "does not list")):
        broken = attrs.evolve(m, shards=(m.shards[0], attrs.evolve(m.shards[1], holds=(bad,))))
        assert any(says in p for p in plan.manifest_problems(broken)), says
    # The same number of elements, but two slices overlap and leave a gap: the sweep sees it.
    a = TensorSlice(name="w", dtype="F64", shape=(3, 2), start=0, offsets=(0, 0))
    b = TensorSlice(name="w", dtype="F64", shape=(3, 2), start=2, offsets=(2, 0))
    spec = TensorSpec(name="w", dtype="F64", shape=(6, 2))
    shards = [ShardEntry(rank=r, file=plan.shard_file(r, 2), size=56, sha256="0" * 64, holds=(x,))
              for r, x in enumerate((a, b))]
    assert plan.coverage_problems([spec], shards) == ["w: two shards hold the same elements"]


# --- one verification: what the manifest alone must hold for every reader (issue 54, item 4) ----

def parted(m: Manifest) -> Manifest:
    """``m`` as schema 2 writes it: each shard with part digests and their root."""
    from trainjob.storage.digest import root
    shards = []
    for s in m.shards:
        holds = [attrs.evolve(h, sha256=f"{h.start + 1:064x}") for h in s.holds]
        parts = ["1" * 64, *(h.sha256 for h in sorted(holds, key=lambda h: h.name))]
        shards.append(attrs.evolve(s, header=8, header_sha256="1" * 64, holds=holds, sha256=root(parts)))
    return attrs.evolve(m, schema=2, shards=shards)


def test_a_shards_sha256_that_is_not_the_root_of_its_part_digests_is_a_problem():
    """A whole-file reader checks the root, a reader of one slice its digest: were they allowed to
    disagree, one would accept what the other refuses (verify ok, an FSDP resume refusing)."""
    m = parted(manifest_for({"params": np.zeros(4)}, 2))
    assert plan.manifest_problems(m) == []
    one_digit = attrs.evolve(m.shards[1].holds[0], sha256="f" + m.shards[1].holds[0].sha256[1:])
    edited = attrs.evolve(m, shards=[m.shards[0], attrs.evolve(m.shards[1], holds=[one_digit])])
    assert plan.manifest_problems(edited) == ["rank 1's sha256 is not the root of its part digests"]


@pytest.mark.parametrize("shape", [(0, 2**62), (2**61, 0, 2**61), (0,) * 7 + (2**62,)])
def test_a_shape_no_array_can_have_is_a_problem_even_without_an_element(shape):
    """numpy refuses a shape whose dimensions, zeros aside, multiply past what an index can count
    ("array is too big"), whether or not it holds an element: such a manifest is refused as
    corrupt, never left to crash a resume (70)."""
    spec = TensorSpec(name="z", dtype="F64", shape=shape)
    holds = (TensorSlice(name="z", dtype="F64", shape=shape, start=0),)
    m = Manifest(schema=1, step=1, attempt=1, world_size=1, loss_milli=0, tensors=[spec],
                 shards=[ShardEntry(rank=0, file=plan.shard_file(0, 1), size=8, sha256="0" * 64, holds=holds)])
    assert [p for p in plan.manifest_problems(m) if "beyond what an array can hold" in p]
    fine = attrs.evolve(m, tensors=[attrs.evolve(spec, shape=(0, 2**40))],
                        shards=[attrs.evolve(m.shards[0], holds=[attrs.evolve(holds[0], shape=(0, 2**40))])])
    assert plan.manifest_problems(fine) == []


@given(st.integers(1, 40), st.integers(1, 6), st.randoms(use_true_random=False))
def test_older_headers_pin_down_row_blocks_in_rank_order_and_nothing_else(rows, world, rng):
    """What a schema-1 or 2 header proves (each rank's row count): with the blocks back to back in
    rank order, every start; with any other order of the same blocks, nothing (``unpinned``)."""
    m = manifest_for({"params": np.zeros((rows, 2))}, world)
    assert plan.unpinned(m) == []
    blocks = [s.holds[0] for s in m.shards]
    order = list(range(world))
    rng.shuffle(order)
    at, moved = 0, {}
    for r in order:  # the same blocks laid out in another order: still a partition of the tensor
        moved[r] = attrs.evolve(blocks[r], start=at)
        at += blocks[r].shape[0]
    shuffled = attrs.evolve(m, shards=[attrs.evolve(s, holds=[moved[s.rank]]) for s in m.shards])
    assert plan.coverage_problems(shuffled.tensors, shuffled.shards) == []
    same_places = all(moved[r].start == blocks[r].start for r in range(world) if blocks[r].shape[0])
    assert plan.unpinned(shuffled) == ([] if same_places else ["params"])


def test_a_header_that_says_another_rank_step_or_place_than_the_manifest_is_a_problem():
    m = manifest_for({"params": np.zeros((4, 2))}, 2)
    shard = m.shards[1]
    said = {"rank": "1", "world_size": "2", "step": "1", plan.SLICES_KEY: plan.placement_text(shard.holds, m.tensors)}
    assert plan.header_problem(m, shard, said) is None
    assert plan.header_problem(m, shard, {**said, "rank": "0"}) == "its header says rank 0, the manifest 1"
    assert "step" in plan.header_problem(m, shard, {**said, "step": "2"})
    elsewhere = plan.placement_text([attrs.evolve(shard.holds[0], start=0)], m.tensors)
    assert plan.header_problem(m, shard, {**said, plan.SLICES_KEY: elsewhere}) == (
        "its header puts params at {'offsets': [0, 0], 'whole': [4, 2]}, "
        "the manifest at {'offsets': [2, 0], 'whole': [4, 2]}")
    without = {k: v for k, v in said.items() if k != plan.SLICES_KEY}
    assert plan.header_problem(m, shard, without) is None  # schema 1 and 2: headers never said it
    assert "does not say where" in plan.header_problem(attrs.evolve(m, schema=3), shard, without)
