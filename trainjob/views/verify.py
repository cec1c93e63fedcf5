"""``trainjob verify``: check everything on a PVC that has a hash, and say what each item is.

Every entry under ``checkpoints/`` (committed, partial, in flight, set aside), the pointer
``checkpoint.json``, and every artifact against the sha256 the log recorded for it. Read-only:
takes no lock and changes nothing, so it is safe beside a running job (whose in-flight staging
directory it reports as such). The verdict for the exit code: the newest committed checkpoint,
the pointer and every artifact must verify.

``completed_job`` is the narrow version an idempotent relaunch (``run --idempotent``) asks: is
the job over, and does the artifact it published still match the hash its log recorded?
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs

from ..checkpoint import plan
from ..checkpoint.store import REJECTED, TMP, TRASH, CheckpointStore
from ..engine import decisions
from ..engine.job import artifact_names
from ..engine.machine import parse_detail
from ..errors import ArtifactUnverified, InputError
from ..storage.eventlog import EventLog, read_log
from ..checkpoint.plan import MANIFEST, Ref
from ..storage.pvc import Pvc


@attrs.frozen
class Item:
    kind: str      # checkpoint | pointer | artifact
    path: str      # relative to the PVC
    verdict: str   # ok | corrupt | partial | in-flight | set-aside | missing | unlogged | unknown
    detail: str = ""


@attrs.frozen
class Report:
    items: list[Item]
    ok: bool


def verify_pvc(pvc: Pvc, log_path: Path) -> Report:
    if not pvc.root.is_dir():
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
                partial = not (store.path(ref) / MANIFEST).exists()
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

    logged = _logged_artifacts(log_path)
    on_disk = sorted(f"artifacts/{p.name}" for p in pvc.artifacts.iterdir()) if pvc.artifacts.is_dir() else []
    for rel in sorted(set(logged) | set(on_disk)):
        items.append(_check_artifact(pvc, rel, logged.get(rel)))
        ok = ok and items[-1].verdict == "ok"
    return Report(items=items, ok=ok)


def _logged_artifacts(log_path: Path) -> dict[str, str]:
    """Each artifact's path -> the sha256 its ``artifact_written`` event recorded."""
    logged: dict[str, str] = {}
    if log_path.is_file():
        for line in read_log(log_path):
            if line.event is not None and line.event.event == "artifact_written":
                fields = parse_detail("artifact_written", line.event.detail)
                if fields is not None:
                    logged[fields["path"]] = fields["sha256"]
    return logged


def _check_artifact(pvc: Pvc, rel: str, logged_sha256: str | None) -> Item:
    """One artifact against the hash the log recorded for it (None: the log records none)."""
    try:
        raw = pvc.read_bytes(pvc.root / rel) if plan.plain_name(rel.removeprefix("artifacts/")) else None
    except InputError as exc:  # a symlink, unreadable: never followed, reported
        return Item("artifact", rel, "corrupt", str(exc))
    if logged_sha256 is None:
        return Item("artifact", rel, "unlogged", "no artifact_written event in the log records its sha256")
    if raw is None:
        return Item("artifact", rel, "missing", f"the log records sha256={logged_sha256}")
    if hashlib.sha256(raw).hexdigest() != logged_sha256:
        return Item("artifact", rel, "corrupt", f"sha256 differs from the log's {logged_sha256[:12]}...")
    return Item("artifact", rel, "ok", f"sha256={logged_sha256}")


@attrs.frozen
class Completion:
    """A completed job found by a relaunch: the attempt that completed and its verified artifact."""

    attempt: int
    artifact: Item

    def line(self) -> str:
        return (f"already completed (attempt {self.attempt}): {self.artifact.path} verified, "
                f"{self.artifact.detail}; nothing to do")


def completed_job(pvc: Pvc, log_path: Path) -> Completion | None:
    """The job this PVC holds, if it is over (state.json and the log both say ``completed``).

    Raises ArtifactUnverified when it is over but its artifact is missing or fails the hash the
    log recorded: success must not be reported for a model that cannot be trusted. Read-only.
    """
    last = pvc.read_state()
    if not decisions.completion_announced(last.state if last else None,
                                          EventLog(log_path).last_event() == "completed"):
        return None
    assert last is not None  # completion_announced needs a state
    logged = _logged_artifacts(log_path)
    names = [f"artifacts/{name}" for name in artifact_names(last.attempt)]  # json for the lab's model
    rel = next((r for r in names if r in logged), names[0])
    item = _check_artifact(pvc, rel, logged.get(rel))
    if item.verdict != "ok":
        raise ArtifactUnverified(
            f"{pvc.root}: the job completed (attempt {last.attempt}) but {rel} is {item.verdict}: {item.detail}; "
            f"the published model cannot be trusted: run `trainjob verify --pvc {pvc.root}`, then restore "
            "the artifact or start over on a fresh --pvc")
    return Completion(attempt=last.attempt, artifact=item)
