"""``TrainingState`` under DDP (trainers/torch/ddp.py): what it marks for the checkpoint, in one
process on a one-rank gloo group. A DDP model's parameters and optimizer state are Replicated,
its buffers FromRank0, or each rank's own with ``broadcast_buffers=False`` (exact bytes in the
rank part, back on a resume); a model without DDP is left for the agreement check. The W = 2
launches are tests/engine/test_replicated_state.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trainjob.checkpoint.snapshot import HostState  # noqa: E402
from trainjob.state_tree import FromRank0, RankLocal, Replicated, split  # noqa: E402
from trainjob.torch import TrainingState  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    import torch.distributed as dist
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    net(torch.randn(8, 4))  # running statistics and num_batches_tracked of their own
    return net


def state_of(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainingState(model=model, optimizer=opt, rng=False, **kw)


def test_under_ddp_parameters_are_replicated_and_buffers_from_rank_0(group):
    ddp = DistributedDataParallel(bn_net())
    sd = state_of(ddp, extra={"ema": bn_net()}).state_dict()
    assert isinstance(sd["model"], Replicated) and isinstance(sd["optim"], Replicated)
    assert isinstance(sd["model"]["1.running_mean"], FromRank0) and not isinstance(sd["model"]["0.weight"], FromRank0)
    parts = split(sd, torch)
    assert parts.from_rank0 == {"model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"}
    assert parts.checked == {n for n in parts.arrays if n.startswith("extra.ema.")}  # not DDP's: compared


def test_without_ddp_nothing_is_marked_and_every_entry_is_compared():
    parts = split(state_of(bn_net()).state_dict(), torch)
    assert parts.from_rank0 == set() and parts.checked == set(parts.arrays)


def test_with_broadcast_buffers_false_each_ranks_buffers_come_back_bit_for_bit(group):
    net = bn_net()
    ddp = DistributedDataParallel(net, broadcast_buffers=False)
    state = state_of(ddp)
    sd = state.state_dict()
    assert "1.running_mean" not in sd["model"] and isinstance(sd["rank"], RankLocal)
    assert set(sd["rank"]["buffers"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    before = {k: v.clone() for k, v in net.state_dict().items()}
    host = HostState()
    arrays = host.snapshot(sd, 3)
    saved = {k: np.array(v, copy=True) for k, v in arrays.items()}
    with torch.no_grad():  # the live model moves on: every parameter and buffer changed
        for t in net.state_dict().values():
            t.add_(1)
    state.load_state_dict(host.live(saved, arrays.plain, arrays.local))
    after = net.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "not restored"
    assert after["1.num_batches_tracked"].dim() == 0
