"""Snapshots of a live state into host arrays (checkpoint/snapshot.py): no copy of what is already
on the host, one reusable buffer for what is not, bfloat16 bit for bit, and one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

from trainjob.checkpoint import shards
from trainjob.checkpoint.plan import plan_shards
from trainjob.checkpoint.snapshot import HostState, exported, specs_of
from trainjob.errors import UsageError

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'trainjob[torch]')")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


def test_numpy_arrays_and_cpu_tensors_are_written_from_their_own_memory():
    w, t = np.arange(6.0).reshape(2, 3), torch.arange(4, dtype=torch.float32)
    host = HostState()
    out = host.snapshot({"w": w, "t": t}, 0)
    assert out["w"] is w  # no copy
    assert out["t"].ctypes.data == t.data_ptr() and not host.buffers  # a view of the tensor itself


@pytest.mark.parametrize("device", DEVICES)
def test_a_copying_snapshot_reuses_one_buffer_per_tensor(device):
    t = torch.arange(8, dtype=torch.float32, device=device)
    host = HostState(copy=True)
    first = host.snapshot({"t": t}, 1)["t"]
    t += 1  # the trainer steps on: the snapshot keeps the bytes it took
    assert first.tolist() == list(range(8))
    second = host.snapshot({"t": t}, 2)["t"]
    assert second is first and second.tolist() == list(range(1, 9))  # the same buffer, refilled


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_through_a_shard_bit_for_bit(tmp_path, device, dtype):
    torch.manual_seed(0)
    source = (torch.randn(5, 3) * 100).to(dtype).to(device)
    host = HostState()
    arrays = host.snapshot({"t": source}, 1)
    (holds,) = plan_shards(host.specs, 1)
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"".join(bytes(c) for c in shards.encode(arrays, {})))
    back = {"t": np.empty((5, 3), dtype=shards.np_dtype(host.specs[0].dtype))}
    assert shards.read_verified(path, holds, back) is None
    restored = host.live(back)["t"]
    assert restored.dtype == dtype and restored.device.type == "cpu"
    as_bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[source.element_size()]
    if dtype is torch.bool:
        assert torch.equal(restored, source.cpu())
    else:
        assert torch.equal(restored.view(as_bits), source.cpu().view(as_bits))  # bits, NaN and -0.0 included
    if dtype is torch.bfloat16:  # and what other readers see: safetensors' own loader agrees
        from safetensors.torch import load_file
        assert torch.equal(load_file(path)["t"].view(torch.int16), source.cpu().view(torch.int16))


def test_a_0d_value_is_checkpointed_with_an_axis_and_given_back_0d_in_its_own_memory(tmp_path):
    """BatchNorm's num_batches_tracked in a plain ``state=net``: stored as shape (1,), a view of
    the live tensor (a resume reads into it), handed back 0-d."""
    count, scale = torch.tensor(7), np.array(0.5)
    host = HostState()
    arrays = host.snapshot({"count": count, "scale": scale, "w": torch.ones(2)}, 0)
    assert arrays["count"].shape == (1,) and arrays["count"].ctypes.data == count.data_ptr()
    assert arrays["scale"].shape == (1,) and np.shares_memory(arrays["scale"], scale)
    assert [t.shape for t in host.specs] == [(1,), (1,), (2,)]
    back = host.live({"count": np.array([9]), "scale": np.array([0.25]), "w": np.zeros(2, dtype=np.float32)})
    assert back["count"].shape == () and int(back["count"]) == 9 and isinstance(back["count"], torch.Tensor)
    assert back["scale"].shape == () and float(back["scale"]) == 0.25


def test_an_export_keeps_0d_and_tied_tensors_and_loads_back_to_the_same_state_dict():
    """What ``export=net.state_dict()`` publishes for a BatchNorm model with tied weights (one
    tensor under two names): each name, its own shape (0-d as []), bytes safetensors loads back
    to the same state_dict; a non-contiguous tensor is written contiguous."""
    from safetensors.torch import load
    net = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "bn": torch.nn.BatchNorm1d(3),
                               "head": torch.nn.Linear(3, 5, bias=False)})
    net["head"].weight = net["emb"].weight
    net["bn"](torch.randn(4, 3))
    state = {**net.state_dict(), "t": torch.arange(6.0).reshape(2, 3).t()}
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()
    data = b"".join(bytes(c) for c in shards.encode(exported(state, 1), {}))
    back = load(data)
    assert back.keys() == state.keys()
    assert all(back[k].shape == state[k].shape and back[k].dtype == state[k].dtype and torch.equal(back[k], state[k])
               for k in state)
    assert back["bn.num_batches_tracked"].shape == () and int(back["bn.num_batches_tracked"]) == 1
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "bn": torch.nn.BatchNorm1d(3),
                                 "head": torch.nn.Linear(3, 5, bias=False)})
    fresh.load_state_dict({k: v for k, v in back.items() if k != "t"})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())


def test_an_export_that_cannot_be_published_is_refused_naming_it():
    with pytest.raises(UsageError, match="no nesting, no plain values"):
        exported({"w": torch.ones(2), "step": 3}, 1)
    with pytest.raises(UsageError, match="complex64"):
        exported({"w": torch.zeros(2, dtype=torch.complex64)}, 1)


W = torch.zeros(4, 3)


@pytest.mark.parametrize("value, says", [
    ([1.0, 2.0], "expected a numpy array or a torch tensor, got list"),
    (np.float64(1.0), "expected a numpy array or a torch tensor"),
    (np.zeros((4, 3)).T, "a non-contiguous array"),
    (W.t(), "a non-contiguous tensor"),
    (W.to_sparse(), "a sparse tensor"),
    (torch.zeros(2, dtype=torch.complex64), "dtype torch.complex64 cannot be stored in a shard"),
])
def test_a_value_that_cannot_be_checkpointed_is_refused_naming_it(value, says):
    with pytest.raises(UsageError, match="state_dict\\(\\)\\['w'\\]") as info:
        specs_of({"w": value})
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("later, says", [
    ({"w": W, "extra": W}, "names changed (new extra)"),
    ({"v": W}, "names changed (missing w; new v)"),
    ({"w": W.reshape(-1)}, "state_dict()['w'] is now F32[12], was F32[4, 3]"),
    ({"w": W.double()}, "state_dict()['w'] is now F64[4, 3], was F32[4, 3]"),
])
def test_a_state_that_changes_between_checkpoints_is_refused_naming_the_array(later, says):
    host = HostState()
    host.snapshot({"w": W}, 0)
    with pytest.raises(UsageError) as info:
        host.snapshot(later, 3)
    assert str(info.value).startswith("step 3: ") and says in str(info.value)


# --- DTensors (FSDP2's parameters): the local shard with its place, never the whole -----------

@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank gloo group in this process: enough for a DTensor of each placement."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_dtensor_is_snapshot_as_its_local_shard_with_its_offsets_and_comes_back_a_dtensor(mesh):
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    local = torch.arange(12.0).reshape(3, 4)
    # One rank of a mesh of 1: its shard is the whole, but the snapshot must still take it as a shard.
    sharded = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    replicated = DTensor.from_local(torch.ones(2), mesh, [Replicate()], run_check=False)
    host = HostState()
    arrays = host.snapshot({"w": sharded, "r": replicated}, 0)
    assert host.sharded and arrays.boxes["w"].origin == (0, 0) and arrays.boxes["w"].shape == (3, 4)
    assert np.shares_memory(arrays["w"], local.numpy())  # the shard itself, no copy, no gather
    assert [t.shape for t in arrays.specs] == [(2,), (3, 4)]
    back = host.live({"w": arrays["w"] * 2, "r": arrays["r"]})
    assert isinstance(back["w"], DTensor) and back["w"].placements == (Shard(1),)
    assert torch.equal(back["w"].to_local(), local * 2)


def test_a_partial_dtensor_is_refused_naming_the_entry_before_anything_is_written(mesh):
    import torch
    from torch.distributed.tensor import DTensor, Partial
    pending = DTensor.from_local(torch.ones(4), mesh, [Partial()], run_check=False)
    with pytest.raises(UsageError, match=r"state_dict\(\)\['model.w'\]: a DTensor placed P.*Shard\(d\) and Replicate"):
        HostState().snapshot({"model.w": pending}, 0)


def test_a_dtensors_box_is_worked_out_once_per_run_and_again_when_its_placements_change(mesh, monkeypatch):
    """A DTensor's place in the whole depends only on its mesh, placements and whole shape: the
    snapshot at every checkpoint must not redo that arithmetic (it was half of a small sharded
    save's snapshot), but a DTensor handed out with other placements is worked out, and checked, anew."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from trainjob.checkpoint import snapshot
    calls: list[str] = []
    real = snapshot.dtensor_box
    monkeypatch.setattr(snapshot, "dtensor_box", lambda name, t: calls.append(name) or real(name, t))
    w, b = torch.arange(12.0).reshape(3, 4), torch.ones(3)

    def state(placement):  # handed out anew each time, as state_dict() detaches FSDP2's parameters
        return {"w": DTensor.from_local(w, mesh, [placement], run_check=False),
                "b": DTensor.from_local(b, mesh, [Shard(0)], run_check=False)}

    host = HostState()
    for step in range(4):
        arrays = host.snapshot(state(Shard(0)), step)
    assert sorted(calls) == ["b", "w"]  # once each for the run, not twice per snapshot
    assert arrays.boxes["w"] == real("w", state(Shard(0))["w"])
    host.snapshot(state(Replicate()), 5)  # the same box on a mesh of one: accepted, but worked out again
    assert sorted(calls) == ["b", "w", "w"]
    with pytest.raises(UsageError, match=r"state_dict\(\)\['w'\]: a DTensor placed P"):
        host.snapshot(state(Partial()), 6)  # a placement first seen now is checked now
