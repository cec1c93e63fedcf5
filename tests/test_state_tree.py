"""Arrays in a RankLocal part (state_tree.py, plain.py's ``$array``): each rank's own statistics
kept as their exact bytes in its shard's header, back as the same type, dtype, shape and bits;
a checkpoint's array that does not fit the live one is named, as is text that cannot be one."""

from __future__ import annotations

import numpy as np
import pytest

from trainjob import InputError
from trainjob import plain
from trainjob.checkpoint.snapshot import HostState
from trainjob.state_tree import RankLocal, arrays_back, split

torch = pytest.importorskip("torch")


def bits(a) -> bytes:
    return a.reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(a, torch.Tensor) else a.tobytes()


VALUES = [torch.tensor([0.1, -0.0, float("nan")]), torch.tensor(7), torch.zeros(0, 2),
          torch.tensor([1.5, 2.25], dtype=torch.bfloat16), torch.tensor([True, False]),
          np.arange(6, dtype=np.int16).reshape(2, 3), np.array([-0.0, np.inf]), np.zeros((3, 0), np.float32)]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: f"{type(v).__name__}-{v.dtype}-{list(v.shape)}")
def test_an_array_in_a_rank_local_part_comes_back_bit_for_bit_as_what_it_was(value):
    parts = split({"w": np.ones(2), "rank": RankLocal({"stats": {"x": value, "n": 3}, "hist": [value]})}, torch)
    assert set(parts.arrays) == {"w"}  # not a tensor of the shards: each rank's own, in its header
    (path, part), = parts.local
    back = arrays_back(plain.decode(plain.encode(parts.local)), torch)[0][1]
    for got in (back["stats"]["x"], back["hist"][0]):
        assert type(got) is type(value) and got.dtype == value.dtype and tuple(got.shape) == tuple(value.shape)
        assert bits(got) == bits(value)
    assert back["stats"]["n"] == 3


def test_a_checkpoints_rank_local_array_must_fit_the_live_one_and_comes_back_a_tensor():
    host = HostState()
    live = {"w": np.ones(2), "rank": RankLocal({"mean": torch.arange(3.0)})}
    arrays = host.snapshot(live, 1)
    back = host.live({"w": np.ones(2)}, arrays.plain, arrays.local)
    assert isinstance(back["rank"]["mean"], torch.Tensor) and torch.equal(back["rank"]["mean"], torch.arange(3.0))
    other = HostState().snapshot({"w": np.ones(2), "rank": RankLocal({"mean": torch.arange(4.0)})}, 1)
    with pytest.raises(InputError, match=r"mean: the checkpoint holds a float32\[4\] tensor, the live state a "
                                         r"float32\[3\] tensor"):
        host.live({"w": np.ones(2)}, other.plain, other.local)


@pytest.mark.parametrize("inner, says", [
    ('{"dtype": "float32", "shape": [2], "hex": "0000", "torch": false}', r"2 bytes are not a float32\[2\] array"),
    ('{"dtype": "float32", "shape": [1], "hex": "zz", "torch": false}', "not hex"),
    ('{"dtype": "object", "shape": [0], "hex": "", "torch": false}', "bytes are not a"),
    ('{"dtype": "nonsense", "shape": [1], "hex": "00", "torch": true}', "bytes are not a"),
    ('{"dtype": "float32", "shape": [-1], "hex": "", "torch": false}', "not an encoded array"),
])
def test_text_that_cannot_be_an_array_is_refused_naming_its_path(inner, says):
    with pytest.raises(plain.PlainError, match=says):
        arrays_back(plain.decode('{"m": {"$array": %s}}' % inner), torch)
