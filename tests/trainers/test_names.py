"""DCP's names at torch's own cost (trainers/torch/names.py, optim.py): after its first call,
``TrainingState`` hands out exactly what ``get_model_state_dict`` and ``get_optimizer_state_dict``
would (the same names, the same live tensors, the same param groups) for a plain module, a
DDP-wrapped one and an FSDP2 one (in one process, a one-rank gloo group), without calling them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from trainjob.torch import TrainingState  # noqa: E402
from trainjob.trainers.torch import names  # noqa: E402


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    import torch.distributed as dist
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                            torch.nn.Linear(4, 6, bias=False))
    m[3].weight = m[0].weight  # tied: one parameter, two names
    return m


def same(ours, theirs):
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        if isinstance(v, DTensor):  # FSDP2: a new DTensor per call, over the same shard
            assert isinstance(ours[k], DTensor) and ours[k].placements == v.placements, k
            ours[k], v = ours[k].to_local(), v.to_local()
        if isinstance(v, torch.Tensor):
            ours[k] = getattr(ours[k], "array", ours[k])  # DDP's buffers are FromRank0
            assert ours[k].data_ptr() == v.data_ptr() and torch.equal(ours[k].reshape(v.shape), v), k
        elif isinstance(v, dict):
            same(ours[k], v)
        else:
            assert ours[k] == v, k


@pytest.mark.parametrize("wrap", ["plain", "ddp", "fsdp2"])
def test_the_state_names_and_tensors_are_dcps_at_every_checkpoint(wrap, request):
    model = net()
    if wrap == "ddp":
        request.getfixturevalue("group")
        model = DistributedDataParallel(model)
    elif wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        request.getfixturevalue("group")
        model = fully_shard(model)
    opt = torch.optim.AdamW([{"params": list(model.parameters())[:2]},
                             {"params": list(model.parameters())[2:], "lr": 0.5}], lr=0.1)
    state = TrainingState(model=model, optimizer=opt, rng=False)
    for _ in range(3):  # the first call learns the names, the next ones use them
        model(torch.tensor([[1, 2], [3, 4]]).reshape(-1)).sum().backward()
        opt.step()
        sd = state.state_dict()
        same(dict(sd["model"]), get_model_state_dict(model))
        dcp = get_optimizer_state_dict(model, opt)
        same({k: v for k, v in sd["optim"]["state"].items() if sd["optim"]["created"][k]}, dcp["state"])
        assert sd["optim"]["param_groups"] == dcp["param_groups"]
    assert state._names._rename is not None and not state._names._dcp  # learnt, and DCP no longer called
    assert any(isinstance(v, DTensor) for v in sd["model"].values()) == (wrap == "fsdp2")


class Extra(torch.nn.Linear):
    def get_extra_state(self):  # a value that is not a tensor: compared by nothing cheaper than DCP
        return {"calls": 1}

    def set_extra_state(self, state):
        pass


def test_a_module_with_state_that_is_not_a_tensor_stays_on_dcp():
    model = torch.nn.Sequential(Extra(2, 2))
    got = names.ModelNames(model)
    first, second = got.state_dict(), got.state_dict()
    assert got._dcp and first.keys() == second.keys() == get_model_state_dict(model).keys()
    assert second["0._extra_state"] == {"calls": 1}


def test_a_param_group_added_during_the_run_is_refused_in_one_line_naming_it():
    """Gradual unfreezing (Lightning's BaseFinetuning adds a group as it unfreezes a layer): the
    names the layout learnt no longer cover the optimizer; refused (exit 2), not an IndexError (70)."""
    from trainjob.errors import UsageError

    model = net()
    model[1].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    state = TrainingState(model=model, optimizer=opt, rng=False)
    state.state_dict()
    model[1].requires_grad_(True)
    opt.add_param_group({"params": list(model[1].parameters())})
    model(torch.tensor([1, 2, 3, 4])).sum().backward()
    opt.step()
    with pytest.raises(UsageError, match=r"optimizer's parameters changed since the run began \(3 then, 5 now"):
        state.state_dict()
