"""``trainjob verify``: check everything on a PVC that has a hash, and say what each item is.

Every entry under ``checkpoints/`` (committed, partial, in flight, set aside), the pointer
``checkpoint.json``, and every artifact against the sha256 the log recorded for it. Read-only:
takes no lock and changes nothing, so it is safe beside a running job (whose in-flight staging
directory it reports as such). The verdict for the exit code: the newest committed checkpoint,
the pointer and every artifact must verify. A PVC holding none of them (an empty directory, a
bucket prefix with nothing under it, a mistyped path) has nothing to verify: that is an
InputError (exit 2) naming where it looked, never "verdict: ok".

Beside a running job the PVC moves while it is read: rotation takes a checkpoint away, the
pointer is replaced, an artifact's log line follows the artifact. A failure that such a move
explains (``moved``: the checkpoint is no longer there, the pointer changed, the log now records
the artifact) is not damage: the pass is made again on what is there now (``retry``), at most
``TRIES`` times, then exit 75 (the job outran every pass). A failure of anything still there and
unchanged is damage, reported at once: committed bytes never change under their name.

Each artifact is checked by ``engine/completion.py``, which an idempotent relaunch asks too.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from ..checkpoint import plan
from ..checkpoint.plan import MANIFEST, Ref
from ..checkpoint.store import REJECTED, CheckpointStore
from ..engine.completion import Item, check_artifact, logged_artifacts
from ..errors import InputError, TryAgainLater
from ..storage.deletion import TMP, TRASH
from ..storage.pvc import MAX_RECORD, Pvc

TRIES = 10  # passes over a PVC that keeps moving under verify, before saying so (exit 75)


@attrs.frozen
class Report:
    items: list[Item]
    ok: bool
    failing: list[Item] = attrs.field(factory=list)  # the items that make ``ok`` false


@attrs.frozen
class View:
    """What a running job changes on a PVC, read around a pass: the pointer's bytes (or why they
    cannot be read), the names of the committed checkpoints, the artifacts the log records."""

    pointer: bytes | str | None
    committed: frozenset[str] = frozenset()
    logged: frozenset[str] = frozenset()


def moved(item: Item, before: View, after: View) -> bool:
    """Whether ``item``'s failure is explained by the PVC moving under the pass (``before`` read
    as it began, ``after`` once it had failed), not by damage: a checkpoint no longer there
    (rotated, or set aside by a resume), a pointer replaced, an artifact the log records by now."""
    if item.kind == "checkpoint":
        return item.path.removeprefix("checkpoints/") not in after.committed
    if item.kind == "pointer":
        return before.pointer != after.pointer
    return item.kind == "artifact" and item.verdict == "unlogged" and item.path in after.logged


def retry(report: Report, before: View, after: View) -> bool:
    """Pass again: the verdict failed, and only because of what moved."""
    return bool(report.failing) and all(moved(item, before, after) for item in report.failing)


def view(pvc: Pvc, store: CheckpointStore | None = None, log_path: Path | None = None) -> View:
    """The pointer's bytes; with ``store`` and ``log_path``, the rest of the View too."""
    try:
        pointer: bytes | str | None = pvc.read_bytes(pvc.checkpoint_path, MAX_RECORD)
    except InputError as exc:
        pointer = str(exc)
    if store is None or log_path is None:
        return View(pointer)
    return View(pointer, frozenset(ref.name for ref in store.committed()), frozenset(logged_artifacts(log_path)))


def verify_pvc(pvc: Pvc, log_path: Path, tries: int = TRIES) -> Report:
    if not pvc.local:
        pvc.backend.list("")  # a missing bucket or refused credentials: one line, exit 2
    elif not pvc.root.is_dir():
        raise InputError(f"{pvc.root}: not a PVC directory")
    store = CheckpointStore(pvc)
    for _ in range(tries):
        before = view(pvc)
        report = verify_once(pvc, store, log_path)
        if report.ok or not retry(report, before, view(pvc, store, log_path)):
            return report
    moving = ", ".join(i.path for i in report.failing)
    raise TryAgainLater(f"{pvc.root}: changed under each of {tries} passes of verify (the running job moved "
                        f"{moving} every time); run it again, or once the job is over")


