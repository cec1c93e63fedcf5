"""The embedded lab data and the toy model reproduce the lab's numbers exactly."""

import hashlib
from pathlib import Path

import pytest

from trainjob.trainers.data import FILES, files_sha256, generate_files, label, lcg_stream, load_dataset
from trainjob.engine.decisions import loss_milli
from trainjob.errors import InputError
from trainjob.trainers.model import evaluate, train_one_epoch


def test_generation_is_byte_identical_every_time():
    assert generate_files() == generate_files()


def test_sizes_labels_and_disjoint_holdout():
    data = load_dataset(None)
    assert (len(data.train), len(data.holdout)) == (40, 20)
    assert all(s.y == label(s.x) for s in data.train + data.holdout)
    files = generate_files()
    assert not set(files["train.jsonl"].splitlines()) & set(files["holdout.jsonl"].splitlines())


def test_lcg_first_value():
    # state 7 -> 7 * a + c mod 2**64, top 24 bits scaled to [-1, 1)
    state = (7 * 6364136223846793005 + 1442695040888963407) % 2**64
    assert next(lcg_stream()) == (state >> 40) / 2**24 * 2 - 1


def test_lab_training_numbers():
    data = load_dataset(None)
    weights, bias, losses = (0.0, 0.0, 0.0), 0.0, []
    for _ in range(10):
        weights, bias, loss = train_one_epoch(weights, bias, data.train, 0.05)
        losses.append(loss_milli(loss))
    assert losses[1::2] == [310, 241, 228, 226, 225]
    assert str(evaluate(weights, bias, data.holdout)) == "20/20"
    assert str(evaluate(data.baseline.weights, data.baseline.bias, data.holdout)) == "20/20"
    assert str(evaluate((0.0, 0.0, 0.0), 0.0, data.holdout)) == "14/20"


def test_files_on_disk_load_like_the_embedded_data(tmp_path: Path):
    for name, raw in generate_files().items():
        (tmp_path / name).write_bytes(raw)
    assert load_dataset(tmp_path) == load_dataset(None)


@pytest.mark.parametrize(
    "name, content, expect",
    [
        ("train.jsonl", b'{"x":[1,2,3],"y":1}\n{"x":[1,2],"y":1}\n', "train.jsonl:2"),
        ("train.jsonl", b'{"x":[1,2,3],"y":2}\n', "train.jsonl:1"),
        ("holdout.jsonl", b'{"x":[1,2,NaN],"y":1}\n', "holdout.jsonl:1"),
        ("holdout.jsonl", b"", "no samples"),
        ("baseline.json", b'{"weights":[1,0.5,-1],"bias":0,"eta":1}', "eta"),
    ],
)
def test_bad_data_names_the_file_and_line(tmp_path: Path, name, content, expect):
    for fname, raw in generate_files().items():
        (tmp_path / fname).write_bytes(raw)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError, match=expect):
        load_dataset(tmp_path)


def test_missing_file_says_how_to_create_it(tmp_path: Path):
    with pytest.raises(InputError, match="trainjob gen"):
        load_dataset(tmp_path)
    assert set(FILES) == {"train.jsonl", "holdout.jsonl", "baseline.json"}


def test_a_data_sets_hash_is_the_sha256_of_its_files_sha256s_in_order():
    """state.json pins an attempt's data by this hash: a new definition would refuse every resume."""
    raw = generate_files()
    expected = hashlib.sha256(b"".join(hashlib.sha256(raw[name]).digest() for name in FILES)).hexdigest()
    assert load_dataset(None).sha256 == files_sha256(raw, FILES) == expected
    assert files_sha256(raw, FILES[::-1]) != expected
