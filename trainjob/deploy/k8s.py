"""Kubernetes manifests that run trainjob on a cluster: a PersistentVolumeClaim and a batch/v1 Job.

Owns how trainjob's contract becomes Job fields: one pod writes the PVC at a time, SIGTERM gets
time to checkpoint, preemption never spends the retry budget, and the Job's ``backoffLimit`` ends
the Job on the very pod whose run logs ``job_failed``, and a pod run again after the job completed
exits 0. With W > 1 ranks, an Indexed Job whose pods run ``trainjob torchrun`` (torchrun that exits
with the job's code) with the c10d rendezvous at index 0, reached through a headless Service: the
ranks agree through torch's store, and the shared claim holds only data. docs/kubernetes.md explains each choice.

An own loop (a script around ``trainjob.Run``: ``k8s render -- python SCRIPT ARGS``) gets the same
Job with the script as the container's command (under ``trainjob torchrun`` at W > 1) and
``TRAINJOB_IDEMPOTENT=1`` in its environment, which makes its ``Run`` idempotent as
``--idempotent`` makes ``trainjob run``. Where the script keeps its PVC is read from its own
arguments (``own_loop``): ``{pvc}``, or a ``--pvc`` naming an absolute path (the claim is mounted
there) or a bucket.

It builds plain dicts and dumps them with PyYAML's ``safe_dump_all``; it never builds YAML text
by hand, talks to a cluster, or reads a file. It knows no exit codes: ``cli.py`` owns them and
passes the Job action for each one. It does not check the run's own flags either: ``cli.py``
parses the container's command line with trainjob's own parser before rendering it.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..defaults import BACKOFF_LIMIT, IDEMPOTENT_ENV, VERSION
from ..errors import UsageError, importing

MOUNT = "/var/lib/trainjob"  # where the PVC appears in the container; the run's --pvc
CONTAINER = "trainjob"
INDEX_ENV = "JOB_COMPLETION_INDEX"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
RDZV_PORT = 29400  # torchrun's default c10d rendezvous port, served by index 0's torchrun agent
# At W > 1, an own loop's pods name its PVC here: `trainjob torchrun` reads it to find a job that
# already completed before any rendezvous, as it does for `-m trainjob run` (a pod recreated alone
# must not wait for peers that finished).
PVC_ENV = "TRAINJOB_PVC"
PVC_PLACEHOLDER = "{pvc}"  # in an own loop's arguments: where the job's files are (as `trainjob prove` has it)
# Exit-code rules in this order, after the DisruptionTarget rule that always comes first. Any code
# no rule names (a signal, 137 from an OOM kill) is counted: the Job's default.
ACTION_ORDER = ("FailJob", "Ignore", "Count")

# A Job name ends up in the pods' job-name label, so it must be a DNS-1123 label (at most 63).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")  # python, python3, python3.12, or a path to one


def is_python(word: str) -> bool:
    """Whether a command after ``--`` starts with a Python interpreter: an own loop, not ``run``."""
    return bool(_PYTHON.fullmatch(posixpath.basename(word)))


@attrs.frozen
class OwnLoop:
    """An own loop's command as a pod runs it: the script (or ``-m MODULE``) and its arguments,
    ``{pvc}`` replaced; ``mount`` where the claim goes, ``bucket`` the s3:// PVC its --pvc names."""

    python: str  # the interpreter named, run at W = 1 (at W > 1 torchrun runs its own)
    program: tuple[str, ...]  # (SCRIPT,) or ("-m", MODULE)
    args: tuple[str, ...]
    mount: str = ""
    bucket: str = ""


