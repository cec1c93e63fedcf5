"""trainjob.Run around your own loop: the CLI's log, event for event; every misuse ends in a
documented exit code with the attempt resumable; a stop checkpoints and ends 75. In-process: the
loop is this test's own code, as it would be a user's script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import trainjob
from conftest import agrees_with_its_log, events, said, snapshot
from trainjob import Run, Score, cli
from trainjob.trainers.linear import make as linear

@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A run leaves a default SIGTERM ignored (see the SIGTERM test); this process's children
    would inherit that, so each test here puts the handlers back."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


NAME = "linear"  # what `trainjob run` records as the trainer: the own-loop lab must match it byte for byte


def lab(pvc: Path, *, steps: int = 3, die_at: int | None = None, force: tuple[float, float, float] | None = None,
        lr: float = 0.05, backoff_limit: int = 2) -> int:
    """The lab's `trainjob run` written as an own loop around the linear trainer."""
    trainer = linear(None, lr)
    with Run(pvc, state=trainer, steps=steps, ckpt_every=2, lr=lr, data_sha256=trainer.data_sha256, die_at=die_at,
             artifact_format="json", name=NAME, backoff_limit=backoff_limit) as run:
        for step in run:
            run.report(trainer.step(step))
        if run.gate_due:
            if force is not None:
                trainer.force_weights(force)
            run.gate(holdout=trainer.evaluate(), baseline=trainer.baseline(), export=trainer.export())
    return run.exit_code


@pytest.mark.process  # the CLI's walkthrough log (a session fixture) comes from the real command
def test_the_lab_walkthrough_as_an_own_loop_logs_what_the_cli_logs(pvc, walkthrough_log):
    assert lab(pvc, steps=10, die_at=4) == 75
    assert lab(pvc, steps=10) == 0
    assert events(pvc / "log.jsonl") == events(walkthrough_log)  # 310/241/228/226/225, the same artifact sha
    assert [d for e, d in events(pvc / "log.jsonl") if e == "checkpointed"][-1] == "step=10 loss_milli=225"


def test_the_lab_gate_and_retry_budget_as_an_own_loop(pvc):
    assert lab(pvc, force=(0.0, 0.0, 0.0)) == 1  # drift_failed: the forced zeros score 14/20
    assert events(pvc / "log.jsonl")[-1] == ("drift_failed",
                                             "holdout: 14/20 vs baseline 20/20 (max drop 20%); refusing artifact")
    assert [lab(pvc, force=(0.0, 0.0, 0.0), backoff_limit=1) for _ in range(2)] == [1, 1]
    assert events(pvc / "log.jsonl")[-1] == ("job_failed", "attempts=2 backoffLimit=1")


class Vector:
    """A Stateful of one float64 vector: each step pulls it halfway to a target."""

    def __init__(self) -> None:
        self.w = np.zeros(4)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"w": self.w}

    def load_state_dict(self, arrays) -> None:
        self.w[...] = arrays["w"]

    def step(self, step: int) -> float:
        self.w += 0.5 * (np.arange(4.0) * step - self.w)
        return float(np.abs(self.w).sum())


def own(pvc: Path, body, *, steps: int = 4, gate: bool = True, **kw) -> tuple[Run, Vector]:
    """An own loop whose body is ``body(run, state, step)``."""
    state = Vector()
    with Run(pvc, state=state, steps=steps, ckpt_every=2, **kw) as run:
        for step in run:
            body(run, state, step)
        if gate:
            run.gate(holdout=Score(correct=9, total=10), baseline=Score(correct=9, total=10), export=state.state_dict())
    return run, state


def good(run: Run, state: Vector, step: int) -> None:
    run.report(state.step(step))


def test_an_own_loop_completes_with_a_verified_artifact_and_exit_0(pvc):
    run, state = own(pvc, good)
    assert (run.exit_code, run.final) == (0, "completed")
    assert [e for e, _ in events(pvc / "log.jsonl")] == ["job_started", "checkpointed", "checkpointed",
                                                           "artifact_written", "completed"]
    assert cli.main(["verify", "--pvc", str(pvc)]) == 0
    assert cli.main(["status", "--path", str(pvc / "log.jsonl")]) == 0  # a legal path of the table


def told(capsys) -> list[str]:
    """What the run printed on stderr besides its progress lines."""
    return said(capsys.readouterr().err)


def resumes_after(pvc: Path, first_code: int, capsys) -> None:
    """The misuse left the attempt in flight: a correct relaunch resumes it and completes."""
    err = told(capsys)
    assert len(err) == 1 and err[0].startswith("trainjob: ") and f"(exit {first_code})" in err[0], err
    agrees_with_its_log(first_code, pvc)  # the log says so too: `refused`, status 2
    run, state = own(pvc, good)
    assert run.exit_code == 0
    kinds = [e for e, _ in events(pvc / "log.jsonl")]
    assert kinds.count("job_started") == 1 and "resumed" in kinds and kinds[-1] == "completed"
    fresh, clean = own(pvc.parent / "clean", good)
    assert np.array_equal(state.w, clean.w)  # the same bytes as a run that was never misused


def test_a_step_reported_twice_is_exit_2_and_saves_nothing_of_it(pvc, capsys):
    def twice(run, state, step):
        run.report(state.step(step))
        if step == 3:
            run.report(0.0)

    run, _ = own(pvc, twice)
    assert run.exit_code == 2 and "reported twice" not in str(run.error) and "called twice" in str(run.error)
    assert [d.split()[0] for e, d in events(pvc / "log.jsonl") if e == "checkpointed"] == ["step=2"]
    resumes_after(pvc, 2, capsys)


