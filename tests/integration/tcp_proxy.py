"""A loopback TCP forwarder that can be cut and restored: the service 'disappears' for real.

While cut, the listening socket is closed and live connections are reset, so clients see
refused connections (UNAVAILABLE), as when a Kubernetes service loses all its endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class TcpProxy:
    def __init__(self, target_port: int, listen_port: int) -> None:
        self.target_port = target_port
        self.listen_port = listen_port
        self.address = f"127.0.0.1:{listen_port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> TcpProxy:
        self._thread.start()
        self.restore()
        return self

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def restore(self) -> None:
        self._call(self._listen())

    def cut(self) -> None:
        self._call(self._cut())

    def stop(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.listen_port)

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}
