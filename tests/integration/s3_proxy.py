"""An HTTP proxy on 127.0.0.1 in front of moto's S3 server, to imitate S3-compatible stores that
misbehave: one that ignores conditional writes (`If-None-Match` / `If-Match` headers are dropped
before they reach moto), one that refuses our credentials on writes (403 AccessDenied), one
that holds writes (a stalled PUT, a partition) while `holding` is set, until `release` is set,
and one that carries out a conditional PUT and then loses its answer (the connection drops, as
real S3 does under load): the first conditional PUT of each key containing `drop_key` (any if
empty), `drop_answers` of them in all; `dropped` lists the keys whose answer was lost; and one
under load that answers 503 SlowDown, without carrying it out, to every `slowdown_every`-th
request (`slowed` counts them; `requests` lists each request's method and path)."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlparse

Mode = Literal["strip_conditions", "deny_writes", "hold_writes", "drop_answer", "slowdown"]

_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
)
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class S3Proxy:
    def __init__(self, upstream: str, mode: Mode) -> None:
        target = urlparse(upstream)
        host, port = target.hostname or "127.0.0.1", target.port or 80
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.mode == "hold_writes" and proxy.holding and self.command in ("PUT", "POST"):
                    proxy.held += 1
                    proxy.release.wait(120)
                if proxy.mode == "deny_writes" and self.command in ("PUT", "POST", "DELETE"):
                    self._refuse(403, _DENIED)
                    return
                if proxy.mode == "slowdown" and proxy._slow_down(self.command, self.path):
                    self._refuse(503, _SLOW_DOWN)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host",)}
                if proxy.mode == "strip_conditions":
                    headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
                drop = (
                    proxy.mode == "drop_answer"
                    and self.command == "PUT"
                    and proxy.drop_answers > 0
                    and proxy.drop_key in self.path
                    and self.path not in proxy.dropped  # its retry goes through
                    and any(k.lower() in ("if-none-match", "if-match") for k in self.headers)
                )
                if drop:
                    proxy.drop_answers -= 1
                    proxy.dropped.append(self.path)
                conn = http.client.HTTPConnection(host, port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    if drop:  # the PUT is carried out; its answer never arrives
                        self.close_connection = True
                        return
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    # A HEAD's answer has no body but tells the object's length.
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            def _refuse(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.mode = mode
        self.holding = False
        self.held = 0
        self.release = threading.Event()
        self.drop_answers = 0
        self.drop_key = ""
        self.dropped: list[str] = []
        self.slowdown_every = 5
        self.slowed = 0
        self.requests: list[tuple[str, str]] = []
        self._count = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _slow_down(self, method: str, path: str) -> bool:
        with self._count:
            self.requests.append((method, path))
            slow = len(self.requests) % self.slowdown_every == 0
            self.slowed += slow
            return slow

    def __enter__(self) -> S3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
