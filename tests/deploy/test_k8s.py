"""`trainjob k8s render`: schema-valid manifests, the semantics a schema cannot check, and a Job
controller's view of the real program's exit codes."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_validate.utils import all_versions
from packaging.version import Version

from conftest import ROOT, events, io_calls, killpoint, trainjob
from trainjob.deploy import k8s
from trainjob.cli import JOB_ACTION_FOR_EXIT, build_parser, main
from trainjob.errors import UsageError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"
OLDEST = "1.29"  # first release with podFailurePolicy and podReplacementPolicy both on by default
SHIPPED = sorted({".".join(v.split(".")[:2]) for v in all_versions()}, key=Version)
SUPPORTED = [v for v in SHIPPED if Version(v) >= Version(OLDEST)]


def render(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["k8s", "render", *argv])
    return code, out.getvalue()


def manifests(*argv: str) -> list[dict]:
    code, text = render(*argv)
    assert code == 0
    return list(yaml.safe_load_all(text))


def check_semantics(docs: list[dict], *, world_size: int = 1, backoff_limit: int = 2) -> None:
    """What the schema cannot say. Raises AssertionError naming the broken rule."""
    claim, *service, job = docs
    assert (claim["kind"], job["kind"]) == ("PersistentVolumeClaim", "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]

    # Never with a failure policy; one pod at a time on the claim; time to checkpoint.
    assert pod["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    assert pod["terminationGracePeriodSeconds"] >= 1 and spec["activeDeadlineSeconds"] >= 1

    # Rule order: preemption is ignored before any exit code is looked at.
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    seen: set[int] = set()
    for rule in rules[1:]:
        codes = rule["onExitCodes"]
        assert codes["operator"] == "In" and codes["containerName"] == container["name"]
        values = codes["values"]
        assert values == sorted(set(values)), "exit codes must be sorted and unique"
        assert 0 not in values, "0 is success, never a failure to match"
        assert not seen & set(values), "an exit code in two rules"
        seen |= set(values)
        assert all(JOB_ACTION_FOR_EXIT[code] == rule["action"] for code in values)
    assert seen == set(JOB_ACTION_FOR_EXIT)

    # The two budgets: the Job ends on the pod whose run logs job_failed.
    assert spec["backoffLimit"] == backoff_limit + 1

    # The claim is mounted where the run keeps its state, and the run checks its own flags.
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume["name"]
    rank_flags = ["--world-size", str(world_size)] if world_size > 1 else []
    assert args[len(args) - len(rank_flags):] == rank_flags and "--rank" not in args
    ran = build_parser().parse_args(args[: len(args) - len(rank_flags)])
    assert ran.command == "run" and str(ran.pvc) == mount["mountPath"] and ran.backoff_limit == backoff_limit

    # One writer (W = 1) or W ranks on a shared claim, each taking its rank from the Job's index.
    assert spec["completions"] == spec["parallelism"] == world_size
    if world_size == 1:
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert spec.get("completionMode", "NonIndexed") == "NonIndexed" and "env" not in container
    else:
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert spec["completionMode"] == "Indexed"
        index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        env = {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index}}}
        assert env in container.get("env", [])
        check_rendezvous(service, job, world_size)
    assert bool(service) == (world_size > 1), "a Service only for ranks to meet through"


def check_rendezvous(service: list[dict], job: dict, world_size: int,
                     tail: tuple[str, ...] = ("-m", "trainjob")) -> None:
    """W > 1: trainjob's torchrun in every pod (the job's exit code, not torchrun's), the c10d
    rendezvous at index 0, reached by its stable DNS name through a headless Service whose name is
    the pods' subdomain (Kubernetes' documented pattern); ``tail``: what torchrun runs (an own
    loop's script and its arguments)."""
    assert len(service) == 1, "one headless Service for the ranks to meet through"
    (svc,) = service
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None", "the Service must be headless"
    assert svc["spec"]["publishNotReadyAddresses"] is True, "index 0's name must resolve while pods start"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), "the Service must select the pods"
    assert pod["spec"].get("subdomain") == svc["metadata"]["name"], "pods get DNS names under the Service"
    command = container["command"]
    assert command[:2] == ["trainjob", "torchrun"], "plain torchrun exits 1 or by a signal: not the job's code"
    assert command[-len(tail):] == list(tail), "one trainjob rank per torchrun"
    launcher = torchrun_parser().parse_args(command[2:-len(tail)])
    assert (launcher.rdzv_backend, launcher.nnodes, launcher.nproc_per_node) == ("c10d", str(world_size), "1")
    host, port = launcher.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}", "the rendezvous is index 0's pod"
    assert int(port) in [p["targetPort"] for p in svc["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert launcher.rdzv_id == job["metadata"]["name"] and launcher.max_restarts == 0


def torchrun_parser():
    """torchrun's own command-line parser, for the flags before the script part (``-m trainjob``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="torchrun")
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    return parser


# --- the schema, offline, in strict mode -----------------------------------------------------------

CASES = {
    "default": [],
    "indexed": ["--world-size", "4"],
    "everything": ["--name", "exp-7", "--image", "registry.example/trainjob:1", "--storage", "500Mi",
                   "--backoff-limit", "0", "--grace", "5", "--deadline", "600",
                   "--", "run", "--steps", "20", "--ckpt-every", "5"],
    "bucket": ["--pvc", "s3://jobs/exp-7", "--s3-secret", "exp-7-aws"],
}


# An own loop (a script around trainjob.Run) in place of `trainjob run`: its PVC said by {pvc},
# by an absolute --pvc (the claim is mounted there) or by an s3:// one (no claim).
OWN_LOOPS = {
    "own loop": ["--", "python", "examples/own_loop.py", "--pvc", "{pvc}", "--steps", "4"],
    "own loop at its path": ["--", "python3", "examples/own_loop.py", "--pvc=/data/job"],
    "own loop indexed": ["--world-size", "3", "--", "python", "examples/own_loop.py", "--pvc", "{pvc}"],
    "own loop module in a bucket": ["--world-size", "2", "--", "python", "-m", "train.loop", "--pvc", "s3://jobs/e"],
}


def test_claimed_versions_are_shipped_by_the_validator():
    assert SUPPORTED[0] == OLDEST and len(SUPPORTED) >= 2


@pytest.mark.parametrize("version", SUPPORTED)
@pytest.mark.parametrize("case", [*CASES, *OWN_LOOPS])
def test_every_manifest_validates_strictly_on_every_supported_version(case, version):
    for doc in manifests(*{**CASES, **OWN_LOOPS}[case]):
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_is_not_vacuous():
    claim, job = manifests()
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, SUPPORTED[-1], strict=True)


def test_versions_before_the_oldest_claimed_reject_the_job():
    # 1.28's schema requires onPodConditions on every rule; its podReplacementPolicy was alpha.
    _, job = manifests()
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.28", strict=True)


def test_docs_name_the_versions_the_tests_validate():
    assert f"{OLDEST} through {SUPPORTED[-1]}" in DOCS.read_text()


# --- what the schema cannot check ----------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if c != "bucket"])  # bucket: its own test below
def test_rendered_semantics(case):
    argv = CASES[case]
    world = int(argv[argv.index("--world-size") + 1]) if "--world-size" in argv else 1
    limit = int(argv[argv.index("--backoff-limit") + 1]) if "--backoff-limit" in argv else 2
    check_semantics(manifests(*argv), world_size=world, backoff_limit=limit)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 64), limit=st.integers(0, 20), grace=st.integers(1, 3600),
       deadline=st.integers(1, 10**6))
def test_semantics_hold_for_any_valid_flags(world, limit, grace, deadline):
    docs = manifests("--world-size", str(world), "--backoff-limit", str(limit), "--grace", str(grace),
                     "--deadline", str(deadline))
    check_semantics(docs, world_size=world, backoff_limit=limit)
    pod = docs[-1]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace and docs[-1]["spec"]["activeDeadlineSeconds"] == deadline


def _rules(job):
    return job["spec"]["podFailurePolicy"]["rules"]


BREAKAGES = {
    "disruption rule not first": lambda job: _rules(job).reverse(),
    "zero under In": lambda job: _rules(job)[2]["onExitCodes"]["values"].insert(0, 0),
    "unsorted codes": lambda job: _rules(job)[2]["onExitCodes"]["values"].reverse(),
    "duplicate code": lambda job: _rules(job)[1]["onExitCodes"]["values"].append(2),
    "code in two rules": lambda job: _rules(job)[1]["onExitCodes"]["values"].append(75),
    "restart in place": lambda job: job["spec"]["template"]["spec"].update(restartPolicy="OnFailure"),
    "budgets disagree": lambda job: job["spec"].update(backoffLimit=6),
    "overlapping pods": lambda job: job["spec"].update(podReplacementPolicy="TerminatingOrFailed"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_semantic_checks_catch_each_breakage(breakage):
    claim, job = manifests()
    BREAKAGES[breakage](job)
    with pytest.raises(AssertionError):
        check_semantics([claim, job])


def test_indexed_checks_catch_a_missing_index_env():
    claim, service, job = manifests("--world-size", "2")
    del job["spec"]["template"]["spec"]["containers"][0]["env"]
    with pytest.raises(AssertionError):
        check_semantics([claim, service, job], world_size=2)


def _command(job):
    return job["spec"]["template"]["spec"]["containers"][0]["command"]


INDEXED_BREAKAGES = {
    "no service": lambda docs: docs.pop(1),
    "service with a cluster IP": lambda docs: docs[1]["spec"].update(clusterIP="10.0.0.7"),
    "no subdomain": lambda docs: docs[2]["spec"]["template"]["spec"].pop("subdomain"),
    "rendezvous at index 1": lambda docs: _command(docs[2]).__setitem__(
        _command(docs[2]).index("--rdzv-endpoint") + 1, "trainjob-1.trainjob:29400"),
    "static rendezvous": lambda docs: _command(docs[2]).__setitem__(
        _command(docs[2]).index("--rdzv-backend") + 1, "static"),
    "trainjob without torchrun": lambda docs: docs[2]["spec"]["template"]["spec"]["containers"][0].update(
        command=["trainjob"]),
    "plain torchrun": lambda docs: _command(docs[2]).__delitem__(0),
}


@pytest.mark.parametrize("breakage", INDEXED_BREAKAGES)
def test_rendezvous_checks_catch_each_breakage(breakage):
    docs = manifests("--world-size", "2")
    INDEXED_BREAKAGES[breakage](docs)
    with pytest.raises(AssertionError):
        check_semantics(docs, world_size=2)


def test_a_name_that_cannot_name_the_service_is_refused_at_w_above_1():
    assert render("--name", "7b")[0] == 0  # a Job alone may be named so
    with pytest.raises(UsageError, match="--name must start with a letter with --world-size above 1"):
        k8s.Target(name="7b", world_size=2).check()


def test_output_is_plain_yaml_without_aliases():
    _, text = render("--world-size", "3")
    assert "&id" not in text and "*id" not in text
    assert list(yaml.safe_load_all(text)) == k8s.manifests(
        k8s.Target(world_size=3), JOB_ACTION_FOR_EXIT)


def test_docs_show_what_render_prints():
    block = re.search(r"prints exactly this.*?```yaml\n(.*?)```", DOCS.read_text(), re.S)
    assert block is not None and block[1] == render()[1]


# --- bad flags -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--backoff-limit", "-1"], ["--world-size", "0"], ["--world-size", "-2"], ["--name", "Trainjob"],
    ["--name", "train_job"], ["--name", "x" * 64], ["--name", "trainjob-"], ["--storage", "0Gi"],
    ["--storage", "1GB"], ["--image", ""], ["--grace", "0"], ["--deadline", "0"],
    ["--", "run", "--pvc", "/elsewhere"], ["--", "run", "--backoff-limit", "5"], ["--", "run", "--steps", "0"],
    ["--", "gen", "data"], ["--", "run", "--no-such-flag"],
])
@pytest.mark.process
def test_bad_flags_are_one_line_and_exit_2(argv):
    done = trainjob("k8s", "render", *argv)
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1


# --- the Job controller's view of the real program ------------------------------------------------

def job_action(rules: list[dict], exit_code: int, conditions: set[str]) -> str:
    """What the Job controller does with one failed pod: the first matching rule, else Count."""
    for rule in rules:
        if "onPodConditions" in rule:
            if any(c["type"] in conditions for c in rule["onPodConditions"]):
                return rule["action"]
        elif exit_code in rule["onExitCodes"]["values"]:  # operator In; exit 0 never reaches here
            return rule["action"]
    return "Count"


@pytest.mark.parametrize(("limit", "preempted"), [(0, False), (1, True), (2, False)])
@pytest.mark.process
def test_the_job_fails_on_the_very_pod_that_logs_job_failed(tmp_path, limit, preempted):
    """Run the rendered command as the Job would, pod after pod, against the rendered policy."""
    _, job = manifests("--backoff-limit", str(limit), "--", "run", "--force-weights", "0,0,0")
    spec = job["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    pvc = tmp_path / "pvc"
    args = [str(pvc) if arg == k8s.MOUNT else arg for arg in container["args"]]
    log = pvc / "log.jsonl"

    failed, pods, last_events = 0, 0, []
    while True:
        pods += 1
        disrupted = preempted and pods == 1  # the node is drained: SIGTERM, checkpoint, exit 75
        extra = ["--die-at", "4"] if disrupted else []
        code = trainjob(*args, *extra).returncode
        last_events.append(json.loads(log.read_text().splitlines()[-1])["event"])
        assert code != 0
        action = job_action(spec["podFailurePolicy"]["rules"], code, {"DisruptionTarget"} if disrupted else set())
        assert action in ("Ignore", "Count")
        failed += action == "Count"
        if failed > spec["backoffLimit"]:
            break  # the Job is Failed: BackoffLimitExceeded
        assert last_events[-1] != "job_failed", "the Job started a pod after the run said job_failed"

    assert last_events[-1] == "job_failed" and last_events.count("job_failed") == 1
    assert last_events.count("drift_failed") == limit + 1
    assert pods == limit + 2 + preempted


@pytest.mark.process
@pytest.mark.killpoint
def test_a_pod_killed_after_the_job_completed_is_replaced_by_one_that_succeeds(tmp_path):
    """The issue's failure: a pod OOM-killed in the instant after it logged `completed` (137,
    counted) is replaced; the replacement, running the rendered command, must exit 0 and the Job
    succeed. If the published artifact no longer matches its logged hash, the Job fails at once."""
    _, job = manifests("--", "run", "--steps", "3")
    spec = job["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    pvc = tmp_path / "pvc"
    args = [str(pvc) if arg == k8s.MOUNT else arg for arg in container["args"]]
    exit_path = io_calls(*(str(tmp_path / "count") if arg == str(pvc) else arg for arg in args))
    oom = killpoint(exit_path, *args)
    assert oom.returncode == -9 and json.loads((pvc / "log.jsonl").read_text().splitlines()[-1])["event"] == "completed"
    assert job_action(spec["podFailurePolicy"]["rules"], 128 + 9, set()) == "Count" and 1 <= spec["backoffLimit"]

    replacement = trainjob(*args)
    assert replacement.returncode == 0, replacement.stderr  # the Job is Complete
    assert "already completed (attempt 1): artifacts/model-v1.json verified" in replacement.stdout

    (pvc / "artifacts/model-v1.json").write_text("{}\n")
    damaged = trainjob(*args)
    assert job_action(spec["podFailurePolicy"]["rules"], damaged.returncode, set()) == "FailJob"


def test_a_bucket_pvc_renders_a_job_without_a_claim_its_credentials_from_a_named_secret():
    docs = manifests("--pvc", "s3://jobs/exp-7", "--s3-secret", "exp-7-aws")
    assert [d["kind"] for d in docs] == ["Job"]  # no PersistentVolumeClaim, so no ReadWriteMany either
    pod = docs[0]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "volumes" not in pod and "volumeMounts" not in container
    assert container["envFrom"] == [{"secretRef": {"name": "exp-7-aws"}}]
    assert container["args"][:3] == ["run", "--pvc", "s3://jobs/exp-7"]
    assert manifests("--pvc", "s3://jobs/x")[0]["spec"]["template"]["spec"]["containers"][0]["envFrom"] == \
        [{"secretRef": {"name": "trainjob-s3"}}]
    for bad in (["--pvc", "/var/data"], ["--pvc", "s3://jobs/x", "--s3-secret", "Bad_Name"]):
        assert render(*bad)[0] == 2
    # W > 1 on a bucket: the ranks meet through the Service and torchrun's store, and share only
    # the bucket, so there is no claim and no ReadWriteMany to find.
    service, job = manifests("--pvc", "s3://jobs/x", "--world-size", "3")
    assert (service["kind"], job["kind"], job["spec"]["completions"]) == ("Service", "Job", 3)
    pod = job["spec"]["template"]["spec"]
    assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "trainjob-s3"}}]
    assert pod["containers"][0]["command"][:2] == ["trainjob", "torchrun"]


# --- own loops: a script around trainjob.Run, made idempotent by the pod's environment -------------

def pod_env(container: dict) -> dict[str, str]:
    """The container's plain environment variables (the downward-API ones left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def check_own_loop(docs: list[dict], script: list[str], *, world_size: int, mount: str | None) -> None:
    """An own loop's pods: the Job's contract unchanged (the policy, the budgets, one writer, the
    rendezvous at W > 1), the script as the command (under `trainjob torchrun` at W > 1), its
    --pvc where the claim is mounted (or the bucket), and its Run made idempotent."""
    *volume, job = docs
    assert (job["kind"], [d["kind"] for d in volume]) == (
        "Job", [*(["PersistentVolumeClaim"] if mount else []), *(["Service"] if world_size > 1 else [])])
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert _rules(job) == manifests()[1]["spec"]["podFailurePolicy"]["rules"]
    assert spec["backoffLimit"] == 3 and spec["podReplacementPolicy"] == "Failed" and pod["restartPolicy"] == "Never"
    # At W > 1 the launcher also learns the PVC, to find a completed job before any rendezvous.
    where = {"TRAINJOB_PVC": mount or script[-1]} if world_size > 1 else {}
    assert pod_env(container) == {"TRAINJOB_IDEMPOTENT": "1", **where}, \
        "a relaunch after `completed` must exit 0, not 2"
    command = [*container["command"], *container.get("args", [])]
    python, *program = script
    if world_size > 1:  # torchrun runs the script with its own interpreter
        tail = tuple(p.replace("{pvc}", mount or "") for p in program)
        check_rendezvous(volume[-1:], job, world_size, tail)
        assert "args" not in container and "--world-size" not in command  # torchrun's WORLD_SIZE
        index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        assert {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index}}} in container["env"]
    else:
        assert command == [python, *(p.replace("{pvc}", mount or "") for p in program)]
    if mount:
        (claim_volume,) = pod["volumes"]
        assert claim_volume["persistentVolumeClaim"]["claimName"] == volume[0]["metadata"]["name"]
        assert container["volumeMounts"] == [{"name": claim_volume["name"], "mountPath": mount}]
        assert mount in command or f"--pvc={mount}" in command, "the script writes where the claim is"
    else:
        assert "volumes" not in pod and container["envFrom"] == [{"secretRef": {"name": "trainjob-s3"}}]


