"""Replicated state at W > 1 (checkpoint/replicas.py, state_tree.py, plan.rank_holds): which rank
is the source of which entry, and the agreement check, pure and in process. The W = 2 launches are
tests/engine/test_replicated_state.py."""

from __future__ import annotations

import numpy as np
import pytest

from trainjob import ReplicasDisagree
from trainjob.checkpoint import plan, replicas
from trainjob.checkpoint.snapshot import HostState
from trainjob.checkpoint.store import Committer
from trainjob.plain import PlainError
from trainjob.records import ShardEntry, TensorSlice, TensorSpec
from trainjob.state_tree import FromRank0, RankLocal, Replicated, split
from trainjob.storage.pvc import Pvc

SPECS = (TensorSpec(name="bn.mean", dtype="F32", shape=(6,)), TensorSpec(name="w", dtype="F32", shape=(6, 2)))


# --- which rank writes what --------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 8])
def test_an_entry_from_rank_0_is_written_whole_by_rank_0_and_the_others_hold_none_of_it(world):
    holds = [plan.rank_holds(SPECS, world, r, sources={"bn.mean": 0}) for r in range(world)]
    mean = [next(h for h in hs if h.name == "bn.mean") for hs in holds]
    assert (mean[0].start, mean[0].shape) == (0, (6,))
    assert all(h.shape == (0,) for h in mean[1:])
    # The other entries keep the documented split, and the whole still partitions every tensor.
    assert [next(h for h in hs if h.name == "w").rows for hs in holds] == [
        slice(a, b) for a, b in plan.split_rows(6, world)]
    entries = [ShardEntry(rank=r, file=plan.shard_file(r, world), size=1000, sha256="0" * 64, holds=hs)
               for r, hs in enumerate(holds)]
    assert plan.coverage_problems(SPECS, entries) == []


def test_without_a_source_every_rank_writes_its_rows_of_an_entry_it_holds():
    holds = [plan.rank_holds(SPECS, 2, r) for r in range(2)]
    assert [hs[0].rows for hs in holds] == [slice(0, 3), slice(3, 6)]


def test_a_dtensor_shard_keeps_its_own_box_whatever_sources_says():
    box = plan.Local(origin=(3,), shape=(3,), replica=0, replicas=1)
    (mean, _) = plan.rank_holds(SPECS, 2, 1, local={"bn.mean": box}, sources={"bn.mean": 0})
    assert (mean.start, mean.shape) == (3, (3,))


def test_the_state_tree_names_each_arrays_kind():
    state = {"model": Replicated({"w": np.ones(2), "bn": {"mean": FromRank0(np.zeros(2))}}),
             "ema": {"w": np.ones(2)}, "rank": RankLocal({"seed": 1}), "sched": {"lr": 0.1}}
    parts = split(state, None)
    assert parts.from_rank0 == {"model.bn.mean"}
    assert parts.checked == {"ema.w"}  # neither under Replicated nor FromRank0
    assert parts.paths["model.bn.mean"] == ("model", "bn", "mean") and set(parts.arrays) == {
        "model.w", "model.bn.mean", "ema.w"}
    assert replicas.sources(parts.from_rank0) == {"model.bn.mean": 0}
    assert split({"w": np.ones(2)}, None).checked == {"w"}  # a plain trainer's flat state: every entry


@pytest.mark.parametrize("state, says", [
    ({"a": FromRank0([1.0])}, "FromRank0 holds an array"),
    ({"a": RankLocal({"b": FromRank0(np.ones(1))})}, "FromRank0 inside a RankLocal part"),
    ({"a": {"b": [FromRank0(np.ones(1))]}}, "an array inside a list"),
])
def test_from_rank_0_wraps_an_array_of_the_replicated_state_only(state, says):
    with pytest.raises(PlainError, match=says):
        split(state, None)


# --- the agreement check -----------------------------------------------------------------------

def entry(rank: int, **digests: str | None) -> ShardEntry:
    holds = [TensorSlice(name=n, dtype="F32", shape=(1,), start=0, digest=d) for n, d in digests.items()]
    return ShardEntry(rank=rank, file=plan.shard_file(rank, 4), size=100, sha256="0" * 64, holds=holds)


A, B = "a" * 32, "b" * 32


def test_digests_that_agree_are_no_disagreement_and_those_that_differ_name_the_ranks_holding_each_copy():
    assert replicas.disagreements([entry(r, w=A, x=None) for r in range(4)]) == {}
    found = replicas.disagreements([entry(0, w=A, v=B), entry(1, w=B, v=B), entry(2, w=A, v=B), entry(3, w=B, v=B)])
    assert found == {"w": [[0, 2], [1, 3]]}
    # A rank that sent no digest of an entry others did holds a copy of its own.
    assert replicas.disagreements([entry(0, w=A), entry(1, w=None)]) == {"w": [[0], [1]]}


def test_the_refusal_is_one_line_naming_the_entry_the_ranks_and_how_many_more():
    line = replicas.refusal(8, {"extra.seen": [[0, 2], [1]], "z": [[0], [1]]})
    assert "\n" not in line and line.startswith("step 8: ")
    assert "extra.seen (and 1 more entry) differs between ranks (ranks 0, 2 and rank 1 hold different values)" in line
    assert "FromRank0" in line and "RankLocal" in line and "nothing was committed" in line
    assert "(and" not in replicas.refusal(8, {"w": [[0], [1]]})


def test_a_digest_is_of_the_bytes_one_flipped_bit_apart():
    a = np.arange(8, dtype=np.float32)
    b = a.copy()
    b.view(np.uint32)[5] ^= 1
    assert replicas.digest(a) == replicas.digest(a.copy()) != replicas.digest(b)
    assert replicas.digest(np.array([0.0])) != replicas.digest(np.array([-0.0]))  # bytes, not values
    assert len(replicas.digest(np.zeros((0, 3)))) == 32


def test_two_ranks_shards_carry_digests_of_checked_entries_only_and_rank_0_finds_the_one_that_differs(tmp_path):
    """As each rank's ``write_shard`` and rank 0's ``Job.write_checkpoint`` do it: the ranks'
    receipts carry a digest of every checked entry, none of a FromRank0 or Replicated one."""
    store = Committer(Pvc(tmp_path / "pvc"))
    store.pvc.create()
    staging = store.create_staging(plan.Ref(attempt=1, step=4, world_size=2), 1)
    entries = []
    for rank in range(2):
        state = {"model": Replicated({"w": np.full(4, 1.0, np.float32),
                                      "mean": FromRank0(np.full(4, rank, np.float32))}),
                 "seen": {"total": np.full(2, rank, np.float32)}, "same": {"c": np.ones(2, np.float32)}}
        entries.append(store.write_shard(staging, rank, 2, 4, HostState().snapshot(state, 4)))
    digests = {(e.rank, h.name): h.digest for e in entries for h in e.holds}
    assert all(digests[r, n] is None for r in range(2) for n in ("model.w", "model.mean"))
    assert digests[0, "same.c"] == digests[1, "same.c"] is not None
    assert replicas.disagreements(entries) == {"seen.total": [[0], [1]]}
    assert next(h for h in entries[1].holds if h.name == "model.mean").shape == (0,)  # rank 0's copy, whole
    alone = store.write_shard(staging, 0, 1, 4, HostState().snapshot({"seen": {"t": np.ones(2)}}, 4))
    assert [h.digest for h in alone.holds] == [None]  # one rank: nothing to compare


def test_a_disagreement_is_refused_with_exit_2():
    from trainjob.exits import exit_code_for
    assert exit_code_for(ReplicasDisagree) == 2
