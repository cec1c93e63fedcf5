"""trainjob.integrations.hf: examples/hf_trainer.py (a transformers.Trainer script, its trainjob part two
lines) as a user runs it. Uninterrupted, it trains to the bytes of the same script with the Trainer
alone; SIGKILLed at random instants (saves included) or SIGTERMed mid-run, each relaunch ends with the
uninterrupted run's artifact bytes; a SIGTERM is a saved step, `killed` and exit 75; a gate that
refuses is `drift_failed` and exit 1; `trainjob prove` finds it PROVEN. A control (the same run with
the RNG streams left where they were at the relaunch) shows the comparison can fail.

Slow: each launch imports transformers (a few seconds of CPU) and trains 36 tiny steps; each test
says how many launches it makes. The fast tests read the code only.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, agrees_with_its_log, built_once, log_length, skip_without, trainjob

pytestmark = pytest.mark.acceptance  # scripts/test.sh's acceptance step: minutes of Trainer launches
EXAMPLE = ROOT / "examples/hf_trainer.py"
PACKAGE = ROOT / "trainjob"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
SEED = int(os.environ.get("TRAINJOB_KILL_SEED", random.randrange(10 ** 6)))  # printed on failure
STEPS = 36  # 192 sentences, batches of 8, 2 micro-batches a step, 3 epochs


def variant(script: Path, *changes: tuple[str, str]) -> Path:
    """The example with each ``(old, new)`` made, written to ``script``; each ``old`` must be in it
    (an example edited without its test would otherwise test the example unchanged)."""
    source = EXAMPLE.read_text()
    for old, new in changes:
        assert old in source, old
        source = source.replace(old, new)
    script.write_text(source)
    return script


# --- fast: the code ------------------------------------------------------------------------------------

def _imported(path: Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports, and whether the import is inside a function."""
    tree = ast.parse(path.read_text(), str(path))
    late = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in late) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module, id(node) in late))
    return out


def test_no_module_outside_the_hf_integration_imports_transformers_or_accelerate():
    """The engine never learns a framework's name, and `import trainjob` never loads one."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "integrations" / "hf"):
            continue
        named = [m for m, _ in _imported(path) if m.split(".")[0] in ("transformers", "accelerate")]
        assert named == [], path


def test_the_hf_integration_imports_transformers_only_when_it_runs():
    """`import trainjob.integrations.hf` costs no transformers import: the calls do, inside run()."""
    for path in sorted((PACKAGE / "integrations" / "hf").glob("*.py")):
        early = [m for m, late in _imported(path) if m.split(".")[0] in ("transformers", "accelerate") and not late]
        assert early == [], path


@pytest.mark.process
def test_importing_trainjob_and_the_integration_loads_no_transformers():
    """A new interpreter: only transformers' own calls, inside ``run``, import it."""
    code = ("import sys, trainjob, trainjob.torch, trainjob.integrations.hf\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate')]")
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# --- slow: real launches --------------------------------------------------------------------------------

def _needs_transformers() -> None:
    skip_without("transformers", "needs the hf extra (transformers, accelerate)")


def launch(pvc: Path, *flags: str, script: Path = EXAMPLE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), "--pvc", str(pvc), *flags], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def losses(text: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) loss (\S+)$", text, re.M)}


def finish(pvc: Path, *flags: str, script: Path = EXAMPLE) -> tuple[int, dict[int, str], str]:
    before = log_length(pvc)
    proc = launch(pvc, *flags, script=script)
    out, err = proc.communicate(timeout=600)
    agrees_with_its_log(proc.returncode, pvc, before)  # every launch: its log says its exit code
    return proc.returncode, losses(out), err


def signalled(pvc: Path, sig: signal.Signals, at_line: int, then: float = 0.0, script: Path = EXAMPLE,
              flags: tuple[str, ...] = (), group: bool = False, twice: bool = False) -> tuple[int, str]:
    """Run until the loss line of step ``at_line`` or a later one, ``then`` seconds more, and send
    ``sig`` (a loss line is printed before the step's checkpoint: a kill soon after one lands in it)
    to the process, or with ``group`` to its whole process group (its loader's workers too); with
    ``twice``, again half a second later, if it still runs (Slurm's preemption)."""
    before = log_length(pvc)
    proc = launch(pvc, *flags, script=script)
    assert proc.stdout is not None
    for line in proc.stdout:
        if (step := losses(line)) and min(step) >= at_line:
            break
    time.sleep(then)
    for n in range(2 if twice else 1):
        time.sleep(0.5 if n else 0)
        if proc.poll() is None:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    agrees_with_its_log(proc.returncode, pvc, before)
    return proc.returncode, err


