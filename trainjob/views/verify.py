"""``trainjob verify``: check everything on a PVC that has a hash, and say what each item is.

Every entry under ``checkpoints/`` (committed, partial, in flight, set aside), the pointer
``checkpoint.json``, and every artifact against the sha256 the log recorded for it. Read-only:
takes no lock and changes nothing, so it is safe beside a running job (whose in-flight staging
directory it reports as such). The verdict for the exit code: the newest committed checkpoint,
the pointer and every artifact must verify. A PVC holding none of them (an empty directory, a
bucket prefix with nothing under it, a mistyped path) has nothing to verify: that is an
InputError (exit 2) naming where it looked, never "verdict: ok".

Each artifact is checked by ``engine/completion.py``, which an idempotent relaunch asks too.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from ..checkpoint import plan
from ..checkpoint.plan import MANIFEST, Ref
from ..checkpoint.store import REJECTED, CheckpointStore
from ..engine.completion import Item, check_artifact, logged_artifacts
from ..errors import InputError
from ..storage.deletion import TMP, TRASH
from ..storage.pvc import Pvc


@attrs.frozen
class Report:
    items: list[Item]
    ok: bool


def verify_pvc(pvc: Pvc, log_path: Path) -> Report:
    if not pvc.local:
        pvc.backend.list("")  # a missing bucket or refused credentials: one line, exit 2
    elif not pvc.root.is_dir():
        raise InputError(f"{pvc.root}: not a PVC directory")
    store = CheckpointStore(pvc)
    items, ok = [], True
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
                ok = ok and ref not in newest
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
        ok = False
    elif pointer is not None:
        if named is not None and Ref.parse(named) in committed:
            good = any(i.path == pointer.dir and i.verdict == "ok" for i in items)
            items.append(Item("pointer", "checkpoint.json", "ok" if good else "corrupt",
                              f"names {pointer.dir} (step {pointer.step})"))
            ok = ok and good
        else:
            items.append(Item("pointer", "checkpoint.json", "missing", f"names {pointer.dir}, which is not there"))
            ok = False

    logged = logged_artifacts(log_path)
    on_disk = sorted(f"artifacts/{name}" for name in pvc.artifact_names())
    for rel in sorted(set(logged) | set(on_disk)):
        items.append(check_artifact(pvc, rel, logged.get(rel)))
        ok = ok and items[-1].verdict == "ok"
    if not items:
        raise InputError(nothing_to_verify(pvc, log_path))
    return Report(items=items, ok=ok)


def nothing_to_verify(pvc: Pvc, log_path: Path) -> str:
    """The one line for a PVC without a checkpoint, a pointer or an artifact: where it looked,
    and what it found there instead (so a mistyped prefix or a wrong directory shows as such)."""
    entries = pvc.backend.list("")
    held = f"it holds only {', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}" if entries else "it is empty"
    return (f"{pvc.root}: nothing to verify: no checkpoints/, checkpoint.json or artifacts/ there, and "
            f"{log_path} logs no artifact ({held}); is this the job's --pvc?")
