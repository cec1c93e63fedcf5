"""Checkpoints as earlier versions of trainjob wrote them, made from current ones: what the
tests that old checkpoints still load start from."""

from __future__ import annotations

import hashlib

import attrs

from trainjob.records import dumps


def as_schema_1(store, ref) -> None:
    """Rewrite a checkpoint's manifest as trainjob wrote it before shards were hashed in parts:
    schema 1, each shard's sha256 its whole file's, no part digests."""
    manifest, _ = store.read_manifest(ref)
    old = attrs.evolve(manifest, schema=1, shards=[
        attrs.evolve(s, sha256=hashlib.sha256((store.path(ref) / s.file).read_bytes()).hexdigest(), header=None,
                     header_sha256=None, holds=[attrs.evolve(h, sha256=None) for h in s.holds])
        for s in manifest.shards])
    (store.path(ref) / "manifest.json").write_text(dumps(old) + "\n")


def as_schema_2(store, ref) -> None:
    """Rewrite a checkpoint as trainjob wrote it before shard headers said where their slices sit
    (issue 54): each shard's header without ``trainjob.slices``, its parts' digests and root
    recomputed, the manifest schema 2. The tensor bytes stay as they are."""
    import json

    from trainjob.checkpoint.plan import SLICES_KEY
    from trainjob.storage.digest import root
    manifest, _ = store.read_manifest(ref)
    shards = []
    for s in manifest.shards:
        path = store.path(ref) / s.file
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        del header["__metadata__"][SLICES_KEY]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        head = len(text).to_bytes(8, "little") + text
        path.write_bytes(head + data[8 + n:])
        head_sha = hashlib.sha256(head).hexdigest()
        parts = [head_sha, *(h.sha256 for h in sorted(s.holds, key=lambda h: h.name))]
        shards.append(attrs.evolve(s, size=len(head) + len(data) - 8 - n, header=len(head), header_sha256=head_sha,
                                   sha256=root(parts)))
    (store.path(ref) / "manifest.json").write_text(dumps(attrs.evolve(manifest, schema=2, shards=shards)) + "\n")
