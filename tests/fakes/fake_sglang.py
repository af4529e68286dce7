"""A scripted fake SGLang server on a real socket, for client logic and fault injection only.

It speaks the subset of SGLang's HTTP API the ServerManager uses. Tokens are a
deterministic function of (input ids, seed), so retries elsewhere give the same answer.
Behaviour is switched at run time through `mode`: ok | error500 | error400 | hang | slow | garbage.
Weight-sync endpoints (disk, tensor, distributed, group init/destroy) are recorded in `admin` and set
`weight_version` when the request carries one; paths in `refuse` answer `success: false` (HTTP 400).
GET /server_info reports `tp_size`; GET /model_info what SGLang 0.5.23 names there: `model_path` (moved by
/update_weights_from_disk, as in SGLang), `model_type`, `architectures` and `weight_version`; GET
/health_generate is /health. With `token_delay_s` > 0 tokens are made one at a time, so a pause can meet a request
midway, as in SGLang: mode abort returns the partial tokens (finish abort), retract and in_place
hold the request and go on after /continue_generation; responses carry `weight_versions` spans
(switch off with `report_spans=False`, like servers that do not report them).
`started` is set whenever a generation starts producing tokens (tests wait on it, not on sleeps).
`weight_sessions=True` behaves like SGLang 0.5.23: /begin_weight_update and /end_weight_update exist,
and tensor/distributed updates outside a session answer 400; False (the default) like 0.5.17: those
endpoints answer 404.
`flush_model` says when a flush (POST /flush_cache, or `flush_cache` in an update call) is refused because
requests are held by a retract or in_place pause: "ideal" (the default) never; "0.5.23" only while
requests run in place (retracted ones wait in the queue, which a paused 0.5.23 ignores), the update then
answering `success: false`; "0.5.17" while any request is held, an update asking for that flush killing
the server as 0.5.17's scheduler assertion does (`crashed`, every later request answers 500). A refused
/flush_cache answers 400, as SGLang's does. Held requests end on /abort_request with abort_all, paused
or not, with the tokens they made (finish abort).

Hooks for tests that must not synchronize by sleeping:
    events        every request's path in arrival order (/generate, /health, admin paths)
    wait_until    await a condition on the fake; re-checked on every request, completion and answer
    hold/release  a gate: while held, /generate requests wait after arriving (counted in `inflight`,
                  highest count in `peak_inflight`); `hold_after=n` closes the gate after n completions
    probes        the status of every /health answer, in order
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeSGLang:
    mode: str = "ok"
    finish: str = "length"
    """The finish type of a generation that made all its tokens ("stop": as if the model ended its turn)."""
    delay_s: float = 0.0
    eos_id: int = 2
    vocab: int = 1000
    port: int = 0
    healthy: bool = True
    weight_version: str = "default"
    model_path: str = "fake"
    model_type: str | None = None
    architectures: list[str] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    admin: list[tuple[str, Any]] = field(default_factory=list)
    tp_size: int = 1
    max_running_requests: int | None = None
    """Reported in /server_info as SGLang 0.5.23 does (top level and internal_states[0]); None: not reported."""
    memory_saver: bool = True
    """Reported in /server_info (`enable_memory_saver`): lent servers release their memory only then."""
    load_capacity: int | None = None
    """Serve /v1/loads as SGLang 0.5.x does, for a server whose KV pool holds this many requests: that many run
    (token_usage = running / load_capacity), the rest wait in its queue. None: no /v1/loads (404)."""
    refuse: set[str] = field(default_factory=set)
    paused: bool = False
    pause_mode: str | None = None
    token_delay_s: float = 0.0
    report_spans: bool = True
    started: asyncio.Event | None = None
    weight_sessions: bool = False
    session_open: bool = False
    events: list[str] = field(default_factory=list)
    probes: list[int] = field(default_factory=list)
    inflight: int = 0
    peak_inflight: int = 0
    hold_after: int | None = None
    drop_next: int = 0
    abort_epoch: int = 0
    """Bumped by /abort_request with abort_all: requests making tokens then return what they made."""
    running_at_pause: list[int] = field(default_factory=list)
    """Requests making tokens when each /pause_generation arrived."""
    connections: int = 0
    """Connections accepted so far."""
    flush_model: str = "ideal"
    """When a flush with requests held is refused: ideal | 0.5.23 | 0.5.17 (see the module doc)."""
    refuse_flushes: int = 0
    """The next N /flush_cache calls are refused (HTTP 400) whatever runs: SGLang's scheduler right after its last
    request ended ("Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 0")."""
    released: bool = False
    """Its memory released (/release_memory_occupation), as SGLang 0.5.x: a release while a request runs, or a
    request while released, kills it (crashed), as SGLang's assertion or a fault on the released KV would."""
    crashed: bool = False
    """An update asked for a flush that 0.5.17's scheduler asserts on: the server is dead from then on."""
    """The next N /generate requests find their connection closed as they arrive (unanswered), as when
    uvicorn closes an idle keep-alive connection just as the client sends on it."""
    _gate: asyncio.Event | None = None
    _transports: set[Any] = field(default_factory=set)
    _listener: asyncio.AbstractServer | None = None
    _stopping: bool = False
    _changed: asyncio.Condition | None = None
    _runner: web.AppRunner | None = None
    _unpause: asyncio.Event | None = None
    _inflight: dict[str, asyncio.Future] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FakeSGLang":
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/model_info", self._model_info)
        for path in ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
                     "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                     "/update_weights_from_distributed", "/destroy_weights_update_group",
                     "/release_memory_occupation", "/resume_memory_occupation"):
            app.router.add_post(path, self._admin)
        app.router.add_get("/server_info", self._server_info)
        if self.load_capacity is not None:
            app.router.add_get("/v1/loads", self._loads)
        if self.weight_sessions:
            app.router.add_post("/begin_weight_update", self._admin)
            app.router.add_post("/end_weight_update", self._admin)
        self._unpause = asyncio.Event()
        self._unpause.set()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.started = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._changed = asyncio.Condition()
        self.port = self.port or _free_port()
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.2)
        await self._runner.setup()
        # Our own listener rather than web.TCPSite, so that stop() can reset every connection, also one the
        # event loop accepted just before the stop and connects just after it (aiohttp would leave that
        # socket open, and pytest fails a later test on its ResourceWarning).
        handler = self._runner.server
        assert handler is not None
        self._stopping = False
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: _Tracked(self, handler()), "127.0.0.1", self.port, reuse_address=True)
        return self

    async def _note(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Any, timeout: float = 10.0) -> None:
        """Return once `predicate(self)` holds (checked now and after every change); TimeoutError after `timeout`."""
        assert self._changed is not None

        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self))

        await asyncio.wait_for(wait(), timeout)

    def hold(self) -> None:
        """From now on /generate requests wait after arriving, until `release`."""
        assert self._gate is not None
        self._gate.clear()

    def release(self) -> None:
        assert self._gate is not None
        self._gate.set()

    async def stop(self) -> None:
        """Like a killed process: the socket closes and in-flight connections drop (reset at once, so no
        request still held by the gate or a hang leaves its socket to the garbage collector)."""
        self._stopping = True
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _model_info(self, request: web.Request) -> web.Response:
        if not self.healthy:  # like a process that is gone: nothing answers
            return web.Response(status=503, text="unhealthy")
        return web.json_response({"model_path": self.model_path, "model_type": self.model_type,
                                  "architectures": self.architectures, "weight_version": self.weight_version})

    async def _health(self, request: web.Request) -> web.Response:
        self.events.append(request.path)
        status = 503 if not self.healthy or self.mode == "hang" else 200
        self.probes.append(status)
        await self._note()
        return web.Response(status=status, text="ok" if status == 200 else "unhealthy")

    @staticmethod
    def tokens_for(input_ids: list[int], seed: Any, n: int, vocab: int, eos: int) -> list[int]:
        h = hashlib.sha256(f"{input_ids}|{seed}".encode()).digest()
        out = []
        for i in range(n):
            b = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
            out.append(3 + int.from_bytes(b[:4], "little") % (vocab - 3))
        return out

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.events.append(request.path)
        await self._note()
        rid = body.get("rid", "")
        if self.released:
            self.crashed = True
        if self.mode == "error500" or self.crashed:
            return web.Response(status=500, text="internal error (injected)")
        if self.mode == "error400":
            return web.json_response({"error": {"message": "bad request (injected)"}}, status=400)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "garbage":
            return web.Response(text="{not json")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        assert self._unpause is not None and self._gate is not None
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        await self._note()
        try:
            await self._gate.wait()
            await self._unpause.wait()
        finally:
            self.inflight -= 1
        sp = body.get("sampling_params", {})
        ids = self.tokens_for(body["input_ids"], sp.get("sampling_seed"), int(sp.get("max_new_tokens", 16)),
                              self.vocab, self.eos_id)
        spans = [[self.weight_version, 0, 0]]
        finish: dict[str, Any] = ({"type": "length", "length": len(ids)} if self.finish == "length"
                                  else {"type": "stop", "matched": self.eos_id})
        if self.token_delay_s > 0:
            made: list[int] = []
            assert self.started is not None
            self._active += 1
            self._idle.clear()
            epoch = self.abort_epoch
            try:
                ids = await self._tokens(ids, made, spans, epoch)
            finally:
                self._active -= 1
                if self._active == 0:
                    self._idle.set()
            cut = (self.paused and self.pause_mode == "abort") or self.abort_epoch != epoch
            if len(ids) < int(sp.get("max_new_tokens", 16)) and cut:
                finish = {"type": "abort", "message": "Aborted", "status_code": None}
        else:
            spans[-1][2] = len(ids)
        self.completed.append(rid)
        if self.hold_after is not None and len(self.completed) >= self.hold_after:
            self._gate.clear()
        await self._note()
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "cached_tokens": max(0, len(body["input_ids"]) - 4),
            "weight_version": self.weight_version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        }
        if self.report_spans:
            meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans if b > a]
        return web.json_response({"text": "", "output_ids": ids, "meta_info": meta})

    async def _tokens(self, ids: list[int], made: list[int], spans: list[list[Any]], epoch: int) -> list[int]:
        """Make tokens one at a time; an abort-mode pause or an abort_all cuts here, other pauses hold here."""
        assert self._unpause is not None and self.started is not None
        for t in ids:
            if self.abort_epoch != epoch:
                return made
            if self.paused:
                if self.pause_mode == "abort":
                    return made
                # retract / in_place: go on after continue, or end on an abort_all that comes meanwhile
                assert self._changed is not None
                async with self._changed:
                    await self._changed.wait_for(lambda: not self.paused or self.abort_epoch != epoch)
                if self.abort_epoch != epoch:
                    return made
            if spans[-1][0] != self.weight_version:
                spans.append([self.weight_version, len(made), len(made)])
            made.append(t)
            spans[-1][2] = len(made)
            self.started.set()
            await asyncio.sleep(self.token_delay_s)
        return made

    async def _server_info(self, request: web.Request) -> web.Response:
        self.admin.append((request.path, None))
        info: dict[str, Any] = {"tp_size": self.tp_size, "version": "fake", "device": "cuda",
                                "enable_memory_saver": self.memory_saver}
        if self.max_running_requests is not None:
            info["max_running_requests"] = self.max_running_requests
            info["internal_states"] = [{"effective_max_running_requests_per_dp": self.max_running_requests}]
        return web.json_response(info)

    async def _loads(self, request: web.Request) -> web.Response:
        cap = self.load_capacity or 1
        running = min(self.inflight, cap)
        return web.json_response({"loads": [{
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": self.inflight - running,
            "token_usage": running / cap, "max_running_requests": 4 * cap, "queues": {"retracted": 0}}]})

    def _flush_refused(self) -> bool:
        """Whether a flush now would be refused (requests held by a pause; see `flush_model`)."""
        if self.flush_model == "0.5.17":
            return self._active > 0
        if self.flush_model == "0.5.23":
            return self._active > 0 and self.paused and self.pause_mode == "in_place"
        return False

    async def _admin(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        path = request.path
        self.admin.append((path, body))
        self.events.append(path)
        await self._note()
        if self.crashed:
            return web.Response(status=500, text="scheduler died (injected 0.5.17 flush assertion)")
        if path in self.refuse:
            return web.json_response({"success": False, "message": "refused (injected)"}, status=400)
        assert self._unpause is not None
        if path == "/release_memory_occupation":
            if self._active > 0:
                self.crashed = True  # SGLang asserts "should be called only when server is idle"
                return web.Response(status=500, text="release_memory_occupation while requests run (injected)")
            self.released = True
        if path == "/resume_memory_occupation":
            self.released = False
        if path == "/flush_cache" and self.refuse_flushes > 0:
            self.refuse_flushes -= 1
            return web.json_response({"success": False, "message": "Cache not flushed because there are pending "
                                      "requests. #queue-req: 0, #running-req: 0"}, status=400)
        if path == "/flush_cache" and self._flush_refused():
            return web.Response(status=400, text="Cache not flushed: requests are still running or queued")
        if path.startswith("/update_weights_from_") and body.get("flush_cache") and self._flush_refused():
            if self.flush_model == "0.5.17":
                self.crashed = True
                self.healthy = False
                return web.Response(status=500, text="AssertionError: Cache flush failed after updating weights")
            return web.json_response({"success": False, "message": "Weights were updated, but the cache was not "
                                      "flushed because requests are still running or queued."}, status=400)
        if path == "/abort_request" and body.get("abort_all"):
            self.abort_epoch += 1
            await self._note()  # held requests end now, paused or not
        if path == "/pause_generation":
            self.running_at_pause.append(self._active)
            self.paused = True
            self.pause_mode = body.get("mode", "abort")
            self._unpause.clear()
            if self.pause_mode == "abort":  # like SGLang: returns once every running request returned
                await self._idle.wait()
        elif path == "/continue_generation":
            self.paused = False
            self.pause_mode = None
            self._unpause.set()
            await self._note()  # requests held in place or retracted go on
        elif path == "/update_weights_from_disk":
            self.weight_version = str(body.get("weight_version") or "updated")
            self.model_path = str(body.get("model_path") or self.model_path)
            return web.json_response({"success": True, "message": "ok"})
        elif path == "/begin_weight_update":
            if self.session_open:
                return web.json_response({"success": False, "message": "a weight-update session is already open; "
                                          "call end_weight_update() first"}, status=400)
            self.session_open = True
        elif path == "/end_weight_update":
            if not self.session_open:
                return web.json_response({"success": False, "message": "no weight-update session is open"},
                                         status=400)
            self.session_open = False
        elif path in ("/update_weights_from_tensor", "/update_weights_from_distributed"):
            if self.weight_sessions and not self.session_open:
                name = path.lstrip("/")
                return web.json_response({"success": False, "message": f"{name} must run between "
                                          "begin_weight_update() and end_weight_update()"}, status=400)
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            return web.json_response({"success": True, "message": "ok"})
        return web.json_response({"success": True})


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the connection's transport known to the fake: stop()
    resets every live one, and one that connects after stop() began is reset at once (a dead process)."""

    def __init__(self, fake: FakeSGLang, inner: Any):
        self.fake, self.inner, self.transport, self.live = fake, inner, None, False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self.fake._stopping:
            transport.abort()
            return
        self.fake._transports.add(transport)
        self.fake.connections += 1
        self.live = True
        self.inner.connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.fake._transports.discard(self.transport)
        if self.live:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.fake.drop_next > 0 and data.startswith(b"POST /generate"):
            self.fake.drop_next -= 1
            self.fake.events.append("dropped")
            self.transport.close()
            return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


async def start_fakes(n: int, **kw: Any) -> list[FakeSGLang]:
    return [await FakeSGLang(**kw).start() for _ in range(n)]
