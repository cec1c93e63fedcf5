"""--async-checkpoint through the engine, in process: the log claims a checkpoint only once its
commit is durable, one write is in flight at most, a writer's I/O error ends the run with exit 75
at a step boundary (never lost, never torn), and a stop lands the write in flight first."""

from __future__ import annotations

import errno
import os
import re
import threading
import time

import pytest

from conftest import events, snapshot, trainjob
from trainjob import cli
from trainjob.storage import durable, eventlog

FLAGS = ["--steps", "10", "--ckpt-every", "2"]
ASYNC = ["--async-checkpoint"]


def on_writer_thread() -> str | None:
    name = threading.current_thread().name
    return name if name.startswith("trainjob-checkpoint-writer") else None


@pytest.fixture
def slow_commits(monkeypatch):
    """Each background commit takes 30 ms, so the loop really runs ahead of the writer."""
    real = durable.commit_dir

    def slow(staging, final, *args):
        if on_writer_thread():
            time.sleep(0.03)
        return real(staging, final, *args)

    monkeypatch.setattr("trainjob.storage.local.commit_dir", slow)


@pytest.fixture
def log_watch(monkeypatch):
    """Each appended event with whether its checkpoint was committed on disk at that instant."""
    seen: list[tuple[str, str, bool, str]] = []
    real = eventlog.EventLog.append

    def append(self, event, detail, fsync=True):
        if event in ("snapshotted", "checkpointed"):
            step = int(detail.split()[0].removeprefix("step="))
            root = self.path.parent / "checkpoints"
            committed = any((d / "manifest.json").exists() for d in root.glob(f"step-{step:08d}-*"))
            seen.append((event, detail, committed, threading.current_thread().name))
        # Only a line that claims nothing on disk may skip its fsync.
        assert fsync or event == "snapshotted", event
        return real(self, event, detail, fsync)

    monkeypatch.setattr(eventlog.EventLog, "append", append)
    return seen


def test_checkpointed_is_logged_only_once_the_commit_is_durable_and_from_the_main_thread(
        tmp_path, slow_commits, log_watch):
    assert cli.main(["run", "--pvc", str(tmp_path / "pvc"), *FLAGS, "--ckpt-every", "1", *ASYNC]) == 0
    assert log_watch, "no checkpoint was logged"
    for event, detail, committed, thread in log_watch:
        assert thread == "MainThread"  # the machine's triggers, and so the log, stay on one thread
        assert committed == (event == "checkpointed"), (event, detail)
    # At most one in flight: every snapshot lands before the next begins, in step order.
    kinds = [event for event, *_ in log_watch]
    assert kinds == ["snapshotted", "checkpointed"] * 10
    assert [d for _, d, *_ in log_watch[::2]] == [d for _, d, *_ in log_watch[1::2]]


def test_the_write_starts_only_once_its_snapshotted_line_is_logged(tmp_path, monkeypatch):
    """The writer's first work is pure Python (header, manifest): started before the line, it held
    the interpreter's lock while the loop appended it (2.4 ms instead of 0.6 with the HF Trainer)."""
    from trainjob.engine.job import Job

    order: list[tuple[str, int]] = []
    real_append, real_write = eventlog.EventLog.append, Job.write_checkpoint

    def append(self, event, detail, fsync=True):
        if event == "snapshotted":
            time.sleep(0.05)  # room for a writer already started to begin first
            order.append(("line", int(detail.split()[0].removeprefix("step="))))
        return real_append(self, event, detail, fsync)

    def write_checkpoint(self, step, *args):
        order.append(("write", step))
        return real_write(self, step, *args)

    monkeypatch.setattr(eventlog.EventLog, "append", append)
    monkeypatch.setattr(Job, "write_checkpoint", write_checkpoint)
    assert cli.main(["run", "--pvc", str(tmp_path / "pvc"), *FLAGS, *ASYNC]) == 0
    assert order == [(kind, step) for step in (2, 4, 6, 8, 10) for kind in ("line", "write")]


def test_an_async_run_publishes_the_synchronous_runs_bytes(tmp_path, slow_commits):
    assert cli.main(["run", "--pvc", str(tmp_path / "sync"), *FLAGS]) == 0
    assert cli.main(["run", "--pvc", str(tmp_path / "async"), *FLAGS, *ASYNC]) == 0
    assert snapshot(tmp_path / "sync" / "artifacts") == snapshot(tmp_path / "async" / "artifacts")
    sync, asynchronous = (events(tmp_path / p / "log.jsonl") for p in ("sync", "async"))
    assert [e for e in asynchronous if e[0] != "snapshotted"] == sync  # the same story, parted and met


@pytest.mark.parametrize("code, text", [(errno.ENOSPC, "No space left on device"), (errno.EIO, "Input/output error")])
def test_a_writer_io_error_ends_the_run_with_exit_75_and_its_one_line_error_and_the_previous_checkpoint_stands(
        tmp_path, monkeypatch, capsys, code, text):
    pvc = tmp_path / "pvc"
    assert cli.main(["run", "--pvc", str(tmp_path / "ref"), *FLAGS]) == 0
    capsys.readouterr()
    real = os.fsync

    def failing(fd):  # the second checkpoint's shard (its fsync runs on the fsync pool, into the commit)
        if re.search(r"step-00000004.*\.safetensors$", os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    assert cli.main(["run", "--pvc", str(pvc), *FLAGS, *ASYNC, "--quiet"]) == 75  # the error's line alone
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0] and "shard-00000-of-00001" in err[0], err
    logged = events(pvc / "log.jsonl")
    assert logged[-1] == ("snapshotted", "step=4 loss_milli=241")  # never claimed as checkpointed
    # Published = renamed out of staging (the failed one's manifest may sit in its `.tmp-` directory,
    # written beside the shard's failing fsync, but that directory never counts).
    committed = sorted(p.name for p in (pvc / "checkpoints").iterdir()
                       if not p.name.startswith(".tmp-") and (p / "manifest.json").exists())
    assert committed == ["step-00000002-a0001-w001"]  # the previous checkpoint stands, nothing torn

    monkeypatch.setattr(os, "fsync", real)
    assert cli.main(["run", "--pvc", str(pvc), *FLAGS, *ASYNC]) == 0  # the relaunch resumes from it
    assert ("resumed", "from_step=2") in events(pvc / "log.jsonl")
    assert snapshot(pvc / "artifacts") == snapshot(tmp_path / "ref" / "artifacts")