def test_a_step_without_report_is_exit_2(pvc, capsys):
    run, _ = own(pvc, lambda run, state, step: state.step(step) if step == 2 else good(run, state, step))
    assert run.exit_code == 2 and "step 2 ended without run.report" in str(run.error)
    assert [e for e, _ in events(pvc / "log.jsonl")] == ["job_started", "refused"]
    assert events(pvc / "log.jsonl")[-1][1].startswith("at_step=2 reason=step 2 ended without run.report")
    resumes_after(pvc, 2, capsys)


def test_a_break_out_of_the_loop_is_exit_2_never_a_success(pvc, capsys):
    state = Vector()
    with Run(pvc, state=state, steps=4, ckpt_every=2) as run:
        for step in run:
            run.report(state.step(step))
            if step == 3:
                break
        run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1), export={})
    assert run.exit_code == 2 and "gate(...) comes after" in str(run.error)
    assert events(pvc / "log.jsonl")[-1][1].startswith("at_step=3 reason=run.gate(...) comes after")
    assert json.loads((pvc / "checkpoint.json").read_text())["step"] == 2  # in flight, from step 2
    resumes_after(pvc, 2, capsys)


def published(pvc: Path):
    """The artifact's record and its one array."""
    from safetensors.numpy import load

    from trainjob.engine.job import read_artifact_record

    data = (pvc / "artifacts/model-v1.safetensors").read_bytes()
    return read_artifact_record(data, "model-v1"), load(data)["w"]


def test_an_early_end_saves_its_step_and_publishes_the_model_it_stopped_with(pvc, tmp_path):
    """``end_early`` in the body of step 5 of 8: step 5 is saved (not due: forced), the gate
    publishes the model of step 5, its record says step 5, ``completed``, exit 0. Called in the
    body of step 6 before any ``report`` (a framework's loop that ended without training it), the
    run ends at step 5 the same way."""
    def stops_at_5(run, state, step):
        run.report(state.step(step))
        if step == 5:
            run.end_early()

    run, state = own(pvc, stops_at_5, steps=8)
    assert (run.exit_code, run.final) == (0, "completed")
    assert [d.split()[0] for e, d in events(pvc / "log.jsonl") if e == "checkpointed"] == ["step=2", "step=4",
                                                                                           "step=5"]
    assert [e for e, _ in events(pvc / "log.jsonl")][-2:] == ["artifact_written", "completed"]
    record, weights = published(pvc)
    assert record.step == 5 and np.array_equal(weights, state.w)
    assert cli.main(["verify", "--pvc", str(pvc)]) == 0

    def untrained_6(run, state, step):
        if step == 6:
            return run.end_early()
        run.report(state.step(step))

    other = tmp_path / "other"
    run, _ = own(other, untrained_6, steps=8)
    assert run.exit_code == 0 and events(other / "log.jsonl") == events(pvc / "log.jsonl")
    assert (other / "artifacts/model-v1.safetensors").read_bytes() == (pvc / "artifacts/model-v1.safetensors").read_bytes()


def test_an_early_end_cut_short_before_the_gate_ends_early_again_on_the_relaunch(pvc, tmp_path, capsys):
    """Killed (here: left without the gate, exit 2) after the early end's checkpoint: the relaunch
    resumes from step 5 and, its state saying the training ended, calls ``end_early`` before the
    loop: no step is trained, and it publishes the uninterrupted run's bytes."""
    def stops_at_5(run, state, step):
        run.report(state.step(step))
        if step == 5:
            run.end_early()

    assert own(pvc, stops_at_5, steps=8, gate=False)[0].exit_code == 2
    capsys.readouterr()
    first = len(events(pvc / "log.jsonl"))
    state = Vector()
    with Run(pvc, state=state, steps=8, ckpt_every=2) as run:
        run.end_early()
        assert list(run) == []
        run.gate(holdout=Score(correct=9, total=10), baseline=Score(correct=9, total=10), export=state.state_dict())
    assert run.exit_code == 0 and run.from_step == 5
    assert events(pvc / "log.jsonl")[first:][0] == ("resumed", "from_step=5")
    assert [e for e, _ in events(pvc / "log.jsonl")][first:] == ["resumed", "artifact_written", "completed"]
    own(tmp_path / "whole", stops_at_5, steps=8)
    assert (pvc / "artifacts/model-v1.safetensors").read_bytes() == \
        (tmp_path / "whole/artifacts/model-v1.safetensors").read_bytes()


def test_leaving_without_the_gate_is_exit_2_and_the_relaunch_gates(pvc, capsys):
    run, _ = own(pvc, good, gate=False)
    assert run.exit_code == 2 and "gate(...) was never called" in str(run.error)
    assert events(pvc / "log.jsonl")[-1][1].startswith("at_step=4 reason=the loop trained the last step")
    resumes_after(pvc, 2, capsys)


def test_an_export_that_cannot_be_published_is_logged_refused_status_says_2_and_a_mended_relaunch_completes(
        pvc, capsys):
    """Refused at the gate, after every step trained: the log says so (``refused``), so ``status``
    and the exit code agree on 2, and the attempt stays in flight for the mended script."""
    state = Vector()
    with Run(pvc, state=state, steps=4, ckpt_every=2) as run:
        for step in run:
            run.report(state.step(step))
        run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1),
                 export={"w": state.w, "epoch": 3})
    assert run.exit_code == 2 and "no plain values" in str(run.error)
    assert str(run.error).startswith("refused at step 4: export: publish a flat mapping")  # its one line says so
    last, detail = events(pvc / "log.jsonl")[-1]
    assert last == "refused" and detail.startswith("at_step=4 reason=export: publish a flat mapping")
    assert cli.main(["status", str(pvc / "log.jsonl")]) == 2
    assert cli.main(["status", "--path", str(pvc / "log.jsonl")]) == 2  # a legal path, ending in refused
    assert not (pvc / "artifacts").exists() or not any((pvc / "artifacts").iterdir())
    resumes_after(pvc, 2, capsys)
    assert cli.main(["status", "--path", str(pvc / "log.jsonl")]) == 0  # refused, then resumed: legal


