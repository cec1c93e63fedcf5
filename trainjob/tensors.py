"""A training state's tensors as trainjob stores them: dtype codes and specs, at the foundation.

The numpy dtype of each safetensors dtype code (from ``records.DTYPES``, the one table) and back,
and the ``TensorSpec``s that describe a state. Both the trainer checks (``trainers/protocol.py``)
and the shard format (``checkpoint/shards.py``) need them, and trainers may not import the
checkpoint part, so they live here, below both. No I/O: this module only names and describes arrays.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .errors import importing
from .records import DTYPES, TensorSpec

# numpy has no bfloat16: ml_dtypes registers one. Importing it costs most of a second, so it is
# imported only when a BF16 dtype is asked for by its code (an array that already has the dtype
# was made after ml_dtypes was imported, and is recognised by the dtype's name).
_BF16 = "BF16"
_CODE = {np.dtype(v): k for k, v in DTYPES.items() if k != _BF16}


def np_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code (little-endian)."""
    if code == _BF16:
        with importing("bfloat16 support (ml_dtypes)"):
            import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16")
    return np.dtype(DTYPES[code])


def dtype_code(array: np.ndarray) -> str:
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.name == DTYPES[_BF16]:
        return _BF16
    try:
        return _CODE[dtype]
    except KeyError:
        raise ValueError(f"dtype {array.dtype} cannot be stored in a shard") from None


def tensor_specs(tensors: Mapping[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name=n, dtype=dtype_code(a), shape=a.shape) for n, a in sorted(tensors.items()))
