"""Shard files: the safetensors bytes, hashing while writing, verification, the directory commit."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from trainjob.checkpoint import shards
from trainjob.storage.digest import Sha256Pipe
from trainjob.errors import InputError
from trainjob.storage.durable import atomic_write, commit_dir
from trainjob.records import TensorSlice

floats = st.floats(allow_nan=False, width=64)


@given(st.lists(floats, max_size=40), st.integers(0, 3))
@settings(max_examples=50)
def test_encoding_is_byte_for_byte_the_reference_implementation(values, rank):
    tensors = {"params": np.array(values, dtype=np.float64), "aux": np.arange(3, dtype=np.float64)}
    meta = {"rank": str(rank)}
    mine = b"".join(bytes(c) for c in shards.encode(tensors, meta))
    assert mine == safetensors.numpy.save(tensors, metadata=meta)


def test_large_tensors_stream_in_chunks_that_view_the_array(monkeypatch):
    monkeypatch.setattr(shards, "CHUNK", 1024)
    a = np.arange(1000, dtype=np.float64)  # 8000 bytes -> 8 chunks after the header
    chunks = list(shards.encode({"a": a}, {}))
    assert len(chunks) == 9 and all(isinstance(c, memoryview) for c in chunks[1:])


def test_sha256_is_computed_from_the_bytes_as_written(tmp_path):
    tensors = {"params": np.array([1.0, 2.0, 3.0, 4.0])}
    written = atomic_write(tmp_path / "s.safetensors", shards.encode(tensors, {}))
    data = (tmp_path / "s.safetensors").read_bytes()
    assert written.size == len(data) and written.sha256 == hashlib.sha256(data).hexdigest()
    assert shards.hash_file(tmp_path / "s.safetensors", written.size, written.sha256) is None
    holds = [TensorSlice(name="params", dtype="F64", shape=(4,), start=0)]
    assert np.array_equal(shards.read(tmp_path / "s.safetensors", holds)["params"], tensors["params"])


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "s.safetensors"
    written = atomic_write(path, shards.encode({"params": np.arange(4, dtype=np.float64)}, {}))
    return path, written


def test_truncation_is_caught_by_size(shard):
    path, w = shard
    os.truncate(path, w.size - 1)
    assert "bytes, the manifest says" in shards.hash_file(path, w.size, w.sha256)


def test_one_flipped_bit_is_caught_by_sha256(shard):
    path, w = shard
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert "sha256" in shards.hash_file(path, w.size, w.sha256)


def test_a_symlinked_shard_is_never_followed(shard, tmp_path):
    path, w = shard
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)  # the very same good bytes, behind a link
    assert "symlink is never followed" in shards.hash_file(link, w.size, w.sha256)
    assert "missing" in shards.hash_file(tmp_path / "nope", w.size, w.sha256)


def test_a_header_that_disagrees_with_the_manifest_is_refused(shard):
    path, _ = shard
    with pytest.raises(ValueError, match="F64"):
        shards.read(path, [TensorSlice(name="params", dtype="F64", shape=(3,), start=0)])
    with pytest.raises(ValueError, match="holds tensors"):
        shards.read(path, [TensorSlice(name="other", dtype="F64", shape=(4,), start=0)])
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a valid safetensors"):
        shards.read(path, [])


@given(st.lists(st.integers(0, 600_000), max_size=6))
@settings(max_examples=30, deadline=None)
def test_the_pipelined_sha256_is_the_plain_sha256_of_the_same_chunks(sizes):
    chunks = [os.urandom(n) for n in sizes]  # sizes either side of the inline/threaded cut-off
    pipe = Sha256Pipe()
    for c in chunks:
        pipe.update(memoryview(c))
    assert pipe.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()


def _rewrite_header(path, edit):
    """Rewrite a shard's JSON header with ``edit`` applied, keeping the data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = edit(raw[8:8 + n].decode().rstrip())
    text += " " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text.encode() + raw[8 + n:])