@pytest.mark.parametrize(("case", "mount"), [("own loop", k8s.MOUNT), ("own loop at its path", "/data/job"),
                                             ("own loop indexed", k8s.MOUNT), ("own loop module in a bucket", None)])
def test_an_own_loop_renders_the_same_job_with_its_script_made_idempotent(case, mount):
    argv = OWN_LOOPS[case]
    world = int(argv[argv.index("--world-size") + 1]) if "--world-size" in argv else 1
    check_own_loop(manifests(*argv), argv[argv.index("--") + 1:], world_size=world, mount=mount)


def test_the_pods_of_trainjob_run_keep_their_flag_and_get_no_idempotent_environment():
    for argv in ([], ["--world-size", "2"]):
        container = manifests(*argv)[-1]["spec"]["template"]["spec"]["containers"][0]
        assert "--idempotent" in container["args"] and "TRAINJOB_IDEMPOTENT" not in pod_env(container)


def test_own_loop_checks_catch_a_pod_without_the_idempotent_environment():
    docs = manifests(*OWN_LOOPS["own loop"])
    docs[-1]["spec"]["template"]["spec"]["containers"][0].pop("env")
    with pytest.raises(AssertionError, match="must exit 0"):
        check_own_loop(docs, OWN_LOOPS["own loop"][1:], world_size=1, mount=k8s.MOUNT)


