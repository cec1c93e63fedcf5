"""Sha256Pipe hashes exactly the bytes handed to it, in order, in either mode."""

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from trainjob.storage import digest
from trainjob.storage.digest import Sha256Pipe, root

SIZES = st.lists(st.sampled_from([0, 1, 7, 2048, (256 << 10) - 1, 256 << 10, (1 << 20) + 3]), max_size=12)


@settings(max_examples=40, deadline=None)
@given(sizes=SIZES, kept=st.booleans())
def test_the_digest_is_hashlibs_of_the_chunks_in_order(sizes, kept):
    chunks = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    pipe = Sha256Pipe(buffers_kept=kept)
    for c in chunks:
        pipe.update(memoryview(c))
    assert pipe.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()


def test_a_kept_stream_never_queues_more_than_its_bound(monkeypatch):
    """A stream that makes its chunks as it goes (a sharded model's artifact) stays bounded."""
    monkeypatch.setattr(digest, "_AHEAD", 1 << 20)
    pipe, chunk, most = Sha256Pipe(buffers_kept=True), 512 << 10, 0
    for i in range(64):
        pipe.update(memoryview(bytes([i]) * chunk))
        most = max(most, pipe._queued)
    assert most <= (1 << 20) + chunk
    assert pipe.hexdigest() == hashlib.sha256(b"".join(bytes([i]) * chunk for i in range(64))).hexdigest()


@given(data=st.binary(max_size=4000), cuts=st.lists(st.integers(0, 4000), max_size=6),
       chunk=st.integers(1, 700), kept=st.booleans())
def test_a_stream_hashed_in_parts_gives_each_parts_sha256_and_their_root_however_it_is_chunked(data, cuts, chunk,
                                                                                              kept):
    """What a shard's part digests are (storage/digest.py): each part's sha256 whatever the chunks
    straddle, empty parts included, and the root over them; a stream longer than its parts can
    never hash to the root its parts would give."""
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    sizes = [b - a for a, b in zip(bounds, bounds[1:])] or [0]
    pipe = Sha256Pipe(buffers_kept=kept, parts=sizes)
    for i in range(0, len(data), chunk):
        pipe.update(memoryview(data[i:i + chunk]))
    expected = [hashlib.sha256(data[a:b]).hexdigest() for a, b in zip(bounds, bounds[1:])] or \
        [hashlib.sha256(b"").hexdigest()]
    assert pipe.hexdigest() == root(expected) and pipe.parts() == expected
    longer = Sha256Pipe(parts=sizes)
    longer.update(memoryview(data + b"x"))
    assert longer.hexdigest() != root(expected)
