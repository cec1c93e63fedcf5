"""The lab's embedded data set: generation from a seeded LCG, and strict loading.

``generate`` is deterministic: the same bytes on every call and every machine. ``load_dataset``
validates every line (one-line errors naming file and line) and returns the records together
with a SHA-256 over the files, so a resumed attempt can prove it trains on the same data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import attrs

from ..errors import InputError, os_errors, read_regular
from ..records import LinearModel, Sample, dumps, load

N_TRAIN = 40
N_HOLDOUT = 20
BASELINE = LinearModel(weights=(1.0, 0.5, -1.0), bias=0.0)
FILES = ("train.jsonl", "holdout.jsonl", "baseline.json")

_MASK64 = (1 << 64) - 1


def lcg_stream(state: int = 7) -> Iterator[float]:
    """Uniform-ish floats in [-1, 1) from the lab's 64-bit linear congruential generator."""
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) & _MASK64
        yield ((state >> 40) / (1 << 24)) * 2.0 - 1.0


def label(x: tuple[float, float, float]) -> int:
    return int(x[0] + 0.5 * x[1] - x[2] > 0.0)


def generate_files() -> dict[str, bytes]:
    """The three data files, as bytes: 40 training samples, then 20 holdout samples."""
    rng = lcg_stream()
    samples = []
    for _ in range(N_TRAIN + N_HOLDOUT):
        x = (next(rng), next(rng), next(rng))
        samples.append(Sample(x=x, y=label(x)))

    def jsonl(rows: list[Sample]) -> bytes:
        return "".join(dumps(r) + "\n" for r in rows).encode()

    return {
        "train.jsonl": jsonl(samples[:N_TRAIN]),
        "holdout.jsonl": jsonl(samples[N_TRAIN:]),
        "baseline.json": (dumps(BASELINE) + "\n").encode(),
    }


@attrs.frozen
class Dataset:
    train: tuple[Sample, ...]
    holdout: tuple[Sample, ...]
    baseline: LinearModel
    sha256: str  # over the three files, in FILES order


MAX_DATA_FILE = 256 << 20  # the toy data sets are kilobytes; a bound before reading, not a target


def read_data_file(path: Path, gen_flags: str = "") -> bytes:
    """A data file's bytes; a missing one says which ``trainjob gen`` writes it. A symlink is
    followed (a Kubernetes ConfigMap mounts its files as links) but must lead to a regular file of
    at most MAX_DATA_FILE bytes: a FIFO, ``/dev/zero`` or a file too large is refused unread."""
    with os_errors(path, "cannot read", InputError):
        try:
            return read_regular(path, MAX_DATA_FILE, follow=True)
        except FileNotFoundError as exc:
            raise InputError(f"{path}: missing (create it with `trainjob gen {gen_flags}{path.parent}`)") from exc


def files_sha256(raw: Mapping[str, bytes], names: Sequence[str]) -> str:
    """A data set's hash (a trainer's ``data_sha256``): the sha256 of its files' sha256s, in order."""
    return hashlib.sha256(b"".join(hashlib.sha256(raw[name]).digest() for name in names)).hexdigest()


def _samples(path: Path, raw: bytes) -> tuple[Sample, ...]:
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    rows = tuple(load(line, Sample, where=f"{path}:{n}") for n, line in enumerate(lines, 1))
    if not rows:
        raise InputError(f"{path}: holds no samples")
    return rows


def load_dataset(directory: Path | None) -> Dataset:
    """Load and validate the data set in ``directory``; ``None`` means the embedded lab data."""
    if directory is None:
        raw, directory = generate_files(), Path("<embedded>")
    elif not directory.is_dir():
        raise InputError(f"{directory}: data directory not found (create it with `trainjob gen {directory}`)")
    else:
        raw = {name: read_data_file(directory / name) for name in FILES}
    return Dataset(
        train=_samples(directory / "train.jsonl", raw["train.jsonl"]),
        holdout=_samples(directory / "holdout.jsonl", raw["holdout.jsonl"]),
        baseline=load(raw["baseline.json"], LinearModel, where=str(directory / "baseline.json")),
        sha256=files_sha256(raw, FILES),
    )