@pytest.mark.parametrize(("argv", "says"), [
    (["python"], "got no script"),
    (["python", "loop.py"], "cannot tell where loop.py keeps the job's files"),
    (["python", "loop.py", "--pvc", "pvc"], "must be an absolute path"),
    (["python", "loop.py", "--pvc", "/"], "must be an absolute path other than /"),
    (["python", "-u", "loop.py", "--pvc", "{pvc}"], "only -m of Python's options"),
    (["python", "-m"], "needs a module name"),
    (["python", "-m", "trainjob", "run"], "render `-- run ARGS...`"),
    (["python", "loop.py", "--pvc", "s3://Bad_Bucket/x"], "not a valid S3 bucket name"),
    (["gen", "data"], "expected `-- run ARGS...` or `-- python SCRIPT ARGS...`"),
])
def test_an_own_loop_whose_pod_could_not_run_as_the_job_is_refused_with_exit_2(argv, says, capsys):
    assert render("--", *argv) == (2, "")
    assert says in capsys.readouterr().err


def test_an_own_loop_and_render_pvc_must_name_the_same_bucket():
    loop = ["--", "python", "loop.py", "--pvc"]
    assert render("--pvc", "s3://jobs/a", *loop, "s3://jobs/b")[0] == 2
    assert render("--pvc", "s3://jobs/a", *loop, "/data")[0] == 2
    (job,) = manifests("--pvc", "s3://jobs/a", *loop, "{pvc}")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["loop.py", "--pvc", "s3://jobs/a"]
    (job,) = manifests("--pvc", "s3://jobs/a", *loop, "s3://jobs/a")
    assert "volumes" not in job["spec"]["template"]["spec"]