def test_a_load_reads_straight_into_the_state_and_checks_the_bytes_it_kept(shard):
    path, w = shard
    holds = [TensorSlice(name="params", dtype="F64", shape=(4,), start=0)]
    dest = {"params": np.full(4, -1.0)}
    assert shards.read_verified(path, holds, dest, w.size, w.sha256) is None
    assert np.array_equal(dest["params"], np.arange(4, dtype=np.float64))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert "sha256" in shards.read_verified(path, holds, dest, w.size, w.sha256)


@pytest.mark.parametrize("chunk", [64, 96, 1 << 20])  # 2 rows a block, 3, and the whole slice at once
def test_a_load_by_offsets_copies_each_piece_as_its_rows_go_by_block_after_block(tmp_path, monkeypatch, chunk):
    """The reshard path: only the parts of a saved slice that overlap this rank's are copied,
    read through one reused block of whole rows; every block after the first reads from the same
    shard (a regression: the pieces' loop once rebound the source it reads from)."""
    whole = np.arange(50 * 4, dtype=np.float64).reshape(50, 4)
    path = tmp_path / "s.safetensors"
    written = atomic_write(path, shards.encode({"w": whole}, {}))
    monkeypatch.setattr(shards, "CHUNK", chunk)
    holds = [TensorSlice(name="w", dtype="F64", shape=(50, 4), start=0)]
    middle, tail = np.full((38, 2), -1.0), np.full((5, 4), -1.0)
    pieces = {"w": [((slice(3, 41), slice(1, 3)), middle), ((slice(45, 50), slice(0, 4)), tail)]}
    assert shards.read_verified(path, holds, pieces, written.size, written.sha256) is None
    assert np.array_equal(middle, whole[3:41, 1:3]) and np.array_equal(tail, whole[45:50])


@pytest.mark.parametrize("edit, reason", [
    (lambda t: t.replace("[0,32]", "[8,40]"), "gap or overlap"),
    (lambda t: t.replace("[0,32]", "[0,24]"), "offsets"),
    (lambda t: t[:-1] + ',"params":{"dtype":"F64","shape":[4],"data_offsets":[0,32]}}', "twice"),
    (lambda t: "[1]", "not a JSON object"),
])
def test_a_header_the_format_forbids_is_refused(shard, edit, reason):
    path, _ = shard
    _rewrite_header(path, edit)
    with pytest.raises(ValueError, match=reason):
        shards.read(path, [TensorSlice(name="params", dtype="F64", shape=(4,), start=0)])


def test_commit_dir_publishes_whole_and_never_replaces(tmp_path):
    staging, final = tmp_path / ".tmp-x", tmp_path / "x"
    staging.mkdir()
    atomic_write(staging / "a", b"A")
    commit_dir(staging, final)
    assert (final / "a").read_bytes() == b"A" and not staging.exists()
    staging.mkdir()
    with pytest.raises(InputError, match="never overwrites"):
        commit_dir(staging, final)
    final.rename(tmp_path / "y")
    final.mkdir()  # rename(2) would silently replace an empty directory: commit_dir must not
    with pytest.raises(InputError, match="never overwrites"):
        commit_dir(staging, final)


def test_a_lazily_encoded_file_is_byte_for_byte_the_eager_one_asking_for_one_tensor_at_a_time():
    from trainjob.tensors import tensor_specs
    arrays = {"b": np.arange(5, dtype=np.float32), "a": np.ones((3, 2)), "c": np.zeros(0, dtype=np.int8)}
    asked = []

    def produce(name):
        assert len(asked) == 0 or asked[-1] < name  # in name order, each once
        asked.append(name)
        return arrays[name]

    stream = shards.encode_lazy(tensor_specs(arrays), produce, {"k": "v"})
    header = next(stream)
    assert asked == []  # the header needs no tensor
    assert header + b"".join(bytes(c) for c in stream) == b"".join(bytes(c) for c in shards.encode(arrays, {"k": "v"}))
    assert asked == ["a", "b", "c"]
