"""The one converter: strict on the way in, canonical on the way out."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainjob.errors import InputError
from trainjob.records import Checkpoint, dumps, load

GOOD = {"attempt": 1, "step": 4, "weights": [1.0, 0.5, -1.0], "bias": 0.0, "loss_milli": 241}


def bad(**change):
    return json.dumps({**GOOD, **change})


@pytest.mark.parametrize(
    "text, names",
    [
        (bad(extra=1), "extra"),
        (bad(step=True), "step"),           # JSON true is not a step number
        (bad(step=4.5), "step"),
        (bad(bias="0.5"), "bias"),
        (bad(step=-1), "step"),
        (bad(weights=[1.0, 2.0]), "weights"),
        ('{"attempt": 1, "step": 4, "weights": [1, 2, 1e400], "bias": 0, "loss_milli": 1}', "weights"),  # inf
        ('{"attempt": 1, "step": 4}', "weights"),
        ('{"attempt": 1, "step": NaN, "weights": [1,2,3], "bias": 0, "loss_milli": 1}', "NaN"),
        ("[1, 2]", "JSON object"),
        ('{"step": 4', "invalid JSON"),
        (b"\xff\xfe", "UTF-8"),
        ("[" * 100_000 + "]" * 100_000, "JSON"),
    ],
)
def test_invalid_checkpoints_are_rejected_with_one_line_naming_the_problem(text, names):
    with pytest.raises(InputError) as err:
        load(text, Checkpoint, where="ckpt.json")
    message = str(err.value)
    assert "ckpt.json" in message and names in message and "\n" not in message


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(st.integers(0, 10**9), st.tuples(finite, finite, finite), finite, st.integers(0, 10**6))
def test_round_trip_is_exact_and_canonical(step, weights, bias, loss):
    ckpt = Checkpoint(attempt=1, step=step, weights=weights, bias=bias, loss_milli=loss)
    text = dumps(ckpt)
    again = load(text, Checkpoint, where="x")
    assert again == ckpt
    assert dumps(again) == text
    assert all(math.copysign(1, a) == math.copysign(1, b) for a, b in zip(again.weights, weights))
