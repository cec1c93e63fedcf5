"""Scripts written as the Transformers, PEFT and datasets docs write them (tests/integrations/scripts/hf_*.py),
with `hf.run` in place of `trainer.train()`, under `trainjob prove --kills 4 --signal both` (issue 58's
acceptance) and the checks each finding needs: a PEFT LoRA fine-tune whose checkpoints hold the adapter
and its optimizer state, not the base, and whose artifact PEFT loads.

Slow: each launch imports transformers (and peft, datasets: seconds of CPU); a prove is a reference
run and four trials, each relaunched to its end (a few minutes on a loaded 2-core machine). Each test
says how many launches it makes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, built_once, skip_without

pytestmark = pytest.mark.acceptance
SCRIPTS = ROOT / "tests/integrations/scripts"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def needs(*modules: str) -> None:
    for module in ("transformers", *modules):
        skip_without(module, f"needs {module} (the test extra)")


def run(script: Path, pvc: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), "--pvc", str(pvc), *flags], env=ENV, capture_output=True,
                          text=True, timeout=900)


def events(pvc: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (pvc / "log.jsonl").read_text().splitlines()]


def prove(script: Path, capsys, *flags: str) -> str:
    from trainjob import cli

    code = cli.main(["prove", "--kills", "4", "--signal", "both", "--", sys.executable, str(script), "--pvc", "{pvc}",
                     *flags])
    out = capsys.readouterr().out
    assert code == 0 and "verdict: PROVEN" in out and out.count("same bytes, verified") == 4, out
    return out


def variant(source: Path, target: Path, *changes: tuple[str, str]) -> Path:
    text = source.read_text()
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new)
    target.write_text(text)
    return target


# --- a PEFT LoRA fine-tune --------------------------------------------------------------------------------

LORA = SCRIPTS / "hf_peft_lora.py"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """The LoRA script's uninterrupted PVC (one launch, once per test run)."""
    needs("peft", "datasets")

    def build(directory: Path) -> None:
        done = run(LORA, directory / "pvc")
        assert done.returncode == 0, done.stderr[-3000:]

    return built_once(tmp_path_factory, "hf-peft-lora", build) / "pvc"


@pytest.mark.process
def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_not_the_base(lora_run):
    """The uninterrupted run (shared): every checkpoint's tensors are the LoRA weights and AdamW's state
    over them; the base is referenced by its digest in the rank part, not written."""
    from safetensors import safe_open

    steps = [p for p in sorted((lora_run / "checkpoints").glob("step-*")) if (p / "manifest.json").exists()]
    assert steps
    for step in steps:
        names = [t["name"] for t in json.loads((step / "manifest.json").read_text())["tensors"]]
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
        with safe_open(str(step / "shard-00000-of-00001.safetensors"), "np") as shard:
            (path, part), = json.loads(shard.metadata()["trainjob.local"])
        assert path == ["rank"] and part["frozen"]["tensors"] == 29  # the GPT-2's, lm_head included
        assert sum(f.stat().st_size for f in step.iterdir()) < part["frozen"]["bytes"] * 0.6


@pytest.mark.process
def test_the_published_adapter_loads_with_peft_and_merges_into_the_plain_model(lora_run, tmp_path):
    """PEFT's two ways to load an adapter, on the artifact as published, and its merge: in a process
    of its own (it imports transformers and peft)."""
    code = f"""
import shutil, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, set_seed
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, set_peft_model_state_dict

def base():
    set_seed(0)
    return AutoModelForCausalLM.from_config(GPT2Config(vocab_size=14, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                                       pad_token_id=0, bos_token_id=0, eos_token_id=0))
artifact = {str(lora_run / "artifacts/model-v1.safetensors")!r}
config = LoraConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, r=8, lora_alpha=32, lora_dropout=0.1)
one = get_peft_model(base(), config)
assert not set_peft_model_state_dict(one, load_file(artifact)).unexpected_keys
config.save_pretrained({str(tmp_path)!r})
shutil.copy(artifact, {str(tmp_path / "adapter_model.safetensors")!r})
two = PeftModel.from_pretrained(base(), {str(tmp_path)!r})
untrained = get_peft_model(base(), config)
ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
for m in (one, two, untrained):
    m.eval()
a, b, c = (m(input_ids=ids).logits for m in (one, two, untrained))
merged = two.merge_and_unload()
assert type(merged).__name__ == "GPT2LMHeadModel"
assert torch.equal(a, b) and not torch.equal(a, c) and torch.allclose(merged(input_ids=ids).logits, a, atol=1e-5)
"""
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.process
def test_the_trainers_output_dir_is_not_left_behind_empty(lora_run):
    """The Trainer makes output_dir when it is built; under hf.run nothing is written there."""
    assert not lora_run.with_name("pvc-trainer").exists()
    assert (lora_run / "checkpoints").is_dir()


