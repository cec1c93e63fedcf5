"""The engine's handling of the trainer's state (job.py): a resume reads into the trainer's own arrays."""

from __future__ import annotations

import pytest

from conftest import ROOT, events
from trainjob import cli


def test_a_resume_holds_the_state_once_in_the_arrays_the_trainer_built(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests/helpers"))
    import user_trainers

    pvc, flags = tmp_path / "pvc", ["--trainer", "user_trainers:watched", "--ckpt-every", "1"]
    assert cli.main(["run", "--pvc", str(pvc), *flags, "--die-at", "2"]) == 75
    user_trainers.WATCH["built"].clear()
    user_trainers.WATCH["stepped"].clear()
    user_trainers.WATCH["loaded"].clear()
    assert cli.main(["run", "--pvc", str(pvc), *flags]) == 0
    assert ("resumed", "from_step=2") in events(pvc / "log.jsonl")
    built = user_trainers.WATCH["built"]
    step, params, values = user_trainers.WATCH["stepped"][0]
    assert len(built) == 1 and params is built[0]  # the trainer kept its own array
    assert [a is params for a in user_trainers.WATCH["loaded"]] == [True]  # the shard was read into it
    assert step == 3 and values.any()  # holding the checkpoint's step-2 values, not the zeros it built


def test_building_a_job_reads_nothing_the_explicit_read_step_does(tmp_path):
    from trainjob.engine.job import Job, RunConfig
    from trainjob.errors import InputError
    from trainjob.ranks.peers import PvcCoordinator
    from trainjob.storage.eventlog import EventLog
    from trainjob.storage.pvc import Pvc

    pvc = Pvc(tmp_path / "pvc")
    pvc.create()
    (pvc.root / "state.json").write_text("{not json")  # a corrupt PVC file
    peers = PvcCoordinator(pvc, 1, 1.0, lambda: None)
    job = Job(RunConfig(), pvc, EventLog(pvc.root / "log.jsonl"), "0" * 64, peers)
    assert job.state == "pending" and job.loaded is None  # built without touching the PVC
    with pytest.raises(InputError, match="state.json"):
        job.read()


def test_only_the_coordinator_commits_rotates_or_cleans_up():
    from trainjob.checkpoint.store import CheckpointStore, Committer, ShardWriter

    rank0_only = ("create_staging", "read_receipt", "commit", "rotate", "set_aside", "cleanup", "check_space")
    every_rank = ("write_shard", "write_slices", "write_receipt")
    assert not [m for m in rank0_only + every_rank if hasattr(CheckpointStore, m)]  # verify cannot write
    assert not [m for m in rank0_only if hasattr(ShardWriter, m)]
    assert all(callable(getattr(Committer, m)) for m in rank0_only + every_rank)


def test_a_checkpoint_written_before_part_digests_resumes_to_the_same_artifact(tmp_path):
    """Manifest schema 1 (each shard hashed whole, no part digests) is still read: a run killed
    and relaunched over such a checkpoint publishes the uninterrupted run's bytes."""
    import hashlib
    import json
    from old_formats import as_schema_1
    from trainjob.checkpoint.plan import Ref
    from trainjob.checkpoint.store import CheckpointStore
    from trainjob.storage.pvc import Pvc

    flags = ["--ckpt-every", "2"]
    assert cli.main(["run", "--pvc", str(tmp_path / "ref"), *flags]) == 0
    pvc = tmp_path / "pvc"
    assert cli.main(["run", "--pvc", str(pvc), *flags, "--die-at", "4"]) == 75
    store = CheckpointStore(Pvc(pvc))
    ref = max(store.committed())
    as_schema_1(store, ref)
    pointer = json.loads((pvc / "checkpoint.json").read_text())  # as it named the rewritten manifest
    pointer["manifest_sha256"] = hashlib.sha256((store.path(ref) / "manifest.json").read_bytes()).hexdigest()
    (pvc / "checkpoint.json").write_text(json.dumps(pointer) + "\n")
    assert cli.main(["run", "--pvc", str(pvc), *flags]) == 0
    assert ("resumed", "from_step=4") in events(pvc / "log.jsonl")
    assert ref == Ref(attempt=1, step=4, world_size=1)
    artifact = "artifacts/model-v1.json"
    assert (pvc / artifact).read_bytes() == (tmp_path / "ref" / artifact).read_bytes()
