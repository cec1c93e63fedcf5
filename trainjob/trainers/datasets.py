"""The data sets ``trainjob gen --dataset NAME`` writes, by name: the lab's and scikit-learn's digits.

A registry only: each data set's files are made beside the trainer that reads them (``data.py``,
``digits.py``). It sits above both, so neither of those imports the other.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from . import data, digits


@attrs.frozen
class Source:
    """A data set ``trainjob gen --dataset NAME`` writes: its files' bytes, and one line saying what."""

    generate: Callable[[], dict[str, bytes]]
    summary: str


DATASETS = {
    "lab": Source(data.generate_files, f"train.jsonl ({data.N_TRAIN}), holdout.jsonl ({data.N_HOLDOUT}), baseline.json"),
    "digits": Source(digits.generate_files, "train.safetensors (1437), holdout.safetensors (360), "
                                            "baseline.safetensors (a reference model)"),
}
