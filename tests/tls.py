"""TLS for tests: certificates made per test session, and a TLS-terminating loopback proxy.

`TlsProxy` plays the sidecar that production puts in front of Serve's plaintext gRPC proxy:
it terminates TLS (offering ALPN h2, as gRPC requires) and forwards the plaintext bytes to the
target port. It records the TLS sessions it accepted, so a test can show its calls went
through TLS.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme

from bench.tcp_proxy import TcpProxy, free_port


@dataclass(frozen=True)
class Pki:
    """A CA the client trusts, one it does not, and their PEM files."""

    ca: trustme.CA
    other_ca: trustme.CA
    ca_file: Path
    other_ca_file: Path

    @classmethod
    def create(cls, folder: Path) -> Pki:
        ca, other = trustme.CA(), trustme.CA()
        ca.cert_pem.write_to_path(str(folder / "ca.pem"))
        other.cert_pem.write_to_path(str(folder / "other-ca.pem"))
        return cls(ca, other, folder / "ca.pem", folder / "other-ca.pem")

    def server_context(self, *names: str, alpn: bool = True) -> ssl.SSLContext:
        """A server-side context with a certificate of `ca` for `names` (default: localhost, 127.0.0.1)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(*(names or ("localhost", "127.0.0.1"))).configure_cert(context)
        if alpn:
            context.set_alpn_protocols(["h2"])
        return context


class TlsProxy(TcpProxy):
    """Terminates TLS on `listen_port` and forwards plaintext to `target_port` (both on 127.0.0.1)."""

    def __init__(self, target_port: int, context: ssl.SSLContext, listen_port: int | None = None) -> None:
        super().__init__(target_port, listen_port or free_port())
        self._context = context
        self.sessions: list[tuple[str, str | None]] = []
        """(TLS version, ALPN protocol) of each connection accepted."""

    def stop(self) -> None:
        self._call(self._close_connections())
        super().stop()

    async def _close_connections(self) -> None:
        """Cuts the connections and lets their handlers end before the loop stops."""
        await self._cut()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=2)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.listen_port, ssl=self._context)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tls = writer.get_extra_info("ssl_object")
        self.sessions.append((tls.version(), tls.selected_alpn_protocol()))
        await super()._handle(reader, writer)
