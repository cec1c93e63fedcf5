"""`trainjob prove`'s hints name the piece of the training state that did not resume, from the evidence alone.

Pure: each case is the evidence prove reads from two runs' checkpoints (the tensor entries that
differ, the replicated plain document, each rank's rank-local document), written out by hand in the
shapes ``trainjob.torch.TrainingState`` gives them. The process test that runs a real naive script
is in test_prove.py.
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
from hypothesis import given

from trainjob.deploy.hints import EntryDiff, Evidence, Snapshot, first_difference, hints, lr_diffs, stream_diffs

MODEL = ("model.0.bias", "model.0.weight")
ADAM = ("optim.state.0.weight.exp_avg", "optim.state.0.weight.exp_avg_sq")
WEIGHTS_DIFFER = (EntryDiff("model.0.weight", "max abs diff 0.01"), EntryDiff(ADAM[0], "max abs diff 0.02"))


def groups(*lrs: float, scheduler: bool = False) -> dict:
    doc = {"model": {}, "optim": {"param_groups": [{"lr": lr, "initial_lr": 0.01, "params": ["0.weight"]}
                                                   for lr in lrs]}}
    if scheduler:
        doc["scheduler"] = {"last_epoch": 12, "base_lrs": [0.01] * len(lrs)}
    return doc


def rank_local(loader: str | None = '{"samples_yielded": 64}', **streams: str) -> list:
    record = {"python": "p", "numpy": "n", "torch": "t", "cuda": [], **streams}
    part = {"rng": record} if loader is None else {"rng": record, "loader": loader}
    return [[["rank"], part]]


def evidence(ref: Snapshot, trial: Snapshot, differing=WEIGHTS_DIFFER, first_loss: int | None = 13,
             world: int = 1, resumed: int | None = 12) -> Evidence:
    return Evidence(resumed, 16, tuple(differing), first_loss, True, world, ref, trial)


def snapshot(plain=None, local=None, names=MODEL + ADAM) -> Snapshot:
    return Snapshot(names, plain, local or {})


def pieces(e: Evidence) -> list[str]:
    return [h.piece for h in hints(e)]


def test_a_scheduler_left_out_of_the_state_is_named_from_the_param_groups_lr():
    """The naive script: TrainingState(model, optimizer, rng=False), a plain DataLoader, the
    scheduler outside the state: no rank-local record at all, and lr differs after the resume."""
    found = hints(evidence(snapshot(groups(0.01)), snapshot(groups(0.00625))))
    assert [h.piece for h in found] == ["scheduler", "unsaved"]
    assert "optim.param_groups[0].lr is 0.01 in the reference, 0.00625 here" in found[0].text
    assert "holds no scheduler" in found[0].text and "TrainingState(scheduler=sched)" in found[0].text
    assert "RNG streams and data loader position" in found[1].text


def test_a_saved_scheduler_whose_lr_still_differs_is_named_as_not_the_one_that_sets_lr():
    found = hints(evidence(snapshot(groups(0.01, scheduler=True), {0: rank_local()}),
                           snapshot(groups(0.02, scheduler=True), {0: rank_local()})))
    assert [h.piece for h in found] == ["scheduler"]
    assert "although the checkpoint holds a scheduler" in found[0].text


def test_a_loader_position_that_differs_names_the_loader_and_where_its_record_parts():
    ref = snapshot(groups(0.01), {0: rank_local('{"samples_yielded": 64}', torch="a")})
    trial = snapshot(groups(0.01), {0: rank_local('{"samples_yielded": 16}', torch="b")})
    found = hints(evidence(ref, trial))
    assert [h.piece for h in found] == ["loader"]  # the batch order explains the streams too
    assert "(first at samples_yielded)" in found[0].text


def test_streams_that_differ_under_an_agreeing_loader_are_named_one_by_one():
    ref = snapshot(groups(0.01), {0: rank_local(torch="a", numpy="n")})
    trial = snapshot(groups(0.01), {0: rank_local(torch="b", numpy="n")})
    found = hints(evidence(ref, trial))
    assert [h.piece for h in found] == ["rng"]
    assert "torch's CPU generator" in found[0].text and "numpy" not in found[0].text.split(" at step")[0]
    assert "the batch order agrees" in found[0].text


def test_a_named_generator_that_differs_is_named():
    ref = [[["rank"], {"generators": {"noise": {"state": 1}}, "loader": "{}"}]]
    trial = [[["rank"], {"generators": {"noise": {"state": 2}}, "loader": "{}"}]]
    assert stream_diffs(ref, trial) == ["the generator 'noise'"]


def test_at_two_ranks_entries_that_differ_while_every_loss_agrees_are_named_as_replicated_state():
    local = {0: rank_local(), 1: rank_local()}
    buffers = [EntryDiff(f"model.1.{n}", "max abs diff 0.1") for n in ("running_mean", "running_var")]
    found = hints(evidence(snapshot(groups(0.01), local), snapshot(groups(0.01), local), buffers, None, world=2))
    assert [h.piece for h in found] == ["replicated"]
    assert "model.1.running_mean, model.1.running_var differ at step 16" in found[0].text and "W=2" in found[0].text
    # At one rank, the same evidence is no replicated state: something else, outside the saved pieces.
    assert pieces(evidence(snapshot(groups(0.01), local), snapshot(groups(0.01), local), buffers, None)) \
        == ["elsewhere"]


def test_every_saved_piece_agreeing_points_outside_the_state():
    local = {0: rank_local()}
    found = hints(evidence(snapshot(groups(0.01), local), snapshot(groups(0.01), local)))
    assert [h.piece for h in found] == ["elsewhere"]


def test_a_flat_state_without_optimizer_entries_names_the_optimizer_alone():
    flat = snapshot(names=("W", "b"))
    assert pieces(evidence(flat, flat, [EntryDiff("W", "max abs diff 1")])) == ["optimizer"]


def test_a_flat_state_with_its_optimizer_names_rng_or_the_loader_as_before():
    flat = snapshot(names=("model.0.weight", "optim.0.momentum_buffer"))
    found = hints(evidence(flat, flat))
    assert [h.piece for h in found] == ["unsaved"] and found[0].text.startswith("RNG or data loader position")


def test_a_learning_rate_entry_alone_names_the_scheduler():
    flat = snapshot(names=("W", "momentum", "lr"))
    assert pieces(evidence(flat, flat, [EntryDiff("lr", "max abs diff 0.1")])) == ["scheduler"]


def test_nothing_differing_or_no_resume_blames_nothing():
    same = snapshot(groups(0.01))
    assert hints(evidence(same, same, [], None)) == []
    assert hints(evidence(same, snapshot(groups(0.02)), resumed=None)) == []


def test_first_difference_reads_a_record_held_as_json_text():
    assert first_difference('{"a": 1, "b": [1, 2]}', '{"a": 1, "b": [1, 3]}') == "b[1]"
    assert first_difference({"a": 1}, {"a": 1}) is None
    assert first_difference({"a": 1}, {"a": 1, "c": 2}) == "c"


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=4))
def test_lr_diffs_are_exactly_the_param_groups_whose_lr_differs_and_name_the_scheduler(pairs):
    ref, trial = groups(*(a for a, _ in pairs)), groups(*(b for _, b in pairs))
    differ = [i for i, (a, b) in enumerate(pairs) if a != b]
    assert [p for p, _, _ in lr_diffs(ref, trial)] == [f"optim.param_groups[{i}].lr" for i in differ]
    found = pieces(evidence(snapshot(ref), snapshot(trial)))
    assert (found[0] == "scheduler") == bool(differ)
    assert found  # the weights differ after a resume: some piece is always named


def test_a_loader_whose_workers_seed_alone_differs_names_the_workers_randomness_not_the_batch_order():
    def loader(seed: int) -> str:
        return ('{"loader": {"_snapshot": {"_main_snapshot": {"_num_workers": 2, "_base_seed": %d, '
                '"_sampler_iter_state": {"samples_yielded": 64}}}}}' % seed)
    ref = snapshot(groups(0.01), {0: rank_local(loader(11))})
    trial = snapshot(groups(0.01), {0: rank_local(loader(12))})
    found = hints(evidence(ref, trial))
    assert [h.piece for h in found] == ["rng"]
    assert "the loader workers' seed (loader._snapshot._main_snapshot._base_seed)" in found[0].text
    assert "the batch order agrees" in found[0].text and "seeded afresh on the relaunch" in found[0].text
    assert "the loader runs 2 worker processes" in found[0].text


def test_main_process_streams_that_differ_beside_loader_workers_name_both():
    """With no other checkpoint to tell a stream drawn from after the resume from one that never
    was, the streams that differ are named, and the loader's worker processes beside them."""
    loader = '{"loader": {"_snapshot": {"_main_snapshot": {"_num_workers": 2, "_base_seed": 7}}}}'
    ref = snapshot(groups(0.01), {0: rank_local(loader, python="a", numpy="a")})
    trial = snapshot(groups(0.01), {0: rank_local(loader, python="b", numpy="b")})
    found = hints(evidence(ref, trial))
    assert [h.piece for h in found] == ["rng"]
    assert found[0].text.startswith("RNG stream: python's random and numpy's global generator at step 16 differ,")
    assert "the loader runs 2 worker processes" in found[0].text


