"""The tests' loopback proxy (`bench.tcp_proxy`): a cut resets live connections at once and a
restore listens again on the same port."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest

from bench.tcp_proxy import TcpProxy, free_port


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1 << 16):
            self.request.sendall(data)


@pytest.fixture
def echo_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _echo(conn: socket.socket, payload: bytes) -> bytes:
    conn.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += conn.recv(1 << 16)
    return got


def test_a_cut_resets_live_connections_at_once_and_a_restore_listens_again(echo_port):
    proxy = TcpProxy(echo_port).start()
    try:
        live = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        assert _echo(live, b"before") == b"before"
        t0 = time.monotonic()
        proxy.cut()  # with a connection open: a cut that waited for it would hang here
        assert time.monotonic() - t0 < 2
        with pytest.raises(OSError):
            live.sendall(b"x" * 65536)
            if not live.recv(1):
                raise ConnectionResetError("closed by the proxy")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        proxy.restore()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as again:
            assert _echo(again, b"after") == b"after"
    finally:
        live.close()
        proxy.stop()


def test_a_cut_on_a_byte_count_fires_inside_a_connection(echo_port):
    proxy = TcpProxy(echo_port, cut_after_up=100).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as conn:
            conn.sendall(b"y" * 200)
            assert proxy.cut_fired.wait(2), "the proxy never cut itself"
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    finally:
        proxy.stop()


def test_free_ports_are_never_handed_out_twice():
    """The OS picks a just-closed port again (many times in 2,000 picks): a node given the same
    port for two of its components does not start."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
