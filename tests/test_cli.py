"""End to end through the real CLI: the lab's walkthrough, exit codes, and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, events, snapshot, trainjob, untouched
from trainjob import cli

WALKTHROUGH = [
    ("job_started", "steps=10 attempt=1"),
    ("checkpointed", "step=2 loss_milli=310"),
    ("checkpointed", "step=4 loss_milli=241"),
    ("killed", "at_step=4"),
    ("resumed", "from_step=4"),
    ("checkpointed", "step=6 loss_milli=228"),
    ("checkpointed", "step=8 loss_milli=226"),
    ("checkpointed", "step=10 loss_milli=225"),
    ("artifact_written", "sha256=<hex> path=artifacts/model-v1.json"),
    ("completed", "holdout: 20/20 vs baseline 20/20"),
]


def hide_hash(pairs):
    return [(e, re.sub(r"sha256=[0-9a-f]{64}", "sha256=<hex>", d)) for e, d in pairs]


@pytest.mark.process
def test_walkthrough_event_for_event(pvc):
    assert trainjob("run", "--pvc", pvc, "--die-at", 4, "--steps", 10).returncode == 75
    assert json.loads((pvc / "checkpoint.json").read_text())["step"] == 4
    assert trainjob("run", "--pvc", pvc).returncode == 0
    log = pvc / "log.jsonl"
    assert hide_hash(events(log)) == WALKTHROUGH
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", json.loads(l)["ts"]) for l in log.read_text().splitlines())
    status = trainjob("status", log)
    assert status.returncode == 0
    assert status.stdout.splitlines() == [
        "lines: 10", "last_event: completed", "attempts: 1", "artifact: artifacts/model-v1.json", "drift: pass"]


@pytest.mark.process
def test_logged_sha256_is_the_hash_of_the_artifact_bytes(pvc):
    assert trainjob("run", "--pvc", pvc).returncode == 0
    detail = dict(events(pvc / "log.jsonl"))["artifact_written"]
    digest = re.search(r"sha256=([0-9a-f]{64})", detail).group(1)
    assert digest == hashlib.sha256((pvc / "artifacts/model-v1.json").read_bytes()).hexdigest()


@pytest.mark.process
def test_forced_zero_weights_fail_the_gate_honestly(pvc):
    result = trainjob("run", "--pvc", pvc, "--force-weights", "0,0,0")
    assert result.returncode == 1
    assert events(pvc / "log.jsonl")[-1] == (
        "drift_failed", "holdout: 14/20 vs baseline 20/20 (max drop 20%); refusing artifact")
    assert not (pvc / "artifacts").exists()
    status = trainjob("status", pvc / "log.jsonl")
    assert status.returncode == 1 and "drift: fail" in status.stdout and "artifact: none" in status.stdout


@pytest.mark.process
def test_backoff_limit_stops_the_loop(pvc):
    codes = [trainjob("run", "--pvc", pvc, "--backoff-limit", 1, "--force-weights", "0,0,0").returncode
             for _ in range(3)]
    assert codes == [1, 1, 1]
    names = [e for e, _ in events(pvc / "log.jsonl")]
    assert names.count("job_started") == 2 and names.count("drift_failed") == 2
    assert events(pvc / "log.jsonl")[-1] == ("job_failed", "attempts=2 backoffLimit=1")
    assert (pvc / "attempts").read_text().strip() == "2"


@pytest.mark.process
def test_die_at_a_step_without_checkpoint_repeats_that_step(pvc):
    assert trainjob("run", "--pvc", pvc, "--die-at", 3).returncode == 75
    assert trainjob("run", "--pvc", pvc).returncode == 0
    assert ("resumed", "from_step=2") in events(pvc / "log.jsonl")


@pytest.mark.process
def test_data_directory_from_gen_gives_the_same_artifact(tmp_path):
    assert trainjob("gen", tmp_path / "data").stdout.startswith("wrote train.jsonl (40), holdout.jsonl (20)")
    assert trainjob("run", "--pvc", tmp_path / "a", "--data", tmp_path / "data").returncode == 0
    assert trainjob("run", "--pvc", tmp_path / "b").returncode == 0
    assert snapshot(tmp_path / "a" / "artifacts") == snapshot(tmp_path / "b" / "artifacts")


@pytest.mark.process
def test_log_flag_puts_the_log_elsewhere(tmp_path, pvc):
    assert trainjob("run", "--pvc", pvc, "--log", tmp_path / "logs/run.jsonl").returncode == 0
    assert events(tmp_path / "logs/run.jsonl")[-1][0] == "completed"
    assert not (pvc / "log.jsonl").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--steps", "100000000"], "--steps must be at most 99999999 (a checkpoint's name holds the step in 8"),
        (["--backoff-limit", "9999"], "--backoff-limit must be at most 9998"),
        (["--ckpt-every", "0"], "--ckpt-every must be at least 1"),
        (["--die-at", "11"], "--die-at must be a step from 1 to --steps"),
        (["--backoff-limit", "-1"], "--backoff-limit"),
        (["--max-drop", "101"], "--max-drop"),
        (["--lr", "nan"], "--lr"),
        (["--force-weights", "0,0"], "three"),
        (["--steps", "ten"], "invalid int"),
    ],
)
@pytest.mark.process
def test_bad_flags_exit_2_with_one_line(pvc, flags, message):
    result = trainjob("run", "--pvc", pvc, *flags)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not pvc.exists()  # nothing written for a run that could never work


@pytest.mark.parametrize("command", [["run", "--pvc", ""], ["run", "--pvc", "p", "--log", ""], ["verify", "--pvc", ""],
                                     ["status", ""]])
def test_an_empty_path_is_a_usage_error_not_the_current_directory(tmp_path, monkeypatch, capsys, command):
    """pathlib reads "" as "."; before, `run --pvc ""` wrote `tate.json` and `ttempts` here."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(command)
    assert exited.value.code == 2 and "an empty path is no storage location" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_status_of_missing_log_is_exit_2_not_1(tmp_path):
    result = trainjob("status", tmp_path / "nope.jsonl")
    assert result.returncode == 2 and "not found" in result.stderr


