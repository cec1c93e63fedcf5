"""`trainjob prove`: a correct resume is proven, a broken one is caught and located, bad usage is 2.

The slow tests kill real launches of real training commands (two trials each: "between checkpoints",
then "during a checkpoint write", the phases where a resume can go wrong). The pure parts (the plan, the entry comparison, the hints, the loss lines) are tested in
process.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from conftest import ROOT
from trainjob import cli
from trainjob.deploy import divergence, launches, prove

PYTHON = sys.executable
BETWEEN_AND_DURING = ["--kills", "2"]


# --- in process --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd, said", [
    (["--kills", "0", "--", PYTHON, "x.py", "{pvc}"], "--kills must be at least 1"),
    (["--", PYTHON, "x.py", "--pvc", "pvc"], "{pvc} appears nowhere"),
    (["--", "no-such-command-here", "{pvc}"], "no-such-command-here: command not found"),
    ([], "no command"),
])
def test_bad_usage_is_one_line_and_exit_2(cmd, said, capsys):
    assert cli.main(["prove", *cmd]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1


def test_the_plan_covers_every_phase_in_four_trials_resumes_first_and_alternates_signals():
    plan = prove.plan(4, "both")
    assert sorted(phase for phase, _ in plan) == sorted(prove.PHASES)
    assert [kind for _, kind in plan] == ["KILL", "preempted", "KILL", "grace ended"]
    assert [phase for phase, _ in prove.plan(2, "KILL")] == ["between checkpoints", "during a checkpoint write"]
    assert [kind for _, kind in prove.plan(3, "TERM")] == ["preempted", "grace ended", "preempted"]


def test_term_trials_are_stopped_as_slurm_preempts_and_as_kubernetes_ends_a_grace():
    """The TERM trials used to signal the launch's first process once: the data loader's workers
    never saw a signal, and neither a second SIGTERM nor a SIGKILL during the stop was tried."""
    reference = prove.Outcome(Path("r"), (0,), 0, 10.0, {}, checkpoint_times=(1.0, 2.0, 3.0))
    rng = random.Random(0)
    assert prove.stop_for("KILL", reference, rng) == launches.NODE_DIES
    preempted = prove.stop_for("preempted", reference, rng)
    assert (preempted.sig, preempted.everyone, preempted.repeat) == (signal.SIGTERM, True, 0.5)
    grace = prove.stop_for("grace ended", reference, rng)
    assert grace.sig == signal.SIGTERM and not grace.everyone and 0 <= grace.kill_after <= 1.0  # the checkpoint gap


def test_a_trial_that_crashed_is_its_own_verdict_never_not_deterministic(tmp_path):
    """A launch that ended 70 was taken for "trial N was never resumed and still published other
    bytes": NOT DETERMINISTIC, with advice to seed the command. A crash is a verdict of its own,
    with the last line the launch wrote."""
    reference = outcome(tmp_path / "reference")
    trial = attrs.evolve(outcome(tmp_path / "trial-01", blob=b""), codes=(70,), code=70, artifacts={})
    trial.pvc.parent.mkdir(parents=True)
    (trial.pvc.parent / "launch-01.stderr").write_text("Traceback ...\ntrainjob: DataLoader worker (pid 7) is "
                                                       "killed by signal: Terminated. (exit 70)\n")
    verdicts = [prove.judge(1, trial, reference, lambda pvc: None)]
    text = "\n".join(prove.report(reference, [trial], verdicts, tmp_path))
    assert "NOT DETERMINISTIC" not in text and "DIVERGES" not in text, text
    assert ("verdict: CRASHED: trial 1's launch 1 exited 70, an internal error (a bug in the command or in "
            "trainjob), not a resume that went elsewhere: trainjob: DataLoader worker (pid 7) is killed") in text
    assert "trial-01/launch-01.stderr" in text


def test_a_launch_whose_log_does_not_say_its_exit_code_fails_its_trial(tmp_path):
    said = "launch 2 exited 2 but its log ends at 'checkpointed', for which `trainjob status` says 75"
    trial = attrs.evolve(outcome(tmp_path), disagreements=(said,))
    verdict = prove.judge(1, trial, outcome(tmp_path), lambda pvc: None)
    assert not verdict.passed and verdict.problems == (f"`trainjob status` disagrees: {said}",)


def test_entry_diffs_name_each_entry_with_its_largest_difference():
    a = {"w": np.array([1.0, 2.0]), "same": np.zeros(2), "gone": np.ones(1)}
    b = {"w": np.array([1.0, 2.5]), "same": np.zeros(2), "new": np.ones(1)}
    assert [(d.name, d.what) for d in divergence.entry_diffs(a, b)] == [
        ("gone", "only in the reference"), ("new", "only in the trial"), ("w", "max abs diff 0.5")]


def outcome(tmp_path, delivered=True, draws=1, blob=b"w") -> prove.Outcome:
    return prove.Outcome(tmp_path / "pvc", (-9, 0) if delivered else (0,), 0, 1.0, {"model-v1.safetensors": blob},
                         "between checkpoints", "SIGKILL", "after checkpointed step=4" if delivered else
                         "not delivered: the launch had ended before it", (0.5, 0.9), delivered=delivered, draws=draws)


@given(st.lists(st.floats(0.01, 100), min_size=0, max_size=6).map(sorted), st.sampled_from(prove.PHASES),
       st.integers(0, 2**32))
def test_a_redraw_is_never_later_than_the_instant_the_run_outran(times, phase, seed):
    reference = prove.Outcome(Path("r"), (0,), 0, 120.0, {}, checkpoint_times=tuple(times), first_line=0.01)
    rng = random.Random(seed)
    first = prove.draw(phase, reference, rng)
    again = prove.draw(phase, reference, rng, first)
    assert 1 <= again.nth <= max(1, first.nth - 1) and 0 <= again.delay <= first.delay / 2


def test_a_trial_whose_signal_never_landed_is_untested_and_never_proven(tmp_path):
    reference, ran = outcome(tmp_path), outcome(tmp_path, delivered=False, draws=prove.MAX_DRAWS)

    def verify(pvc):
        raise AssertionError("an untested trial is not judged")
    verdicts = [prove.judge(1, outcome(tmp_path), reference, lambda pvc: None), prove.judge(2, ran, reference, verify)]
    assert verdicts[0].passed and verdicts[1].untested and not verdicts[1].passed
    assert not prove.proven(verdicts) and prove.proven(verdicts[:1])
    lines = prove.report(reference, [outcome(tmp_path), ran], verdicts, tmp_path)
    text = "\n".join(lines)
    assert "2 trials, 1 signals delivered" in text and text.count("same bytes, verified") == 1
    assert "UNTESTED" in lines[4] and "in each of 3 draws" in lines[5]
    assert "verdict: UNPROVEN: the signal of trial 2 never landed" in text and "verdict: PROVEN" not in text


def test_a_trial_delivered_at_a_later_draw_counts_and_says_so(tmp_path):
    reference, trial = outcome(tmp_path), outcome(tmp_path, draws=2)
    verdicts = [prove.judge(1, trial, reference, lambda pvc: None)]
    lines = prove.report(reference, [trial], verdicts, tmp_path)
    assert prove.proven(verdicts) and "(drawn 2 times: the run outran the earlier instants)" in lines[3]
    assert lines[-1].startswith("verdict: PROVEN")


def test_losses_keep_the_value_a_resumed_run_went_on_from(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [("checkpointed", "step=2 loss_milli=310"), ("checkpointed", "step=4 loss_milli=241"),
             ("resumed", "from_step=2"), ("checkpointed", "step=4 loss_milli=240")]
    log.write_text("".join(f'{{"ts":"t","event":"{e}","detail":"{d}"}}\n' for e, d in lines) + '{"torn')
    assert divergence.losses(tmp_path) == {2: 310, 4: 240}
    assert divergence.resumed_from(tmp_path) == 2


def test_printed_losses_are_read_from_every_launch_the_later_one_winning(tmp_path):
    (tmp_path / "launch-01.stdout").write_text("step 1 loss 0.5\nstep 2 loss 0.4\nother 3\n")
    (tmp_path / "launch-02.stdout").write_text("step 2 loss 0.41\nstep 3 loss 0.3\n")
    assert divergence.printed_losses(tmp_path / "pvc") == {1: "0.5", 2: "0.41", 3: "0.3"}


# --- real launches -----------------------------------------------------------------------------------

@pytest.mark.process
@pytest.mark.killpoint
def test_prove_passes_the_own_loop_example(capsys):
    """Slower than 20 s: five launches of a torch script (the reference, two trials of two)."""
    code = cli.main(["prove", *BETWEEN_AND_DURING, "--", PYTHON, str(ROOT / "examples/own_loop.py"),
                     "--pvc", "{pvc}", "--steps", "20", "--ckpt-every", "5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PROVEN" in out and out.count("same bytes, verified") == 2


@pytest.mark.process
@pytest.mark.killpoint
def test_a_batch_generator_living_across_steps_is_caught_at_the_first_step_after_the_resume(tmp_path, capsys):
    """Slower than 20 s: three launches of a torch script (the reference, one trial: "between
    checkpoints", which resumes) on a copy of the example whose batches come from one generator
    (and which prints each step's loss, as examples/finetune.py does)."""
    source = (ROOT / "examples/own_loop.py").read_text()
    drawn = "np.random.default_rng([1, step]).choice("
    assert drawn in source
    script = tmp_path / "own_loop_generator.py"
    printed = "        run.report(loss.item())\n"
    assert printed in source
    script.write_text(source.replace(drawn, "batches.choice(")
                      .replace("with trainjob.Run(", "batches = np.random.default_rng(1)\nwith trainjob.Run(", 1)
                      .replace(printed, printed + "        print(f'step {step} loss {loss.item()}')\n"))
    # --seed 1: the kill comes after the first of the 4 checkpoints, so a watcher that lags on a
    # loaded machine still kills before the last one (seed 0 drew the third, and a CI run's kill
    # landed after the last checkpoint: nothing left to diverge).
    code = cli.main(["prove", "--kills", "1", "--seed", "1", "--", PYTHON, str(script), "--pvc", "{pvc}",
                     "--steps", "20", "--ckpt-every", "5"])
    out = capsys.readouterr().out
    assert code == 1, out
    resumed = int(out.split("resumed from step ")[1].split()[0])
    assert f"first differing loss: step {resumed + 1} (printed loss " in out  # the first step after the resume
    assert "model.0.weight: max abs diff" in out and "hint: RNG or data loader position" in out


@pytest.mark.process
@pytest.mark.killpoint
def test_a_trainer_whose_momentum_lives_on_the_object_is_caught_with_its_entries_named(digits_data, monkeypatch,
                                                                                      capsys):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests/helpers"))
    code = cli.main(["prove", *BETWEEN_AND_DURING, "--", PYTHON, "-m", "trainjob", "run", "--pvc", "{pvc}",
                     "--data", str(digits_data), "--trainer", "user_trainers:forgetful", "--steps", "8",
                     "--ckpt-every", "2", "--keep", "10", "--idempotent"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "published other bytes than the reference" in out
    assert "equals the reference's: what was saved was right, what differs after the resume was never saved" in out
    assert "  W: max abs diff" in out and "hint: optimizer state" in out
    assert "first differing loss: step" in out and "(loss_milli " in out  # from the log: it prints none


@pytest.mark.process
@pytest.mark.killpoint
def test_the_lab_trainer_is_proven_and_twice_finds_it_deterministic(capsys):
    code = cli.main(["prove", "--kills", "2", "--twice", "--signal", "both", "--", PYTHON, "-m", "trainjob",
                     "run", "--pvc", "{pvc}", "--steps", "20", "--ckpt-every", "2", "--idempotent"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "\n1     KILL " in out and "\n2     TERM all x2 " in out, out


@pytest.mark.process
def test_twice_names_a_command_that_differs_from_itself(tmp_path, capsys):
    script = tmp_path / "noisy.py"
    script.write_text("import sys, time, trainjob\n"
                      "class S:\n    def state_dict(self): return {}\n    def load_state_dict(self, a): pass\n"
                      "with trainjob.Run(sys.argv[1], state=S(), steps=2, ckpt_every=1, lr=0.1) as run:\n"
                      "    for step in run: run.report(time.time_ns() % 1000 / 1000)\n"
                      "    run.gate(holdout=trainjob.Score(1, 1), baseline=trainjob.Score(1, 1),\n"
                      "             export={'t': __import__('numpy').array([time.time_ns()])})\n"
                      "sys.exit(run.exit_code)\n")
    code = cli.main(["prove", "--kills", "1", "--twice", "--", PYTHON, str(script), "{pvc}"])
    out = capsys.readouterr().out
    assert code == 1 and "NOT DETERMINISTIC" in out, out


@pytest.mark.process
def test_a_model_built_before_any_seed_is_named_not_deterministic_without_twice(tmp_path, capsys):
    """A framework's docs build the model before the trainer seeds anything (its initial weights
    then differ run to run): every trial differs from the reference before any resume, and prove
    says so, naming the fix, instead of blaming what a resume lost."""
    script = tmp_path / "unseeded.py"
    script.write_text("import sys, time, numpy as np, trainjob\n"
                      "class S:\n"
                      "    def __init__(self): self.w = np.random.default_rng().standard_normal(4)  # no seed\n"
                      "    def state_dict(self): return {'w': self.w}\n"
                      "    def load_state_dict(self, state): self.w[...] = state['w']\n"
                      "s = S()\n"
                      "with trainjob.Run(sys.argv[1], state=s, steps=30, ckpt_every=3, lr=0.1) as run:\n"
                      "    for step in run:\n"
                      "        s.w *= 0.99\n"
                      "        time.sleep(0.05)\n"
                      "        run.report(float(abs(s.w).sum()))\n"
                      "    run.gate(holdout=trainjob.Score(1, 1), baseline=trainjob.Score(1, 1), export={'w': s.w})\n"
                      "sys.exit(run.exit_code)\n")
    code = cli.main(["prove", "--kills", "1", "--", PYTHON, str(script), "{pvc}"])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: NOT DETERMINISTIC: " in out and "before any resume" in out, out
    assert "transformers.set_seed" in out and "hint:" not in out, out


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.process
@pytest.mark.killpoint
@pytest.mark.torchrun
def test_prove_kills_a_torchrun_launch_whole_and_passes_the_own_loop_at_two_ranks(capsys, tmp_path, monkeypatch):
    """Slower than 20 s: three launches of two torch workers each (the reference, one trial of two)."""
    # prove's PVCs under this test's own folder, so the check below sees only this test's workers
    # (another test may run examples/own_loop.py under prove at the same time).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = cli.main(["prove", "--kills", "1", "--", PYTHON, "-m", "trainjob", "torchrun", "--standalone",
                     "--nproc-per-node", "2", "--monitor-interval", "0.1", str(ROOT / "examples/own_loop.py"),
                     "--pvc", "{pvc}", "--steps", "20", "--ckpt-every", "5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PROVEN" in out and "-9 0" in out  # killed once (the whole launch), relaunched once
    left = subprocess.run(["pgrep", "-f", f"examples/own_loop.py --pvc {tmp_path}/trainjob-prove-"], capture_output=True)
    assert left.stdout == b"", "a worker outlived its killed launch"


@pytest.mark.process
@pytest.mark.killpoint
def test_prove_passes_the_whole_training_state_example(capsys):
    """Slower than 20 s: three launches of examples/finetune.py (AdamW, a scheduler, dropout, a
    shuffling StatefulDataLoader under trainjob.torch.TrainingState): the reference and one trial
    that resumes. Both phases of a trial are the own-loop test's; the example's own kills are
    tests/engine/test_finetune_example.py's."""
    code = cli.main(["prove", "--kills", "1", "--", PYTHON, str(ROOT / "examples/finetune.py"), "--pvc", "{pvc}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("same bytes, verified") == 1 and "-9 0" in out  # killed once, relaunched once


@pytest.mark.process
@pytest.mark.killpoint
def test_a_naive_script_whose_scheduler_is_not_in_the_state_is_caught_with_a_hint_naming_the_scheduler(
        capsys, tmp_path, monkeypatch):
    """Slower than 20 s: three launches of a tiny torch script (the reference, one trial that resumes): its
    TrainingState holds the model and the optimizer only (rng=False), its DataLoader is a plain
    one, and its LambdaLR warm-up is outside the state. Seed 1 draws the first checkpoint to resume
    from, so the trial resumes from step 4 or 8, inside the 8-step warm-up's reach."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the runs prove keeps on failure: this test's
    code = cli.main(["prove", "--kills", "1", "--seed", "1", "--", PYTHON,
                     str(ROOT / "tests/helpers/naive_scheduler.py"), "--pvc", "{pvc}"])
    out = capsys.readouterr().out
    assert code == 1, out
    hints = [line for line in out.splitlines() if line.startswith("hint: ")]
    assert hints[0].startswith("hint: LR scheduler: the optimizer's learning rate at step "), out
    assert "optim.param_groups[0].lr is 0.01 in the reference, 0.00625 here" in hints[0]
    assert "holds no scheduler" in hints[0] and "RNG streams and data loader position" in hints[1]
    assert "RNG or data loader position" not in out  # the old catch-all no longer stands in for the cause


@pytest.mark.process
def test_a_run_that_outruns_every_signal_is_redrawn_then_untested_never_proven(tmp_path, capsys, monkeypatch):
    """A command that publishes and exits without ever logging a checkpoint: a signal drawn
    "between checkpoints" can never land. Each draw is a run of sh (milliseconds)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    publish = ("mkdir -p {pvc}/artifacts && printf w > {pvc}/artifacts/model-v1.json && "
               "printf '{\"ts\":\"t\",\"event\":\"completed\",\"detail\":\"\"}\\n' > {pvc}/log.jsonl")
    code = cli.main(["prove", "--kills", "1", "--", "sh", "-c", publish])
    captured = capsys.readouterr()
    assert code == 1, captured.out
    assert "1 trials, 0 signals delivered" in captured.out and "same bytes" not in captured.out
    assert "UNTESTED" in captured.out and f"in each of {prove.MAX_DRAWS} draws" in captured.out
    assert "verdict: UNPROVEN" in captured.out
    assert captured.err.count("the run ended before its signal landed") == prove.MAX_DRAWS
    work = next(tmp_path.glob("trainjob-prove-*"))
    assert sorted(p.name for p in work.glob("trial-*")) == ["trial-01", "trial-01-draw-2", "trial-01-draw-3"]


@pytest.mark.process
def test_a_relaunch_that_hangs_is_killed_whole_and_named_hung(tmp_path, capsys, monkeypatch):
    """A relaunch waited on without a bound: two DDP ranks stuck in a collective held a CI run for
    the collective's 30-minute timeout. The command's first launch logs a checkpoint and sleeps (the
    trial's signal lands there); its relaunch sleeps for good."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(prove, "GRACE", 2)
    monkeypatch.setattr(prove, "HUNG_AFTER", 1)  # the reference's second, at least GRACE
    monkeypatch.setattr(prove, "STACKS_SECONDS", 0.5)
    line = '{"ts":"t","event":"%s","detail":""}'
    hang = f"{sys.executable} -c 'import time; time.sleep(600)'"
    once = (f"[ -e {{pvc}}/began ] && exec {hang}; mkdir -p {{pvc}}/artifacts && touch {{pvc}}/began && "
            f"echo '{line % 'checkpointed'}' > {{pvc}}/log.jsonl && sleep 1 && printf w > {{pvc}}/artifacts/model-v1.json "
            f"&& echo '{line % 'completed'}' >> {{pvc}}/log.jsonl")
    code = cli.main(["prove", "--kills", "1", "--", "sh", "-c", once])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"verdict: HUNG: trial 1's launch 2 was still running after [23] s \(1 times the reference's "
                     r"time, at least 2 s\) and was killed", out), out
    stderr = next(tmp_path.glob("trainjob-prove-*/trial-01/launch-02.stderr"))
    assert "trial-01/launch-02.stderr" in out and "(most recent call first)" in stderr.read_text()  # its stack
    left = subprocess.run(["pgrep", "-f", "time.sleep.600"], capture_output=True, text=True).stdout.split()
    assert not left, f"the hung launch's processes still run: {left}"


def test_a_trial_pvc_verify_refuses_is_named_by_its_first_bad_item_and_an_empty_one_by_verify(tmp_path, capsys):
    """verify_problem read the items' ``status``, which they do not have (``verdict``): a trial
    whose PVC failed verification would have ended prove in 70. An empty PVC has nothing to
    verify (issue 48): that is a problem too, in verify's own words."""
    pvc = tmp_path / "pvc"
    assert cli.main(["run", "--pvc", str(pvc)]) == 0
    capsys.readouterr()
    assert prove.verify_problem(pvc) is None
    (pvc / "artifacts/model-v1.json").write_text("{}\n")
    assert prove.verify_problem(pvc).startswith("artifacts/model-v1.json: corrupt ")
    (tmp_path / "empty").mkdir()
    assert "nothing to verify" in prove.verify_problem(tmp_path / "empty")
