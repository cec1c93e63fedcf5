"""A loopback HTTP proxy in front of the real S3 server that answers chosen requests badly.

The server itself cannot be told to fail one request with a 503 or to stall a reply, and a mock
in its place would prove nothing about the client. So the requests go to the real server through
this proxy, which forwards them byte for byte (headers included, so the signatures still hold)
except those it has been told to fail: those never reach the server.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>injected</Message></Error>"


class FaultyProxy:
    """``fail(n)``: the next n requests get a 503 (``n=None``: every request until ``heal``);
    ``stall(seconds)``: every reply waits that long first. Counts what it did."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._failing: int | None = 0
        self._stall = 0.0
        self.failed = 0  # requests answered 503 without reaching the server
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet: pytest shows failures, not traffic
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy._take_fault():
                    self._reply(503, [("Content-Type", "application/xml")], SLOW_DOWN)
                    return
                time.sleep(proxy._stall)
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        conn.putheader(name, value)
                    conn.endheaders(body)
                    got = conn.getresponse()
                    data = got.read()
                    headers = [(k, v) for k, v in got.getheaders()
                               if k.lower() not in ("content-length", "transfer-encoding", "connection")]
                    with proxy._lock:
                        proxy.forwarded += 1
                    self._reply(got.status, headers, data, head=self.command == "HEAD",
                                length=got.getheader("Content-Length"))
                finally:
                    conn.close()

            def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes, head: bool = False,
                       length: str | None = None) -> None:
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", length if head and length else str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _take_fault(self) -> bool:
        with self._lock:
            if self._failing is None or self._failing > 0:
                if self._failing is not None:
                    self._failing -= 1
                self.failed += 1
                return True
            return False

    def fail(self, n: int | None) -> None:
        with self._lock:
            self._failing = n

    def stall(self, seconds: float) -> None:
        self._stall = seconds

    def heal(self) -> None:
        self.fail(0)
        self.stall(0.0)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