def test_a_stop_finishes_the_write_in_flight_then_saves_the_step_reached_and_exits_75(tmp_path, monkeypatch):
    pvc, stopped = tmp_path / "pvc", []
    real = durable.commit_dir

    def commit_then_signal(staging, final, *args):
        real(staging, final, *args)
        if on_writer_thread() and not stopped:  # SIGTERM arrives while the first write is in flight
            stopped.append(True)
            time.sleep(0.05)
            os.kill(os.getpid(), 15)

    monkeypatch.setattr("trainjob.storage.local.commit_dir", commit_then_signal)
    # A fresh StopFlag is installed by the CLI: its handler takes the signal on the main thread.
    assert cli.main(["run", "--pvc", str(pvc), "--steps", "100000", "--ckpt-every", "3", *ASYNC]) == 75
    logged = events(pvc / "log.jsonl")
    assert logged[-1][0] == "killed" and logged[-1][1].endswith("signal=SIGTERM")
    at_step = int(logged[-1][1].split()[0].removeprefix("at_step="))
    assert logged[-3:-1] == [("snapshotted", logged[-2][1]), ("checkpointed", logged[-2][1])]
    assert logged[-2][1].startswith(f"step={at_step} ")  # the step reached, saved and landed
    assert ("checkpointed", logged[1][1]) in logged  # the write that was in flight landed too


@pytest.mark.process
@pytest.mark.torchrun
def test_two_ranks_writing_in_the_background_publish_the_one_rank_synchronous_bytes(tmp_path):
    """Rank 0's writer gathers rank 1's receipts while both train on; the result is bit-equal."""
    assert cli.main(["run", "--pvc", str(tmp_path / "ref"), *FLAGS]) == 0
    result = trainjob("run", "--pvc", tmp_path / "pvc", *FLAGS, "--ckpt-every", "1", *ASYNC, "--world-size", "2")
    assert result.returncode == 0, result.stderr
    assert snapshot(tmp_path / "pvc" / "artifacts") == snapshot(tmp_path / "ref" / "artifacts")
    logged = [e for e, _ in events(tmp_path / "pvc" / "log.jsonl")]
    assert logged.count("checkpointed") == logged.count("snapshotted") == 10


def test_the_python_api_takes_the_option_and_logs_the_clis_async_story(tmp_path, slow_commits):
    """trainjob.Run(async_checkpoint=True) around an own loop: the same events, the same bytes."""
    from trainjob import Run
    from trainjob.trainers.linear import make as linear

    assert cli.main(["run", "--pvc", str(tmp_path / "cli"), *FLAGS, *ASYNC]) == 0
    trainer = linear(None, 0.05)
    with Run(tmp_path / "api", state=trainer, steps=10, ckpt_every=2, lr=0.05, data_sha256=trainer.data_sha256,
             artifact_format="json", name="linear", async_checkpoint=True) as run:
        for step in run:
            run.report(trainer.step(step))
        run.gate(holdout=trainer.evaluate(), baseline=trainer.baseline(), export=trainer.export())
    assert run.exit_code == 0
    assert events(tmp_path / "api" / "log.jsonl") == events(tmp_path / "cli" / "log.jsonl")
    assert snapshot(tmp_path / "api" / "artifacts") == snapshot(tmp_path / "cli" / "artifacts")


def test_an_exception_in_the_loop_lets_the_write_in_flight_end_before_the_pvc_lock_goes(tmp_path, monkeypatch):
    """No thread of this process may write to a PVC after its lock is released to another."""
    from trainjob import Run
    from trainjob.storage.pvc import Pvc
    from trainjob.trainers.linear import make as linear

    real, alive_at_unlock = durable.commit_dir, []

    def slow(staging, final, *args):
        time.sleep(0.2)
        return real(staging, final, *args)

    monkeypatch.setattr("trainjob.storage.local.commit_dir", slow)
    real_lock = Pvc.lock

    def lock(self, rank, **tidy):
        held = real_lock(self, rank, **tidy)

        class Watched:
            def __enter__(self):
                return held.__enter__()

            def __exit__(self, *exc):
                alive_at_unlock.extend(t.name for t in threading.enumerate() if on_writer_thread_named(t.name))
                return held.__exit__(*exc)

        return Watched()

    monkeypatch.setattr(Pvc, "lock", lock)
    trainer = linear(None, 0.05)
    with Run(tmp_path / "pvc", state=trainer, steps=10, ckpt_every=2, async_checkpoint=True) as run:
        for step in run:
            run.report(trainer.step(step))
            if step == 3:
                raise RuntimeError("the user's loop broke")
    assert run.exit_code == 70 and alive_at_unlock == []
    committed = sorted(p.name for p in (tmp_path / "pvc" / "checkpoints").iterdir())
    assert committed == ["step-00000002-a0001-w001"]  # the write in flight ended, committed


def on_writer_thread_named(name: str) -> bool:
    return name.startswith("trainjob-checkpoint-writer")