@pytest.mark.process
def test_an_own_loop_pod_relaunched_after_completed_exits_0_with_the_rendered_environment(tmp_path):
    """The issue's failure for own loops: examples/own_loop.py run as the rendered pod runs it, to
    completion; a replacement pod (an OOM kill after `completed`) with the rendered environment
    verifies the artifact and exits 0 (the Job succeeds); the same command without it is the lab's
    refusal, 2, which the policy turns into FailJob. A damaged artifact is still 2 with it. Slower
    than 20 s under load: four launches of a torch script (about 14 s of CPU, torch's import in
    each), each a pod of its own, which one launch could not show."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("examples/own_loop.py is a torch script (trainjob[torch])")
    _, job = manifests("--", "python", "examples/own_loop.py", "--pvc", "{pvc}", "--steps", "4", "--ckpt-every", "2")
    rules = _rules(job)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    pvc = tmp_path / "pvc"
    # The pod's command here: this interpreter, the repository as the image's working directory,
    # the claim's mount at the test's PVC.
    argv = [sys.executable, *(str(pvc) if a == k8s.MOUNT else a for a in container["args"])]
    bare = {k: v for k, v in os.environ.items() if k != "TRAINJOB_IDEMPOTENT"}
    pod = {**bare, **pod_env(container)}

    def launch(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    first = launch(pod)
    assert first.returncode == 0 and events(pvc / "log.jsonl")[-1][0] == "completed", first.stderr[-2000:]
    log = (pvc / "log.jsonl").read_bytes()

    replacement = launch(pod)
    assert replacement.returncode == 0, replacement.stderr[-2000:]  # the Job is Complete
    assert "already completed (attempt 1): artifacts/model-v1.safetensors verified" in replacement.stderr
    refused = launch(bare)  # the same pod without the rendered environment
    assert refused.returncode == 2 and job_action(rules, 2, set()) == "FailJob", refused.stderr[-2000:]
    assert "already completed" in refused.stderr and (pvc / "log.jsonl").read_bytes() == log

    artifact = pvc / "artifacts/model-v1.safetensors"
    artifact.write_bytes(artifact.read_bytes()[:-1] + b"?")
    damaged = launch(pod)
    assert damaged.returncode == 2 and "cannot be trusted" in damaged.stderr, damaged.stderr[-2000:]