@pytest.mark.process
def test_save_total_limit_is_honoured_as_the_checkpoints_kept(tmp_path):
    """One launch of the quicktour with save_total_limit=2 (3 epochs, a checkpoint each): 2 are kept."""
    needs("peft", "datasets")
    script = variant(LORA, tmp_path / "limit.py", ('save_strategy="epoch",', 'save_strategy="epoch", save_total_limit=2,'))
    done = run(script, tmp_path / "pvc")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len([e for e in events(tmp_path / "pvc") if e["event"] == "checkpointed"]) == 3
    kept = [p.name for p in (tmp_path / "pvc/checkpoints").iterdir() if p.name.startswith("step-")]
    assert sorted(kept) == ["step-00000016-a0001-w001", "step-00000024-a0001-w001"], kept


@pytest.mark.process
def test_the_quicktours_load_best_model_at_end_is_refused_in_one_line_naming_the_gate(tmp_path):
    """One launch of the quicktour's own arguments: exit 2, one line that says what to do instead."""
    needs("peft", "datasets")
    script = variant(LORA, tmp_path / "best.py", ('save_strategy="epoch",', 'save_strategy="epoch", '
                                                                           'load_best_model_at_end=True,'))
    done = run(script, tmp_path / "pvc")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "load_best_model_at_end" in last and "gate=hf.metric('eval_loss', baseline=...)" in last, last
    assert not (tmp_path / "pvc/checkpoints").exists() or not any((tmp_path / "pvc/checkpoints").iterdir())


@pytest.mark.process
@pytest.mark.killpoint
def test_prove_finds_the_peft_lora_fine_tune_proven(capsys):
    """About nine launches: prove's reference and four trials (SIGKILL and SIGTERM, each phase)."""
    needs("peft", "datasets")
    prove(LORA, capsys)


@pytest.mark.process
@pytest.mark.killpoint
def test_a_relaunch_that_builds_another_base_model_is_refused_exit_2_and_loads_nothing(tmp_path):
    """Two launches: SIGTERM once the first checkpoint is committed (75), then the same script with
    the base drawn from another seed: exit 2, one line naming the frozen parameters, the PVC's
    checkpoints as they were."""
    needs("peft", "datasets")
    pvc = tmp_path / "pvc"
    proc = subprocess.Popen([sys.executable, str(LORA), "--pvc", str(pvc)], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not ((pvc / "log.jsonl").exists() and "checkpointed" in (pvc / "log.jsonl").read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 75, proc.stderr.read()[-3000:]
    before = sorted(p.name for p in (pvc / "checkpoints").iterdir())
    other = variant(LORA, tmp_path / "other_base.py",
                    ("model = AutoModelForCausalLM.from_config(", "set_seed(1)\nmodel = AutoModelForCausalLM.from_config("))
    done = run(other, pvc)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "frozen parameters" in last and "not those the checkpoint was trained on" in last, last
    assert sorted(p.name for p in (pvc / "checkpoints").iterdir()) == before
    assert events(pvc)[-1]["event"] == "killed"
    shutil.rmtree(tmp_path / "pvc-trainer", ignore_errors=True)


# --- masked-LM: random masks in every batch ----------------------------------------------------------------

MLM = SCRIPTS / "hf_masked_lm.py"


@pytest.mark.process
@pytest.mark.killpoint
@pytest.mark.parametrize("workers", ["0", "2"], ids=["main-process", "2-loader-workers"])
def test_prove_finds_a_masked_lm_run_with_random_masks_proven(capsys, workers):
    """About nine launches each: the collator's masks drawn in the main process, or in two loader
    workers; on main both DIVERGED (the masks of batches collated ahead of the checkpoint were
    drawn again from other numbers)."""
    needs("datasets")
    prove(MLM, capsys, "--workers", workers)


# --- a stream: an IterableDataset over three passes, shuffled with a buffer ----------------------------------

STREAM = SCRIPTS / "hf_streaming.py"


@pytest.mark.process
@pytest.mark.killpoint
def test_prove_finds_a_streaming_run_over_three_passes_proven(capsys):
    """About nine launches: 30 steps, three passes of 10 over an IterableDataset shuffled with a
    buffer; on main a resume past the first pass DIVERGED (it started the first pass again)."""
    needs("datasets")
    out = prove(STREAM, capsys)
    assert "between checkpoints" in out


@pytest.mark.process
def test_a_stream_without_max_steps_is_exit_2_in_one_line_before_anything_is_written(tmp_path):
    """One launch: the Trainer refuses to be built (its ValueError and traceback ended in exit 1)."""
    needs("datasets")
    script = variant(STREAM, tmp_path / "no_max_steps.py", ("    max_steps=args.max_steps,\n", ""))
    done = run(script, tmp_path / "pvc")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("trainjob: ") and "max_steps=N" in last and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "pvc").exists()