@pytest.mark.process
def test_status_of_killed_run_is_75(pvc):
    trainjob("run", "--pvc", pvc, "--die-at", 2)
    assert trainjob("status", pvc / "log.jsonl").returncode == 75


@pytest.mark.process
def test_status_of_a_pvc_directory_reads_its_log(pvc):
    """`trainjob status pvc` was refused ("is a directory"): the PVC is what a user has in hand."""
    trainjob("run", "--pvc", pvc, "--die-at", 2)
    result = trainjob("status", pvc)
    assert result.returncode == 75 and "last_event: killed" in result.stdout, result.stderr
    assert trainjob("status", pvc, "--path").returncode == 75


@pytest.mark.process
def test_status_json(pvc):
    trainjob("run", "--pvc", pvc)
    result = trainjob("status", pvc / "log.jsonl", "--json")
    assert json.loads(result.stdout) == {"lines": 8, "last_event": "completed", "attempts": 1,
                                          "artifact": "artifacts/model-v1.json", "drift": "pass", "skipped": [],
                                          "supervisor": None}


@pytest.mark.process
def test_pvc_that_is_a_file_exits_2(tmp_path):
    (tmp_path / "f").write_text("mine")
    result = trainjob("run", "--pvc", tmp_path / "f")
    assert result.returncode == 2 and "must be a directory" in result.stderr
    assert (tmp_path / "f").read_text() == "mine"


@pytest.mark.parametrize(
    "name, content",
    [
        ("checkpoint.json", '{"step": 4, "weights": [0,0], "bias": 0, "loss_milli": 1}'),
        ("checkpoint.json", "{half"),
        ("state.json", '{"state": "checkpointed", "attempt": "one"}'),
        ("attempts", "-3"),
        ("attempts", "3"),  # valid on its own, but disagrees with state.json
        ("state.json", '{"state": "checkpoint3d", "attempt": 1, "lr": 0.05, "data_sha256": "' + "0" * 64 + '"}'),
    ],
)
@pytest.mark.process
def test_corrupt_pvc_file_exits_2_and_is_left_untouched(pvc, name, content):
    assert trainjob("run", "--pvc", pvc, "--die-at", 4).returncode == 75
    (pvc / name).write_text(content)
    before = snapshot(pvc)
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and name in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert snapshot(pvc) == before


@pytest.mark.process
def test_bad_data_exits_2_naming_file_and_line(tmp_path, pvc):
    trainjob("gen", tmp_path / "data")
    with open(tmp_path / "data/train.jsonl", "a") as f:
        f.write('{"x":[1,2,"3"],"y":1}\n')
    result = trainjob("run", "--pvc", pvc, "--data", tmp_path / "data")
    assert result.returncode == 2 and "train.jsonl:41" in result.stderr