def test_streams_nothing_seeded_or_drew_from_are_not_blamed_and_loader_workers_are_named_instead():
    """What prove found on a StatefulDataLoader with 2 workers adding noise in __getitem__, every
    piece in the state: python's and numpy's global streams, never seeded and never drawn from,
    differ between any two runs (start-up entropy) and stay put within each; the cause is the
    workers' randomness, which no saved stream holds."""
    loader = '{"loader": {"_snapshot": {"_main_snapshot": {"_num_workers": 2, "_base_seed": 7}}}}'

    def local(python: str, torch: str) -> dict:
        return {0: rank_local(loader, python=python, numpy=python, torch=torch)}
    ref, trial = snapshot(groups(0.01), local("a", "t2")), snapshot(groups(0.01), local("b", "t2"))
    # Each run's other checkpoint: the same python/numpy as at the compared step (never drawn).
    e = attrs.evolve(evidence(ref, trial), reference_other=snapshot(groups(0.01), local("a", "t1")),
                     trial_other=snapshot(groups(0.01), local("b", "t1")))
    found = hints(e)
    assert [h.piece for h in found] == ["elsewhere"]
    assert "the loader runs 2 worker processes, which a relaunch starts afresh" in found[0].text
    # Without the other checkpoints to tell, the streams that differ are named (the evidence is all there is).
    assert pieces(evidence(ref, trial)) == ["rng"]


