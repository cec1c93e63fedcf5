"""Hostile input, round two (issue 19): each class of input that broke a promise, through the real
CLI in a subprocess with a timeout and a memory limit. Every case asserts the exit code, exactly one
line on stderr, no traceback, and that the PVC is unchanged (or took the documented fallback).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, snapshot, trainjob

pytestmark = pytest.mark.process  # every test here runs the CLI or torchrun in a subprocess

MEMORY = 1 << 30  # address space of each child: far above a healthy run, far below the harm
HELPERS = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests/helpers"), os.environ.get("PYTHONPATH", "")])}


def hostile(*args: str | Path, timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a child limited to MEMORY bytes of address space and ``timeout`` seconds."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))

    return subprocess.run([sys.executable, "-m", "trainjob", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, env=env)


def refused(result: subprocess.CompletedProcess, code: int, says: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


@pytest.fixture(scope="module")
def killed_pvc(tmp_path_factory) -> Path:
    """A PVC whose run was killed at step 4 (checkpoints 2 and 4 committed): what relaunches find."""
    pvc = tmp_path_factory.mktemp("killed") / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4, "--steps", 10).returncode == 75
    return pvc


def copy(pvc: Path, tmp_path: Path) -> Path:
    shutil.copytree(pvc, tmp_path / "pvc", symlinks=True)
    return tmp_path / "pvc"


def newest(pvc: Path, pattern: str = "shard-*") -> Path:
    return sorted(pvc.glob(f"checkpoints/step-*/{pattern}"))[-1]


def logged(pvc: Path) -> list[str]:
    return [json.loads(line)["event"] for line in (pvc / "log.jsonl").read_text().splitlines()]


def tamper(pvc: Path, shard: bytes | None = None, edit=lambda manifest: None) -> None:
    """Rewrite the newest checkpoint's shard and/or manifest, keeping every size and sha256 in
    agreement (the header's and the one slice's digests and their root, as schema 2 and later
    hash a shard, and dropping checkpoint.json's hash of the manifest), so only the hostile part
    is wrong: what a resume must catch by bounds and headers, not by hashes."""
    path = newest(pvc)
    if shard is not None:
        path.write_bytes(shard)
    manifest = path.parent / "manifest.json"
    record = json.loads(manifest.read_text())
    data, entry = path.read_bytes(), record["shards"][0]
    head = data[:8 + int.from_bytes(data[:8], "little")]
    parts = [hashlib.sha256(head).digest(), hashlib.sha256(data[len(head):]).digest()]  # the lab's one tensor
    (hold,) = entry["holds"]
    hold["sha256"] = parts[1].hex()
    entry.update(size=len(data), header=len(head), header_sha256=parts[0].hex(),
                 sha256=hashlib.sha256(b"".join(parts)).hexdigest())
    edit(record)
    manifest.write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
    (pvc / "checkpoint.json").unlink()


def falls_back(pvc: Path) -> None:
    """The documented fallback: the damaged checkpoint set aside, the older one resumed, exit 0."""
    result = hostile("run", "--pvc", pvc)
    assert "Traceback" not in result.stderr and result.returncode == 0, result.stderr
    assert "checkpoint_rejected" in logged(pvc)


# --- 1: sizes in a manifest are checked against the files before anything is sized from them --------

def absurd_world_size(record):
    record["world_size"] = 10 ** 9  # list(range(world_size)) alone would cost gigabytes


def absurd_shape(record):
    for entry in (*record["tensors"], *record["shards"][0]["holds"]):
        entry["shape"] = [10 ** 12]  # np.empty of it: 8 TB


@pytest.mark.parametrize("edit", [absurd_world_size, absurd_shape])
def test_absurd_manifest_sizes_are_that_checkpoints_failure_for_run_verify_and_reshard(killed_pvc, tmp_path, edit):
    pvc = copy(killed_pvc, tmp_path)
    tamper(pvc, edit=edit)
    result = hostile("verify", "--pvc", pvc)
    assert result.returncode == 1 and "corrupt" in result.stdout and "Traceback" not in result.stderr, result.stderr
    refused(hostile("reshard", "--pvc", pvc, "--world-size", 2), 2, "--step")  # never an older step unasked
    result = hostile("reshard", "--pvc", pvc, "--world-size", 2, "--step", 2)  # the older one, named: it verifies
    assert result.returncode == 0 and "step 2" in result.stdout, result.stderr
    falls_back(pvc)


# --- 2: a shard header nested too deeply is that checkpoint's verification failure ------------------

def test_a_deeply_nested_shard_header_falls_back_to_the_older_checkpoint(killed_pvc, tmp_path):
    pvc = copy(killed_pvc, tmp_path)
    header = b"[" * 100_000 + b"]" * 100_000
    tamper(pvc, shard=len(header).to_bytes(8, "little") + header)
    falls_back(pvc)


# --- 3: verify calls ok exactly what a resume loads -------------------------------------------------

def test_verify_checks_shard_headers_as_a_resume_does(killed_pvc, tmp_path):
    pvc = copy(killed_pvc, tmp_path)
    raw = newest(pvc).read_bytes()
    assert raw.count(b'"dtype":"F64"') == 1
    tamper(pvc, shard=raw.replace(b'"dtype":"F64"', b'"dtype":"I64"'))  # same size, hashes agree
    result = hostile("verify", "--pvc", pvc)
    assert result.returncode == 1, result.stdout
    assert "is I64[4], the manifest says F64[4]" in result.stdout
    falls_back(pvc)


# --- 4: what is not a regular file is refused without blocking ------------------------------------

@pytest.mark.parametrize("target", ["state.json", "checkpoint.json", "attempts", "log.jsonl", ".lock"])
@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_a_special_file_on_the_pvc_is_refused_without_hanging(killed_pvc, tmp_path, target, kind):
    pvc = copy(killed_pvc, tmp_path)
    (pvc / target).unlink()
    if kind == "fifo":
        os.mkfifo(pvc / target)
    elif kind == "socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(pvc / target))
    else:
        os.mknod(pvc / target, 0o644 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's
    before = snapshot(pvc)
    refused(hostile("run", "--pvc", pvc), 2, target)
    assert snapshot(pvc) == before


def test_a_fifo_for_a_shard_falls_back_and_verify_does_not_hang(killed_pvc, tmp_path):
    pvc = copy(killed_pvc, tmp_path)
    shard = newest(pvc)
    shard.unlink()
    os.mkfifo(shard)
    result = hostile("verify", "--pvc", pvc)
    assert result.returncode == 1, result.stdout + result.stderr
    assert any(line.startswith("corrupt") and shard.parent.name in line for line in result.stdout.splitlines())
    result = hostile("run", "--pvc", pvc)
    assert "Traceback" not in result.stderr and result.returncode == 0, result.stderr
    assert "checkpoint_rejected" in logged(pvc)


def test_a_fifo_for_an_artifact_does_not_hang_verify(tmp_path):
    pvc = tmp_path / "pvc"
    assert trainjob("run", "--pvc", pvc).returncode == 0
    artifact = pvc / "artifacts/model-v1.json"
    artifact.unlink()
    os.mkfifo(artifact)
    result = hostile("verify", "--pvc", pvc)
    assert result.returncode == 1 and "is a FIFO" in result.stdout, result.stdout + result.stderr


def test_gen_over_a_fifo_is_refused_without_hanging(tmp_path):
    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data/train.jsonl")
    refused(hostile("gen", tmp_path / "data"), 2, "is a FIFO")


# --- 11: --data files are regular files of bounded size, read without following them into devices --

@pytest.mark.parametrize("kind, says", [("fifo", "is a FIFO"), ("zero", "is a character device"),
                                        ("huge", "more than"), ("link", None)])
def test_data_files_are_regular_bounded_files(tmp_path, kind, says):
    data = tmp_path / "data"
    assert trainjob("gen", data).returncode == 0
    train = data / "train.jsonl"
    if kind == "link":  # a link to a regular file is followed: a ConfigMap mounts files as links
        train.rename(tmp_path / "train.jsonl")
        train.symlink_to(tmp_path / "train.jsonl")
        assert hostile("run", "--pvc", tmp_path / "pvc", "--data", data).returncode == 0
        return
    train.unlink()
    if kind == "fifo":
        os.mkfifo(train)
    elif kind == "zero":
        train.symlink_to("/dev/zero")
    else:
        with open(train, "wb") as f:
            f.truncate(4 << 30)  # sparse: 4 GiB that cost no disk
    refused(hostile("run", "--pvc", tmp_path / "pvc", "--data", data), 2, says)
    assert not (tmp_path / "pvc").exists()


# --- 12: status, status --path and plot read logs in flat memory and summarise what they skip -------

def test_one_enormous_log_line_costs_no_memory(walkthrough_log, tmp_path):
    log = tmp_path / "log.jsonl"
    shutil.copy(walkthrough_log, log)
    with open(log, "ab") as f:
        f.truncate(f.tell() + (700 << 20))  # one 700 MiB line of NULs (sparse), under a 1 GiB limit
    for flags in ([], ["--path"]):
        result = hostile("status", log, *flags, timeout=120)
        assert "Traceback" not in result.stderr and result.returncode == 0, result.stderr
        assert "longer than 65536 bytes; not read" in result.stdout


def test_a_million_garbage_lines_are_summarised_not_printed(walkthrough_log, tmp_path):
    """Slow (about 3 s of CPU per read): `status` and `status --path` each parse a million lines."""
    log = tmp_path / "log.jsonl"
    log.write_bytes(walkthrough_log.read_bytes() + b"x\n" * 1_000_000)
    for flags in ([], ["--path"]):
        result = hostile("status", log, *flags, timeout=120)
        assert result.returncode == 0, result.stderr
        skipped = [line for line in result.stdout.splitlines() if line.startswith("skipped: ")]
        assert len(skipped) == 6 and skipped[-1] == "skipped: 999995 more line(s) that are not valid events"


# --- 5: a read-only file system is storage trouble (75) everywhere, the lock included --------------

@pytest.fixture
def read_only_pvc(tmp_path):
    """A killed run's PVC on a tmpfs, remounted read-only (what ext4 does after a disk error)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        assert trainjob("run", "--pvc", mount / "pvc", "--die-at", 4, "--steps", 10).returncode == 75
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        yield mount / "pvc"
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_relaunch_on_a_read_only_pvc_is_75_not_2(read_only_pvc):
    before = snapshot(read_only_pvc)
    refused(hostile("run", "--pvc", read_only_pvc), 75, "Read-only file system")
    assert snapshot(read_only_pvc) == before


def test_reshard_on_a_read_only_pvc_is_75(read_only_pvc):
    refused(hostile("reshard", "--pvc", read_only_pvc, "--world-size", 2), 75, "Read-only file system")


# --- 6: what a terminal would interpret is escaped, in every command --------------------------------

FORGED = "ok\x1b[2J\rcheckpoint\nverdict: ok"


def test_status_escapes_event_names_details_and_key_names(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [{"ts": "2026-11-30T10:03:24Z", "event": "job_started", "detail": "steps=10 attempt=1"},
             {"ts": "2026-11-30T10:03:24Z", "event": FORGED, "detail": FORGED},
             {"ts": "2026-11-30T10:03:24Z", "event": "killed", "detail": "at_step=1", FORGED: 1}]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for flags in ([], ["--path"]):
        result = hostile("status", log, *flags)
        assert "\x1b" not in result.stdout + result.stderr and "\r" not in result.stdout + result.stderr
        assert not any(line.startswith("verdict: ok") for line in result.stdout.splitlines())
        assert "ok\\x1b[2J\\rcheckpoint\\nverdict: ok" in result.stdout + result.stderr


def test_verify_escapes_directory_names(killed_pvc, tmp_path):
    pvc = tmp_path / "pvc"
    subprocess.run(["cp", "-a", str(killed_pvc), str(pvc)], check=True)
    (pvc / "checkpoints" / FORGED).mkdir()
    result = hostile("verify", "--pvc", pvc)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\r" not in result.stdout
    assert [l for l in result.stdout.splitlines() if l.startswith("verdict")] == ["verdict: ok"]


# --- 7: an unusable --log is exit 2 up front, not 75 on every launch ------------------------------

@pytest.mark.parametrize("kind", ["/dev/null", "/dev/full", "fifo", "directory"])
def test_a_log_that_is_not_a_regular_file_is_refused_up_front(tmp_path, kind):
    log = Path(kind) if kind.startswith("/") else tmp_path / "log"
    if kind == "fifo":
        os.mkfifo(log)
    elif kind == "directory":
        log.mkdir()
    refused(hostile("run", "--pvc", tmp_path / "pvc", "--log", log), 2, str(log))
    assert not (tmp_path / "pvc").exists()


# --- 9: ordinary bad input is exit 2, never 70 ----------------------------------------------------

LONG = "x" * 300  # longer than any file system's NAME_MAX (255)


@pytest.mark.parametrize("flag", ["--pvc", "--data", "--log"])
def test_a_path_component_too_long_is_a_usage_error(tmp_path, flag):
    paths = {"--pvc": tmp_path / "pvc", "--data": None, "--log": None, flag: tmp_path / LONG / "x"}
    argv = [a for f, p in paths.items() if p is not None for a in (f, p)]
    refused(hostile("run", *argv), 2, "File name too long")
    assert not (tmp_path / "pvc").exists()


@pytest.mark.parametrize("command, code", [(["status"], 75), (["plot", "-o", "out.png"], 2)])
def test_a_number_too_long_to_convert_is_not_a_crash(tmp_path, command, code):
    log = tmp_path / "log.jsonl"
    huge = "9" * 5000  # beyond Python's int conversion limit (4300 digits)
    events = [("job_started", f"steps=10 attempt={huge}"), ("checkpointed", f"step={huge} loss_milli={huge}"),
              ("killed", "at_step=²")]  # a digit str.isdigit() accepts and int() refuses
    log.write_text("".join(json.dumps({"ts": "2026-11-30T10:03:24Z", "event": e, "detail": d}) + "\n"
                           for e, d in events))
    result = hostile(command[0], log, *command[1:], timeout=60)
    assert "Traceback" not in result.stderr and result.returncode == code, result.stderr


# --- 10: --trainer is checked before it is called; what it raises is a usage error ------------------

@pytest.mark.parametrize("spec, says", [
    ("shutil:rmtree", "the factory must accept (data, lr) by those names"),  # would delete --data
    ("os:remove", "must be a class or a function"),               # a builtin: no signature to check
    ("user_trainers:raises", "'user_trainers:raises': the factory raised ZeroDivisionError"),
    ("user_trainers:exits", "'user_trainers:exits': the factory raised SystemExit"),
])
def test_a_trainer_factory_is_checked_before_the_call_and_its_errors_are_usage_errors(tmp_path, spec, says):
    data = tmp_path / "data"
    assert trainjob("gen", data).returncode == 0
    before = snapshot(data)
    refused(hostile("run", "--pvc", tmp_path / "pvc", "--data", data, "--trainer", spec, env=HELPERS), 2, says)
    assert snapshot(data) == before and not (tmp_path / "pvc").exists()


# --- 13: k8s render refuses the world sizes run refuses ---------------------------------------------

@pytest.mark.torchrun
def test_k8s_render_bounds_the_world_size_as_run_does(tmp_path):
    refused(hostile("k8s", "render", "--world-size", 65), 2, "--world-size must be from 1 to 64")
    refused(hostile("run", "--pvc", tmp_path / "pvc", "--world-size", 65), 2, "--world-size must be from 1 to 64")


# --- 8: the PVC lock cannot be unlinked away ----------------------------------------------------------

def test_deleting_the_lock_file_under_a_running_job_admits_no_second_writer(tmp_path):
    pvc = tmp_path / "pvc"
    long_run = ["run", "--pvc", str(pvc), "--steps", "10000000", "--ckpt-every", "1000000"]
    first = subprocess.Popen([sys.executable, "-m", "trainjob", *long_run], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ((pvc / "log.jsonl").exists() and "job_started" in logged(pvc)):
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read() if first.poll() else ""
            time.sleep(0.02)
        (pvc / ".lock").unlink()
        refused(hostile(*long_run), 75, "another trainjob run holds this PVC")
        assert first.poll() is None  # the first run was still training while the second was refused
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 75
    assert logged(pvc) == ["job_started", "checkpointed", "killed"]  # no line from a second writer