@pytest.mark.process
def test_gen_refuses_to_overwrite_different_data(tmp_path):
    trainjob("gen", tmp_path / "data")
    (tmp_path / "data/baseline.json").write_text('{"weights":[0,0,0],"bias":0}')
    result = trainjob("gen", tmp_path / "data")
    assert result.returncode == 2 and "refusing to overwrite" in result.stderr
    assert (tmp_path / "data/baseline.json").read_text() == '{"weights":[0,0,0],"bias":0}'


@pytest.mark.process
def test_completed_pvc_refuses_a_new_run(pvc):
    assert trainjob("run", "--pvc", pvc).returncode == 0
    before = snapshot(pvc)
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and "already completed" in result.stderr
    assert snapshot(pvc) == before


@pytest.mark.process
def test_idempotent_relaunch_of_a_completed_job_exits_0_touching_nothing_but_the_lab_gets_its_refusal(pvc):
    assert trainjob("run", "--pvc", pvc).returncode == 0
    before = untouched(pvc)
    again = trainjob("run", "--pvc", pvc, "--idempotent")
    sha = hashlib.sha256((pvc / "artifacts/model-v1.json").read_bytes()).hexdigest()
    assert again.returncode == 0 and again.stderr == ""
    assert again.stdout == (f"trainjob run: already completed (attempt 1): artifacts/model-v1.json verified, "
                            f"sha256={sha}; nothing to do\n")
    lab = trainjob("run", "--pvc", pvc)  # a person at a terminal: the lab's rule
    assert lab.returncode == 2 and lab.stderr.endswith("already completed (attempt 1); use a fresh --pvc for a new job\n")
    assert untouched(pvc) == before


def _flip_a_byte(pvc):
    path = pvc / "artifacts/model-v1.json"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))


def _edit_the_logged_hash(pvc):
    log = pvc / "log.jsonl"
    log.write_text(re.sub(r"sha256=[0-9a-f]", "sha256=x", log.read_text()))


@pytest.mark.process
@pytest.mark.parametrize(("damage", "verdict"), [
    (_flip_a_byte, "corrupt"),
    (lambda pvc: (pvc / "artifacts/model-v1.json").unlink(), "missing"),
    (_edit_the_logged_hash, "corrupt"),
])
def test_a_completed_job_whose_artifact_fails_its_logged_hash_is_exit_2_never_success(pvc, damage, verdict):
    assert trainjob("run", "--pvc", pvc).returncode == 0
    damage(pvc)
    before = untouched(pvc)
    result = trainjob("run", "--pvc", pvc, "--idempotent")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert f"the job completed (attempt 1) but artifacts/model-v1.json is {verdict}" in line
    assert f"trainjob verify --pvc {pvc}" in line
    assert untouched(pvc) == before


@pytest.mark.process
def test_resume_with_other_settings_is_refused(pvc):
    trainjob("run", "--pvc", pvc, "--die-at", 4)
    result = trainjob("run", "--pvc", pvc, "--lr", "0.1")
    assert result.returncode == 2 and "same --lr" in result.stderr


@pytest.mark.process
def test_fresh_attempt_killed_before_its_first_checkpoint_starts_from_step_0(tmp_path, pvc):
    assert trainjob("run", "--pvc", pvc, "--force-weights", "0,0,0").returncode == 1  # attempt 1 ends at step 10
    assert trainjob("run", "--pvc", pvc, "--die-at", 1).returncode == 75  # attempt 2 dies before step 2's checkpoint
    assert trainjob("run", "--pvc", pvc).returncode == 0
    assert events(pvc / "log.jsonl")[-9:-7] == [("killed", "at_step=1"), ("resumed", "from_step=0")]
    clean = tmp_path / "clean"
    assert trainjob("run", "--pvc", clean).returncode == 0
    weights = [json.loads(p.read_text())["arrays"] for p in (pvc / "artifacts/model-v2.json", clean / "artifacts/model-v1.json")]
    assert weights[0] == weights[1]


@pytest.mark.process
def test_fresh_attempt_may_change_settings(pvc):
    assert trainjob("run", "--pvc", pvc, "--force-weights", "0,0,0").returncode == 1
    assert trainjob("run", "--pvc", pvc, "--lr", "0.1").returncode == 0
    assert events(pvc / "log.jsonl")[-2][1].endswith("path=artifacts/model-v2.json")


def test_internal_error_is_70_never_1(pvc, monkeypatch, capsys):
    def boom(*_args, **_kw):
        raise RuntimeError("a bug")

    from trainjob.engine.run import Run

    monkeypatch.setattr(Run, "_enter", boom)  # a bug inside the engine
    assert cli.main(["run", "--pvc", str(pvc)]) == 70
    assert "internal error" in capsys.readouterr().err


