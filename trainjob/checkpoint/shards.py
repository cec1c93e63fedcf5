"""One shard file: the safetensors format, streamed out and verified back in.

safetensors (maintained by Hugging Face) is a header of JSON plus raw little-endian tensor bytes:
loading it runs no code, unlike pickled files. Writing is done here rather than with the package's
``save_file`` because the bytes must be hashed as they are written (``durable.atomic_write`` does
that chunk by chunk) and must never be held twice in memory; ``tests/checkpoint/test_shards.py`` checks the
output is byte-for-byte what ``safetensors.numpy.save`` produces. Reading is done here too
(``read_verified``, following the format's spec): the bytes go straight from the file into the
caller's arrays and are hashed on the way, so a load reads every byte once, holds the state once,
and uses exactly the bytes it checked. A load by offsets (a rank taking parts of another
sharding's slices) reads a slice through one bounded buffer and copies only those parts
(``_scatter``); ``encode_lazy`` writes a file whose tensors are produced one at a time (a sharded
model's artifact, gathered tensor by tensor).

This module knows nothing about ranks, manifests on disk or the PVC layout.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, TryAgainLater, classify, open_regular
from ..storage.backend import ByteSource
from ..storage.digest import Sha256Pipe
from ..records import ShardEntry, TensorSlice, TensorSpec, once_each
from .plan import slice_bytes, slice_offsets
from ..tensors import dtype_code, np_dtype

CHUNK = 8 << 20  # bytes per write/hash call: large enough to release the GIL, small enough to stream
_MAX_HEADER = 100 << 20  # the safetensors format's own cap on the JSON header

def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (through uint8: the buffer protocol
    knows no bfloat16)."""
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> Iterator[bytes | memoryview]:
    """The safetensors bytes of ``tensors``, as a stream of chunks that views the arrays.

    Layout as the reference implementation writes it: tensors in name order (all of one dtype in
    trainjob's shards), offsets back to back, header JSON padded with spaces to 8 bytes.
    """
    return encode_parts(tensors, metadata)[1]


def encode_parts(tensors: Mapping[str, np.ndarray],
                 metadata: Mapping[str, str]) -> tuple[list[int], Iterator[bytes | memoryview]]:
    """``encode``'s stream, and the byte length of each of its parts (the header, its length
    included, then each tensor in name order): what a shard's digests are taken over."""
    # np.asarray(order="C"), not ascontiguousarray: that gives a 0-d array an axis
    arrays = {name: np.asarray(a, dtype=np_dtype(dtype_code(a)), order="C") for name, a in sorted(tensors.items())}
    head = _header([(name, dtype_code(a), a.shape) for name, a in arrays.items()], metadata)

    def stream() -> Iterator[bytes | memoryview]:
        yield head
        for a in arrays.values():
            yield from _chunks(a)

    return [len(head), *(a.nbytes for a in arrays.values())], stream()


def encode_lazy(specs: Sequence[TensorSpec], produce: Callable[[str], np.ndarray],
                metadata: Mapping[str, str]) -> Iterator[bytes | memoryview]:
    """The same bytes as ``encode`` of the arrays ``produce(name)`` returns, asking for each one
    (in name order) only once the previous one is written: the header needs only ``specs``, so
    at most one tensor is held at a time (a sharded model's artifact, gathered tensor by tensor)."""
    ordered = sorted(specs, key=lambda t: t.name)
    yield _header([(t.name, t.dtype, t.shape) for t in ordered], metadata)
    for t in ordered:
        a = np.asarray(produce(t.name), dtype=np_dtype(t.dtype), order="C")
        if a.shape != tuple(t.shape):
            raise ValueError(f"{t.name}: {list(a.shape)} produced, {list(t.shape)} announced")  # a caller's bug
        yield from _chunks(a)
        del a


