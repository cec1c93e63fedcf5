"""Every error trainjob raises on purpose, as one tree, and the one place OS errors become it.

    TrainJobError                 base; raised bare, it is unclassified     -> exit 70
    ├── Refused(ValueError)       the request cannot work; retrying cannot help -> exit 2
    │   ├── UsageError            a flag or argument that cannot work
    │   ├── MissingExtra(ImportError)  an optional package is not installed (names its extra)
    │   ├── ReplicasDisagree      an entry every rank holds differs between ranks (W > 1)
    │   └── InputError            a file trainjob reads is missing or wrong
    │       ├── AlreadyCompleted      the PVC holds a completed job
    │       ├── ArtifactUnverified    a completed job's artifact fails its logged hash
    │       ├── NoVerifiedCheckpoint  checkpoints exist, none verifies
    │       ├── WorldSizeMismatch     newest checkpoint is for another world size
    │       ├── StateMismatch         a sharded checkpoint's tensors are not the live model's
    │       └── PeerRefused           rank 0 ended the launch on such an error
    └── TryAgainLater(OSError)    nothing is wrong with the job; relaunch      -> exit 75
        ├── PvcBusy               another process holds the PVC (rank) lock
        ├── NoSpace               the PVC (or a checkpoint about to be saved) is out of space
        ├── OutOfMemory           host or device memory ran out while loading a checkpoint
        ├── RankTimeout           a bounded wait for another rank ran out
        ├── PeerFailed            the coordinator (rank 0) stopped on error (a bug there: a
        │                         bare TrainJobError, exit 70, as rank 0's own)
        ├── WriteTimeout          a background checkpoint write did not end in its bounded wait
        └── Superseded            a newer launch took over (a rank rejoins it; only escapes
                                  by mistake)

Each class below the root subclasses exactly one exit-code base (``Refused`` or
``TryAgainLater``), and the builtin it resembles, as attrs' errors do, so callers may catch
either. The exit codes are mapped from those bases in one table in ``exits.py``; a test walks
every subclass and checks it has exactly one code.

Honest failures (drift_failed, job_failed) are outcomes of the state machine, not exceptions.

``os_errors`` is the one translation from ``OSError`` to this tree: storage trouble (a full,
read-only or failing disk) is always retryable, anything else is what the caller says it means
there (a bad path the user gave is ``InputError``; a failed write on the PVC is
``TryAgainLater``). The OSError stays chained as the cause.

``missing_extra`` and ``require`` are the one way a missing optional package is said: an
``ImportError`` of one of ``EXTRA_FOR``'s packages becomes ``MissingExtra``, one line naming the
``pip install 'trainjob[EXTRA]'`` that brings it, exit 2 (the CLI and ``Run`` map any such error
raised in what they run; ``require`` raises it where a module of trainjob needs the package).

``importing`` is that translation for a lazy import (the modules a command loads inside its own
function, numpy, torch, an object store's client): a resource or I/O fault while a module loads
(EMFILE, ENOMEM, EIO, as an OSError, or as the cause of the ImportError a package raises over it)
is ``TryAgainLater``, one line, exit 75; a module that is simply not there stays the caller's.

``open_regular`` (and ``read_regular`` on it) is the one way trainjob opens a file it reads or
appends to: the PVC's files, artifacts, logs and data sets. Anything but a regular file (a FIFO,
a socket, a device, a symlink unless asked to follow) is an InputError, found without blocking.
It lives here, at the foundation, because the trainers read their data sets through it too.

``one_line`` is the one escaping function for anything printed that came from a file (an error
quoting a JSON key, a log's event or detail, a directory's name): every command uses it.

This module must not import anything from the rest of the package.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class TrainJobError(Exception):
    """Base of every error trainjob raises deliberately; raised bare it is unclassified (exit 70)."""


class Refused(TrainJobError, ValueError):
    """The request cannot work as given; relaunching the same way cannot help (exit 2)."""


class UsageError(Refused):
    """A command-line argument that cannot work (exit 2)."""


class MissingExtra(Refused, ImportError):
    """An optional package that what was asked needs is not installed (exit 2): the message names
    the ``pip install 'trainjob[EXTRA]'`` that brings it. An ImportError too, so that code which
    tries an import and goes without it still can."""


class ReplicasDisagree(Refused):
    """At W > 1, an entry of the state every rank holds, which nothing marks as one rank's or
    each rank's own, differs between ranks at a checkpoint (checkpoint/replicas.py): written
    from both it would be a mix, so nothing is committed (exit 2). The message names the entry
    and the ranks."""


class InputError(Refused):
    """A file trainjob reads is missing, unreadable or invalid (exit 2).

    The message names the file and, where it can, the field or line.
    """


class AlreadyCompleted(InputError):
    """The PVC already holds a completed job; a new run would overwrite its story."""


class ArtifactUnverified(InputError):
    """The PVC holds a completed job, but its artifact is missing or no longer matches the sha256
    the log recorded: the published model cannot be trusted, and no relaunch can repair it."""


class NoVerifiedCheckpoint(InputError):
    """Checkpoints exist but none verifies: starting over would silently discard them."""


class WorldSizeMismatch(InputError):
    """The newest verified checkpoint was written by another world size; reshard it first."""


class StateMismatch(InputError):
    """A checkpoint's tensors (names, whole shapes, dtypes) are not the live state's: another model
    wrote it. Found before any byte of it is read, so it is refused, never set aside as damaged."""


class PeerRefused(InputError):
    """Rank 0 ended this launch on a usage or input error (a corrupt PVC file, a world-size
    mismatch): every rank exits 2 with it, so no launcher counts the launch as relaunchable."""


class TryAgainLater(TrainJobError, OSError):
    """Nothing is wrong with the job itself; relaunching later is safe (exit 75)."""


class PvcBusy(TryAgainLater):
    """Another ``trainjob`` process holds the PVC's lock (or this rank's lock)."""


class NoSpace(TryAgainLater):
    """The PVC is out of space (or below the size of the next checkpoint); nothing was deleted."""


class OutOfMemory(TryAgainLater):
    """Host or device memory ran out while a checkpoint was read or handed to the state: the
    checkpoint is sound, and the next try (a node with more memory free) may pass."""


class RankTimeout(TryAgainLater):
    """A bounded wait for another rank (through the PVC) ran out."""


class PeerFailed(TryAgainLater):
    """Rank 0 ended this launch with an error; the other ranks stop too."""


class WriteTimeout(TryAgainLater):
    """A background (``--async-checkpoint``) write did not end within its bounded wait; the
    previous checkpoint stands."""


class Superseded(TryAgainLater):
    """A newer launch (generation) started while this rank worked for an older one.

    ``job.follow`` catches it and rejoins the new launch; were it ever to escape, relaunching
    is still the right answer.
    """


# errno -> error class for trouble with the storage itself, whatever the file: the job and its
# input are fine, and the same command can succeed once the disk (or the node) recovers.
# A read-only file system is here too: ext4 remounts read-only after a disk error.
STORAGE_TROUBLE: dict[int, type[TryAgainLater]] = {
    errno.ENOSPC: NoSpace, errno.EDQUOT: NoSpace,
    **dict.fromkeys((errno.EIO, errno.EROFS, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ESTALE,
                     errno.ETIMEDOUT, errno.ENOLCK, errno.EMFILE, errno.ENFILE, errno.ENOMEM,
                     errno.ENOBUFS, errno.EDEADLK), TryAgainLater),
}


def classify(exc: OSError, otherwise: type[TrainJobError]) -> type[TrainJobError]:
    """The class an OSError becomes: storage trouble is retryable, the rest is ``otherwise``."""
    return STORAGE_TROUBLE.get(exc.errno or 0, otherwise)


@contextmanager
def os_errors(where: object, doing: str, otherwise: type[TrainJobError] = TryAgainLater) -> Iterator[None]:
    """Turn an OSError raised inside into this tree's error, as ``WHERE: DOING: STRERROR``.

    ``otherwise`` is what any error that is not storage trouble means at this call site:
    ``InputError`` where the path came from the user (missing, a directory, a name too long),
    ``TryAgainLater`` (the default) for the PVC's own files. Errors of this tree (TryAgainLater
    is an OSError too) pass through untouched.
    """
    try:
        yield
    except TrainJobError:
        raise
    except OSError as exc:
        raise classify(exc, otherwise)(f"{where}: {doing}: {exc.strerror or exc}") from exc


# The optional packages trainjob, or a script it runs, imports: each with the extra of
# pyproject.toml that installs it (torchdata comes with the torch extra, accelerate with hf).
EXTRA_FOR = {"torch": "torch", "torchdata": "torch", "obstore": "s3", "transformers": "hf", "accelerate": "hf",
             "lightning": "lightning", "matplotlib": "plot", "graphviz": "diagrams", "sklearn": "digits"}


def _missing(package: str, extra: str, what: str) -> MissingExtra:
    said = f"{what} needs {package}, which is not installed" if what else f"{package} is not installed"
    error = MissingExtra(f"{said}: pip install 'trainjob[{extra}]'")
    error.name = package
    return error


def missing_extra(exc: BaseException, what: str = "") -> MissingExtra | None:
    """``exc`` as MissingExtra when it is the import of one of ``EXTRA_FOR``'s packages failing
    because the package is not there (a module missing inside an installed package is not: that
    install is broken, not incomplete); ``what`` says what needed it. Else None."""
    if isinstance(exc, MissingExtra):
        return exc
    if not isinstance(exc, ModuleNotFoundError) or exc.name not in EXTRA_FOR:
        return None
    return _missing(exc.name, EXTRA_FOR[exc.name], what)


def require(what: str, extra: str, *packages: str) -> None:
    """At the top of a module of trainjob that cannot work without ``packages`` (an integration,
    the torch adapter): MissingExtra naming ``extra`` if one is not installed. Looked up, not
    imported (transformers alone takes seconds to import)."""
    import importlib.util

    for package in packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a finder that refuses it, or a stub left in sys.modules
            found = False
        if not found:
            _say_if_uncaught()
            raise _missing(package, extra, what)


def _say_if_uncaught() -> None:
    """A script's own ``import`` of an integration raises MissingExtra before trainjob runs
    anything, so nothing else can give it trainjob's exit code: if it is never caught (a script may
    try the import and go without: it stays an ImportError), Python's handler of uncaught exceptions
    ends the process with one line and exit 2, not a traceback and exit 1. Installed once, in front of
    the handler there is; any other exception goes on to that one."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "_trainjob_extra", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: object) -> None:
        if isinstance(exc, MissingExtra):
            print(f"trainjob: {exc} (exit 2)", file=sys.stderr)
            sys.stderr.flush()
            os._exit(2)  # EXIT_USAGE (exits.py imports this module)
        previous(kind, exc, tb)  # type: ignore[arg-type]

    hook._trainjob_extra = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _os_fault(exc: BaseException) -> OSError | None:
    """The OSError an ImportError was raised over (its cause or context, a few links deep), if any:
    numpy, for one, turns a failed submodule import into an ImportError of its own."""
    seen: BaseException | None = exc
    for _ in range(8):
        seen = seen.__cause__ or seen.__context__ if seen is not None else None
        if seen is None or isinstance(seen, OSError):
            return seen
    return None


