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


def test_a_read_error_on_the_newest_shard_is_75_and_sets_no_good_checkpoint_aside(tmp_path, monkeypatch, capsys):
    """One EIO while a resume reads the newest checkpoint's shard: storage trouble (75, one line),
    not damage: the checkpoint is not renamed rejected-, the run does not fall back a step, and
    the relaunch once the disk answers resumes from it (issue 54, item 1)."""
    import errno
    import os
    from conftest import snapshot
    from trainjob.checkpoint import shards

    pvc = tmp_path / "pvc"
    assert cli.main(["run", "--pvc", str(pvc), "--die-at", "4"]) == 75
    before = snapshot(pvc / "checkpoints")
    real_open, real_read = shards._File.__init__, shards._File.readinto

    def opened(self, name, fd):
        real_open(self, name, fd)
        self.failing = "step-00000004" in os.readlink(f"/proc/self/fd/{fd}")

    def read(self, view):
        if self.failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_read(self, view)
    monkeypatch.setattr(shards._File, "__init__", opened)
    monkeypatch.setattr(shards._File, "readinto", read)
    capsys.readouterr()
    assert cli.main(["run", "--pvc", str(pvc)]) == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Input/output error" in err[0] and "storage" in err[0], err
    assert snapshot(pvc / "checkpoints") == before  # nothing set aside, nothing rotated
    assert [e for e, _ in events(pvc / "log.jsonl")][-1] == "killed"  # nothing logged: no fallback
    monkeypatch.undo()
    assert cli.main(["run", "--pvc", str(pvc)]) == 0
    assert ("resumed", "from_step=4") in events(pvc / "log.jsonl")


@pytest.mark.process
@pytest.mark.torchrun
@pytest.mark.parametrize(("world", "code"), [(1, "EIO"), (2, "ETIMEDOUT")])
def test_every_shard_read_failing_for_real_is_75_at_any_world_size_and_the_relaunch_resumes(tmp_path, world, code):
    """libfiu fails every readv and preadv of the resumed run (its ranks' too: the preload is
    inherited), with EIO or ETIMEDOUT, as a disk or an NFS server in trouble fails them: the
    launch exits 75 with one line (it exited 2, "no checkpoint verifies": a Job's FailJob for a
    passing fault), the PVC's checkpoints untouched; once the reads succeed it resumes from step 4.
    At W = 2 through the files rank 1, which never got a session, says so in a line of its own
    once --rank-timeout runs out (75 too)."""
    import errno
    import os
    import shutil
    import subprocess
    import sys
    from conftest import snapshot, trainjob
    if not shutil.which("fiu-run"):
        pytest.skip("fiu-run is not installed (apt-get install fiu-utils)")
    pvc, flags = tmp_path / "pvc", ["--world-size", str(world), "--rank-timeout", "4"]
    assert trainjob("run", "--pvc", pvc, *flags, "--die-at", 4).returncode == 75
    before = snapshot(pvc / "checkpoints")
    number = getattr(errno, code)
    faults = [f for call in ("readv", "preadv") for f in ("-c", f"enable name=posix/io/rw/{call},failinfo={number}")]
    failed = subprocess.run(["fiu-run", "-x", *faults, sys.executable, "-m", "trainjob", "run", "--pvc", str(pvc),
                             *flags], capture_output=True, text=True, timeout=120)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 75, failed.stderr
    assert len(lines) == world and "storage trouble" in lines[0] and os.strerror(number) in lines[0], lines
    assert snapshot(pvc / "checkpoints") == before  # nothing set aside, nothing fallen back from
    assert trainjob("run", "--pvc", pvc, *flags).returncode == 0
    assert ("resumed", "from_step=4") in events(pvc / "log.jsonl")
