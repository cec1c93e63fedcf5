"""The JSON-lines decision log: durable appends and a streaming, forgiving reader.

Appends are one ``write`` of one complete line on an O_APPEND descriptor, then fsync, so
concurrent readers never see half an event from a live writer. A line torn by a crash (power
loss, a full disk) is skipped and counted by the reader, and the next append starts on a fresh
line, so one torn line never swallows the event after it. JSON encoding escapes newlines and
control characters in a detail: no detail can forge a second line.

The reader streams: memory stays flat however long the log grows. It knows nothing about
which sequences are legal; ``engine/machine.py`` owns that.

On a bucket (``s3://.../log.jsonl``: no append there) the log is ordered segments,
``log.jsonl.d/NNNNNNNN.jsonl``: each writer (a launch, a supervisor) takes the next number by a
conditional create and rewrites its own segment, whole, by a conditional replace at every event,
so an event is durable when its append returns, as on a PVC. ``read_log`` reads the segments in
number order; a segment holds at most SEGMENT_LINES lines before the writer takes the next.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import BinaryIO
from datetime import UTC, datetime
from pathlib import Path

import attrs

from ..errors import InputError, open_regular, os_errors
from ..records import Event, converter, load
from .backend import Url
from .durable import FILE_MODE, refuse_symlink
from .pvc import open_backend

SEGMENT_LINES = 512


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_writable(path: Path) -> None:
    """Fail before anything is created, not at the first announcement, when the log can never be
    written: a directory, a symlink, a device (/dev/null, /dev/full), a FIFO, a file that cannot
    be fsynced. A log that does not exist yet is created by the first append."""
    if isinstance(path, Url):
        return  # the bucket was probed by ``Pvc.create``; a segment is written whole or not at all
    if path.is_dir():
        raise InputError(f"{path}: the log must be a file, but this is a directory")
    refuse_symlink(path)
    if not os.path.lexists(path):
        return
    with os_errors(path, "cannot use as the log", InputError):
        fd = open_regular(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.fsync(fd)  # a log that cannot be made durable breaks the log's one promise
        finally:
            os.close(fd)


class EventLog:
    """Appends events to one log file, each marked with this writer's ``source`` (None: the run)."""

    def __init__(self, path: Path, source: str | None = None) -> None:
        self.path = path
        self.source = source
        self._segments = Segments(path) if isinstance(path, Url) else None

    def append(self, event: str, detail: str, fsync: bool = True) -> Event:
        """Append one line and fsync it. ``fsync=False`` is for an event that claims nothing on
        disk (the engine's ``machine.UNSYNCED``): its line is made durable by the next append's
        fsync, and a power loss before that can drop or tear it, which the reader tolerates."""
        record = Event(ts=utc_now(), event=event, detail=detail, source=self.source)
        line = json.dumps(converter.unstructure(record), separators=(",", ":")) + "\n"
        if self._segments is not None:
            self._segments.append(line)
            return record
        with os_errors(self.path, "cannot append to log"):
            fd = open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, mode=FILE_MODE)
            try:
                if _ends_mid_line(fd):
                    line = "\n" + line
                os.write(fd, line.encode())
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        return record

    def last_event(self) -> str | None:
        """Name of the last valid event from this writer's source, reading only the log's tail
        (logs grow without bound). The run never mistakes a supervisor's line for its own."""
        if self._segments is not None:
            return self._segments.last_event(self.source)
        with os_errors(self.path, "cannot read log", InputError):
            try:
                with open(open_regular(self.path), "rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(0, size - _TAIL))
                    lines = f.read().splitlines()
            except FileNotFoundError:
                return None
        for raw in reversed(lines[1:] if size > _TAIL else lines):  # the first may be cut
            try:
                event = load(raw, Event, where=str(self.path))
            except InputError:
                continue  # a torn line: look further back
            if event.source == self.source:
                return event.event
        return None


_TAIL = 64 * 1024


def _segment_dir(path: Path) -> Path:
    return path.with_name(f"{path.name}.d")


class Segments:
    """A log on a bucket, as ordered segment objects (module docstring); read-only, also a folder
    of them (a bucket prefix synced into a directory)."""

    def __init__(self, path: Path | Url) -> None:
        self.backend = open_backend(path.parent)
        self.prefix = f"{path.name}.d"
        self.key: str | None = None
        self.lines: list[str] = []

    def names(self) -> list[str]:
        return [n for n in self.backend.list(self.prefix) if n.endswith(".jsonl") and n[:-6].isdigit()]

    def append(self, line: str) -> None:
        if self.key is not None and len(self.lines) < SEGMENT_LINES:
            self.lines.append(line)
            self.backend.write(self.key, "".join(self.lines).encode())
            return
        self.lines = [line]
        names = self.names()
        number = int(names[-1][:-6]) + 1 if names else 1
        while self.backend.create(key := f"{self.prefix}/{number:08d}.jsonl", line.encode()) is None:
            number += 1  # another writer took this number first
        self.key = key

    def read(self, name: str) -> bytes:
        return self.backend.read(f"{self.prefix}/{name}", 64 << 20) or b""

    def last_event(self, source: str | None) -> str | None:
        for name in reversed(self.names()):
            for raw in reversed(self.read(name).splitlines()):
                try:
                    event = load(raw, Event, where=name)
                except InputError:
                    continue
                if event.source == source:
                    return event.event
        return None


def log_exists(path: Path) -> bool:
    """Is there a log to read at ``path`` (a file, or a bucket log with a segment)?"""
    if isinstance(path, Url):
        return bool(Segments(path).names()) or Segments(path).backend.size(path.name) is not None
    return path.is_file() or (not os.path.lexists(path) and _segment_dir(path).is_dir())


def _ends_mid_line(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


@attrs.define
class LogLine:
    number: int
    event: Event | None  # None: torn or not an event
    problem: str = ""


MAX_LINE = 64 << 10  # an event line is well under a kilobyte; a longer one is skipped unread
SHOW_SKIPPED = 5  # the skipped lines a reader reports one by one; the rest are counted


def cut(problem: str) -> str:
    """A skipped line's problem, cut short: it may quote a hostile line."""
    return problem if len(problem) <= 300 else problem[:300] + "..."


def more_skipped(count: int) -> list[str]:
    """What a reader says about the skipped lines it does not show one by one."""
    return [f"{count} more line(s) that are not valid events"] if count else []


@attrs.define
class SkippedLines:
    """The lines of a log that are not events, in flat memory: a count and the first few problems,
    so a log of a million garbage lines costs neither memory nor pages of output."""

    count: int = 0
    first: list[str] = attrs.Factory(list)

    def add(self, line: LogLine) -> None:
        self.count += 1
        if len(self.first) < SHOW_SKIPPED:
            self.first.append(f"line {line.number}: {cut(line.problem)}")

    def report(self) -> list[str]:
        return [*self.first, *more_skipped(self.count - len(self.first))]


def _bounded_lines(handle: BinaryIO) -> Iterator[bytes | None]:
    """The file's lines, each read in at most MAX_LINE bytes; None for a longer one, whose bytes
    are passed over in MAX_LINE pieces (never held whole)."""
    while raw := handle.readline(MAX_LINE + 1):
        if len(raw) <= MAX_LINE or raw.endswith(b"\n"):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = handle.readline(MAX_LINE)
        yield None


def read_log(path: Path) -> Iterator[LogLine]:
    """Yield every line of the log; lines that are not valid events carry a problem instead.
    Memory stays flat for any input: lines are read one at a time, each at most MAX_LINE bytes."""
    if isinstance(path, Url) or (not os.path.lexists(path) and _segment_dir(path).is_dir()):
        yield from _read_segments(path)  # a bucket's log, or one synced from a bucket into a folder
        return
    with os_errors(path, "cannot read log", InputError):
        try:
            handle = open(open_regular(path, follow=True), "rb")
        except FileNotFoundError as exc:
            raise InputError(f"{path}: log not found") from exc
    with handle:
        for number, raw in enumerate(_bounded_lines(handle), 1):
            if raw is None:
                yield LogLine(number, None, f"{path}:{number}: longer than {MAX_LINE} bytes; not read")
                continue
            if not raw.strip():
                continue
            try:
                yield LogLine(number, load(raw, Event, where=f"{path}:{number}"))
            except InputError as exc:
                yield LogLine(number, None, str(exc))


def _read_segments(path: Url) -> Iterator[LogLine]:
    """A bucket log's lines, segment after segment in number order, numbered across them."""
    import io

    segments = Segments(path)
    names = segments.names()
    # A PVC directory synced into the bucket brings its log.jsonl as one object: read it first.
    plain = segments.backend.read(path.name, 1 << 30) if isinstance(path, Url) else None
    if not names and plain is None:
        raise InputError(f"{path}: log not found (no segment under {path}.d/)")
    number = 0
    for name, data in [("", plain or b""), *((n, segments.read(n)) for n in names)]:
        for raw in _bounded_lines(io.BytesIO(data)):
            number += 1
            if raw is None:
                yield LogLine(number, None, f"{path}.d/{name}: a line longer than {MAX_LINE} bytes; not read")
            elif raw.strip():
                try:
                    yield LogLine(number, load(raw, Event, where=f"{path}.d/{name}"))
                except InputError as exc:
                    yield LogLine(number, None, str(exc))