@pytest.mark.parametrize("export, says", [
    ({}, "export: an empty mapping, an artifact with nothing in it"),
    ({"": np.ones(2)}, "export: the name '' cannot be stored; a name is 1 to 200 letters"),
    ({"x" * 5000: np.ones(2)}, "export: the name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (5000 characters) cannot"),
    ({"w": np.ones(2, dtype=object)}, "export['w']: dtype object cannot be stored"),
], ids=["empty", "empty-name", "long-name", "object-dtype"])
def test_an_export_with_nothing_or_a_bad_entry_is_refused_in_one_line_naming_it_and_logged(pvc, capsys, export,
                                                                                          says):
    """An empty export published an artifact with nothing in it, exit 0; a name a file cannot
    hold was refused with a dump of the record's attrs validator; an entry that cannot be
    stored was blamed on ``state_dict()``. Each is now one line about the export, exit 2, and
    the log says ``refused``; nothing is published."""
    state = Vector()
    with Run(pvc, state=state, steps=2, ckpt_every=2) as run:
        for step in run:
            run.report(state.step(step))
        run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=0, total=1), export=export)
    assert run.exit_code == 2 and str(run.error).startswith(f"refused at step 2: {says}"), run.error
    err = told(capsys)
    assert len(err) == 1 and "Attribute(" not in err[0] and "state_dict()" not in err[0], err
    kind, detail = events(pvc / "log.jsonl")[-1]
    assert kind == "refused" and detail.startswith(f"at_step=2 reason={says}"), detail
    assert not (pvc / "artifacts").exists() or not any((pvc / "artifacts").iterdir())


def test_more_steps_or_attempts_than_a_checkpoints_name_holds_are_refused_before_the_pvc_is_touched(pvc):
    """Past step 99,999,999 a checkpoint's name no longer parses: its checkpoints were invisible
    (rotation stopped, verify missed the pointer's directory, a relaunch resumed backwards)."""
    run, _ = own(pvc, good, steps=10 ** 8)
    assert run.exit_code == 2 and "--steps must be at most 99999999" in str(run.error)
    run, _ = own(pvc, good, backoff_limit=9999)
    assert run.exit_code == 2 and "--backoff-limit must be at most 9998" in str(run.error)
    assert not pvc.exists()


def metric_gated(pvc: Path, **verdict) -> Run:
    """Two steps of the Vector, gated by ``verdict`` (Run.gate's keywords besides export)."""
    state = Vector()
    with Run(pvc, state=state, steps=2, ckpt_every=2, max_drop=20) as run:
        for step in run:
            run.report(state.step(step))
        run.gate(export=state.state_dict(), **verdict)
    return run


def test_a_metric_gate_publishes_a_loss_within_the_tolerance_and_refuses_one_beyond_it(tmp_path):
    """A validation loss against its frozen value, lower is better, max_drop 20: 0.6 less 20% of
    itself is 0.48, within 0.5 (completed, 0); 0.7 less 20% is 0.56 (drift_failed, 1). The log
    holds the verdict in the Score rule's whole numbers: baseline / loss in millionths."""
    loss = lambda value: trainjob.Metric(value, baseline=0.5, higher_is_better=False, name="val_loss")  # noqa: E731
    published = metric_gated(tmp_path / "published", metric=loss(0.6))
    assert (published.exit_code, events(tmp_path / "published/log.jsonl")[-1]) == (
        0, ("completed", "holdout: 833333/1000000 vs baseline 1000000/1000000"))
    refused = metric_gated(tmp_path / "refused", metric=loss(0.7))
    assert (refused.exit_code, events(tmp_path / "refused/log.jsonl")[-1]) == (
        1, ("drift_failed", "holdout: 714286/1000000 vs baseline 1000000/1000000 (max drop 20%); refusing artifact"))
    accuracy = metric_gated(tmp_path / "accuracy", metric=trainjob.Metric(0.81, baseline=1.0, higher_is_better=True))
    assert accuracy.exit_code == 0  # at least 1.0 less 20% of it


@pytest.mark.parametrize(("verdict", "said"), [
    (dict(metric=trainjob.Metric(float("nan"), baseline=0.5, higher_is_better=False, name="val_loss")),
     "the gate's val_loss: its value is nan; a metric is a finite number from 0"),
    (dict(metric=trainjob.Metric(0.4, baseline=0, higher_is_better=False)), "its baseline is 0"),
    (dict(metric=trainjob.Metric("0.4", baseline=0.5, higher_is_better=False)), "its value is a str, not a number"),
    (dict(metric=trainjob.Metric(0.4, baseline=0.5, higher_is_better=False), holdout=Score(correct=1, total=1)),
     "holdout= and baseline= or metric=, not both"),
    (dict(holdout=Score(correct=1, total=1)), "takes holdout= and baseline=, two trainjob.Score, or metric="),
])
def test_a_metric_the_gate_cannot_judge_is_refused_exit_2_and_resumable(pvc, verdict, said):
    run = metric_gated(pvc, **verdict)
    assert run.exit_code == 2 and said in str(run.error)
    assert events(pvc / "log.jsonl")[-1][0] == "refused"
    assert metric_gated(pvc, metric=trainjob.Metric(0.4, baseline=0.5, higher_is_better=False)).exit_code == 0


