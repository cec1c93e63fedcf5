"""A job's files in an S3 bucket: the ``Backend`` interface by conditional writes (docs/checkpoints.md).

A bucket has no rename, no fsync, no directory and no lock, so each promise a PVC keeps by the
file system is kept here by one conditional PUT, which S3 makes atomic:

- create-if-absent is ``If-None-Match: *`` (412 when the key exists): a checkpoint becomes
  visible by creating its manifest this way, after every shard under its key is uploaded; a
  listing never makes anything count.
- replace is ``If-Match: ETAG`` of the bytes this process last read or wrote (or ``If-None-Match``
  when it saw none): two writers cannot both win; the loser gets PvcBusy (exit 75) instead of
  overwriting. A 409 ConditionalRequestConflict is retried after re-reading, as AWS documents.
- the single-writer lock is a lease object (``.lease``: holder, expiry), taken and renewed by the
  same conditional writes; a live one refuses a second run (PvcBusy), a lapsed one is taken over
  loudly (a line on stderr naming the previous holder).

The client is obstore (Rust's object_store: multipart, parallel, conditional PUTs, the AWS
environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``), imported on first use. Errors are mapped once (``_errors``): a missing bucket,
refused credentials or a store that ignores ``If-None-Match`` are bad input (exit 2, one line); an
unreachable or failing server, after the client's bounded retries, is TryAgainLater (exit 75).

Must not decide anything about what a key means (that is above ``Backend``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ..errors import InputError, PvcBusy, TryAgainLater, importing, missing_extra, one_line
from .backend import SCHEME, ByteSource, Data, Url, Written
from .digest import Sha256Pipe

LEASE_SECONDS = float(os.environ.get("TRAINJOB_LEASE_SECONDS", "30"))  # a holder renews at a third of it
RELEASE_SECONDS = 8.0  # the most letting go of the lease may add to a run's end (``lock``)
PART = 16 << 20  # multipart and ranged-GET part size: large parts, few requests
WINDOW = 4  # ranged GETs in flight while a shard is read (memory: about two windows of parts)
CONFLICT_RETRIES = 5


class Unconformant(InputError):
    """The store answered a conditional create of an existing key with success: it does not
    honour ``If-None-Match``, so no commit protocol can be built on it."""


def _is(exc: BaseException, *names: str) -> bool:
    return type(exc).__name__ in names


@contextmanager
def _errors(where: str, doing: str) -> Iterator[None]:
    """obstore's errors as this tree's: bad input (2) or retryable (75), one line naming ``where``."""
    try:
        yield
    except (InputError, TryAgainLater):
        raise
    except Exception as exc:
        module = type(exc).__module__ or ""
        if not module.startswith("obstore") and not isinstance(exc, (OSError, ValueError)):
            raise
        text = str(exc)
        first = one_line(text.split("\n", 1)[0])[:300]
        if "NoSuchBucket" in text:
            raise InputError(f"{where}: the bucket does not exist; create it first (or fix the URL)") from exc
        if _is(exc, "PermissionDeniedError", "UnauthenticatedError") or "InvalidAccessKeyId" in text \
                or "SignatureDoesNotMatch" in text or "AccessDenied" in text:
            raise InputError(f"{where}: the store refused the credentials ({first}); check AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY and AWS_PROFILE") from exc
        if _is(exc, "UnknownConfigurationKeyError", "InvalidPathError"):
            raise InputError(f"{where}: {doing}: {first}") from exc
        raise TryAgainLater(f"{where}: {doing}: {first} (the store is unreachable or failing; relaunch when "
                            "it answers)") from exc


def _etag(meta: Any) -> str | None:
    return meta.get("e_tag") if isinstance(meta, dict) else getattr(meta, "e_tag", None)


class _Ranged:
    """An object as a ``ByteSource``: a helper thread fetches the next ``WINDOW`` parts by
    parallel ranged GETs while the reader copies out the current ones, so the network, the copy
    and the caller's hashing overlap; at most two windows are held."""

    def __init__(self, backend: S3Backend, key: str) -> None:
        self.name = key.rsplit("/", 1)[-1]
        self.where = backend.where(key)
        with _errors(self.where, "download failed"):
            size = backend.size(key)
        self.size = -1 if size is None else size
        self._parts: queue.Queue[Any] = queue.Queue(maxsize=WINDOW)  # a window queued, the next in flight
        self._view, self._at, self._closed = memoryview(b""), 0, threading.Event()
        self._backend, self._key, self._started = backend, key, False

    def read_at(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from byte ``offset`` by one ranged GET (a slice of a shard, read by
        offset: nothing else of the object is fetched); the count, short at the end."""
        import obstore as obs

        end = min(self.size, offset + len(view))
        if end <= offset:
            return 0
        with _errors(self.where, "download failed"):
            got = memoryview(obs.get_range(self._backend.store, self._key, start=offset, end=end))
        view[:len(got)] = got
        return len(got)

    def _fetch(self, backend: S3Backend, key: str) -> None:
        import obstore as obs

        try:
            for batch in range(0, self.size, PART * WINDOW):
                starts = list(range(batch, min(self.size, batch + PART * WINDOW), PART))
                ends = [min(self.size, start + PART) for start in starts]
                with _errors(self.where, "download failed"):
                    chunks = obs.get_ranges(backend.store, key, starts=starts, ends=ends, coalesce=0)
                for chunk in chunks:
                    if not self._offer(chunk):
                        return
        except BaseException as exc:  # noqa: BLE001 - raised in the reader's thread
            self._offer(exc)

    def _offer(self, item: Any) -> bool:
        """Queue ``item`` for the reader; False once it has closed (never blocks past that)."""
        while not self._closed.is_set():
            try:
                self._parts.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def readinto(self, view: memoryview) -> int:
        if not self._started and self.size > 0:  # read front to back: fetch ahead from here on
            self._started = True
            threading.Thread(target=self._fetch, args=(self._backend, self._key), name="trainjob-s3-get",
                             daemon=True).start()
        if not self._view:
            if self._at >= self.size:
                return 0
            got = self._parts.get()
            if isinstance(got, BaseException):
                raise got
            self._view = memoryview(got)
        n = min(len(view), len(self._view))
        view[:n] = self._view[:n]
        self._view, self._at = self._view[n:], self._at + n
        return n

    def close(self) -> None:
        self._closed.set()


class S3Backend:
    """``s3://BUCKET/PREFIX`` as a PVC: the same keys under the prefix (backend.Backend)."""

    def __init__(self, root: Url) -> None:
        self.root = root
        self.bucket, _, self.prefix = root[len(SCHEME):].partition("/")
        self._store: Any = None
        self._etags: dict[str, str | None] = {}  # what this process last saw of each key (None: absent)
        self._lock = threading.Lock()
        self._lost: BaseException | None = None  # the lease's renewal failed: write nothing more
        self._unanswered = ""  # what a call said after it waited out the request timeout (``_answering``)
        self.request_timeout = float(os.environ.get("TRAINJOB_S3_TIMEOUT", "30"))  # seconds, each request
        try:
            with importing("the S3 client"):  # the first of this module's obstore imports; the rest find it loaded
                import obstore  # noqa: F401
        except ImportError as exc:  # before any method needs it: every command on a bucket says the same
            if (missing := missing_extra(exc, f"{self.root}: an s3:// PVC")) is None:
                raise
            raise missing from exc

    # --- the client ---------------------------------------------------------------------------

    @property
    def store(self) -> Any:
        if self._store is None:
            from obstore.store import S3Store  # there: the backend's constructor looked
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
            options = {"allow_http": True} if endpoint.startswith("http://") else {}
            retry = {"max_retries": int(os.environ.get("TRAINJOB_S3_RETRIES", "3")),
                     "retry_timeout": timedelta(seconds=float(os.environ.get("TRAINJOB_S3_RETRY_SECONDS", "10"))),
                     "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2),
                                 "base": 2}}
            options["timeout"] = timedelta(seconds=self.request_timeout)
            options["connect_timeout"] = timedelta(seconds=5)
            with self._answering(self.root, "cannot configure the S3 client"):
                self._store = S3Store(self.bucket, prefix=self.prefix or None, client_options=options,
                                      retry_config=retry,
                                      **({"virtual_hosted_style_request": False} if endpoint else {}))
        return self._store

    @contextmanager
    def _answering(self, where: str, doing: str) -> Iterator[None]:
        """``_errors`` for a call of this backend, noting a store that stopped answering: a call
        that failed after waiting out the whole request timeout (a hung server, a partition that
        keeps connections open; a refused connection or a 503 fails sooner and is not this). Every
        later call of this backend then fails at once (75), and the lease is let go without
        waiting (``lock``), so a run ends within one request timeout of the store going quiet,
        not one per request still to make (a rotation's delete that failed used to let the run go
        on into the next write, and its timeout)."""
        if self._unanswered:  # one request timeout is all a run spends on a store that stopped answering
            raise TryAgainLater(f"{where}: {doing}: not tried: the store stopped answering earlier in this run "
                                f"({self._unanswered})")
        started = time.monotonic()
        try:
            with _errors(where, doing):
                yield
        except TryAgainLater as exc:
            if not isinstance(exc, PvcBusy) and time.monotonic() - started >= 0.9 * self.request_timeout:
                self._unanswered = str(exc)  # it waited out a whole request timeout: nobody answers
            raise

    def where(self, key: str) -> Url:
        return self.root / key if key else self.root

    # --- Backend -------------------------------------------------------------------------------

    def create_root(self) -> None:
        """Check the bucket before anything is written: it exists, the credentials work, and it
        honours ``If-None-Match`` (a second conditional create of one key must fail)."""
        import obstore as obs

        with self._answering(self.root, "cannot list the bucket"):
            obs.list_with_delimiter(self.store, None)
        probe = f".probe-{uuid.uuid4().hex}"
        with self._answering(self.where(probe), "cannot write"):
            obs.put(self.store, probe, b"1", mode="create")
            try:
                obs.put(self.store, probe, b"2", mode="create")
                honoured = False
            except Exception as exc:
                if not _is(exc, "AlreadyExistsError", "PreconditionError"):
                    raise
                honoured = True
            finally:
                obs.delete(self.store, probe)
        if not honoured:
            raise Unconformant(f"{self.root}: the store overwrote an existing object despite If-None-Match: *; "
                               "trainjob cannot commit safely to it (use a store with conditional writes)")

    def read(self, key: str, limit: int) -> bytes | None:
        import obstore as obs

        with self._answering(self.where(key), "cannot read"):
            try:
                result = obs.get(self.store, key)
            except Exception as exc:
                if _is(exc, "FileNotFoundError", "NotFoundError") and "NoSuchBucket" not in str(exc):
                    self._etags[key] = None
                    return None
                raise
            meta = result.meta
            if meta["size"] > limit:
                raise InputError(f"{self.where(key)}: {meta['size']} bytes, more than the {limit} trainjob reads")
            data = bytes(result.bytes())
        self._etags[key] = _etag(meta)
        return data

    def _head(self, key: str) -> dict[str, Any] | None:
        import obstore as obs

        with self._answering(self.where(key), "cannot read"):
            try:
                return dict(obs.head(self.store, key))
            except Exception as exc:
                if _is(exc, "FileNotFoundError", "NotFoundError") and "NoSuchBucket" not in str(exc):
                    return None
                raise

    def _holding(self, key: str) -> None:
        """Refuse any write once the lease could not be renewed: another run may hold it now."""
        if isinstance(self._lost, PvcBusy):
            raise PvcBusy(f"{self.where(key)}: not written: this run's lease could not be renewed: another "
                          "run took it over (this one stalled past its lease); it holds the PVC now") from self._lost
        if self._lost is not None:
            raise TryAgainLater(f"{self.where(key)}: not written: this run's lease could not be renewed (the store "
                                "is unreachable or failing); relaunch when it answers") from self._lost

    def write(self, key: str, data: Data, durable: bool = True) -> Written:
        """Replace ``key`` by If-Match on the ETag this process last saw (If-None-Match when it saw
        none): a write by anyone else in between makes this one fail (PvcBusy), not win."""
        import obstore as obs

        if not key.startswith(".lease"):
            self._holding(key)
        body = data if isinstance(data, bytes) else b"".join(bytes(c) for c in data)
        if key not in self._etags:
            head = self._head(key)
            self._etags[key] = None if head is None else _etag(head)
        for _ in range(CONFLICT_RETRIES):
            expected = self._etags[key]
            mode: Any = "create" if expected is None else {"e_tag": expected}
            with self._answering(self.where(key), "write failed"):
                try:
                    result = obs.put(self.store, key, body, mode=mode)
                except Exception as exc:
                    if _is(exc, "AlreadyExistsError", "PreconditionError"):
                        raise PvcBusy(f"{self.where(key)}: changed by another writer since this run read it; "
                                      "this run no longer holds the job (relaunch: the lease decides who "
                                      "does)") from exc
                    if "409" in str(exc) or "ConditionalRequestConflict" in str(exc):
                        head = self._head(key)  # re-read, then try again only if nobody else won
                        if (None if head is None else _etag(head)) != expected:
                            raise PvcBusy(f"{self.where(key)}: changed by another writer during a conflicting "
                                          "write; this run no longer holds the job") from exc
                        time.sleep(0.05)
                        continue
                    raise
            self._etags[key] = _etag(result)
            return Written(size=len(body), sha256=hashlib.sha256(body).hexdigest())
        raise TryAgainLater(f"{self.where(key)}: {CONFLICT_RETRIES} conditional writes in a row met a conflict")

    def create(self, key: str, data: bytes) -> Written | None:
        import obstore as obs

        self._holding(key)
        with self._answering(self.where(key), "write failed"):
            try:
                result = obs.put(self.store, key, data, mode="create")
            except Exception as exc:
                if _is(exc, "AlreadyExistsError", "PreconditionError"):
                    return None
                raise
        self._etags[key] = _etag(result)
        return Written(size=len(data), sha256=hashlib.sha256(data).hexdigest())

    def size(self, key: str) -> int | None:
        head = self._head(key)
        return None if head is None else int(head["size"])

    def _all(self, prefix: str) -> list[str]:
        """Every key below ``prefix`` (relative to the root), sorted."""
        import obstore as obs

        with self._answering(self.where(prefix), "cannot list"):
            return sorted(str(o["path"]) for batch in obs.list(self.store, prefix.rstrip("/") + "/" if prefix else None)
                          for o in batch)

    def list(self, prefix: str) -> list[str]:
        # From every key below, not the delimiter listing: some servers (SeaweedFS) keep an empty
        # "directory" as a common prefix after its last object is deleted.
        base = prefix.rstrip("/") + "/" if prefix else ""
        return sorted({key[len(base):].split("/", 1)[0] for key in self._all(prefix)})

    def delete_tree(self, prefix: str, wait: bool = True) -> bool:
        """Delete every key below ``prefix``, the manifest (``manifest.json``) first: "m" sorts
        before "shard-", and a tree without its manifest is unpublished, so a half-deleted
        checkpoint never looks committed."""
        import obstore as obs

        keys = self._all(prefix)
        keys.sort(key=lambda k: (not k.endswith("/manifest.json"), k))
        try:
            with self._answering(self.where(prefix), "cannot delete"):
                for key in keys:
                    obs.delete(self.store, key)
        except TryAgainLater:
            return False  # left for the next start's cleanup
        return True

    def start_deletions(self) -> None:
        """Nothing to start: ``delete_tree`` deletes before it returns on a bucket."""

    def settle(self) -> None:
        """Nothing to wait for: every PUT is durable when it returns."""

    def move(self, src: str, dest: str) -> bool:
        """Copy ``src``'s keys under ``dest`` (the manifest last), then delete ``src``."""
        import obstore as obs

        keys = self._all(src)
        if not keys:
            return False
        keys.sort(key=lambda k: (k.endswith("/manifest.json"), k))
        with self._answering(self.where(src), "cannot set aside"):
            for key in keys:
                obs.copy(self.store, key, dest + key[len(src):])
        return self.delete_tree(src)

    def stage(self, final: str, staging: str) -> str:
        # No rename on a bucket: the parts go under the final key, and only the manifest's
        # conditional create (``publish``) makes it count. What a killed writer left there has no
        # manifest: ``unpublished`` names it and the next start deletes it.
        return final

    def write_part(self, key: str, data: Data, sync: bool = True, parts: list[int] | None = None) -> Written:
        """Upload, hashing each chunk as it goes (never by reading back): up to one PART in one
        PUT, anything larger in parallel parts. Every completed upload is durable: ``sync``
        changes nothing here.

        One PUT when it fits, because a multipart upload that fails is aborted, and the abort is
        a request of its own: against a server that stopped answering it waits out a second
        request timeout (docs/checkpoints.md, "A stalled store")."""
        import obstore as obs

        self._holding(key)
        digest, size = Sha256Pipe(parts=parts), 0

        def hashed() -> Iterator[bytes]:
            nonlocal size
            for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                view = memoryview(chunk).cast("B")
                copy = bytes(view)  # the client holds the buffer past this call
                digest.update(memoryview(copy))
                size += len(copy)
                yield copy

        chunks, head, held = hashed(), [], 0
        for chunk in chunks:  # at most one PART held before deciding
            head.append(chunk)
            held += len(chunk)
            if held > PART:
                break
        with self._answering(self.where(key), "upload failed"):
            if held <= PART:
                obs.put(self.store, key, b"".join(head), use_multipart=False)
            else:
                obs.put(self.store, key, itertools.chain(head, chunks), use_multipart=True, chunk_size=PART,
                        max_concurrency=8)
        sha256 = digest.hexdigest()
        return Written(size=size, sha256=sha256, parts=tuple(digest.parts()))

    def publish(self, staged: str, final: str, marker: str, data: bytes,
                then: tuple[str, bytes] | None = None, others: Callable[[], object] | None = None) -> Written:
        if others is not None:
            others()  # the other ranks' parts: their word that their uploads completed
        written = self.create(f"{final}/{marker}", data)
        if written is None:
            raise InputError(f"{self.where(final)}: already committed; trainjob never overwrites a committed "
                             "checkpoint")
        if then is not None:
            self.write(*then)  # a completed PUT is durable: the pointer follows the manifest's create
        return written

    def _markers(self, prefix: str, marker: str) -> tuple[list[str], set[str]]:
        names, marked = set(), set()
        base = prefix.rstrip("/") + "/"
        for key in self._all(prefix):
            name, _, rest = key[len(base):].partition("/")
            names.add(name)
            if rest == marker:
                marked.add(name)
        return sorted(names), marked

    def published(self, prefix: str, marker: str) -> list[str]:
        names, marked = self._markers(prefix, marker)
        return [n for n in names if n in marked]

    def unpublished(self, prefix: str, marker: str) -> list[str]:
        names, marked = self._markers(prefix, marker)
        return [n for n in names if n not in marked and not n.startswith("rejected-")]

    @contextmanager
    def reading(self, key: str) -> Iterator[ByteSource]:
        """The object, streamed: parallel ranged GETs a window ahead of the reader, each part
        copied once, straight into the reader's arrays (no local copy)."""
        source = _Ranged(self, key)
        try:
            yield source
        finally:
            source.close()

    def free_space(self) -> int | None:
        return None

    # --- the lease -----------------------------------------------------------------------------

    @contextmanager
    def lock(self, rank: int = 0, tidy: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """A lease object, taken and renewed by conditional writes (module docstring). Let go with
        ``tidy()`` true, a lease this holder created is deleted rather than released."""
        key = ".lease" if rank == 0 else f".lease.rank-{rank:05d}"
        me = f"pid {os.getpid()} on {socket.gethostname()} ({uuid.uuid4().hex[:8]})"
        created = self._take(key, me)
        stop = threading.Event()
        lost: list[BaseException] = []

        def renew() -> None:
            while not stop.wait(LEASE_SECONDS / 3):
                try:
                    with self._lock:
                        self._put_lease(key, me, time.time() + LEASE_SECONDS)
                except Exception as exc:  # noqa: BLE001  every later write of this process refuses
                    lost.append(exc)
                    self._lost = exc
                    return

        def release() -> None:
            try:  # released: expiry 0, which the next run takes quietly
                if created and tidy():
                    import obstore as obs

                    with self._answering(self.where(key), "cannot delete"):
                        obs.delete(self.store, key)
                else:
                    self._put_lease(key, me, 0.0)
            except (InputError, TryAgainLater):
                pass  # it lapses by itself

        thread = threading.Thread(target=renew, name="trainjob-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            # Letting go is bounded (RELEASE_SECONDS for both steps): when the store stopped
            # answering (a hung server, a partition that keeps connections open), a renewal in
            # flight or the release would each wait out a whole request timeout after the one
            # that already ended the run. Abandoned, they end with the process (daemon threads),
            # and the lease lapses by itself.
            bound = 0.0 if self._unanswered else RELEASE_SECONDS  # the store already failed a call: no wait
            deadline = time.monotonic() + bound
            stop.set()
            thread.join(bound)
            if not lost and not thread.is_alive() and not self._unanswered:
                releasing = threading.Thread(target=release, name="trainjob-lease-release", daemon=True)
                releasing.start()
                releasing.join(max(0.0, deadline - time.monotonic()))

    def _put_lease(self, key: str, holder: str, expires: float) -> None:
        body = json.dumps({"holder": holder, "expires": expires}).encode() + b"\n"
        self.write(key, body)

    def _take(self, key: str, me: str) -> bool:
        """Take the lease at ``key``: True when there was none (this holder created it)."""
        raw = self.read(key, 1 << 16)
        if raw is not None:
            try:
                lease = json.loads(raw)
                holder, expires = str(lease["holder"]), float(lease["expires"])
            except (ValueError, KeyError, TypeError):
                holder, expires = "unreadable", 1.0
            if expires > time.time():
                raise PvcBusy(f"{self.root}: another trainjob run holds this PVC: {one_line(holder)[:120]} "
                              f"(lease {self.where(key)} renewed until {time.strftime('%H:%M:%SZ', time.gmtime(expires))})"
                              "; relaunch when it has exited")
            if expires > 0:  # lapsed, not released: its holder died or lost the store
                print(f"trainjob: {self.where(key)}: taking over the lapsed lease of {one_line(holder)[:120]} "
                      f"(expired {time.time() - expires:.0f} s ago)", file=sys.stderr, flush=True)
        try:
            self._put_lease(key, me, time.time() + LEASE_SECONDS)
        except PvcBusy as exc:
            raise PvcBusy(f"{self.root}: another trainjob run took the lease at the same moment; relaunch "
                          "when it has exited") from exc
        return raw is None
