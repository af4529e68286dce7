"""The gateway's HTTP server (aiohttp, in the engine's event loop): sessions by key, a key per session,
one gateway per ServerManager.

Map:
    SessionHandle    what an episode gets: its session key, API key and base URLs
    Gateway          start / close, open / close sessions, the route handlers, gauges
    gateway_for      the gateway of a ServerManager: started on first use, closed when the manager closes
    log_once         a warning logged once per process and key (ignored request fields, sampling knobs)

Routes, each under /s/{key}/v1 where {key} is the session's (an episode's):
    POST chat/completions   OpenAI Chat Completions (agentloop.gateway.openai_api), streaming or not
    POST responses          OpenAI Responses (agentloop.gateway.responses_api), streaming or not
    POST messages           Anthropic Messages (agentloop.gateway.anthropic_api), streaming or not
    GET  models             the one model ("agentloop-policy"; any model name is accepted in requests)
Any other path or method is answered 404 in the OpenAI error shape, naming the route asked for and the routes
served.

Access: every request must carry the session's key as `Authorization: Bearer <key>` (what OpenAI SDKs
send) or `x-api-key: <key>` (Anthropic SDKs); a wrong key is 401, an unknown or closed session 404.
A session's requests run as tasks owned by the session: closing it (its episode ended, timed out or was
cancelled) cancels what still runs, and the harness gets a 503. Errors come back in the API's own shape:
400 (the message names the field), 401, 404, 413 (body over gateway.max_request_mb), 500/503 when the
backend failed (the backend remembers the failure and the episode fails with it). Every error carries
`x-should-retry: false`: the SDKs retry 5xx (and 408/409/429) by default, and a retry here cannot succeed (the
episode's failure is already recorded, or its session closed); each retry would only start a new segment.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging
import re
import secrets
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentloop.errors import ServerError
from agentloop.gateway import anthropic_api, openai_api, responses_api
from agentloop.gateway.config import GatewayConfig
from agentloop.gateway.messages import ChatRequest, Completion, GatewayError, SessionBackend

if TYPE_CHECKING:
    from agentloop.server_manager import ServerManager

logger = logging.getLogger(__name__)

MODEL_ID = "agentloop-policy"
"""The model the gateway lists; requests may name any model (the policy being trained answers)."""

ROUTES = ("POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages", "GET /v1/models")
"""What the gateway serves, under each episode's /s/<episode> prefix."""

_WARNED: set[str] = set()


def log_once(key: str, message: str) -> None:
    """Log `message` as a warning the first time `key` is seen in this process."""
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


@dataclass(frozen=True)
class SessionHandle:
    key: str
    """The session's key, the {key} of its URLs."""
    api_key: str
    """The secret a request must carry (Authorization: Bearer ... or x-api-key)."""
    openai_base_url: str
    """http://host:port/s/{key}/v1: the base URL of an OpenAI client."""
    anthropic_base_url: str
    """http://host:port/s/{key}: the base URL of an Anthropic client (it adds /v1/messages itself)."""


@dataclass
class _Session:
    key: str
    api_key: str
    backend: SessionBackend
    tasks: set[asyncio.Task] = field(default_factory=set)