def test_gating_before_the_last_step_is_exit_2(pvc, capsys):
    def early(run, state, step):
        good(run, state, step)
        if step == 1:
            run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1), export={})

    run, _ = own(pvc, early)
    assert run.exit_code == 2 and "comes after" in str(run.error)
    resumes_after(pvc, 2, capsys)


def test_an_exception_in_the_body_is_70_with_its_traceback_never_1_and_no_checkpoint_of_its_step(pvc, capsys):
    def boom(run, state, step):
        good(run, state, step)
        if step == 2:
            raise ZeroDivisionError("the user's bug")

    run, _ = own(pvc, boom)
    assert run.exit_code == 70 and isinstance(run.error, ZeroDivisionError)
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: the user's bug" in err
    assert [e for e, _ in events(pvc / "log.jsonl")] == ["job_started"]  # step 2 was never saved
    run, _ = own(pvc, good)
    assert run.exit_code == 0


def test_an_error_after_the_outcome_is_said_and_the_exit_code_stays_the_logged_outcomes(pvc, capsys):
    """The script's own code after ``gate``, inside the ``with``, fails: the job completed and the
    log says so, so the process exits 0 as `status` says (it exited 70 before), and the error is
    printed in full."""
    state = Vector()
    with Run(pvc, state=state, steps=2, ckpt_every=2) as run:
        for step in run:
            run.report(state.step(step))
        run.gate(holdout=Score(correct=9, total=10), baseline=Score(correct=9, total=10), export=state.state_dict())
        raise ZeroDivisionError("the script's own code after the gate")
    assert (run.exit_code, run.final, run.error) == (0, "completed", None)
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: the script's own code after the gate" in err
    lines = err.strip().splitlines()
    assert lines[-2].endswith("after the run's outcome (completed), which stands (exit 0)"), lines
    assert lines[-1].startswith("trainjob: completed (exit 0): published "), lines  # the last line says how it ended
    agrees_with_its_log(run.exit_code, pvc)


def test_a_trainjob_error_in_the_body_keeps_its_code(pvc, capsys):
    def peer_gone(run, state, step):
        raise trainjob.PeerFailed("a peer left")

    run, _ = own(pvc, peer_gone)
    assert run.exit_code == 75
    assert told(capsys) == ["trainjob: a peer left (exit 75)"]


def test_sigterm_in_the_body_saves_that_step_and_ends_killed_75(pvc):
    def preempted(run, state, step):
        good(run, state, step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it: the step finishes

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever an earlier test left
    run, _ = own(pvc, preempted)
    assert run.exit_code == 75
    (saved, at), killed = events(pvc / "log.jsonl")[-2:]
    assert (saved, at.split()[0], killed) == ("checkpointed", "step=3", ("killed", "at_step=3 signal=SIGTERM"))
    # Once the outcome is decided a late SIGTERM must not turn it into a kill (143): the default
    # action becomes "ignore"; a handler of the script's own is put back as it was.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def mine(*_):
        pass

    signal.signal(signal.SIGTERM, mine)
    assert own(pvc.parent / "other", good)[0].exit_code == 0
    assert signal.getsignal(signal.SIGTERM) is mine


def test_bad_settings_and_a_busy_pvc_end_in_exit_codes_not_exceptions(pvc, capsys):
    run, _ = own(pvc, good, steps=0)
    assert run.exit_code == 2 and "--steps must be at least 1" in str(run.error)
    assert not pvc.exists()  # refused before anything was created
    run, _ = own(pvc, good, world_size=2)  # no rank: an own loop needs torchrun (or rank=)
    assert run.exit_code == 2 and "torchrun" in str(run.error)
    with Run(pvc, state=Vector(), steps=2, ckpt_every=2) as holder:
        inner, _ = own(pvc, good)
        assert inner.exit_code == 75 and isinstance(inner.error, trainjob.PvcBusy)
        for step in holder:
            holder.report(0.0)
        holder.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1), export={"w": np.ones(1)})
    assert holder.exit_code == 0


@pytest.mark.parametrize("settings, says", [
    (dict(steps="4"), "steps= must be an integer, got '4'"),
    (dict(steps=4.0), "steps= must be an integer, got 4.0"),
    (dict(steps=True), "steps= must be an integer, got True"),
    (dict(keep=None), "keep= must be an integer, got None"),
    (dict(rank_timeout="60"), "rank_timeout= must be a number, got '60'"),
    (dict(world_size="1"), "world_size= must be an integer, got '1'"),
    (dict(rank=1.0, world_size=2), "rank= must be an integer, got 1.0"),
])
def test_a_setting_of_the_wrong_type_is_exit_2_naming_it(pvc, capsys, settings, says):
    """Not 70: without the check, a str failed a comparison and a numpy scalar the JSON of a record."""
    run, _ = own(pvc, good, **settings)
    assert run.exit_code == 2 and str(run.error) == says, run.error
    assert not pvc.exists()


def test_numpy_scalars_are_settings_like_the_numbers_they_hold(pvc):
    run, _ = own(pvc, good, steps=np.int64(4), keep=np.int32(1), rank_timeout=np.float32(30), lr=np.float64(0.1))
    assert run.exit_code == 0, run.error
    assert events(pvc / "log.jsonl")[0] == ("job_started", "steps=4 attempt=1")


@pytest.mark.parametrize("location, says", [(None, "pvc= must be a directory's path or an s3:// URL, got None"),
                                            (b"pvc", "pvc= must be a directory's path or an s3:// URL, got b'pvc'"),
                                            ("", "an empty path is no storage location")])