def events(pvc: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (pvc / "log.jsonl").read_text().splitlines()]


def tensors(path: Path) -> dict[str, bytes]:
    from safetensors.numpy import load_file

    return {k: v.tobytes() for k, v in load_file(str(path)).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[bytes, dict[int, str], Path]:
    """The uninterrupted run's artifact bytes, its loss lines and its PVC; the bare script's weights
    beside it (two launches, once per test run)."""
    _needs_transformers()

    def build(directory: Path) -> None:
        code, lines, err = finish(directory / "pvc")
        assert code == 0 and len(lines) == STEPS, err[-2000:]
        (directory / "losses.json").write_text(json.dumps(lines))
        bare = subprocess.run([sys.executable, str(EXAMPLE), "--bare", str(directory / "bare.safetensors")],
                              env=ENV, capture_output=True, text=True, timeout=600)
        assert bare.returncode == 0, bare.stderr[-2000:]
        (directory / "bare-losses.json").write_text(json.dumps(losses(bare.stdout)))

    directory = built_once(tmp_path_factory, "hf-trainer-reference", build)
    lines = {int(s): v for s, v in json.loads((directory / "losses.json").read_text()).items()}
    return (directory / "pvc/artifacts/model-v1.safetensors").read_bytes(), lines, directory


def artifact(pvc: Path) -> bytes:
    return (pvc / "artifacts/model-v1.safetensors").read_bytes()


@pytest.mark.process
def test_uninterrupted_the_run_publishes_the_bare_trainers_weights_and_reads_as_any_run(reference, tmp_path):
    """The reference's two launches (shared), then the CLI on its PVC."""
    _, lines, directory = reference
    published = tensors(directory / "pvc/artifacts/model-v1.safetensors")
    assert published == tensors(directory / "bare.safetensors")  # every tensor, bit for bit
    assert "lm_head.weight" not in published  # the tied embedding once
    assert lines == {int(s): v for s, v in json.loads((directory / "bare-losses.json").read_text()).items()}
    log = events(directory / "pvc")
    assert [e["event"] for e in log] == ["job_started", *["checkpointed"] * 8, "artifact_written", "completed"]
    assert [e["detail"].split()[0] for e in log[1:9]] == [f"step={s}" for s in (5, 10, 15, 20, 25, 30, 35, 36)]
    status = trainjob("status", directory / "pvc/log.jsonl")
    assert status.returncode == 0 and "last_event: completed" in status.stdout
    verified = trainjob("verify", "--pvc", directory / "pvc")
    assert verified.returncode == 0, verified.stdout
    path = trainjob("status", directory / "pvc/log.jsonl", "--path")
    assert path.returncode == 0, path.stdout + path.stderr
    if shutil.which("dot"):  # replay draws the machine with Graphviz
        page = tmp_path / "replay.html"
        replay = trainjob("replay", directory / "pvc/log.jsonl", "-o", page)
        assert replay.returncode == 0 and "completed" in page.read_text(), replay.stderr


@pytest.mark.process
@pytest.mark.killpoint
def test_sigkills_at_random_instants_resume_to_the_uninterrupted_bytes(reference, tmp_path):
    """Three launches: two SIGKILLs, each at a random step and delay after its loss line (a delay
    lands in the step's checkpoint as often as between them), then the relaunch that completes."""
    expected, lines, _ = reference
    rng = random.Random(SEED)
    pvc = tmp_path / "pvc"
    first = rng.randrange(3, 20)
    for at in (first, rng.randrange(first + 2, 34)):
        code, err = signalled(pvc, signal.SIGKILL, at, then=rng.uniform(0, 0.05))
        assert code == -signal.SIGKILL, err[-1000:]
    code, resumed, err = finish(pvc)
    assert code == 0, err[-2000:]
    assert artifact(pvc) == expected, f"TRAINJOB_KILL_SEED={SEED}"
    assert resumed and all(lines[s] == v for s, v in resumed.items()), f"TRAINJOB_KILL_SEED={SEED}"
    assert [e["event"] for e in events(pvc)].count("resumed") >= 1


@pytest.mark.process
@pytest.mark.killpoint
def test_sigterm_saves_the_step_logs_killed_exits_75_and_the_relaunch_completes(reference, tmp_path):
    """Two launches: SIGTERM after step 12's loss line, then the relaunch."""
    expected, _, _ = reference
    pvc = tmp_path / "pvc"
    code, err = signalled(pvc, signal.SIGTERM, 12)
    assert code == 75, err[-2000:]
    log = events(pvc)
    assert log[-1]["event"] == "killed" and "signal=SIGTERM" in log[-1]["detail"], log[-3:]
    at = int(re.search(r"at_step=(\d+)", log[-1]["detail"])[1])
    assert log[-2] == {**log[-2], "event": "checkpointed"} and log[-2]["detail"].startswith(f"step={at} ")
    assert not (pvc / "artifacts").exists() or not any((pvc / "artifacts").iterdir())
    code, _, err = finish(pvc)
    assert code == 0, err[-2000:]
    assert events(pvc)[-1]["event"] == "completed" and artifact(pvc) == expected


@pytest.mark.process
def test_a_gate_that_refuses_is_drift_failed_exit_1_and_publishes_nothing(tmp_path):
    """One launch of the example whose frozen baseline is perfect."""
    _needs_transformers()
    script = variant(tmp_path / "hf_strict.py", ("trainjob.Score(correct=repeat, total=total)",
                                                 "trainjob.Score(correct=total, total=total)"))
    code, _, err = finish(tmp_path / "pvc", script=script)
    assert code == 1, err[-2000:]
    assert events(tmp_path / "pvc")[-1]["event"] == "drift_failed"
    assert not any((tmp_path / "pvc/artifacts").glob("model-v*"))


@pytest.mark.process
@pytest.mark.killpoint
def test_control_a_resume_without_the_rng_streams_reaches_other_bytes(reference, tmp_path):
    """Two launches of the example with the RNG restore taken out (dropout's masks then differ
    after the resume): the comparison the tests above make can fail."""
    expected, _, _ = reference
    script = tmp_path / "hf_no_rng.py"
    script.write_text(
        "import runpy, sys\n"
        "from trainjob.integrations.hf import hooks, state\n"
        "hooks.REPLACEMENTS['_load_rng_state'] = lambda b, checkpoint: None\n"
        "state.streams.restore = lambda saved: None\n"
        f"sys.argv[0] = {str(EXAMPLE)!r}\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n")
    pvc = tmp_path / "pvc"
    code, err = signalled(pvc, signal.SIGTERM, 12, script=script)
    assert code == 75, err[-2000:]
    code, _, err = finish(pvc, script=script)
    assert code == 0, err[-2000:]
    assert artifact(pvc) != expected


@pytest.mark.process
@pytest.mark.killpoint
def test_prove_finds_the_example_proven_under_sigkill_and_sigterm(capsys):
    """Five or more launches: the reference, then two trials (a SIGKILL between checkpoints, a
    SIGTERM during a checkpoint write), each relaunched to its end."""
    _needs_transformers()
    from trainjob import cli

    code = cli.main(["prove", "--kills", "2", "--signal", "both", "--", sys.executable, str(EXAMPLE),
                     "--pvc", "{pvc}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PROVEN" in out and out.count("same bytes, verified") == 2
    assert re.search(r"^1 +KILL ", out, re.M) and re.search(r"^2 +TERM ", out, re.M), out  # the table's signal column


@pytest.mark.process
@pytest.mark.killpoint
@pytest.mark.torchrun
def test_prove_finds_the_example_proven_at_two_ranks_under_trainjob_torchrun(capsys, tmp_path, monkeypatch):
    """Five or more launches of two DDP workers each (the reference, a SIGKILL of the whole launch,
    a SIGTERM to `trainjob torchrun`, which passes it on): the slowest test here, a few minutes."""
    _needs_transformers()
    from trainjob import cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # prove's PVCs here: the check below sees only ours
    code = cli.main(["prove", "--kills", "2", "--signal", "both", "--", sys.executable, "-m", "trainjob", "torchrun",
                     "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", str(EXAMPLE),
                     "--pvc", "{pvc}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PROVEN" in out and out.count("same bytes, verified") == 2
    left = subprocess.run(["pgrep", "-f", f"hf_trainer.py --pvc {tmp_path}/trainjob-prove-"], capture_output=True)
    assert left.stdout == b"", "a worker outlived its launch"


@pytest.mark.process
def test_a_trainer_trainjob_cannot_resume_exactly_is_refused_exit_2_before_the_pvc_holds_anything(tmp_path):
    """One launch: ``ignore_data_skip=True`` would resume on other batches; one line names it."""
    _needs_transformers()
    script = variant(tmp_path / "hf_noskip.py", ('report_to="none",', 'report_to="none", ignore_data_skip=True,'))
    code, _, err = finish(tmp_path / "pvc", script=script)
    assert code == 2, err[-2000:]
    assert "ignore_data_skip" in err.strip().splitlines()[-1]
    assert not (tmp_path / "pvc/log.jsonl").exists() or not (tmp_path / "pvc/log.jsonl").read_text().strip()
    assert not any((tmp_path / "pvc").glob("checkpoints/step-*"))


@pytest.mark.process
def test_a_gate_on_an_eval_metric_compares_it_with_the_frozen_value(tmp_path):
    """One launch of the example gated by ``hf.metric("eval_loss", ...)`` on its holdout set: the
    trained loss (about 2.1) against a uniform guess's, ln 32 (lower is better)."""
    _needs_transformers()
    script = variant(tmp_path / "hf_metric.py",
                     ("train_dataset=train)", "train_dataset=train, eval_dataset=holdout)"),
                     ("gate=next_token_accuracy)", "gate=hf.metric('eval_loss', baseline=3.4657, higher_is_better=False))"))
    code, _, err = finish(tmp_path / "pvc", script=script)
    assert code == 0, err[-2000:]
    last = events(tmp_path / "pvc")[-1]
    holdout = int(re.search(r"holdout: (\d+)/1000000 vs baseline 1000000/1000000", last["detail"])[1])
    assert last["event"] == "completed" and 1_500_000 < holdout < 1_800_000  # 3.4657 / 2.1 in millionths
    ours = [line for line in err.splitlines() if line.startswith("trainjob")]  # the Trainer keeps its own progress
    assert len(ours) == 1 and ours[0].startswith("trainjob: completed (exit 0): published "), ours
    assert ours[0].endswith(" vs baseline 3.4657 (lower is better; at most 4.33212 passes with max_drop 20%)")


@pytest.mark.process
@pytest.mark.killpoint
def test_a_sigterm_to_the_whole_process_group_twice_with_workers_on_every_loader_is_a_saved_step_and_75(tmp_path):
    """Slurm's preemption: SIGTERM to the process group, twice, half a second apart, with 2 workers
    on the train loader and 2 on the loader of an evaluation every 4 steps (eval_dataset), sent
    as step 12's evaluation begins. The
    integration guarded the train loader's workers only: the eval loader's died of the signal and
    the run ended 70 ("DataLoader worker ... is killed by signal"). Now every loader's workers
    outlive it: the step is saved, exit 75, and the relaunch publishes the uninterrupted bytes of
    the same script. Three launches: the uninterrupted one, the stopped one, the relaunch."""
    _needs_transformers()
    script = variant(tmp_path / "hf_eval_workers.py",
                     ("train_dataset=train)", "train_dataset=train, eval_dataset=holdout * 8)"),
                     ('save_strategy="steps",', 'save_strategy="steps", eval_strategy="steps", eval_steps=4,'))
    flags = ("--workers", "2")
    code, _, err = finish(tmp_path / "ref", *flags, script=script)
    assert code == 0, err[-2000:]
    pvc = tmp_path / "pvc"
    # Step 12's loss line is printed just before its evaluation (64 batches): the signal lands there.
    code, err = signalled(pvc, signal.SIGTERM, 12, script=script, flags=flags, group=True, twice=True)
    assert code == 75, err[-2000:]
    assert events(pvc)[-1]["event"] == "killed"
    code, _, err = finish(pvc, *flags, script=script)
    assert code == 0, err[-2000:]
    assert artifact(pvc) == artifact(tmp_path / "ref")


@pytest.mark.process
@pytest.mark.killpoint
def test_a_resume_at_an_epochs_end_with_an_evaluation_there_reaches_the_uninterrupted_bytes(tmp_path):
    """``eval_strategy="epoch"`` (the Transformers docs' choice) with a checkpoint on an epoch's last
    step: the evaluation after that step draws from the RNG streams (its loader's seed), so the
    checkpoint must hold them as they are after it, or a resume there trains the next epoch with
    other dropout masks. SIGKILL after that checkpoint; the relaunch publishes the uninterrupted
    run's bytes."""
    _needs_transformers()
    script = variant(tmp_path / "hf_eval_epoch.py",
                     ("train_dataset=train)", "train_dataset=train, eval_dataset=holdout)"),
                     ('save_strategy="steps",', 'save_strategy="steps", eval_strategy="epoch",'))
    flags = ("--save-steps", "6")  # 12 steps an epoch: checkpoints at 6, 12 (an epoch's end), 18, ...
    code, _, err = finish(tmp_path / "ref", *flags, script=script)
    assert code == 0, err[-2000:]
    pvc = tmp_path / "pvc"
    code, err = signalled(pvc, signal.SIGKILL, 13, script=script, flags=flags)
    assert code == -signal.SIGKILL, err[-2000:]
    assert [e["detail"] for e in events(pvc) if e["event"] == "checkpointed"][-1].startswith("step=12 ")
    code, _, err = finish(pvc, *flags, script=script)
    assert code == 0, err[-2000:]
    assert [e["detail"] for e in events(pvc) if e["event"] == "resumed"] == ["from_step=12"]
    assert artifact(pvc) == artifact(tmp_path / "ref")


EARLY = (("from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments",
          "from transformers import EarlyStoppingCallback, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments"),
         ('save_strategy="steps",', 'save_strategy="steps", eval_strategy="steps", eval_steps=3, '
                                    'metric_for_best_model="eval_loss",'),
         ("trainer = PrintLoss(model=model, args=training, train_dataset=train)",
          "trainer = PrintLoss(model=model, args=training, train_dataset=train, eval_dataset=holdout, callbacks=["
          "EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.05)])"))


@pytest.mark.process
@pytest.mark.killpoint
def test_an_early_stopping_callback_that_fires_ends_the_run_there_killed_or_not(tmp_path, capsys):
    """The example with the Transformers docs' EarlyStoppingCallback (an evaluation every 3 steps; it
    fires at step 33 of 36): the run checkpoints step 33, gates and publishes that model, `completed`.
    A SIGTERM during step 33 saves it with the decision (75) and the relaunch goes straight to the
    gate; prove's four trials are PROVEN. About twelve launches."""
    _needs_transformers()
    script = variant(tmp_path / "hf_early.py", *EARLY)
    code, lines, err = finish(tmp_path / "ref", script=script)
    assert code == 0 and max(lines) == 33, err[-2000:]
    log = events(tmp_path / "ref")
    assert [e["event"] for e in log][-3:] == ["checkpointed", "artifact_written", "completed"]
    assert log[-3]["detail"].startswith("step=33 ")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ref/artifacts/model-v1.safetensors"), "np") as f:
        assert json.loads(f.metadata()["trainjob.artifact"])["step"] == 33
    pvc = tmp_path / "pvc"
    # Step 33 is the last: read from its loss line, a SIGTERM could land after the run completed
    # (it did once, on a loaded machine). This copy holds step 33 for 3 s after printing its loss,
    # so the signal lands in it; the training is the same.
    printed = """print(f"step {self.state.global_step} loss {logs['loss']!r}", flush=True)"""
    held = variant(tmp_path / "hf_early_held.py", *EARLY, (printed, printed + "; __import__('time').sleep("
                                                                     "3 if self.state.global_step == 33 else 0)"))
    code, err = signalled(pvc, signal.SIGTERM, 33, script=held)
    assert code == 75 and events(pvc)[-1]["detail"].startswith("at_step=33 "), err[-2000:]
    code, lines, err = finish(pvc, script=script)
    assert code == 0 and not lines, err[-2000:]  # nothing trained: the gate
    assert [e["event"] for e in events(pvc)][-4:] == ["killed", "resumed", "artifact_written", "completed"]
    assert artifact(pvc) == artifact(tmp_path / "ref")
    from trainjob import cli
    code = cli.main(["prove", "--kills", "4", "--signal", "both", "--", sys.executable, str(script), "--pvc", "{pvc}"])
    out = capsys.readouterr().out
    assert code == 0 and "verdict: PROVEN" in out and out.count("same bytes, verified") == 4, out


@pytest.mark.process
def test_the_benchmark_times_each_contenders_stall_per_checkpoint(tmp_path):
    """scripts/bench_hf.py at a toy size: the Trainer with save_steps, hf.run and hf.run async, each
    with its step time and its held stall per checkpoint; it runs and reports, never a speed asserted."""
    _needs_transformers()
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_hf.py"), "--width", "32", "--steps", "4",
                           "--save-steps", "2", "--rounds", "1", "--json", str(tmp_path / "out.json")],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert set(runs) == {"trainer", "sync", "async"}
    for name, (run,) in runs.items():
        assert run["checkpoints"] == 2 and run["step"] > 0 and "held" in run, (name, run)
    assert "held stall per checkpoint, ms" in done.stdout and "train_runtime" not in done.stdout
