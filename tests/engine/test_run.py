"""trainjob.Run around your own loop: the CLI's log, event for event; every misuse ends in a
documented exit code with the attempt resumable; a stop checkpoints and ends 75. In-process: the
loop is this test's own code, as it would be a user's script."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import trainjob
from conftest import events
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


def resumes_after(pvc: Path, first_code: int, capsys) -> None:
    """The misuse left the attempt in flight: a correct relaunch resumes it and completes."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainjob: ") and f"(exit {first_code})" in err[0], err
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
    assert [e for e, _ in events(pvc / "log.jsonl")] == ["job_started"]
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
    assert json.loads((pvc / "state.json").read_text())["state"] == "checkpointed"  # in flight, at step 2
    resumes_after(pvc, 2, capsys)


def test_leaving_without_the_gate_is_exit_2_and_the_relaunch_gates(pvc, capsys):
    run, _ = own(pvc, good, gate=False)
    assert run.exit_code == 2 and "gate(...) was never called" in str(run.error)
    assert [e for e, _ in events(pvc / "log.jsonl")][-1] == "checkpointed"
    resumes_after(pvc, 2, capsys)


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


def test_a_trainjob_error_in_the_body_keeps_its_code(pvc, capsys):
    def peer_gone(run, state, step):
        raise trainjob.PeerFailed("a peer left")

    run, _ = own(pvc, peer_gone)
    assert run.exit_code == 75
    assert capsys.readouterr().err.strip() == "trainjob: a peer left (exit 75)"


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


def test_an_idempotent_start_after_completion_is_0_and_trains_nothing(pvc, capsys):
    assert own(pvc, good)[0].exit_code == 0
    log = (pvc / "log.jsonl").read_bytes()
    run, state = own(pvc, lambda *a: pytest.fail("trained a completed job"), idempotent=True)
    assert run.exit_code == 0 and run.completion is not None and (pvc / "log.jsonl").read_bytes() == log
    assert "already completed (attempt 1)" in capsys.readouterr().err
    assert own(pvc, good)[0].exit_code == 2  # without idempotent: the lab's refusal


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