def test_a_pvc_that_is_no_location_is_exit_2_and_nothing_is_written(tmp_path, monkeypatch, capsys, location, says):
    monkeypatch.chdir(tmp_path)  # "" would have been the current directory
    run, _ = own(location, good)
    assert run.exit_code == 2 and str(run.error).startswith(says), run.error
    assert list(tmp_path.iterdir()) == []
    run, _ = own(tmp_path / "pvc", good, log=123)
    assert run.exit_code == 2 and str(run.error) == "log= must be a directory's path or an s3:// URL, got 123"


def test_the_current_directory_is_a_pvc_like_any_other(tmp_path, monkeypatch):
    """A root of "." vanishes from the paths joined to it: the keys once lost their first letter."""
    monkeypatch.chdir(tmp_path)
    assert own(".", good)[0].exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "artifacts", "attempts", "checkpoint.json",
                                                          "checkpoints", "log.jsonl", "state.json"]
    assert cli.main(["verify", "--pvc", "."]) == 0


def test_an_idempotent_start_after_completion_is_0_and_trains_nothing(pvc, capsys):
    assert own(pvc, good)[0].exit_code == 0
    log = (pvc / "log.jsonl").read_bytes()
    run, state = own(pvc, lambda *a: pytest.fail("trained a completed job"), idempotent=True)
    assert run.exit_code == 0 and run.completion is not None and (pvc / "log.jsonl").read_bytes() == log
    assert "already completed (attempt 1)" in capsys.readouterr().err
    assert own(pvc, good)[0].exit_code == 2  # without idempotent: the lab's refusal


def test_the_environment_makes_a_run_idempotent_as_a_rendered_pod_sets_it(pvc, capsys, monkeypatch):
    """TRAINJOB_IDEMPOTENT=1 (what `k8s render -- python SCRIPT` sets) does what idempotent=True
    does for a script that never says it; a damaged artifact is still 2; a value that is neither
    1 nor 0 is 2 with the PVC untouched (a typo must not leave a relaunched pod to be refused)."""
    assert own(pvc, good)[0].exit_code == 0
    before = snapshot(pvc)
    monkeypatch.setenv("TRAINJOB_IDEMPOTENT", "1")
    run, _ = own(pvc, lambda *a: pytest.fail("trained a completed job"))
    assert run.exit_code == 0 and run.completion is not None and snapshot(pvc) == before
    assert "already completed (attempt 1)" in capsys.readouterr().err
    monkeypatch.setenv("TRAINJOB_IDEMPOTENT", "0")
    assert own(pvc, good)[0].exit_code == 2  # the lab's refusal, as without it
    for typo in ("yes", "true", " 1"):
        monkeypatch.setenv("TRAINJOB_IDEMPOTENT", typo)
        run, _ = own(pvc, lambda *a: pytest.fail("trained a completed job"))
        assert run.exit_code == 2 and "TRAINJOB_IDEMPOTENT must be 1" in str(run.error)
    assert snapshot(pvc) == before
    artifact = next((pvc / "artifacts").iterdir())
    artifact.write_bytes(artifact.read_bytes()[:-1] + b"?")
    monkeypatch.setenv("TRAINJOB_IDEMPOTENT", "1")
    run, _ = own(pvc, lambda *a: pytest.fail("trained a completed job"))
    assert run.exit_code == 2 and "cannot be trusted" in str(run.error)


def test_an_idempotent_start_clears_what_a_writer_killed_after_completion_left_and_nothing_else(pvc):
    assert own(pvc, good)[0].exit_code == 0
    generation = pvc / "ranks/g00000001"
    generation.mkdir(parents=True)
    (generation / "outcome.json.tmp.4242").write_text("{half")  # rank 0 killed mid-write, after `completed`
    before = {p: p.read_bytes() for p in pvc.rglob("*") if p.is_file() and ".tmp." not in p.name}
    run, _ = own(pvc, lambda *a: pytest.fail("trained a completed job"), idempotent=True)
    assert run.exit_code == 0
    assert not (generation / "outcome.json.tmp.4242").exists()
    assert {p: p.read_bytes() for p in pvc.rglob("*") if p.is_file()} == before


def test_exit_code_before_the_end_is_a_usage_error(pvc):
    with Run(pvc, state=Vector(), steps=2, ckpt_every=1) as run:
        with pytest.raises(trainjob.UsageError, match="known once"):
            run.exit_code
        for step in run:
            run.report(1.0)
        run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1), export={"w": np.ones(1)})
    assert run.exit_code == 0


def test_a_resume_with_another_lr_is_refused(pvc):
    assert own(pvc, good, lr=0.1, die_at=2)[0].exit_code == 75
    run, _ = own(pvc, good, lr=0.2)
    assert run.exit_code == 2 and "--lr 0.1" in str(run.error)


# --- issue 31: every way out of the `with` block is a code of the table ------------------------

def raises_at(step_no: int, exc: BaseException):
    def body(run, state, step):
        good(run, state, step)
        if step == step_no:
            raise exc
    return body


def ended(pvc: Path, body, **kw) -> tuple[int, Run]:
    """The process exit an own loop ends in: what escapes the `with` block (a SystemExit's code),
    else ``run.exit_code`` (what the script passes to sys.exit)."""
    holder: list[Run] = []

    def kept(run, state, step):
        holder[:] = [run]
        body(run, state, step)

    try:
        run, _ = own(pvc, kept, **kw)
    except SystemExit as exc:
        assert holder and exc.code == holder[0].exit_code, (exc.code, holder[0].exit_code)
        return exc.code, holder[0]
    return run.exit_code, run


