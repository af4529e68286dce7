"""A lean HTTP/1.1 client for the one request the engine sends thousands of times: POST a JSON body, read
the answer, keep the connection for the next one.

Why not aiohttp here: its client costs ~0.5-0.9 ms of CPU per request on the 2-core box (request and response
objects, header multidicts, timer contexts, a StreamReader per body), the largest single cost of an episode
turn once the engine's own work is cut, and ~60 garbage-collected objects per request in flight. SGLang's
/generate is a plain POST with a Content-Length body and one JSON answer, which an asyncio Protocol can carry
with a fraction of that. Everything else (health probes, admin calls, https) stays on aiohttp.

    Http1Pool.post   (status, body) of one POST; raises ConnectFailed (could not connect), Disconnected (the
                     server closed the connection before the answer was complete), HttpTimeout (no complete
                     answer, or no connection, by the deadline; the connection is closed), ProtocolError (not
                     HTTP/1.x, or an answer over `max_body`)
    Http1Pool        per (host, port): idle keep-alive connections reused newest first, dropped after
                     `keepalive_s` idle or when the server closed them; at most `set_limit` connections
                     (None: unbounded); at most `max_connecting` connections the server has not yet been heard
                     on (the pacing below); callers beyond either wait in line (FIFO) and are handed the next
                     connection a finished request frees
    _Host            that per-server state and its accounting (open, unconfirmed, waiters)
    _Conn            one connection: writes a request, parses the status line and headers (interim 1xx
                     answers skipped), then a Content-Length, chunked or read-to-close body

Opening at a pace. A connection the kernel completed is not one the server accepted: the handshake ends in
the kernel and the connection waits in the listen socket's accept queue (SGLang's uvicorn: backlog 2048, capped
by the kernel's somaxconn) until the server's event loop accepts it. Thousands of episodes opening connections
at once while that loop is busy overflow the queue; the kernel then drops SYNs, and the client retransmits
them after 1, 3, 7, 15, 31, 63 s: requests stall for a minute with the server idle. So a new connection's first
request carries `Expect: 100-continue` (the body follows at once; no round trip is added): uvicorn, aiohttp
and most servers answer `100 Continue` as soon as the application reads the request, which shows the
connection was accepted. A connection counts as unconfirmed from its connect until the first byte the
server sends on it, and no more than `max_connecting` are unconfirmed per server: the accept queue never
holds more of ours than that. A connect attempt that gets no handshake within `connect_attempt_s` is
abandoned and retried on a fresh socket (a fresh SYN at once instead of the kernel's growing back-off)
until the connect deadline.

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
    """No complete answer (or no connection to send on) before the deadline."""


class ProtocolError(HttpError):
    """The server's bytes are not an HTTP/1.x answer, or the answer is larger than the pool accepts."""


_MAX_HEAD = 64 * 1024
DEFAULT_MAX_BODY = 256 * 1024 * 1024
"""The largest answer body accepted (an SGLang answer with logprobs for 32k tokens is ~2 MB)."""


class _Host:
    """One server's connections: the idle ones, how many are open and unconfirmed, and who waits for one."""

    __slots__ = ("idle", "open", "unconfirmed", "waiters", "limit")

    def __init__(self) -> None:
        self.idle: deque[_Conn] = deque()
        self.open = 0
        """Connections open or being opened (idle, carrying a request, connecting)."""
        self.unconfirmed = 0
        """Of those, the ones the server has not yet sent a byte on (connecting included)."""
        self.waiters: deque[asyncio.Future[_Conn | None]] = deque()
        """Callers waiting in line: handed a connection (a finished request's), or None (a slot freed: try)."""
        self.limit: int | None = None

    def wake(self) -> None:
        """A slot freed (a connection closed or was confirmed): the first waiter tries again."""
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                w.set_result(None)
                return


