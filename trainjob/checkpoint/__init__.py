"""Checkpoints: the sharded safetensors checkpoints under ``PVC/checkpoints/``.

Owns the pure plan (how a state splits across ranks, rotation, the newest that verifies, a
reshard's moves: ``plan.py``; which rank's copy of a replicated entry is written, and whether the
ranks' copies agree: ``replicas.py``), the shard file format (``shards.py``) and the store that stages,
commits, verifies, loads and rotates them (``store.py``). Must not know the state machine, the
log or the ranks' protocol, and writes only through ``storage.pvc``. Start with ``store.py``.
"""