@pytest.mark.process
def test_status_into_a_closed_pipe_keeps_its_exit_code(pvc):
    trainjob("run", "--pvc", pvc, "--die-at", 2)
    result = subprocess.run(f"{sys.executable} -m trainjob status {pvc}/log.jsonl | head -c 0; exit ${{PIPESTATUS[0]}}",
                            shell=True, executable="/bin/bash", capture_output=True, text=True)
    assert result.returncode == 75 and "internal error" not in result.stderr


@pytest.mark.process
def test_nothing_created_is_group_or_world_writable_even_with_umask_0(tmp_path):
    script = f"import os, sys; os.umask(0); from trainjob.cli import main; sys.exit(main(['run', '--pvc', '{tmp_path}/a/b/pvc']))"
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0
    created = [tmp_path / "a", *(tmp_path / "a").rglob("*")]
    assert [p for p in created if p.stat().st_mode & 0o022] == []


@pytest.mark.parametrize("entry", ["artifacts", "log.jsonl", "state.json", ".lock"])
@pytest.mark.process
def test_a_pvc_entry_that_is_a_symlink_out_of_the_pvc_is_refused(tmp_path, pvc, entry):
    assert trainjob("run", "--pvc", pvc, "--die-at", 8).returncode == 75
    outside = tmp_path / "outside"
    outside.mkdir()
    target = pvc / entry
    target.unlink(missing_ok=True)  # artifacts does not exist yet: the run was killed at step 8
    target.symlink_to(outside / entry, target_is_directory=entry == "artifacts")
    before = snapshot(pvc)
    result = trainjob("run", "--pvc", pvc)
    assert result.returncode == 2 and "symlink" in result.stderr
    assert list(outside.iterdir()) == [] and snapshot(pvc) == before


@pytest.mark.process
def test_a_sigterm_after_the_outcome_is_decided_does_not_change_the_exit_code(tmp_path):
    """Python puts the default SIGTERM action back while it shuts down, and a run that has logged
    `completed` may be told to stop in that instant: it must still exit with its decided code, not
    be killed by the signal (143 to Kubernetes, which would relaunch a finished job). The SIGTERM
    here comes from an exit hook, once main has returned, to a command that never handles it."""
    script = ("import atexit, os, signal; atexit.register(os.kill, os.getpid(), signal.SIGTERM); "
              "from trainjob.cli import entry; entry()")
    result = subprocess.run([sys.executable, "-c", script, "status", str(tmp_path / "missing.jsonl")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result


@pytest.mark.parametrize("command", [["diagram"], ["k8s", "render"], ["status", "LOG"], ["status", "LOG", "--path"]])
@pytest.mark.process
def test_a_closed_stdout_is_one_line_and_exit_2_not_silence_or_70(walkthrough_log, command):
    # `cmd >&-`: Python starts without sys.stdout, and print() to it silently does nothing.
    argv = [str(walkthrough_log) if a == "LOG" else a for a in command]
    result = subprocess.run([sys.executable, "-m", "trainjob", *argv], capture_output=False, text=True,
                            stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1), timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"trainjob {command[0]}: stdout is closed: nothing was written (redirect it to a file)\n"


@pytest.mark.process
def test_stdout_on_a_full_device_is_storage_trouble_75(tmp_path):
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "trainjob", "diagram"], stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=60)
    assert result.returncode == 75
    assert result.stderr == "trainjob diagram: stdout: cannot write: No space left on device\n"


# --- --help and the CLI reference ----------------------------------------------------------------

def test_help_shows_each_default_as_the_cli_reference_does(monkeypatch):
    """The site's CLI reference (scripts/mkdocs_hooks.py) and `--help` read one parser: every
    default the reference's column shows, `--help` appends to that argument's help; a 0 is shown,
    an empty string is not shown as a pair of backquotes."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import mkdocs_hooks

    rows = {}
    for command, _, parser in mkdocs_hooks.subcommands(cli.build_parser()):
        helped = " ".join(parser.format_help().split())
        formatter = parser._get_formatter()
        for action in parser._actions:
            name, default, _ = mkdocs_hooks._argument(action, formatter)
            rows[f"{command} {name}"] = default
            if default not in ("", "required"):
                said = re.escape(default.strip("`"))
                assert re.search(rf"\(default:? {said}[);]", helped), f"{command} {name}"
    assert rows["trainjob prove `--seed` `SEED`"] == "`0`"
    assert rows["trainjob k8s render `--s3-secret` `S3_SECRET`"] == ""
    assert rows["trainjob run `--steps` `STEPS`"] == "`10`"