class _Conn(asyncio.Protocol):
    __slots__ = ("transport", "buf", "waiter", "closed", "idle_since", "status", "head_end", "length", "chunked",
                 "close_after", "pos", "chunks", "chunk_bytes", "got_bytes", "host", "confirmed", "max_body")

    def __init__(self, host: _Host | None = None, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.host = host
        self.confirmed = False
        self.max_body = max_body
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.head_end = -1
        self.length: int | None = None
        self.chunked = False
        self.close_after = False
        self.pos = 0
        self.chunks: list[bytes] = []
        self.chunk_bytes = 0
        self.got_bytes = False

    # ---------------------------------------------------------------- accounting

    def _confirm(self) -> None:
        if not self.confirmed:
            self.confirmed = True
            if self.host is not None and not self.closed:
                self.host.unconfirmed -= 1
                self.host.wake()

    def _gone(self) -> None:
        """Closed (by us or the server): its slot is free. Runs once."""
        if self.closed:
            return
        self.closed = True
        h = self.host
        if h is not None:
            h.open -= 1
            if not self.confirmed:
                h.unconfirmed -= 1
            h.wake()

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
        self._gone()
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
        self._confirm()
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
        while self.head_end < 0:
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
                status = int(status_line[1])
            except ValueError:
                raise ProtocolError(f"bad status code in {lines[0][:80]!r}") from None
            if 100 <= status < 200:
                if status == 101:
                    raise ProtocolError("the server switched protocols (101) on a plain POST")
                del buf[:end + 4]  # an interim answer (100 Continue, 103 Early Hints): the final one follows
                continue
            self.status = status
            self.close_after = status_line[0] == b"HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    try:
                        self.length = int(value)
                    except ValueError:
                        raise ProtocolError(f"bad Content-Length {value[:40]!r}") from None
                    if self.length < 0:
                        raise ProtocolError(f"bad Content-Length {value[:40]!r}")
                    if self.length > self.max_body:
                        raise ProtocolError(f"the answer's body ({self.length} bytes) is over the {self.max_body} "
                                            "bytes this client accepts")
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
                elif name == b"connection":
                    v = value.strip().lower()
                    self.close_after = v == b"close" or (self.close_after and v != b"keep-alive")
            self.head_end = self.pos = end + 4
            if self.status in (204, 304):
                self.length = 0
        if self.chunked:
            self._parse_chunks()
        elif self.length is not None:
            if len(buf) - self.head_end >= self.length:
                self._finish(bytes(buf[self.head_end:self.head_end + self.length]))
        elif len(buf) - self.head_end > self.max_body:
            raise ProtocolError(f"the answer's body is over the {self.max_body} bytes this client accepts")

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
            if self.chunk_bytes + size > self.max_body:
                raise ProtocolError(f"the answer's body is over the {self.max_body} bytes this client accepts")
            if len(buf) < eol + 2 + size + 2:
                return
            self.chunks.append(bytes(buf[eol + 2:eol + 2 + size]))
            self.chunk_bytes += size
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
        self._gone()
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

    def __init__(self, keepalive_s: float = 3.0, *, max_connecting: int | None = 1024, connect_attempt_s: float = 2.0,
                 max_body: int = DEFAULT_MAX_BODY):
        """`max_connecting`: per server, connections not yet heard from (None: no pacing; module doc).
        `connect_attempt_s`: one connect attempt's share of the connect timeout before a fresh socket is tried."""
        self.keepalive_s = keepalive_s
        self.max_connecting = max_connecting
        self.connect_attempt_s = connect_attempt_s
        self.max_body = max_body
        self._hosts: dict[tuple[str, int], _Host] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        self._closed = False
        self.opened = 0
        """Connections opened so far (a counter for tests and gauges)."""
        self.connect_retries = 0
        """Connect attempts that got no handshake in `connect_attempt_s` and were tried again on a fresh socket."""
        self.waits: deque[float] = deque(maxlen=8192)
        """Seconds the latest requests waited for a connection (in line, connecting): each request's one."""
        self.wait_max_s = 0.0
        """The longest wait for a connection so far: in line for a slot (by design: connections per server are bounded
        by what it accepts, so requests past that wait here instead of in its queue) plus connecting."""
        self.connect_max_s = 0.0
        """The longest TCP connect so far (handshake, retries included): what a server's overflowing listen backlog
        would show (SYN retransmission waits 1 s, then 3 s, ...), unlike waiting in line."""

    def _target(self, url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(url)
        if t is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"Http1Pool speaks plain http only, not {url!r}")
            port = parts.port or 80
            host = parts.hostname
            # Host names the server alone: never the URL's user-info (which must not travel in clear headers)
            name = f"[{host}]" if ":" in host else host
            netloc = name if parts.port is None else f"{name}:{port}"
            t = self._targets[url] = (host, port, netloc.encode("idna"))
        return t

    def _host(self, host: str, port: int) -> _Host:
        h = self._hosts.get((host, port))
        if h is None:
            h = self._hosts[(host, port)] = _Host()
        return h

    def set_limit(self, url: str, limit: int | None) -> None:
        """At most `limit` connections to the server at `url` (None: unbounded); callers beyond it wait in line."""
        host, port, _ = self._target(url)
        h = self._host(host, port)
        h.limit = limit
        h.wake()

    def open_connections(self) -> int:
        """Connections open (or being opened) to every server."""
        return sum(h.open for h in self._hosts.values())

    async def _connect(self, host: str, port: int, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + timeout
        while True:
            left = deadline - loop.time()
            attempt = min(left, self.connect_attempt_s) if self.connect_attempt_s > 0 else left
            try:
                # the connection joins the host's accounting only once made (`_acquire`): an attempt given up
                # midway must not release a slot the caller releases itself
                _, conn = await asyncio.wait_for(
                    loop.create_connection(lambda: _Conn(None, self.max_body), host, port), max(0.001, attempt))
                self.connect_max_s = max(self.connect_max_s, loop.time() - t0)
                return conn  # type: ignore[return-value]
            except asyncio.TimeoutError:
                if deadline - loop.time() <= 0.001:
                    raise ConnectFailed(f"could not connect to {host}:{port} within {timeout:.1f}s") from None
                self.connect_retries += 1  # a SYN the server's full queue dropped: try a fresh one now
            except OSError as e:
                raise ConnectFailed(f"could not connect to {host}:{port}: {e}") from None

    async def _acquire(self, host: str, port: int, deadline: float, connect_timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        h = self._host(host, port)
        woken = False  # this caller was first in line and a slot freed: it goes ahead of those behind it
        while True:
            now = time.monotonic()
            while h.idle:
                conn = h.idle.pop()
                if not conn.closed and now - conn.idle_since < self.keepalive_s:
                    return conn
                conn.close()
            # room for another connection, and no one waiting in line ahead of this caller
            if (woken or not h.waiters) and self._room(h):
                h.open += 1
                h.unconfirmed += 1  # reserved here: the _Conn releases both when it is confirmed or closed
                if h.waiters and self._room(h):
                    h.wake()  # more room (several slots freed, a limit raised): the next in line goes too
                try:
                    conn = await self._connect(host, port, min(connect_timeout, max(0.001, deadline - loop.time())))
                except BaseException:
                    h.open -= 1
                    h.unconfirmed -= 1
                    h.wake()
                    raise
                self.opened += 1
                if conn.closed:  # the server closed it before we took it over
                    h.open -= 1
                    h.unconfirmed -= 1
                    h.wake()
                    raise Disconnected("the server closed the connection before the request was sent")
                conn.host = h
                return conn
            left = deadline - loop.time()
            if left <= 0:
                raise HttpTimeout(f"no connection to {host}:{port} came free before the deadline "
                                  f"({h.open} open, {h.unconfirmed} not yet answered, limit {h.limit})")
            fut: asyncio.Future[_Conn | None] = loop.create_future()
            if woken:
                h.waiters.appendleft(fut)  # woken but beaten to the slot: it keeps its place
            else:
                h.waiters.append(fut)
            try:
                got = await asyncio.wait_for(fut, left)
            except BaseException as e:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    c = fut.result()
                    if c is not None:
                        self._release(h, c)  # handed over as this caller gave up: to the next in line
                    else:
                        h.wake()  # its turn passes on
                else:
                    try:
                        h.waiters.remove(fut)
                    except ValueError:
                        pass
                if isinstance(e, asyncio.TimeoutError):
                    raise HttpTimeout(f"no connection to {host}:{port} came free before the deadline ({h.open} "
                                      f"open, {h.unconfirmed} not yet answered, limit {h.limit})") from None
                raise
            if got is not None and not got.closed:
                return got
            woken = True

    def _room(self, h: _Host) -> bool:
        return (h.limit is None or h.open < h.limit) and (self.max_connecting is None
                                                          or h.unconfirmed < self.max_connecting)

    def _release(self, h: _Host, conn: _Conn) -> None:
        """A connection that finished a request: to the first caller in line, else idle."""
        if conn.closed or self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        while h.waiters:
            w = h.waiters.popleft()
            if not w.done():
                w.set_result(conn)
                return
        h.idle.append(conn)

    async def post(self, url: str, path: str, body: bytes, *, timeout: float, connect_timeout: float,
                   content_type: bytes = b"application/json") -> tuple[int, bytes]:
        """POST `body` to url+path; (status, answer body). The deadline `timeout` covers waiting for a connection
        and connecting too."""
        if self._closed:
            raise HttpError("the connection pool is closed")
        host, port, netloc = self._target(url)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + timeout
        conn = await self._acquire(host, port, deadline, connect_timeout)
        waited = loop.time() - t0
        self.waits.append(waited)
        if waited > self.wait_max_s:
            self.wait_max_s = waited
        expect = b"" if conn.confirmed else b"Expect: 100-continue\r\n"
        head = (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s"
                b"Connection: keep-alive\r\n\r\n" % (path.encode(), netloc, content_type, len(body), expect))
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
        self._release(self._host(host, port), conn)
        return status, answer

    def stats(self) -> dict[str, float]:
        """Connection numbers for gauges: open, opened, connect retries, waits for a connection (p99, max), the
        longest connect."""
        waits = sorted(self.waits)
        p99 = waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else 0.0
        return {"conn_open": float(self.open_connections()), "conn_opened": float(self.opened),
                "connect_retries": float(self.connect_retries), "conn_wait_p99_s": p99,
                "conn_wait_max_s": self.wait_max_s, "connect_max_s": self.connect_max_s}

    def close(self) -> None:
        """Close every idle connection; connections in use close when their request ends."""
        self._closed = True
        for h in self._hosts.values():
            while h.idle:
                h.idle.pop().close()
            while h.waiters:
                w = h.waiters.popleft()
                if not w.done():
                    w.set_exception(HttpError("the connection pool is closed"))


def _expire(conn: _Conn, waiter: asyncio.Future[tuple[int, bytes]], timeout: float) -> None:
    if not waiter.done():
        conn.waiter = None
        conn.close()
        waiter.set_exception(HttpTimeout(f"no complete answer within {timeout:.1f}s"))
