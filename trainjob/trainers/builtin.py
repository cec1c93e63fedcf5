"""What the command line can name: the built-in trainers (``--trainer``) and data sets (``gen --dataset``).

A registry only: each data set's files are made beside the trainer that reads them (``data.py``,
``digits.py``). It sits above both, so neither of those imports the other, and it imports neither
numpy nor a trainer, so the command line's parser can list the names without loading them.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from . import data
from ..errors import importing


# ``--trainer NAME``: the factory each name stands for (protocol.build imports it).
BUILTIN = {"linear": "trainjob.trainers.linear:make", "digits": "trainjob.trainers.digits:make"}


@attrs.frozen
class Source:
    """A data set ``trainjob gen --dataset NAME`` writes: its files' bytes, and one line saying what."""

    generate: Callable[[], dict[str, bytes]]
    summary: str


def _digits_files() -> dict[str, bytes]:
    with importing("the digits data set"):
        from .digits import generate_files  # numpy and safetensors, which the lab's data needs neither of
    return generate_files()


DATASETS = {
    "lab": Source(data.generate_files, f"train.jsonl ({data.N_TRAIN}), holdout.jsonl ({data.N_HOLDOUT}), baseline.json"),
    "digits": Source(_digits_files, "train.safetensors (1437), holdout.safetensors (360), "
                                    "baseline.safetensors (a reference model)"),
}
