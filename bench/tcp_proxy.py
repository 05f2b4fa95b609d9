"""A loopback TCP forwarder for the tests and the bench: it can be cut and restored, it counts
the bytes each way, and it can hold each client write a while.

- Cut (`cut`): the listening socket is closed and live connections are reset, so clients see
  refused connections (UNAVAILABLE), as when a Kubernetes service loses all its endpoints;
  `restore` listens again on the same port.
- Counting (`up`: client to server, `down`: server to client; `reset`): what a run fetched from
  moto's S3 server (`bench.daily`).
- Delay (`delay_s`): each client write waits that long before it is passed on, so every
  request waits about that long, as on a network (moto on loopback answers at once;
  `bench.planning`).
- Cut on a byte count (`cut_after_up`): the proxy cuts itself once that many bytes went from
  client to server and sets `cut_fired`, so a test's outage starts at a point of the work,
  not of the clock (a fast CPU would otherwise finish before a timed cut).

Hand-written, not a library: the standard library's asyncio streams make it ~80 lines, and the
tests need to cut live connections at a moment of their choosing, which proxies such as
toxiproxy do from a process of their own that PyPI does not carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["TcpProxy", "free_port"]


_handed_out: set[int] = set()
_handing_out = threading.Lock()


def free_port() -> int:
    """A port free on 127.0.0.1 now (the OS picks it), and never one this process handed out
    before: the OS picks a just-closed port again often enough that two components given ports
    one after the other (a node's agent and metrics ports in one `ray start`) can get the same
    one, and Ray then refuses to start."""
    with _handing_out:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


class TcpProxy:
    """Forwards 127.0.0.1:`listen_port` (0: a free port, kept across cuts) to 127.0.0.1:`target_port`."""

    def __init__(
        self, target_port: int, listen_port: int = 0, *, delay_s: float = 0.0, cut_after_up: int | None = None
    ) -> None:
        self.target_port = target_port
        self.listen_port = listen_port
        self.delay_s = delay_s
        self.cut_after_up = cut_after_up
        self.cut_fired = threading.Event()
        self.up = 0
        self.down = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        return self.listen_port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    def start(self) -> TcpProxy:
        self._thread.start()
        self.restore()
        return self

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def restore(self) -> None:
        self._call(self._listen())
        if self._server is not None and not self.listen_port:
            self.listen_port = int(self._server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        self._call(self._cut())

    def reset(self) -> None:
        self.up = self.down = 0

    def stop(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.listen_port)

    async def _cut(self) -> None:
        # Stop listening, reset every live connection, and only then wait for the server: since
        # Python 3.12 `wait_closed` waits for the server's connections to close, so waiting
        # first would hang the cut (and every connection with it) until the clients' deadlines.
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, down: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    if down:
                        self.down += len(data)
                    else:
                        self.up += len(data)
                        if self.cut_after_up is not None and self.up >= self.cut_after_up:
                            self.cut_after_up = None
                            await self._cut()
                            self.cut_fired.set()
                            return
                        if self.delay_s:
                            await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, down=False), pipe(up_reader, writer, down=True))
        self._writers -= {writer, up_writer}
