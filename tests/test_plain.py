"""Plain state values as JSON: every value round-trips exactly, other types are refused naming
their path, and a checkpoint's values are checked against the live state's before use."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings, strategies as st

from trainjob import plain
from trainjob.plain import PlainError

keys = st.text(max_size=6)
leaves = st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2 ** 4000), max_value=2 ** 4000) \
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                      | st.dictionaries(keys, inner, max_size=4), max_leaves=20)


def same(a: object, b: object) -> bool:
    """Equal, type for type; floats by their 64 bits (nan payloads, -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)  # type: ignore[arg-type]
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)  # type: ignore[union-attr,index]
    return a == b


@settings(max_examples=200, deadline=None)
@given(values)
def test_every_plain_value_round_trips_exactly(value):
    text = plain.encode(value)
    assert same(plain.decode(text), value)
    assert plain.encode(plain.decode(text)) == text  # canonical: the same value, the same bytes


@given(st.integers(min_value=0, max_value=2 ** 52 - 1), st.booleans())
def test_nan_payloads_and_signs_survive(payload, negative):
    bits = (1 << 63 if negative else 0) | (0x7FF << 52) | payload | 1
    nan = struct.unpack(">Q", struct.pack(">Q", bits))[0]
    x = struct.unpack(">d", struct.pack(">Q", nan))[0]
    assert math.isnan(x) and struct.pack(">d", plain.decode(plain.encode(x))) == struct.pack(">d", x)


def test_an_int_of_any_size_and_a_dollar_key_are_exact():
    big = 7 ** 20000  # beyond Python's 4300-digit str() limit
    assert plain.decode(plain.encode({"n": big, "$int": "x", "$$": 1})) == {"n": big, "$int": "x", "$$": 1}
    assert plain.encode(-0.0) == "-0.0" and plain.encode(1.0) == "1.0" and plain.encode(1) == "1"


def test_a_list_of_ints_written_whole_is_the_text_int_by_int_gives():
    """Lists and tuples of ints JSON holds exactly are written whole (an RNG's state, at every
    checkpoint): the text is the one each int would have given, and one int too big, a bool or a
    float among them takes the path int by int."""
    import random

    state = random.Random(3).getstate()
    assert plain.encode(state) == "{\"$tuple\":[" + ",".join(
        ["3", "{\"$tuple\":[" + ",".join(map(str, state[1])) + "]}", "null"]) + "]}"
    assert same(plain.decode(plain.encode(state)), state)
    assert plain.encode([1, -(2 ** 53) + 1, 2 ** 53]) == '[1,-9007199254740991,{"$int":"0x20000000000000"}]'
    assert plain.encode((1, True, 2)) == '{"$tuple":[1,true,2]}' and plain.encode([2, 1.0]) == "[2,1.0]"


@pytest.mark.parametrize("value, says", [
    ({"a": {"b": {1, 2}}}, "a.b: a set cannot be checkpointed"),
    ({"a": [b"xy"]}, "a[0]: a bytes cannot be checkpointed"),
    ({"f": lambda: 0}, "f: a function cannot be checkpointed"),
    ({"o": object()}, "o: a object cannot be checkpointed"),
    ({"d": {3: "x"}}, "d: a key of type int (3); keys must be str"),
])
def test_a_value_of_another_type_is_refused_naming_its_path(value, says):
    with pytest.raises(PlainError) as info:
        plain.encode(value)
    assert says in str(info.value)


@pytest.mark.parametrize("text", ['{"$int":"zz"}', '{"$float":"12"}', '{"$x":1}', "NaN", "[1,", '{"$float":"zzzzzzzzzzzzzzzz"}'])
def test_text_encode_cannot_have_written_is_refused(text):
    with pytest.raises(PlainError):
        plain.decode(text)


@pytest.mark.parametrize("live, found, says", [
    ({"a": 1}, {"b": 1}, "the checkpoint lacks ['a'], has extra ['b']"),
    ({"s": {"lr": 0.1}}, {"s": {"lr": "0.1"}}, "s.lr: the checkpoint holds a str, the live state a number"),
    ({"g": [1, 2]}, {"g": [1]}, "g: the checkpoint holds 1 items, the live state 2"),
    ({"b": True}, {"b": 1}, "b: the checkpoint holds a number, the live state a bool"),
])
def test_a_checkpoint_that_does_not_fit_the_live_state_is_named(live, found, says):
    with pytest.raises(PlainError) as info:
        plain.check_like(live, found)
    assert says in str(info.value)


def test_numbers_fit_numbers_and_none_fits_anything():
    plain.check_like({"lr": 1, "x": None, "y": [None]}, {"lr": 0.5, "x": {"k": 1}, "y": ["z"]})