@pytest.mark.parametrize("exc, code", [
    (SystemExit(0), 75), (SystemExit(None), 75), (SystemExit(1), 75), (SystemExit(3), 75),
    (SystemExit("a message"), 75), (KeyboardInterrupt(), 75), (GeneratorExit(), 70), (BaseException("bare"), 70),
], ids=repr)
def test_a_base_exception_in_the_body_ends_in_a_code_of_the_table_never_0_or_1(pvc, capsys, exc, code):
    got, run = ended(pvc, raises_at(3, exc))
    assert got == code and run.error is exc
    assert [e for e, _ in events(pvc / "log.jsonl")] == ["job_started", "checkpointed"]  # step 3 not saved
    err = capsys.readouterr().err
    assert f"(exit {code})" in err.splitlines()[-1] and "at step 3" in err.splitlines()[-1]
    run, _ = own(pvc, good)  # the attempt stays resumable
    assert run.exit_code == 0 and "resumed" in [e for e, _ in events(pvc / "log.jsonl")]


def test_sys_exit_inside_the_block_after_the_outcome_exits_with_the_outcome(pvc, capsys):
    state = Vector()
    with pytest.raises(SystemExit) as done:
        with Run(pvc, state=state, steps=2, ckpt_every=2) as run:
            for step in run:
                run.report(state.step(step))
            run.gate(holdout=Score(correct=1, total=10), baseline=Score(correct=9, total=10), export=state.state_dict())
            sys.exit(0)  # the script's own idea of success: drift_failed says otherwise
    assert done.value.code == 1 and run.final == "drift_failed"
    state = Vector()
    with pytest.raises(SystemExit) as done:
        with Run(pvc.parent / "ok", state=state, steps=2, ckpt_every=2) as run:
            for step in run:
                run.report(state.step(step))
            run.gate(holdout=Score(correct=9, total=10), baseline=Score(correct=9, total=10), export=state.state_dict())
            sys.exit(run.exit_code)
    assert done.value.code == 0 and run.final == "completed"


class Failing(Vector):
    """A Stateful whose ``method`` raises ``exc`` on its ``after``-th call."""

    def __init__(self, method: str, exc: BaseException, after: int = 0) -> None:
        super().__init__()
        self.method, self.exc, self.calls = method, exc, 0
        self.after = after

    def _maybe(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.calls > self.after:
                raise self.exc

    def state_dict(self):
        self._maybe("state_dict")
        return super().state_dict()

    def load_state_dict(self, arrays) -> None:
        self._maybe("load_state_dict")
        super().load_state_dict(arrays)


def enter_with(pvc: Path, state, **kw) -> tuple[int, Run | None]:
    run = Run(pvc, state=state, steps=4, ckpt_every=2, **kw)
    try:
        with run:
            for step in run:
                run.report(state.step(step))
            run.gate(holdout=Score(correct=9, total=10), baseline=Score(correct=9, total=10), export=state.state_dict())
    except SystemExit as exc:
        return exc.code, run
    return run.exit_code, run


@pytest.mark.parametrize("exc, code", [(SystemExit(0), 75), (KeyboardInterrupt(), 75), (GeneratorExit(), 70)],
                         ids=repr)
def test_a_base_exception_from_load_state_dict_or_state_dict_is_a_code_of_the_table(pvc, capsys, exc, code):
    assert own(pvc, good, die_at=2)[0].exit_code == 75
    before = snapshot(pvc)
    assert enter_with(pvc, Failing("load_state_dict", exc))[0] == code
    assert snapshot(pvc) == before  # refused before any write
    assert enter_with(pvc, Failing("state_dict", exc))[0] == code  # the start's first look
    assert enter_with(pvc, Failing("state_dict", exc, after=1))[0] == code  # at the step-4 checkpoint
    assert own(pvc, good)[0].exit_code == 0


@pytest.mark.parametrize("error", [MemoryError(), "cuda"])
def test_out_of_memory_while_loading_a_checkpoint_is_retryable_75(pvc, capsys, error):
    if error == "cuda":
        torch = pytest.importorskip("torch")
        error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert own(pvc, good, die_at=2)[0].exit_code == 75
    code, run = enter_with(pvc, Failing("load_state_dict", error))
    assert code == 75 and "out of memory" in str(run.error)
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("(exit 75)")
    assert own(pvc, good)[0].exit_code == 0  # the checkpoint was fine


def reporting(value):
    def body(run, state, step):
        state.step(step)
        run.report(value() if callable(value) else value)
    return body


@pytest.mark.parametrize("value, milli", [(1e12, 10**15), (10**12, 10**15), (np.float32(0.5), 500),
                                          (np.array([0.25]), 250), (np.int64(3), 3000)], ids=repr)
def test_an_odd_but_legal_loss_is_recorded_exactly(pvc, value, milli):
    run, _ = own(pvc, reporting(value), steps=2)
    assert run.exit_code == 0
    assert [d for e, d in events(pvc / "log.jsonl") if e == "checkpointed"] == [f"step=2 loss_milli={milli}"]


@pytest.mark.parametrize("value, says", [
    (1e308, "too large"), (1e16, "too large"), (10**30, "too large"), (10**5000, "too large"),
    (np.array([0.5, 0.6]), "2 elements"), (np.array([]), "0 elements"), ("0.5", "not a number"),
    (float("nan"), "not a finite number"),
], ids=["1e308", "1e16", "10**30", "10**5000", "two-elements", "empty", "str", "nan"])
def test_an_odd_and_wrong_loss_is_exit_2_in_one_line_and_logged_refused(pvc, capsys, value, says):
    """The log says it too (``refused``): it used to end at ``job_started``, so `status` said 75
    (relaunch) where the run had exited 2."""
    run, _ = own(pvc, reporting(value), steps=2)
    assert run.exit_code == 2 and says in str(run.error), run.error
    err = told(capsys)
    assert len(err) == 1 and err[0].startswith("trainjob: step 1: ") and err[0].endswith("(exit 2)"), err
    assert events(pvc / "log.jsonl")[-1][1].startswith("at_step=1 reason=step 1: the loss ")
    assert cli.main(["status", str(pvc / "log.jsonl")]) == 2


def test_a_torch_loss_of_one_element_is_accepted_more_or_a_meta_one_is_exit_2(pvc, capsys):
    torch = pytest.importorskip("torch")
    run, _ = own(pvc, reporting(lambda: torch.tensor([0.5], requires_grad=True) * 1), steps=2)
    assert run.exit_code == 0 and told(capsys)[-1].startswith("trainjob: completed (exit 0): published ")
    for n, value in enumerate([torch.tensor([0.5, 0.6]), torch.tensor(0.5, device="meta")]):
        run, _ = own(pvc.parent / str(n), reporting(value), steps=2)
        assert run.exit_code == 2 and ("2 elements" if n == 0 else "meta") in str(run.error), run.error
        assert len(told(capsys)) == 1


class MetaState(Vector):
    def state_dict(self):
        import torch
        return {"w": torch.from_numpy(self.w), "ghost": torch.empty(3, device="meta")}


def test_a_meta_tensor_in_the_state_or_the_export_is_exit_2_in_one_line(pvc, capsys):
    torch = pytest.importorskip("torch")
    run = Run(pvc, state=MetaState(), steps=2, ckpt_every=2)
    with run:
        pass
    assert run.exit_code == 2 and "meta" in str(run.error) and "ghost" in str(run.error)
    state = Vector()
    with Run(pvc.parent / "export", state=state, steps=2, ckpt_every=2) as run:
        for step in run:
            run.report(state.step(step))
        run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1),
                 export={"w": torch.empty(4, device="meta")})
    assert run.exit_code == 2 and "meta" in str(run.error)
    err = told(capsys)
    assert len(err) == 2 and all(line.endswith("(exit 2)") for line in err), err