def _header(entries: Sequence[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, code, shape in entries:
        nbytes = np_dtype(code).itemsize * math.prod(shape)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _chunks(a: np.ndarray) -> Iterator[memoryview]:
    flat = byte_view(a)
    for i in range(0, len(flat), CHUNK):
        yield flat[i:i + CHUNK]


class _File:
    """A regular file's descriptor as a ``ByteSource``."""

    def __init__(self, name: str, fd: int) -> None:
        self.name, self.fd = name, fd
        try:
            self.size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise

    def readinto(self, view: memoryview) -> int:
        return os.readv(self.fd, [view])

    def read_at(self, view: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [view], offset)

    def close(self) -> None:
        os.close(self.fd)


def _open(path: Path | ByteSource, size: int | None) -> tuple[Any, str | None]:
    """A byte source for ``path`` if it is a regular file (never through a symlink, never
    blocking on a FIFO: ``errors.open_regular``), or ``path`` itself when it is one already
    (a bucket's object); (source, None) or (None, the reason)."""
    if isinstance(path, Path):
        try:
            src: Any = _File(path.name, open_regular(path))
        except FileNotFoundError:
            return None, f"{path.name}: missing"
        except InputError:
            return None, f"{path.name}: not a regular file (a symlink is never followed)"
        except OSError as exc:
            return None, unreadable(path, exc, "cannot open (a symlink is never followed)")
    else:
        src = path
        if src.size < 0:
            return None, f"{src.name}: missing"
    if size is not None and src.size != size:
        actual = src.size
        src.close()
        return None, f"{src.name}: {actual} bytes, the manifest says {size}"
    return src, None


def unreadable(path: Path | ByteSource, exc: OSError, doing: str = "read failed") -> str:
    """The reason a shard that cannot be opened or read gives (it is damaged: a resume sets the
    checkpoint aside); but storage trouble (EIO, ETIMEDOUT, ESTALE...: ``errors.classify``) is
    raised as such, exit 75: a failing disk says nothing of the checkpoint, and nothing good may
    be set aside, nor a resume fall back a step, because a read failed."""
    if (kind := classify(exc, InputError)) is not InputError:
        raise kind(f"{path}: {doing} ({exc.strerror}): storage trouble, not a damaged checkpoint; relaunch once "
                   "the storage answers (nothing was set aside)") from exc
    return f"{path.name}: {doing} ({exc.strerror})"


def _read_exact(src: ByteSource, view: memoryview, digest: Sha256Pipe) -> int:
    """Fill ``view`` from ``src`` chunk by chunk, hashing each chunk while the next is read."""
    done = 0
    while done < len(view):
        part = view[done:done + CHUNK]
        n = src.readinto(part)
        if n == 0:
            break
        digest.update(part[:n])
        done += n
    return done


def hash_file(path: Path | ByteSource, size: int, sha256: str) -> str | None:
    """Check the file at ``path`` (or a bucket's object, streamed) is exactly ``size`` bytes
    hashing to ``sha256``.

    Returns None when it is, else the reason. Streams in bounded memory; never follows a
    symlink (O_NOFOLLOW), so a shard name cannot lead outside the checkpoint directory.
    Runs in worker threads: ``readv`` and ``hashlib`` release the GIL.
    """
    src, reason = _open(path, size)
    if reason:
        return reason
    try:
        digest, bufs = Sha256Pipe(), [bytearray(min(CHUNK, max(size, 1))) for _ in range(2)]
        seen = 0
        while True:  # two buffers in turn: one is hashed while the other is filled
            view = memoryview(bufs[seen // CHUNK % 2])
            n = _read_exact(src, view, digest)
            seen += n
            if n < len(view):
                break
        return _size_and_hash(path, seen, size, digest, sha256)
    except TryAgainLater:  # the store failed mid-stream: no verdict on the shard
        raise
    except OSError as exc:
        return unreadable(path, exc)
    finally:
        src.close()


def _size_and_hash(path: Path | ByteSource, seen: int, size: int, digest: Sha256Pipe, sha256: str) -> str | None:
    if seen != size:
        return f"{path.name}: changed size while being read"
    got = digest.hexdigest()
    if got != sha256:
        return f"{path.name}: sha256 {got[:12]}... differs from the manifest's {sha256[:12]}..."
    return None


def _check_header(name: str, header: object, holds: Sequence[TensorSlice], data_size: int) -> list[TensorSlice]:
    """The holds in file order, once the header says exactly what the manifest says; else ValueError.

    The checks the package's parser makes (offsets back to back from 0 to the end of the file,
    each tensor's byte length matching its dtype and shape), plus agreement with ``holds``.
    """
    if not isinstance(header, dict):
        raise ValueError(f"{name}: not a valid safetensors file (the header is not a JSON object)")
    header = {k: v for k, v in header.items() if k != "__metadata__"}
    names, wanted = sorted(header), sorted(h.name for h in holds)
    if names != wanted:
        raise ValueError(f"{name}: holds tensors {names}, the manifest says {wanted}")
    by_name = {h.name: h for h in holds}
    spans = []
    for key, info in header.items():
        h = by_name[key]
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{name}: not a valid safetensors file (tensor {key}: {info!r})") from None
        if dtype != h.dtype or shape != list(h.shape):
            raise ValueError(f"{name}: tensor {key} is {dtype}{shape}, the manifest says {h.dtype}{list(h.shape)}")
        nbytes = np_dtype(h.dtype).itemsize * math.prod(h.shape)
        if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != nbytes:
            raise ValueError(f"{name}: not a valid safetensors file (tensor {key}: offsets {begin}..{end})")
        spans.append((begin, end, h))
    spans.sort(key=lambda s: (s[0], s[1]))
    edge = 0
    for begin, end, _ in spans:
        if begin != edge:
            raise ValueError(f"{name}: not a valid safetensors file (a gap or overlap at byte {begin})")
        edge = end
    if edge != data_size:
        raise ValueError(f"{name}: not a valid safetensors file (tensors end at {edge}, the data is {data_size} bytes)")
    return [h for _, _, h in spans]


MetaCheck = Callable[[Mapping[str, str]], str | None]  # why a header's metadata is not what it must be, or None


def read_verified(path: Path | ByteSource, holds: Sequence[TensorSlice], dest: Mapping[str, Any] | None,
                  size: int | None = None, sha256: str | None = None,
                  metadata: dict[str, str] | None = None,
                  parts: Sequence[tuple[str, int, str]] | None = None,
                  check_meta: MetaCheck | None = None) -> str | None:
    """Read the shard at ``path`` straight into ``dest`` (one C-contiguous array per hold), hashing
    every byte as it arrives; None when the file is ``size`` bytes hashing to ``sha256`` and its
    header says exactly what ``holds`` says, else the reason.

    One read, no intermediate copy: the bytes checked are the bytes the caller gets (no window
    between a hash pass and a parse pass). ``dest`` holds unverified bytes until this returns
    None; callers discard it otherwise. A hold ``dest`` lacks is hashed and skipped; one it maps
    to a list of ``(index into the hold, destination view)`` is read through a bounded buffer
    and only those parts copied (a load by offsets: a rank takes the parts of another sharding's
    slices that overlap its own). The header is parsed here as data (JSON, size-capped),
    following the safetensors format; nothing in the file can run code. ``parts`` (a schema-2
    shard: ``shard_parts``): the file is hashed in those parts and ``sha256`` is their root.
    ``check_meta``: what the header's metadata must say (``plan.header_problem``), asked before a
    tensor byte is read.
    """
    src, reason = _open(path, size)
    if reason:
        return reason
    try:
        digest = Sha256Pipe(parts=None if parts is None else [n for _, n, _ in parts])
        total = src.size
        head = bytearray(8)
        if _read_exact(src, memoryview(head), digest) != 8:
            raise ValueError(f"{path.name}: not a valid safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        if n > min(total - 8, _MAX_HEADER):
            raise ValueError(f"{path.name}: not a valid safetensors file (header length {n})")
        text = bytearray(n)
        if _read_exact(src, memoryview(text), digest) != n:
            raise ValueError(f"{path.name}: changed size while being read")
        try:
            header = json.loads(text.decode("utf-8"), object_pairs_hook=once_each)
        except RecursionError:  # a header nested deeper than the parser's stack: not a crash
            raise ValueError(f"{path.name}: not a valid safetensors file (header nested too deeply)") from None
        except ValueError as exc:
            raise ValueError(f"{path.name}: not a valid safetensors file ({exc})") from None
        seen = 8 + n
        in_file = _check_header(path.name, header, holds, total - seen)
        meta = _metadata(path.name, header)
        if check_meta is not None and (problem := check_meta(meta)):
            raise ValueError(f"{path.name}: {problem}")
        if metadata is not None:  # handed out as read; the caller uses it only once this returns None
            metadata.update(meta)
        for h in in_file:
            if dest is None:  # verify only: the same checks, the bytes through a bounded buffer
                want = np_dtype(h.dtype).itemsize * math.prod(h.shape)
                got = _skim(src, want, digest)
                seen += got
                if got != want:
                    break
                continue
            out = dest.get(h.name)
            if out is None or isinstance(out, list):  # a part of it, or none: through a bounded buffer
                want = np_dtype(h.dtype).itemsize * math.prod(h.shape)
                got = _skim(src, want, digest) if out is None else _scatter(src, h, out, digest)
                seen += got
                if got != want:
                    break
                continue
            if out.dtype != np_dtype(h.dtype) or out.shape != tuple(h.shape) or not out.flags.c_contiguous:
                raise ValueError(f"{path.name}: nowhere to put tensor {h.name}")  # a caller's bug
            view = byte_view(out)
            got = _read_exact(src, view, digest)
            seen += got
            if got != len(view):
                break
        if src.readinto(memoryview(bytearray(1))):
            seen += 1  # grew while being read
        reason = _size_and_hash(path, seen, total if size is None else size, digest,
                                sha256 if sha256 is not None else digest.hexdigest())
        if reason and parts is not None and seen == (total if size is None else size):
            wrong = next((label for (label, _, want), got in zip(parts, digest.parts()) if got != want), None)
            reason = f"{path.name}: {wrong or 'its part digests'}: sha256 differs from the manifest's"
        return reason
    except TryAgainLater:
        raise
    except OSError as exc:
        return unreadable(path, exc)
    except ValueError as exc:
        return str(exc)
    finally:
        src.close()


def shard_parts(shard: ShardEntry) -> list[tuple[str, int, str]] | None:
    """(schema 2) A shard's parts as ``read_verified`` takes them: (what, bytes, sha256), the
    header first, then each slice in file (name) order; None for a schema-1 shard."""
    if shard.header is None or shard.header_sha256 is None:
        return None
    return [("its header", shard.header, shard.header_sha256),
            *((f"tensor {h.name}", slice_bytes(h), h.sha256 or "") for h in sorted(shard.holds, key=lambda h: h.name))]


class _Window:
    """``size`` bytes of ``src`` from ``offset``, as a ``ByteSource`` read front to back (by
    positional reads: several windows of one open file, in any order)."""

    def __init__(self, src: Any, offset: int, size: int) -> None:
        self.src, self.name, self.at, self.left, self.size = src, src.name, offset, size, size

    def readinto(self, view: memoryview) -> int:
        n = self.src.read_at(view[:self.left], self.at) if self.left else 0
        self.at, self.left = self.at + n, self.left - n
        return n


def read_parts(path: Path | ByteSource, shard: ShardEntry, dest: Mapping[str, Any],
               metadata: dict[str, str] | None = None, check_meta: MetaCheck | None = None) -> str | None:
    """(schema 2 and later) Read the header of ``shard``, checked against ``header_sha256``, against
    the manifest's slices as ``read_verified`` checks it, and against ``check_meta``, then only the
    slices ``dest`` names (as ``read_verified`` takes them: an array, or pieces), by offset, each
    hashed and checked against its digest in the manifest; with ``metadata``, the header's metadata
    handed out. Nothing else of the file is read; None, or the reason."""
    src, reason = _open(path, shard.size)
    if reason:
        return reason
    try:
        assert shard.header is not None
        head = bytearray(shard.header)
        digest = Sha256Pipe()
        if _read_exact(_Window(src, 0, shard.header), memoryview(head), digest) != shard.header:
            return f"{shard.file}: changed size while being read"
        if digest.hexdigest() != shard.header_sha256:
            return f"{shard.file}: its header: sha256 differs from the manifest's"
        n = int.from_bytes(head[:8], "little")
        try:
            header = json.loads(bytes(head[8:8 + n]).decode("utf-8"), object_pairs_hook=once_each)
        except (ValueError, RecursionError):
            return f"{shard.file}: not a valid safetensors file (its header)"
        # The slices' offsets below are the manifest's (name order, back to back): the header
        # must say the same of each, or a slice would be read as another dtype or shape.
        in_file = _check_header(shard.file, header, shard.holds, shard.size - shard.header)
        if [h.name for h in in_file] != sorted(h.name for h in shard.holds):
            return f"{shard.file}: its tensors are not in name order, as trainjob writes them"
        meta = _metadata(shard.file, header)
        if check_meta is not None and (problem := check_meta(meta)):
            return f"{shard.file}: {problem}"
        if metadata is not None:
            metadata.update(meta)
        for h, at in slice_offsets(shard):
            if h.name not in dest:
                continue
            nbytes, out = slice_bytes(h), dest[h.name]
            window = _Window(src, at, nbytes)
            digest = Sha256Pipe()
            if out is None:
                got = _skim(window, nbytes, digest)
            elif isinstance(out, list):
                got = _scatter(window, h, out, digest)
            else:
                if out.dtype != np_dtype(h.dtype) or out.shape != tuple(h.shape) or not out.flags.c_contiguous:
                    raise ValueError(f"{shard.file}: nowhere to put tensor {h.name}")  # a caller's bug
                got = _read_exact(window, byte_view(out), digest)
            if got != nbytes:
                return f"{shard.file}: changed size while being read"
            if digest.hexdigest() != h.sha256:
                return f"{shard.file}: tensor {h.name}: sha256 differs from the manifest's"
        return None
    except TryAgainLater:
        raise
    except OSError as exc:
        return unreadable(path, exc)
    except ValueError as exc:
        return str(exc)
    finally:
        src.close()


def _scatter(src: ByteSource, h: TensorSlice, pieces: Sequence[tuple[tuple[slice, ...], np.ndarray]],
             digest: Sha256Pipe) -> int:
    """Read and hash the slice ``h``'s bytes a block of whole rows at a time (one reused buffer
    of about ``CHUNK`` bytes), copying each piece (``(where in h, destination view)``) as its
    rows go by; the byte count actually read."""
    dtype = np_dtype(h.dtype)
    row = dtype.itemsize * math.prod(h.shape[1:])
    step = max(1, CHUNK // row) if row else max(h.shape[0], 1)
    buf = np.empty((min(step, h.shape[0]), *h.shape[1:]), dtype=dtype)
    done = 0
    for first in range(0, h.shape[0], step):
        rows = buf[:min(step, h.shape[0] - first)]
        view = byte_view(rows)
        n = _read_exact(src, view, digest)
        done += n
        if n < len(view):
            break
        for where, out in pieces:
            lo, hi = max(where[0].start, first), min(where[0].stop, first + len(rows))
            if lo < hi:
                out[lo - where[0].start:hi - where[0].start] = rows[(slice(lo - first, hi - first), *where[1:])]
    return done


def _skim(src: ByteSource, nbytes: int, digest: Sha256Pipe) -> int:
    """Read and hash ``nbytes`` through two chunk-sized buffers in turn (one is hashed while the
    other is filled); the count actually read."""
    bufs = [bytearray(min(CHUNK, nbytes)) for _ in range(2)]
    done = 0
    while done < nbytes:
        view = memoryview(bufs[done // CHUNK % 2])[:nbytes - done]
        n = _read_exact(src, view, digest)
        done += n
        if n < len(view):
            break
    return done


def _metadata(name: str, header: object) -> dict[str, str]:
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{name + ': ' if name else ''}not a valid safetensors file (__metadata__ is not a map "
                         "of strings)")
    return meta


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file held in ``data``; ValueError when it is not one."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= n <= min(len(data) - 8, _MAX_HEADER):
        raise ValueError("not a valid safetensors file (header length)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"), object_pairs_hook=once_each)
    except ValueError as exc:
        raise ValueError(f"not a valid safetensors file ({exc})") from None
    return _metadata("", header).copy()


def read(path: Path, holds: Sequence[TensorSlice]) -> dict[str, np.ndarray]:
    """Load a shard (already verified by ``hash_file``) into new arrays; ValueError naming what is wrong."""
    out = {h.name: np.empty(h.shape, dtype=np_dtype(h.dtype)) for h in holds}
    reason = read_verified(path, holds, out)
    if reason:
        raise ValueError(reason)
    return out
