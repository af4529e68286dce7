"""A lean HTTP/1.1 client for the one request the engine sends thousands of times: POST a JSON body, read
the answer, keep the connection for the next one.

Why not aiohttp here: its client costs ~0.5-0.9 ms of CPU per request on the 2-core box (request and response
objects, header multidicts, timer contexts, a StreamReader per body), the largest single cost of an episode
turn once the engine's own work is cut, and ~60 garbage-collected objects per request in flight. SGLang's
/generate is a plain POST with a Content-Length body and one JSON answer, which an asyncio Protocol can carry
with a fraction of that. Everything else (health probes, admin calls, https) stays on aiohttp.

    Http1Pool.post   (status, body) of one POST; raises ConnectFailed (could not connect), Disconnected (the
                     server closed the connection before the answer was complete), HttpTimeout (no complete
                     answer by the deadline; the connection is closed), ProtocolError (not HTTP/1.x)
    Http1Pool        idle keep-alive connections per (host, port), reused newest first, dropped after
                     `keepalive_s` idle or when the server closed them; unbounded like aiohttp's `limit=0`
    _Conn            one connection: writes a request, parses the status line and headers, then a
                     Content-Length, chunked or read-to-close body

A connection carries one request at a time and is reused only after a complete answer that did not say
`Connection: close`; a cancelled or timed-out request closes its connection (an answer may still be coming).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit


class HttpError(Exception):
    """Base of this client's failures."""


class ConnectFailed(HttpError):
    """No connection could be opened (refused, unreachable, or the connect timeout passed)."""


class Disconnected(HttpError):
    """The server closed the connection before the answer was complete."""


class HttpTimeout(HttpError):
    """No complete answer before the deadline."""


class ProtocolError(HttpError):
    """The server's bytes are not an HTTP/1.x answer."""


_MAX_HEAD = 64 * 1024


class _Conn(asyncio.Protocol):
    __slots__ = ("transport", "buf", "waiter", "closed", "idle_since", "status", "head_end", "length", "chunked",
                 "close_after", "pos", "chunks", "got_bytes")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.head_end = -1
        self.length: int | None = None
        self.chunked = False
        self.close_after = False
        self.pos = 0
        self.chunks: list[bytes] = []
        self.got_bytes = False

    # ---------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.transport = None
        w = self.waiter
        if w is None or w.done():
            return
        if self.head_end >= 0 and self.length is None and not self.chunked:
            self._finish(bytes(self.buf[self.head_end:]))  # a read-to-close body ends here
            return
        self.waiter = None
        w.set_exception(Disconnected("the server closed the connection before answering" if not self.got_bytes
                                     else "the server closed the connection in the middle of its answer"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # bytes nobody asked for: the connection is not in a state to reuse
            return
        self.got_bytes = True
        self.buf += data
        try:
            self._parse()
        except ProtocolError as e:
            w, self.waiter = self.waiter, None
            self.close()
            if w is not None and not w.done():
                w.set_exception(e)

    def eof_received(self) -> bool:
        return False

    # ---------------------------------------------------------------- parsing

    def _parse(self) -> None:
        buf = self.buf
        if self.head_end < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise ProtocolError("the answer's headers are longer than 64 KiB")
                return
            lines = bytes(buf[:end]).split(b"\r\n")
            status_line = lines[0].split(b" ", 2)
            if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
                raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            try:
                self.status = int(status_line[1])
            except ValueError:
                raise ProtocolError(f"bad status code in {lines[0][:80]!r}") from None
            self.close_after = status_line[0] == b"HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    try:
                        self.length = int(value)
                    except ValueError:
                        raise ProtocolError(f"bad Content-Length {value[:40]!r}") from None
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
                elif name == b"connection":
                    v = value.strip().lower()
                    self.close_after = v == b"close" or (self.close_after and v != b"keep-alive")
            self.head_end = self.pos = end + 4
            if self.status in (204, 304) or 100 <= self.status < 200:
                self.length = 0
        if self.chunked:
            self._parse_chunks()
        elif self.length is not None:
            if len(buf) - self.head_end >= self.length:
                self._finish(bytes(buf[self.head_end:self.head_end + self.length]))

    def _parse_chunks(self) -> None:
        buf = self.buf
        while True:
            eol = buf.find(b"\r\n", self.pos)
            if eol < 0:
                return
            size_text = bytes(buf[self.pos:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)  # trailers end with an empty line
                if end < 0 and buf[eol:eol + 4] != b"\r\n\r\n":
                    return
                self._finish(b"".join(self.chunks))
                return
            if len(buf) < eol + 2 + size + 2:
                return
            self.chunks.append(bytes(buf[eol + 2:eol + 2 + size]))
            self.pos = eol + 2 + size + 2

    def _finish(self, body: bytes) -> None:
        w, self.waiter = self.waiter, None
        status, close = self.status, self.close_after
        self.buf = bytearray()
        self._reset()
        if close:
            self.close()
        if w is not None and not w.done():
            w.set_result((status, body))

    # ---------------------------------------------------------------- use

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def send(self, data: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiter = loop.create_future()
        self.transport.write(data)
        return self.waiter


class Http1Pool:
    """Pooled HTTP/1.1 connections; `await pool.post(url, path, body, timeout=..., connect_timeout=...)`."""

    def __init__(self, keepalive_s: float = 3.0):
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        self._closed = False
        self.opened = 0
        """Connections opened so far (a counter for tests and gauges)."""

    def _target(self, url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(url)
        if t is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"Http1Pool speaks plain http only, not {url!r}")
            port = parts.port or 80
            t = self._targets[url] = (parts.hostname, port, parts.netloc.encode("idna"))
        return t

    async def _acquire(self, host: str, port: int, timeout: float) -> _Conn:
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, host, port), timeout)
        except asyncio.TimeoutError:
            raise ConnectFailed(f"could not connect to {host}:{port} within {timeout:.1f}s") from None
        except OSError as e:
            raise ConnectFailed(f"could not connect to {host}:{port}: {e}") from None
        self.opened += 1
        return conn  # type: ignore[return-value]

    async def post(self, url: str, path: str, body: bytes, *, timeout: float, connect_timeout: float,
                   content_type: bytes = b"application/json") -> tuple[int, bytes]:
        """POST `body` to url+path; (status, answer body). The deadline `timeout` covers connecting too."""
        if self._closed:
            raise HttpError("the connection pool is closed")
        host, port, netloc = self._target(url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._acquire(host, port, min(connect_timeout, timeout))
        head = (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                b"Connection: keep-alive\r\n\r\n" % (path.encode(), netloc, content_type, len(body)))
        if conn.closed or conn.transport is None:
            raise Disconnected("the server closed the connection before the request was sent")
        waiter = conn.send(head + body, loop)
        timer = loop.call_at(deadline, _expire, conn, waiter, timeout)
        done = False
        try:
            status, answer = await waiter
            done = True
        finally:
            timer.cancel()
            if not done:
                conn.close()  # cancelled, timed out or failed midway: an answer may still arrive on it
        if not conn.closed and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault((host, port), deque()).append(conn)
        return status, answer

    def close(self) -> None:
        """Close every idle connection; connections in use close when their request ends."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


def _expire(conn: _Conn, waiter: asyncio.Future[tuple[int, bytes]], timeout: float) -> None:
    if not waiter.done():
        conn.waiter = None
        conn.close()
        waiter.set_exception(HttpTimeout(f"no complete answer within {timeout:.1f}s"))