def test_a_run_entered_off_the_main_thread_is_refused_in_one_line(pvc, capsys):
    found: list[Run] = []
    worker = threading.Thread(target=lambda: found.append(own(pvc, good)[0]))
    worker.start()
    worker.join()
    assert found and found[0].exit_code == 2 and "main thread" in str(found[0].error)
    err = told(capsys)
    assert len(err) == 1 and err[0].endswith("(exit 2)"), err
    assert not pvc.exists()


def test_a_signal_reaches_every_enclosing_run_and_each_handler_is_put_back(pvc):
    def mine(*_):
        received.append("mine")

    received: list[str] = []
    signal.signal(signal.SIGTERM, mine)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    outer_state = Vector()
    inner: list[Run] = []
    with Run(pvc / "outer", state=outer_state, steps=6, ckpt_every=2) as outer:
        for step in outer:
            outer.report(outer_state.step(step))
            if step == 2:
                def preempted(run, state, at):
                    good(run, state, at)
                    if at == 1:
                        os.kill(os.getpid(), signal.SIGTERM)
                inner.append(own(pvc / "inner", preempted, steps=6)[0])
                assert signal.getsignal(signal.SIGTERM) == outer.stop._handle  # the outer's, back
        outer.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1), export={})
    assert inner[0].exit_code == 75 and events(pvc / "inner/log.jsonl")[-1] == ("killed", "at_step=1 signal=SIGTERM")
    assert outer.exit_code == 75 and events(pvc / "outer/log.jsonl")[-1] == ("killed", "at_step=2 signal=SIGTERM")
    assert received == ["mine"]  # passed on to the script's own handler too
    assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is signal.default_int_handler


BODY_ENDS = {
    "exit0": "sys.exit(0)", "exit1": "sys.exit(1)", "interrupt": "raise KeyboardInterrupt",
    "generatorexit": "raise GeneratorExit", "bare": "raise BaseException('bare')",
}