@contextmanager
def importing(what: str) -> Iterator[None]:
    """Around a lazy import of ``what`` (``with importing("the run command"): from .engine...``):
    an OSError, or an ImportError over one, becomes this tree's error through ``classify``, as
    ``WHAT: cannot load MODULE FILE: STRERROR``; a MemoryError is TryAgainLater too. Both are
    faults of the node (too many open files, a failing disk, memory), never of the job, so
    ``otherwise`` is TryAgainLater: nothing a user gave is being read. Any other ImportError (a
    module that is not installed) passes through untouched, for the caller to name."""
    try:
        yield
    except TrainJobError:
        raise
    except MemoryError as exc:
        raise TryAgainLater(f"{what}: cannot load it: out of memory; relaunch where more is free") from exc
    except (OSError, ImportError) as exc:
        fault = exc if isinstance(exc, OSError) else _os_fault(exc)
        if fault is None:
            raise
        module = f" {exc.name}" if isinstance(exc, ImportError) and exc.name else ""
        file = f" ({fault.filename})" if fault.filename else ""
        raise classify(fault, TryAgainLater)(f"{what}: cannot load{module}{file}: {fault.strerror or fault}; "
                                             "a fault of this node, not of the job: relaunch") from exc


def is_out_of_memory(exc: BaseException) -> bool:
    """A host ``MemoryError``, or torch's out-of-memory error (CUDA and other devices;
    ``torch.cuda.OutOfMemoryError`` is the same class). torch is looked up, never imported."""
    torch = sys.modules.get("torch")
    device_oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(exc, MemoryError) or (isinstance(device_oom, type) and isinstance(exc, device_oom))


