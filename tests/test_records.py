"""The one converter: strict on the way in, canonical on the way out."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainjob.errors import InputError
from trainjob.records import Artifact, CheckpointPointer, NamedArray, Score, dumps, load

# The artifact holds the kinds of field the old whole-state checkpoint did (a step, the model's
# numbers): the converter's strictness is tested on it. The checkpoint itself is now a manifest
# plus safetensors shards (tests/checkpoint/test_manifest.py); checkpoint.json is a pointer.
GOOD = {"attempt": 1, "step": 4, "trainer": "linear",
        "arrays": [{"name": "weights", "shape": [3], "values": [1.0, 0.5, -1.0]},
                   {"name": "bias", "shape": [1], "values": [0.0]}],
        "holdout": {"correct": 20, "total": 20}, "baseline": {"correct": 20, "total": 20}}


def bad(weights=None, **change):
    arrays = GOOD["arrays"] if weights is None else [{"name": "weights", "shape": [3], "values": weights}]
    return json.dumps({**GOOD, "arrays": arrays, **change})


@pytest.mark.parametrize(
    "text, names",
    [
        (bad(extra=1), "extra"),
        (bad(step=True), "step"),           # JSON true is not a step number
        (bad(step=4.5), "step"),
        (bad(weights=[1.0, "0.5", 2.0]), "values"),
        (bad(step=-1), "step"),
        (bad(weights=[1.0, 2.0]), "values"),
        (bad(weights=[1, 2, 1e400]).replace("Infinity", "1e400"), "values"),  # inf
        ('{"step": 4}', "arrays"),
        (bad(step=0).replace('"step": 0', '"step": NaN'), "NaN"),
        ("[1, 2]", "JSON object"),
        ('{"step": 4', "invalid JSON"),
        (b"\xff\xfe", "UTF-8"),
        ("[" * 100_000 + "]" * 100_000, "JSON"),
    ],
)
def test_invalid_checkpoints_are_rejected_with_one_line_naming_the_problem(text, names):
    with pytest.raises(InputError) as err:
        load(text, Artifact, where="ckpt.json")
    message = str(err.value)
    assert "ckpt.json" in message and names in message and "\n" not in message


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(st.integers(0, 10**9), st.tuples(finite, finite, finite), finite, st.integers(0, 10**6))
def test_round_trip_is_exact_and_canonical(step, weights, bias, correct):
    ckpt = Artifact(attempt=1, step=step, trainer="linear",
                    arrays=(NamedArray(name="weights", shape=(3,), values=weights),
                            NamedArray(name="bias", shape=(1,), values=(bias,))),
                    holdout=Score(correct=correct, total=correct), baseline=Score(correct=0, total=correct))
    text = dumps(ckpt)
    again = load(text, Artifact, where="x")
    assert again == ckpt
    assert dumps(again) == text
    assert all(math.copysign(1, a) == math.copysign(1, b) for a, b in zip(again.arrays[0].values, weights))


def test_the_checkpoint_pointer_is_strict_too():
    good = {"step": 4, "attempt": 1, "world_size": 2, "loss_milli": 241,
            "dir": "checkpoints/step-00000004-a0001-w002", "manifest_sha256": "a" * 64}
    assert load(json.dumps(good), CheckpointPointer, where="checkpoint.json").step == 4
    for change in ({"dir": "../elsewhere"}, {"weights": [0, 0, 0]}, {"world_size": 0}):
        with pytest.raises(InputError, match="checkpoint.json"):
            load(json.dumps({**good, **change}), CheckpointPointer, where="checkpoint.json")


def test_every_manifest_dtype_is_one_a_shard_can_be_loaded_as():
    from trainjob.records import DTYPES, TensorSpec, structure
    from trainjob.checkpoint.shards import np_dtype

    assert [np_dtype(code).itemsize > 0 for code in DTYPES] == [True] * len(DTYPES)
    assert structure({"name": "w", "dtype": "BF16", "shape": [2]}, TensorSpec, where="m").dtype == "BF16"  # ml_dtypes
    with pytest.raises(InputError, match="dtype"):  # safetensors has it, numpy cannot load it: refused, not a crash
        structure({"name": "w", "dtype": "F8_E4M3", "shape": [2]}, TensorSpec, where="manifest.json")


def test_each_dtypes_width_is_numpys_itemsize():
    from trainjob.records import DTYPE_BYTES, DTYPES
    from trainjob.tensors import np_dtype
    assert DTYPE_BYTES == {code: np_dtype(code).itemsize for code in DTYPES}


def test_a_record_naming_a_key_twice_is_refused_as_shard_headers_are():
    """JSON lets the last of two equal keys win silently: a file whose two values disagree would be
    read as whichever came last. Every record file is refused instead, naming the key."""
    good = {"step": 4, "attempt": 1, "world_size": 2, "loss_milli": 241,
            "dir": "checkpoints/step-00000004-a0001-w002", "manifest_sha256": "a" * 64}
    text = json.dumps(good)
    twice = text[:-1] + ', "manifest_sha256": "' + "b" * 64 + '"}'
    with pytest.raises(InputError, match="checkpoint.json.*manifest_sha256"):
        load(twice, CheckpointPointer, where="checkpoint.json")
    nested = bad().replace('"correct": 20, "total": 20}, "baseline"', '"correct": 20, "correct": 0, "total": 20}, '
                           '"baseline"')
    with pytest.raises(InputError, match="correct"):
        load(nested, Artifact, where="a.json")
    assert load(text, CheckpointPointer, where="checkpoint.json").manifest_sha256 == "a" * 64
