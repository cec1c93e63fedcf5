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