def own_loop(argv: Sequence[str], bucket: str = "", mount: str = MOUNT) -> OwnLoop:
    """Read ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``): UsageError for a command a pod
    cannot run as the job, or one whose PVC cannot be told.

    Where the script keeps the job's files must be known, or they die with the pod: ``{pvc}`` in
    its arguments is replaced by the claim's ``mount`` (or ``bucket``, ``k8s render --pvc``), else its
    ``--pvc PATH`` (or ``--pvc=PATH``) says it: an absolute path is where the claim is mounted, an
    ``s3://`` URL is the bucket (no claim). Only ``-m`` of Python's own options is taken: at
    W > 1 the script runs under torchrun, which passes none other on.
    """
    python, *rest = argv
    if not rest:
        raise UsageError(f"expected `-- {python} SCRIPT ARGS...` (an own loop around trainjob.Run), got no script")
    if rest[0] in ("-m", "--module"):
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            raise UsageError(f"`{python} -m` needs a module name, got {' '.join(rest[1:2]) or 'nothing'}")
        if rest[1] == "trainjob":
            raise UsageError("for `trainjob run`, render `-- run ARGS...` (the Job passes it --pvc and "
                             "--idempotent itself)")
        program, args = tuple(rest[:2]), tuple(rest[2:])
    elif rest[0].startswith("-"):
        raise UsageError(f"{python} {rest[0]}: only -m of Python's options can be rendered (torchrun runs the "
                         "script at W > 1 and passes no other); give the script or -m MODULE first")
    else:
        program, args = (rest[0],), tuple(rest[1:])
    if any(PVC_PLACEHOLDER in arg for arg in args):
        where = bucket or mount
        return OwnLoop(python, program, tuple(arg.replace(PVC_PLACEHOLDER, where) for arg in args),
                       mount="" if bucket else mount, bucket=bucket)
    named = _flag_value(args, "--pvc")
    if named is None:
        raise UsageError(f"cannot tell where {program[-1]} keeps the job's files, so they would die with the pod: "
                         f"pass the script --pvc {PVC_PLACEHOLDER} (replaced by the claim's mount, {mount}), "
                         "or --pvc with an absolute path or an s3:// URL")
    if named.startswith("s3://"):
        if bucket and bucket.rstrip("/") != named.rstrip("/"):
            raise UsageError(f"the script's --pvc {named} is not k8s render's --pvc {bucket}; give one, "
                             f"or pass the script --pvc {PVC_PLACEHOLDER}")
        return OwnLoop(python, program, args, bucket=named)
    if bucket:
        raise UsageError(f"k8s render --pvc {bucket} but the script's --pvc is {named}; pass the script "
                         f"--pvc {PVC_PLACEHOLDER}")
    if not posixpath.isabs(named) or posixpath.normpath(named) == "/":
        raise UsageError(f"the script's --pvc {named!r} must be an absolute path other than / (the claim is "
                         f"mounted there), or {PVC_PLACEHOLDER}")
    return OwnLoop(python, program, args, mount=posixpath.normpath(named))


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value ``args`` give ``flag`` (argparse's rule: a later one wins)."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1:]
    return found


@attrs.frozen
class Target:
    """What to render: the ``k8s render`` flags, with the run's arguments already checked."""

    name: str = "trainjob"
    image: str = f"trainjob:{VERSION}"
    storage: str = "1Gi"
    world_size: int = 1
    backoff_limit: int = BACKOFF_LIMIT  # the run's own --backoff-limit
    grace: int = 60
    deadline: int = 3600
    run_args: tuple[str, ...] = ()  # extra `trainjob run` flags, after --pvc and --backoff-limit
    bucket: str = ""  # an s3://BUCKET/PREFIX PVC: no claim is rendered, credentials come from ``secret``
    secret: str = ""  # the Secret holding AWS_* for a bucket PVC (default NAME-s3)
    loop: OwnLoop | None = None  # an own loop's script, in place of `trainjob run`
    mount: str = MOUNT  # where the claim appears in the container

    def check(self) -> None:
        """Raise UsageError for a flag Kubernetes would reject or that breaks the contract."""
        if not _DNS_LABEL.fullmatch(self.name):
            raise UsageError(
                f"--name must be a DNS-1123 label (lowercase letters, digits and '-', starting and "
                f"ending with a letter or digit, at most 63 characters), got {self.name!r}"
            )
        if not self.image or any(ch.isspace() for ch in self.image):
            raise UsageError(f"--image must be a container image reference without spaces, got {self.image!r}")
        match = _QUANTITY.fullmatch(self.storage)
        if match is None or float(match[1]) == 0:
            raise UsageError(f"--storage must be a positive Kubernetes quantity such as 1Gi or 500Mi, "
                             f"got {self.storage!r}")
        with importing("the checkpoint plan"):
            from ..checkpoint.plan import world_size_problem  # the run's own bound; records and cattrs, so late

        if (problem := world_size_problem(self.world_size)) is not None:  # run's own bound: no pod exits 2
            raise UsageError(problem)
        if self.world_size > 1 and not self.name[0].isalpha():  # the Service's name is a DNS-1035 label
            raise UsageError(f"--name must start with a letter with --world-size above 1 (it also names the "
                             f"headless Service the ranks meet through), got {self.name!r}")
        if self.grace < 1:  # 0 means SIGKILL at once: no checkpoint, the kill loses the step
            raise UsageError(f"--grace must be at least 1 second, long enough to checkpoint, got {self.grace}")
        if self.deadline < 1:
            raise UsageError(f"--deadline must be at least 1 second, got {self.deadline}")
        if self.secret and not _DNS_LABEL.fullmatch(self.secret):
            raise UsageError(f"--s3-secret must be a Secret name (a DNS-1123 label), got {self.secret!r}")

    @property
    def claim(self) -> str:
        return f"{self.name}-data"

    @property
    def credentials(self) -> str:
        return self.secret or f"{self.name}-s3"

    @property
    def pvc(self) -> str:
        """The run's --pvc: the claim's mount, or the bucket."""
        return self.bucket or self.mount

    @property
    def job_backoff_limit(self) -> int:
        """The Job's backoffLimit: the program's budget B allows B + 1 failed attempts.

        Every attempt that fails the drift gate is a pod exiting 1 (counted), so after B + 1 of
        them the Job has spent exactly its limit; the next pod's run logs ``job_failed`` and exits
        1, which exceeds it: the Job fails on that same pod and never starts another.
        """
        return self.backoff_limit + 1

    def run_flags(self) -> list[str]:
        """The `trainjob run` flags every pod passes, whatever its rank.

        ``--idempotent``: Kubernetes may run a pod again after its work is done (an OOM kill, an
        eviction or a lost node in the instant after the model was published); that pod must
        verify the artifact and exit 0, not fail the Job with the lab's refusal (exit 2).
        """
        return ["--pvc", self.pvc, "--backoff-limit", str(self.backoff_limit), "--idempotent", *self.run_args]

    def container_args(self) -> list[str]:
        """The container's ``trainjob`` arguments (Kubernetes wants every one a string).

        With W > 1 each pod is one rank: it passes the world size, and torchrun (``launcher``)
        gives it its rank ($RANK), which ``run`` reads when --rank is absent.
        """
        if self.loop is not None:  # W > 1: the launcher's own command ends with the script
            return [] if self.world_size > 1 else [*self.loop.program, *self.loop.args]
        ranks = ["--world-size", str(self.world_size)] if self.world_size > 1 else []
        return ["run", *self.run_flags(), *ranks]

    def command(self) -> list[str]:
        """The container's command: ``trainjob``; an own loop's interpreter; at W > 1 the launcher."""
        if self.world_size > 1:
            return self.launcher()
        return [self.loop.python] if self.loop is not None else ["trainjob"]

    def env(self) -> list[dict[str, Any]]:
        """The container's environment: an own loop's ``Run`` made idempotent (the pods of
        ``trainjob run`` pass ``--idempotent`` instead), and at W > 1 the completion index."""
        env: list[dict[str, Any]] = []
        if self.loop is not None:
            env.append({"name": IDEMPOTENT_ENV, "value": "1"})
            if self.world_size > 1:
                env.append({"name": PVC_ENV, "value": self.pvc})
        if self.world_size > 1:
            # The control plane injects this too; declaring it (the same downward-API field) makes
            # the rank's source explicit in the manifest and independent of that convenience.
            env.append({"name": INDEX_ENV, "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}})
        return env

    @property
    def rendezvous(self) -> str:
        """Index 0's stable name through the headless Service: ``<job>-0.<service>``."""
        return f"{self.name}-0.{self.name}:{RDZV_PORT}"

    def launcher(self) -> list[str]:
        """The command of a W > 1 pod: ``trainjob torchrun`` (torchrun's agent, exiting with the
        job's code rather than torchrun's 1 or a signal: ranks/torchrun.py), one trainjob rank per
        pod, meeting the others through the c10d rendezvous that index 0's agent hosts (its store
        is also where the ranks agree, ranks/store.py). No torchrun restarts: the Job relaunches
        pods and trainjob resumes from the claim."""
        return ["trainjob", "torchrun", "--nnodes", str(self.world_size), "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rendezvous, "--rdzv-id", self.name,
                "--max-restarts", "0",
                *(["-m", "trainjob"] if self.loop is None else [*self.loop.program, *self.loop.args])]


def pod_failure_policy(actions: Mapping[int, str]) -> dict[str, Any]:
    """Ordered rules: DisruptionTarget -> Ignore first, then one rule per action over exit codes.

    A preempted or evicted pod usually exits 75 after its checkpoint; matching the condition
    before any exit code means preemption never spends the budget, whatever the code. Exit 0 is
    never listed: Kubernetes rejects it under ``In``, and a pod that exits 0 has not failed.
    """
    unknown = set(actions.values()) - set(ACTION_ORDER)
    if unknown:  # a typo in cli.py's table must not silently drop a rule
        raise ValueError(f"unknown Job actions {sorted(unknown)}; expected one of {ACTION_ORDER}")
    rules: list[dict[str, Any]] = [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    for action in ACTION_ORDER:
        codes = sorted({code for code, act in actions.items() if act == action and code != 0})
        if codes:
            rules.append({"action": action,
                          "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": codes}})
    return {"rules": rules}


def manifests(target: Target, actions: Mapping[int, str]) -> list[dict[str, Any]]:
    """The PersistentVolumeClaim, the headless Service (W > 1) and the Job, in the order
    ``kubectl apply`` should create them."""
    def labels() -> dict[str, str]:  # a fresh dict each time: a shared one dumps as a YAML alias
        return {"app.kubernetes.io/name": "trainjob", "app.kubernetes.io/instance": target.name}

    indexed = target.world_size > 1
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": target.claim, "labels": labels()},
        "spec": {
            # One writer: ReadWriteOnce. W ranks on any nodes share one volume: ReadWriteMany.
            "accessModes": ["ReadWriteMany" if indexed else "ReadWriteOnce"],
            "resources": {"requests": {"storage": target.storage}},
        },
    }
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": target.image,
        "command": target.command(),
        **({"args": args} if (args := target.container_args()) else {}),
        "volumeMounts": [{"name": "pvc", "mountPath": target.mount}],
    }
    if target.bucket:  # no volume: the bucket is reached over the network, with the Secret's AWS_* keys
        del container["volumeMounts"]
        container["envFrom"] = [{"secretRef": {"name": target.credentials}}]
    if indexed:
        container["ports"] = [{"name": "c10d", "containerPort": RDZV_PORT}]
    if env := target.env():
        container["env"] = env
    job_spec: dict[str, Any] = {
        "completions": target.world_size,
        "parallelism": target.world_size,
        **({"completionMode": "Indexed"} if indexed else {}),
        "backoffLimit": target.job_backoff_limit,
        "activeDeadlineSeconds": target.deadline,
        # A replacement pod starts only once the old one has fully terminated, so two pods never
        # write the PVC at once (a terminating pod may still be saving its checkpoint).
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": pod_failure_policy(actions),
        "template": {
            "metadata": {"labels": labels()},
            "spec": {
                "restartPolicy": "Never",  # required by podFailurePolicy; the Job relaunches
                # Each pod gets the DNS name <job>-<index>.<service>: index 0's is the rendezvous.
                **({"subdomain": target.name} if indexed else {}),
                "terminationGracePeriodSeconds": target.grace,
                "containers": [container],
                **({} if target.bucket else
                   {"volumes": [{"name": "pvc", "persistentVolumeClaim": {"claimName": target.claim}}]}),
            },
        },
    }
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": target.name, "labels": labels()}, "spec": job_spec}
    volume = [] if target.bucket else [claim]  # a bucket needs no claim, so W > 1 needs no ReadWriteMany
    if not indexed:
        return [*volume, job]
    # The documented pattern for pod-to-pod communication in an Indexed Job: a headless Service
    # whose name is the pods' subdomain. Not-ready addresses are published so index 0's name
    # resolves while the pods are starting, which is when the rendezvous happens.
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": target.name, "labels": labels()},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels(),
                 "ports": [{"name": "c10d", "port": RDZV_PORT, "targetPort": RDZV_PORT}]},
    }
    return [*volume, service, job]


def render(docs: Sequence[dict[str, Any]]) -> str:
    """Multi-document YAML, keys in the order built (reads like the Kubernetes docs)."""
    with importing("PyYAML"):
        import yaml  # only `k8s render` needs it

    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