def verify_once(pvc: Pvc, store: CheckpointStore, log_path: Path) -> Report:
    """One pass over the PVC as it is (see the module's docstring for what may move under it)."""
    items = []
    try:
        pointer, pointer_problem = pvc.read_checkpoint(), ""
    except InputError as exc:
        pointer, pointer_problem = None, str(exc)
    named = pointer.dir.removeprefix("checkpoints/") if pointer else None

    committed = store.committed()
    newest = plan.newest_first(committed, pointer.world_size if pointer else 0)[:1]
    for name in store.entries():
        rel = f"checkpoints/{name}"
        ref = Ref.parse(name)
        if ref is not None:
            verdict = store.verify(ref, pointer.manifest_sha256 if name == named else None)
            if verdict.reason is None:
                m = verdict.manifest
                assert m is not None
                extra = f" resharded_from={m.resharded_from[:12]}..." if m.resharded_from else ""
                items.append(Item("checkpoint", rel, "ok", f"step={m.step} attempt={m.attempt} "
                                  f"world_size={m.world_size} loss_milli={m.loss_milli}{extra}"))
            else:
                partial = pvc.backend.size(store.rel(store.path(ref) / MANIFEST)) is None
                items.append(Item("checkpoint", rel, "partial" if partial else "corrupt", verdict.reason))
        elif name.startswith(TMP):
            items.append(Item("checkpoint", rel, "in-flight", "staging: being written, or abandoned by a "
                              "kill (the next start removes it); never loaded"))
        elif name.startswith(TRASH):
            items.append(Item("checkpoint", rel, "partial", "being deleted by rotation; never loaded"))
        elif name.startswith(REJECTED):
            items.append(Item("checkpoint", rel, "set-aside", "failed verification at a resume; never loaded"))
        else:
            items.append(Item("checkpoint", rel, "unknown", "not a name trainjob writes; ignored"))

    if pointer_problem:
        items.append(Item("pointer", "checkpoint.json", "corrupt", pointer_problem))
    elif pointer is not None:
        if named is not None and Ref.parse(named) in committed:
            good = any(i.path == pointer.dir and i.verdict == "ok" for i in items)
            items.append(Item("pointer", "checkpoint.json", "ok" if good else "corrupt",
                              f"names {pointer.dir} (step {pointer.step})"))
        else:
            items.append(Item("pointer", "checkpoint.json", "missing", f"names {pointer.dir}, which is not there"))

    logged = logged_artifacts(log_path)
    on_disk = sorted(f"artifacts/{name}" for name in pvc.artifact_names())
    for rel in sorted(set(logged) | set(on_disk)):
        items.append(check_artifact(pvc, rel, logged.get(rel)))
    if not items:
        raise InputError(nothing_to_verify(pvc, log_path))
    decisive = {f"checkpoints/{ref.name}" for ref in newest}  # of the checkpoints, only the newest decides
    failing = [i for i in items if i.verdict != "ok" and (i.kind != "checkpoint" or i.path in decisive)]
    return Report(items=items, ok=not failing, failing=failing)


def nothing_to_verify(pvc: Pvc, log_path: Path) -> str:
    """The one line for a PVC without a checkpoint, a pointer or an artifact: where it looked,
    and what it found there instead (so a mistyped prefix or a wrong directory shows as such)."""
    entries = pvc.backend.list("")
    held = f"it holds only {', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}" if entries else "it is empty"
    return (f"{pvc.root}: nothing to verify: no checkpoints/, checkpoint.json or artifacts/ there, and "
            f"{log_path} logs no artifact ({held}); is this the job's --pvc?")
