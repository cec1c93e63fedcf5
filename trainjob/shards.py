"""One shard file: the safetensors format, streamed out and verified back in.

safetensors (maintained by Hugging Face) is a header of JSON plus raw little-endian tensor bytes:
loading it runs no code, unlike pickled files. Writing is done here rather than with the package's
``save_file`` because the bytes must be hashed as they are written (``pvc.atomic_write`` does
that chunk by chunk) and must never be held twice in memory; ``tests/test_shards.py`` checks the
output is byte-for-byte what ``safetensors.numpy.save`` produces. Reading uses the package's own
parser (``safe_open``), but only after ``hash_file`` has checked the exact bytes against the
manifest.

This module knows nothing about ranks, manifests on disk or the PVC layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
from safetensors import safe_open

from .records import TensorSlice

CHUNK = 8 << 20  # bytes per write/hash call: large enough to release the GIL, small enough to stream
_NP_DTYPE = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
             "I8": "i1", "U8": "u1", "BOOL": "?"}
_CODE = {np.dtype(v): k for k, v in _NP_DTYPE.items()}


def np_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code (little-endian)."""
    return np.dtype(_NP_DTYPE[code])


def dtype_code(array: np.ndarray) -> str:
    try:
        return _CODE[array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype]
    except KeyError:
        raise ValueError(f"dtype {array.dtype} cannot be stored in a shard") from None


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> Iterator[bytes | memoryview]:
    """The safetensors bytes of ``tensors``, as a stream of chunks that views the arrays.

    Layout as the reference implementation writes it: tensors in name order (all of one dtype in
    trainjob's shards), offsets back to back, header JSON padded with spaces to 8 bytes.
    """
    arrays = {name: np.ascontiguousarray(a, dtype=np.dtype(_NP_DTYPE[dtype_code(a)]))
              for name, a in sorted(tensors.items())}
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, a in arrays.items():
        header[name] = {"dtype": dtype_code(a), "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield len(text).to_bytes(8, "little") + text
    for a in arrays.values():
        flat = memoryview(a.reshape(-1)).cast("B") if a.size else memoryview(b"")
        for i in range(0, len(flat), CHUNK):
            yield flat[i:i + CHUNK]


def hash_file(path: Path, size: int, sha256: str) -> str | None:
    """Check the file at ``path`` is a regular file of exactly ``size`` bytes hashing to ``sha256``.

    Returns None when it is, else the reason. Streams in bounded memory; never follows a
    symlink (O_NOFOLLOW), so a shard name cannot lead outside the checkpoint directory.
    Runs in worker threads: ``os.readv``-style reads and ``hashlib`` release the GIL.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return f"{path.name}: missing"
    except OSError as exc:
        return f"{path.name}: cannot open ({exc.strerror}; a symlink is never followed)"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"{path.name}: not a regular file"
        if st.st_size != size:
            return f"{path.name}: {st.st_size} bytes, the manifest says {size}"
        digest, buf = hashlib.sha256(), bytearray(min(CHUNK, max(size, 1)))
        view, seen = memoryview(buf), 0
        while True:
            n = os.readv(fd, [view])
            if n == 0:
                break
            digest.update(view[:n])
            seen += n
        if seen != size:
            return f"{path.name}: changed size while being read"
        if digest.hexdigest() != sha256:
            return f"{path.name}: sha256 {digest.hexdigest()[:12]}... differs from the manifest's {sha256[:12]}..."
        return None
    except OSError as exc:
        return f"{path.name}: read failed ({exc.strerror})"
    finally:
        os.close(fd)


def read(path: Path, holds: Sequence[TensorSlice]) -> dict[str, np.ndarray]:
    """Load a shard whose bytes ``hash_file`` has verified; check its header against ``holds``.

    Raises ValueError naming what disagrees (the caller turns it into a rejection reason).
    """
    try:
        with safe_open(str(path), framework="np") as f:
            names = sorted(f.keys())
            if names != sorted(h.name for h in holds):
                raise ValueError(f"{path.name}: holds tensors {names}, the manifest says "
                                 f"{sorted(h.name for h in holds)}")
            out = {}
            for h in holds:
                a = f.get_tensor(h.name)
                if a.shape != h.shape or dtype_code(a) != h.dtype:
                    raise ValueError(f"{path.name}: tensor {h.name} is {dtype_code(a)}{list(a.shape)}, "
                                     f"the manifest says {h.dtype}{list(h.shape)}")
                out[h.name] = a
            return out
    except ValueError:
        raise
    except Exception as exc:  # the package's own parse errors (SafetensorError) and I/O errors
        raise ValueError(f"{path.name}: not a valid safetensors file ({exc})") from None