def test_a_loader_over_an_epoch_shuffled_sampler_names_the_sampler_first_not_only_the_workers():
    """Lightning's default DistributedSampler (its DistributedSamplerWrapper over the loader's own
    sampler) diverged under prove while every saved piece agreed, and the hint blamed the loader's
    workers alone: the loader's record names its epoch-shuffled samplers (``loader.py``), and the
    hint names them first."""
    loader = ('{"loader": {"_snapshot": {"_main_snapshot": {"_num_workers": 2, "_base_seed": 7}}}, '
              '"samplers": [{"sampler": "DistributedSamplerWrapper", "epoch": 1}]}')

    def at(torch: str) -> Snapshot:
        return snapshot(groups(0.01), {0: rank_local(loader, torch=torch)})
    e = attrs.evolve(evidence(at("t2"), at("t2")), reference_other=at("t1"), trial_other=at("t1"))
    found = hints(e)
    assert [h.piece for h in found] == ["elsewhere"]
    text = found[0].text
    assert "the loader's sampler, DistributedSamplerWrapper (epoch 1), draws each epoch's order" in text
    assert text.index("DistributedSamplerWrapper") < text.index("the loader runs 2 worker processes")
    assert "use_distributed_sampler=False" in text
    drawn = hints(attrs.evolve(e, trial=at("t3"), trial_other=at("t1"), others_at_resume=True))
    assert [h.piece for h in drawn] == ["rng"] and "DistributedSamplerWrapper (epoch 1)" in drawn[0].text
    plain = '{"loader": {"_snapshot": {"_main_snapshot": {"_num_workers": 2, "_base_seed": 7}}}}'
    without = snapshot(groups(0.01), {0: rank_local(plain, torch="t2")})
    assert "sampler" not in hints(evidence(without, without))[0].text


def test_a_stream_the_trial_drew_from_after_the_resume_is_blamed_one_that_differed_at_the_resume_is_not():
    def at(**streams: str) -> Snapshot:
        return snapshot(groups(0.01), {0: rank_local(**streams)})
    drawn = attrs.evolve(evidence(at(torch="t2"), at(torch="t3")), reference_other=at(torch="t1"),
                         trial_other=at(torch="t1"), others_at_resume=True)
    assert pieces(drawn) == ["rng"] and "torch's CPU generator" in hints(drawn)[0].text
    already = attrs.evolve(drawn, trial_other=at(torch="t0"))  # differed where the trial resumed from
    assert pieces(already) == ["elsewhere"]


def test_streams_that_differ_with_no_loader_position_name_the_data_order_and_a_collators_draws():
    """What prove found on a Trainer's masked-LM run and on its stream over several passes (issue 58):
    torch's stream differs and nothing saved says where the data stood; the hint named only dropout."""
    ref = snapshot(groups(0.01), {0: rank_local(None, torch="a")})
    trial = snapshot(groups(0.01), {0: rank_local(None, torch="b")})
    found = hints(evidence(ref, trial))
    assert found[0].piece == "rng" and "the data order" in found[0].text and "a stream's pass" in found[0].text
    assert "masked-LM masking" in found[0].text