class Gateway:
    """The HTTP server; all methods run on one event loop."""

    def __init__(self, cfg: GatewayConfig | None = None):
        self.cfg = cfg or GatewayConfig()
        self._sessions: dict[str, _Session] = {}
        self._runner: web.AppRunner | None = None
        self._start_lock = asyncio.Lock()
        self._closed = False
        self.url = ""
        """http://host:port once started."""
        self._slots: asyncio.Semaphore | None = None
        self._stats = {"requests": 0, "streamed": 0, "client_errors": 0, "server_errors": 0, "sessions": 0}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "Gateway":
        """Listen on gateway.host:gateway.port (0: a free port); idempotent.

        The server is set up in a context of its own: its accept loop and every handler task copy the context
        current when it starts listening, and the first episode's (its trajectory list, its deadline) must
        not become every later request's. Each session's backend is told its episode explicitly instead."""
        # a task made inside an empty context copies that one (create_task's context= is Python 3.11+)
        return await contextvars.Context().run(asyncio.ensure_future, self._start())

    async def _start(self) -> "Gateway":
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("the gateway was closed")
            if self._runner is not None:
                return self
            app = web.Application(client_max_size=int(self.cfg.max_request_mb * (1 << 20)))
            app.router.add_post("/s/{key}/v1/chat/completions", self._openai)
            app.router.add_post("/s/{key}/v1/responses", self._responses)
            app.router.add_post("/s/{key}/v1/messages", self._anthropic)
            app.router.add_get("/s/{key}/v1/models", self._models)
            app.router.add_route("*", "/{tail:.*}", self._unknown)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.cfg.shutdown_timeout_s)
            await runner.setup()
            site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
            try:
                await site.start()
            except OSError:
                await runner.cleanup()
                raise
            port = runner.addresses[0][1]
            host = "127.0.0.1" if self.cfg.host in ("", "0.0.0.0", "::") else self.cfg.host
            self.url = f"http://{host}:{port}"
            self._runner = runner
            return self

    async def close(self) -> None:
        """Cancel every session's running requests, then stop listening (bounded by gateway.shutdown_timeout_s)."""
        self._closed = True
        for key in list(self._sessions):
            self.close_session(key)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> "Gateway":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def slots(self, n: int) -> asyncio.Semaphore:
        """The process-wide cap on agents running at once (agent.max_concurrency), made on first use."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(n)
        return self._slots

    # ------------------------------------------------------------------ sessions

    def open_session(self, name: str, backend: SessionBackend) -> SessionHandle:
        """A new session served by `backend`; `name` (the episode id) becomes its key, made unique."""
        if self._runner is None:
            raise RuntimeError("start the gateway before opening sessions")
        base = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "session"
        key, n = base, 1
        while key in self._sessions:
            n += 1
            key = f"{base}~{n}"
        sess = _Session(key, secrets.token_urlsafe(24), backend)
        self._sessions[key] = sess
        self._stats["sessions"] += 1
        return SessionHandle(key, sess.api_key, f"{self.url}/s/{key}/v1", f"{self.url}/s/{key}")

    def close_session(self, key: str) -> None:
        """Forget the session and cancel its running requests (they are answered 503)."""
        sess = self._sessions.pop(key, None)
        if sess is not None:
            for t in sess.tasks:
                t.cancel()

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def gauges(self) -> dict[str, float]:
        return {f"gateway/{k}": float(v) for k, v in {**self._stats, "open_sessions": len(self._sessions)}.items()}

    # ------------------------------------------------------------------ handlers

    def _session(self, request: web.Request) -> _Session:
        sess = self._sessions.get(request.match_info["key"])
        if sess is None:
            raise GatewayError(404, f"no open session {request.match_info['key']!r} (its episode has ended, or the "
                                    "base URL is wrong)", kind="not_found_error")
        given = request.headers.get("x-api-key", "")
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            given = given or auth[7:].strip()
        if not hmac.compare_digest(given.encode(), sess.api_key.encode()):
            raise GatewayError(401, "wrong or missing API key for this session (send the episode's api_key as "
                                    "'Authorization: Bearer <key>' or 'x-api-key: <key>')", kind="authentication_error")
        return sess

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, "openai")

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, "anthropic")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, "responses")

    async def _unknown(self, request: web.Request) -> web.StreamResponse:
        routes = ", ".join(ROUTES)
        return self._error("openai", GatewayError(
            404, f"the gateway does not serve {request.method} {request.path}; it serves {routes} (under each "
                 "episode's base URL /s/<episode>/v1)", kind="not_found_error", code="unknown_route"))

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._session(request)
        except GatewayError as e:
            return self._error("openai", e)
        return web.json_response(openai_api.models_body(MODEL_ID))

    async def _chat(self, request: web.Request, api: str) -> web.StreamResponse:
        self._stats["requests"] += 1
        try:
            sess = self._session(request)
            req = await self._parse(request, api)
            completion = await self._serve(sess, req)
        except GatewayError as e:
            return self._error(api, e)
        model = req.model or MODEL_ID
        now = int(time.time())
        if not req.stream:
            body = (openai_api.completion_body(completion, model, now) if api == "openai"
                    else responses_api.response_body(completion, model, now) if api == "responses"
                    else anthropic_api.message_body(completion, model))
            return web.json_response(body, dumps=_dumps)
        self._stats["streamed"] += 1
        events = (openai_api.stream_chunks(completion, model, now, req.include_usage) if api == "openai"
                  else responses_api.stream_events(completion, model, now) if api == "responses"
                  else anthropic_api.stream_events(completion, model))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            for ev in events:
                await resp.write(ev)
            await resp.write_eof()
        except ConnectionResetError:  # the harness went away; the turn is already in the session's record
            pass
        return resp

    async def _parse(self, request: web.Request, api: str) -> ChatRequest:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(413, f"request body over gateway.max_request_mb={self.cfg.max_request_mb:g}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GatewayError(400, f"the request body is not JSON: {e}") from None
        req = {"openai": openai_api, "responses": responses_api, "anthropic": anthropic_api}[api].parse_request(body)
        for k in req.ignored:
            log_once(f"{api}:ignored:{k}", f"gateway: requests set {k!r}, which the gateway does not honour "
                                           "(ignored; this is logged once)")
        if req.tool_choice not in ("auto", "none"):
            log_once(f"{api}:tool_choice", f"gateway: tool_choice={req.tool_choice!r} cannot be enforced on a "
                                           "sampled policy; treated as auto (logged once)")
        return req

    async def _serve(self, sess: _Session, req: ChatRequest) -> Completion:
        task = asyncio.create_task(sess.backend.complete(req), name=f"gateway-{sess.key}-{uuid.uuid4().hex[:6]}")
        sess.tasks.add(task)
        try:
            return await task
        except GatewayError:
            raise
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the handler itself is being cancelled
            raise GatewayError(503, "the session closed while this request ran (its episode ended)",
                               kind="overloaded_error") from None
        except Exception as e:  # noqa: BLE001 - the backend keeps the failure for its episode; the harness hears of it
            raise GatewayError(503 if isinstance(e, ServerError) else 500,
                               f"generation failed: {type(e).__name__}: {e}", kind="api_error") from None
        finally:
            sess.tasks.discard(task)

    def _error(self, api: str, e: GatewayError) -> web.Response:
        self._stats["client_errors" if e.status < 500 else "server_errors"] += 1
        body = anthropic_api.error_body(e) if api == "anthropic" else openai_api.error_body(e)
        # a retry cannot succeed: the backend's failure is the episode's, a closed session stays closed
        return web.json_response(body, status=e.status, dumps=_dumps, headers={"x-should-retry": "false"})


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


_GATEWAYS: "weakref.WeakKeyDictionary[Any, Gateway]" = weakref.WeakKeyDictionary()


async def gateway_for(sm: "ServerManager", cfg: GatewayConfig) -> Gateway:
    """The gateway serving through `sm`: started on first use (with `cfg`), closed when `sm` closes."""
    gw = _GATEWAYS.get(sm)
    if gw is None:
        gw = _GATEWAYS[sm] = Gateway(cfg)
        sm.on_close(gw.close)
    return await gw.start()


__all__ = ["MODEL_ID", "Gateway", "SessionHandle", "gateway_for", "log_once"]