@contextmanager
def memory_errors(doing: str) -> Iterator[None]:
    """Turn an out-of-memory raised inside into OutOfMemory (exit 75), as ``DOING: out of memory
    (KIND: FIRST LINE)``; every other error passes through untouched."""
    try:
        yield
    except TrainJobError:
        raise
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise OutOfMemory(f"{doing}: out of memory ({type(exc).__name__}{': ' if first else ''}{first}); "
                          "the checkpoint is not at fault, relaunch where more memory is free") from exc


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(path: Path, flags: int = os.O_RDONLY, *, follow: bool = False, mode: int = 0o644) -> int:
    """Open ``path`` (``flags``: O_RDONLY, or O_WRONLY/O_RDWR with O_APPEND/O_CREAT) if it is a
    regular file, else InputError; never blocks, never follows a symlink unless ``follow``.

    Every file trainjob reads or appends to is opened here. O_NONBLOCK makes the open return at
    once where a plain one would wait forever (a FIFO's reader) or fail at once (ENXIO: a FIFO
    with no reader, a socket); fstat on the descriptor then says what was opened, with no window
    between a check and the open. A device (``/dev/zero`` never ends, ``/dev/null`` drops what is
    written) is not a file either. Raises OSError for everything else, for the caller's
    ``os_errors`` to classify.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow and os.path.islink(path):
            raise InputError(f"{path}: is a symlink; trainjob does not follow links here") from exc
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EISDIR):
            raise InputError(f"{path}: not a regular file ({exc.strerror}); trainjob reads and writes "
                             "regular files only") from exc
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(st_mode)), "not a file")
        raise InputError(f"{path}: is {kind}, not a regular file; trainjob reads and writes regular files only")
    os.set_blocking(fd, True)  # a regular file never blocks anyway; plain reads and writes from here on
    return fd


def read_regular(path: Path, limit: int, *, follow: bool = False) -> bytes:
    """The bytes of the regular file at ``path`` (``open_regular``), refusing (InputError) one
    larger than ``limit`` before reading any of it, and one that grows past it while being read.
    OSError (a missing file included) is the caller's to classify."""
    fd = open_regular(path, follow=follow)
    with open(fd, "rb") as file:
        size = os.fstat(fd).st_size
        data = file.read(size + 1) if size <= limit else b""  # read(n) allocates n bytes at once
    if size > limit:
        raise InputError(f"{path}: {size} bytes, more than the {limit} trainjob reads from such a file")
    if len(data) > size:
        raise InputError(f"{path}: grew while being read; is something else writing it?")
    return data


# Control characters, format characters (bidirectional overrides), line and paragraph separators
# and lone surrogates: what a terminal or an editor would act on instead of showing.
_UNPRINTABLE = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def one_line(text: str) -> str:
    """``text`` with every character a terminal would interpret escaped as Python does (``\\n``,
    ``\\x1b``, ``\\u202e``): text quoted from a hostile file stays one line that cannot forge
    another, move the cursor or recolour the screen."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in _UNPRINTABLE else c for c in text)