@pytest.mark.process
def test_a_script_whose_body_exits_ends_the_process_with_a_code_of_the_table(tmp_path):
    """The same as in process, as the operating system sees it: the script's own exit code."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import sys, trainjob\nimport numpy as np\n"
        "class S:\n    def __init__(self): self.w = np.zeros(2)\n"
        "    def state_dict(self): return {'w': self.w}\n"
        "    def load_state_dict(self, a): self.w[...] = a['w']\n"
        "s = S()\n"
        "with trainjob.Run(sys.argv[1], state=s, steps=4, ckpt_every=2) as run:\n"
        "    for step in run:\n"
        "        run.report(0.5)\n"
        "        if step == 3:\n"
        "            exec(sys.argv[2])\n"
        "    run.gate(holdout=trainjob.Score(correct=1, total=1), baseline=trainjob.Score(correct=1, total=1),"
        " export=s.state_dict())\n"
        "sys.exit(run.exit_code)\n")
    codes = {}
    for name, statement in BODY_ENDS.items():
        done = subprocess.run([sys.executable, str(script), str(tmp_path / name), statement],
                              capture_output=True, text=True, timeout=60)
        codes[name] = done.returncode
        assert events(tmp_path / name / "log.jsonl")[-1][0] == "checkpointed", done.stderr
    assert codes == {"exit0": 75, "exit1": 75, "interrupt": 75, "generatorexit": 70, "bare": 70}


@pytest.mark.process
@pytest.mark.parametrize("statement", ["sys.exit(0)", "raise KeyboardInterrupt"])
def test_a_trainer_whose_step_exits_through_the_cli_is_75_never_0(tmp_path, statement):
    (tmp_path / "quitter.py").write_text(
        "import sys\nfrom trainjob.trainers.linear import make\n"
        "def factory(data, lr):\n    t = make(data, lr)\n    step = t.step\n"
        f"    def quitting(n):\n        if n == 3:\n            {statement}\n        return step(n)\n"
        "    t.step = quitting\n    return t\n")
    done = subprocess.run([sys.executable, "-m", "trainjob", "run", "--pvc", str(tmp_path / "pvc"),
                           "--trainer", "quitter:factory"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 75, done.stderr
    assert events(tmp_path / "pvc/log.jsonl")[-1] == ("checkpointed", "step=2 loss_milli=310")


def test_the_docs_misuse_table_has_a_row_for_every_end_tested_here():
    text = (Path(__file__).resolve().parents[2] / "docs/howto/own-loop.md").read_text()
    table = text[text.index("| in your loop | what happens | exit |"):]
    rows = table[:table.index("\n\n")].splitlines()
    for end in ("SIGTERM or SIGINT", "an exception in the body", "`sys.exit(n)` of any `n`", "after the outcome",
                "`GeneratorExit`", "out of memory", "without `run.report(loss)`", "`run.report` of a number",
                "meta-device tensor in `state_dict()`", "a `break`", "off the main thread",
                "inside another `Run`", "locked by another run"):
        assert sum(end in row for row in rows) == 1, end


def test_a_launch_refused_before_it_began_leaves_no_directory_it_created(tmp_path):
    """A state that cannot be checkpointed is refused on entering (exit 2), after the PVC and its
    lock were made: the directories this launch created go with it, and an existing PVC keeps
    exactly what it held."""
    class Strided:
        def state_dict(self):
            return {"w": np.zeros((4, 4), dtype=np.float32)[:, ::2]}  # not contiguous: refused

        def load_state_dict(self, state):
            raise AssertionError("never loaded")

    fresh = tmp_path / "new" / "deeper" / "pvc"
    with Run(fresh, state=Strided(), steps=2, ckpt_every=1) as run:
        for _ in run:
            pytest.fail("trained")
    assert run.exit_code == 2 and not (tmp_path / "new").exists()
    existing = tmp_path / "kept"
    (existing / "notes").mkdir(parents=True)
    with Run(existing, state=Strided(), steps=2, ckpt_every=1) as run:
        for _ in run:
            pytest.fail("trained")
    assert run.exit_code == 2 and sorted(p.name for p in existing.rglob("*")) == ["notes"]


class Stopping(Vector):
    """A Vector whose training decides to stop at ``stop_at``: the decision is part of its state."""

    def __init__(self, stop_at: int) -> None:
        super().__init__()
        self.stop_at, self.stopped = stop_at, False

    def state_dict(self):
        return {"w": self.w, "stopped": self.stopped}

    def load_state_dict(self, state) -> None:
        self.w[...], self.stopped = state["w"], state["stopped"]


def stopping(pvc: Path, stop_at: int, signal_at: int | None = None) -> Run:
    """An own loop of 8 steps (a checkpoint every 2) whose training stops early at ``stop_at``."""
    state = Stopping(stop_at)
    with Run(pvc, state=state, steps=8, ckpt_every=2) as run:
        if state.stopped:  # resumed from the step it stopped at: nothing left to train
            run.end_early()
        for step in run:
            run.report(state.step(step))
            if step == state.stop_at:
                state.stopped = True
                run.end_early()
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
        run.gate(holdout=Score(correct=9, total=10), baseline=Score(correct=9, total=10), export={"w": state.w})
    return run


def test_an_early_stop_checkpoints_its_step_gates_and_publishes_that_step(pvc):
    run = stopping(pvc, 3)
    assert (run.exit_code, run.final, run.last_step) == (0, "completed", 3)
    assert [(e, d.split()[0]) for e, d in events(pvc / "log.jsonl")][1:3] == [("checkpointed", "step=2"),
                                                                             ("checkpointed", "step=3")]
    assert [e for e, _ in events(pvc / "log.jsonl")][3:] == ["artifact_written", "completed"]
    from safetensors import safe_open
    with safe_open(str(pvc / "artifacts/model-v1.safetensors"), "np") as f:
        assert json.loads(f.metadata()["trainjob.artifact"])["step"] == 3
    assert cli.main(["verify", "--pvc", str(pvc)]) == 0


def test_a_stop_at_the_early_stop_step_resumes_straight_to_the_gate_with_the_same_bytes(pvc):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert stopping(pvc, 3, signal_at=3).exit_code == 75
    assert events(pvc / "log.jsonl")[-1] == ("killed", "at_step=3 signal=SIGTERM")
    run = stopping(pvc, 3)
    assert (run.exit_code, run.last_step) == (0, 3)
    kinds = [e for e, _ in events(pvc / "log.jsonl")]
    assert kinds[kinds.index("killed") + 1:] == ["resumed", "artifact_written", "completed"]
    stopping(pvc.parent / "straight", 3)
    assert (pvc / "artifacts/model-v1.safetensors").read_bytes() == \
        (pvc.parent / "straight/artifacts/model-v1.safetensors").read_bytes()


def test_end_early_outside_the_loop_of_a_fresh_run_is_exit_2(pvc, capsys):
    state = Vector()
    with Run(pvc, state=state, steps=4, ckpt_every=2) as run:
        run.end_early()
    assert run.exit_code == 2 and "run.end_early() belongs inside" in str(run.error)
