"""`agentloop tools serve`: the registered tools (built-ins, plugins, a verl tool config's) behind an HTTP service,
so heavy tools (sandboxes, retrievers, environments) run on their own machines.

API (JSON bodies; with a token set, every request carries `Authorization: Bearer <token>`):

    GET    /v1/tools                    {"tools": [{name, description, parameters, verl_style, sandboxed,
                                        isolated, idempotent}], "lease_s"}
    POST   /v1/instances                {tool, episode (a Sample), kwargs} -> {instance_id}: tool.create
    POST   /v1/instances/{id}/execute   {arguments, timeout_s} -> {text, metrics, error}, or
                                        {timeout: true} | {exception: {type, message}}: tool.execute
    POST   /v1/instances/{id}/reward    {} -> {reward}: tool.reward
    DELETE /v1/instances/{id}           tool.release -> {released}
    GET    /health                      {status, tools, instances}
    GET    /metrics                     counters and gauges (JSON): creates, calls, errors, timeouts, leases ...

Parts:
    Leases        plain class: an instance not touched for `lease_s` (every call renews it) belongs to an
                  episode that vanished (its engine died): the reaper releases it
    StartRate     plain class: a token bucket pacing the calls of sandbox tools (each starts a sandbox process)
    ToolService   the instances, the limits, the handlers; `serve()` runs it until cancelled

Limits: `max_concurrent_calls` executes at once (others wait), each under min(its timeout_s,
`max_call_timeout_s`); calls of `sandbox_tools` start at most `sandbox_start_rate` per second. A call's
exception or timeout is answered as data (the client raises it again, so the loop words and counts it exactly as
for a local tool). Bind: 127.0.0.1 by default; any other host needs a shared secret in AGENTLOOP_TOOLS_TOKEN (the
service executes code) and TLS (tools.service.tls_cert / tls_key), so the secret never travels in plain HTTP. One
tool object per instance (as tool_agent_loop makes one per episode).

Isolation: the tools of `sandbox_tools` run model-written code. The service refuses to start when this host
cannot isolate them (no sandbox backend works), as `agentloop train` refuses on its own host, unless
tools.python.allow_unisolated=true; its catalog says of each tool whether it is sandboxed and isolated, and
clients refuse an unisolated one unless tools.allow_unisolated_service=true.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from agentloop.errors import ConfigError
from agentloop.records import Sample
from agentloop.tools.base import BaseTool
from agentloop.tools.config import ToolsConfig, ToolServiceConfig

TOKEN_ENV = "AGENTLOOP_TOOLS_TOKEN"
"""Environment variable holding the shared secret, on the service and on its clients (never in a config file)."""


class Leases:
    """Lease deadlines of instances (no event loop): `touch` on every use, `expired` lists the vanished."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self._until: dict[str, float] = {}

    def touch(self, iid: str, now: float) -> None:
        self._until[iid] = now + self.lease_s

    def drop(self, iid: str) -> None:
        self._until.pop(iid, None)

    def expired(self, now: float) -> list[str]:
        return [i for i, t in self._until.items() if t <= now]

    def __len__(self) -> int:
        return len(self._until)


class StartRate:
    """Token bucket (no event loop): `reserve(now)` takes the next start and says how long to wait for it."""

    def __init__(self, rate_per_s: float, burst: int | None = None):
        self.rate = rate_per_s
        self.burst = float(burst if burst is not None else max(1, int(rate_per_s)))
        self.tokens = self.burst
        self.t = 0.0
        self.started = False

    def reserve(self, now: float) -> float:
        if not self.started:
            self.started, self.t = True, now
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        self.tokens -= 1.0
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


@dataclass
class _Instance:
    tool: BaseTool
    state: Any
    episode_id: str


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on the loopback interface only ("" and "0.0.0.0" listen everywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, tls: bool = False) -> None:
    """Refuse a non-loopback bind without a shared secret, or without TLS to carry it: the service executes code."""
    if is_loopback(host):
        return
    if not token:
        raise ConfigError(f"the tool service executes code: binding {host!r} (not localhost) needs a shared secret; "
                          f"set {TOKEN_ENV} on the service and its clients")
    if not tls:
        raise ConfigError(f"binding {host!r} (not localhost) needs TLS, or the shared secret travels in plain HTTP: "
                          "set tools.service.tls_cert and tools.service.tls_key (PEM files), and give clients "
                          "https:// URLs (tools.server_ca_file for a private CA)")


def sandbox_isolation(cfg: ToolsConfig, names: list[str]) -> dict[str, bool]:
    """name -> whether it would run isolated here, for the served tools that run model code (`sandbox_tools`)."""
    from agentloop.tools.sandbox import isolation_status

    sandboxed = [n for n in names if n in cfg.service.sandbox_tools]
    if not sandboxed:
        return {}
    isolated = isolation_status(cfg.python).isolated
    return {n: isolated for n in sandboxed}


def require_served_isolation(cfg: ToolsConfig, names: list[str]) -> dict[str, bool]:
    """`sandbox_isolation`, or ConfigError when a sandboxed tool would run unisolated and
    tools.python.allow_unisolated is not set (what `agentloop train` refuses on its own host)."""
    iso = sandbox_isolation(cfg, names)
    bare = sorted(n for n, ok in iso.items() if not ok)
    if bare and not cfg.python.allow_unisolated:
        from agentloop.tools.sandbox import isolation_status

        raise ConfigError(
            f"agentloop tools serve refuses to run model-written code unisolated: the tools {bare} "
            f"(tools.service.sandbox_tools) have no working sandbox here ({isolation_status(cfg.python).reason}). "
            "Run as root, install bubblewrap, or accept it with tools.python.allow_unisolated=true (the catalog "
            "then says so, and clients refuse it unless tools.allow_unisolated_service=true)")
    return iso


class ToolService:
    """The service's state and handlers (see the module docstring)."""

    def __init__(self, tools_cfg: ToolsConfig, classes: dict[str, type[BaseTool]], token: str | None = None):
        self.cfg = tools_cfg
        self.scfg: ToolServiceConfig = tools_cfg.service
        self.classes = classes
        self.token = token
        self.instances: dict[str, _Instance] = {}
        self.leases = Leases(self.scfg.lease_s)
        self.rate = StartRate(self.scfg.sandbox_start_rate)
        self._calls = asyncio.Semaphore(self.scfg.max_concurrent_calls)
        self.m: dict[str, float] = {k: 0.0 for k in (
            "creates", "create_errors", "calls", "call_errors", "call_exceptions", "call_timeouts", "rewards",
            "releases", "release_errors", "lease_expired", "unauthorized", "unknown_instance", "calls_waiting",
            "calls_running", "sandbox_wait_s")}
        self.schemas = {name: cls(tools_cfg) for name, cls in classes.items()}
        self.isolation = sandbox_isolation(tools_cfg, list(self.schemas))

    # ------------------------------------------------------------------ app

    def app(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> Any:
            if self.token is not None:
                got = request.headers.get("Authorization", "")
                if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
                    self.m["unauthorized"] += 1
                    return web.json_response({"error": "unauthorized: a Bearer token is required"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[auth], client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/tools", self._tools)
        app.router.add_post("/v1/instances", self._create)
        app.router.add_post("/v1/instances/{iid}/execute", self._execute)
        app.router.add_post("/v1/instances/{iid}/reward", self._reward)
        app.router.add_delete("/v1/instances/{iid}", self._release)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    @staticmethod
    def _json(body: Any, status: int = 200) -> Any:
        from aiohttp import web

        return web.json_response(body, status=status)

    async def _tools(self, request: Any) -> Any:
        return self._json({"lease_s": self.scfg.lease_s, "tools": [
            {"name": t.name, "description": t.description, "parameters": t.parameters, "verl_style": t.verl_style,
             "sandboxed": name in self.isolation, "isolated": self.isolation.get(name),
             "idempotent": bool(getattr(t, "idempotent", False))}
            for name, t in self.schemas.items()]})

    async def _body(self, request: Any) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise _Bad("body is not JSON") from None
        if not isinstance(body, dict):
            raise _Bad("body must be a JSON object")
        return body

    def _get(self, request: Any) -> tuple[str, _Instance]:
        iid = request.match_info["iid"]
        inst = self.instances.get(iid)
        if inst is None:
            self.m["unknown_instance"] += 1
            raise _Gone(f"no instance {iid} (released, or its lease of {self.scfg.lease_s:g}s ran out)")
        self.leases.touch(iid, time.monotonic())
        return iid, inst

    async def _create(self, request: Any) -> Any:
        try:
            body = await self._body(request)
            name = body.get("tool")
            cls = self.classes.get(name) if isinstance(name, str) else None
            if cls is None:
                raise _Bad(f"unknown tool {name!r}; this service has {sorted(self.classes)}")
            episode = Sample.model_validate(body.get("episode"))
            kwargs = body.get("kwargs") or {}
            if not isinstance(kwargs, dict):
                raise _Bad("kwargs must be an object")
        except _Bad as e:
            return self._json({"error": str(e)}, 400)
        except ValueError as e:  # the episode is not a Sample
            return self._json({"error": f"episode: {e}"}, 400)
        if len(self.instances) >= self.scfg.max_instances:
            return self._json({"error": f"at the limit of {self.scfg.max_instances} live instances"}, 503)
        tool = cls(self.cfg)
        try:
            state = await asyncio.wait_for(tool.create(episode, **kwargs), self.scfg.max_call_timeout_s)
        except Exception as e:  # noqa: BLE001 - answered as data: the client raises it in the episode
            self.m["create_errors"] += 1
            return self._json({"exception": {"type": type(e).__name__, "message": str(e)}})
        iid = uuid.uuid4().hex
        self.instances[iid] = _Instance(tool, state, episode.episode_id)
        self.leases.touch(iid, time.monotonic())
        self.m["creates"] += 1
        return self._json({"instance_id": iid})

    async def _execute(self, request: Any) -> Any:
        try:
            iid, inst = self._get(request)
            body = await self._body(request)
            arguments = body.get("arguments")
            if not isinstance(arguments, dict):
                raise _Bad("arguments must be an object")
            timeout = min(float(body.get("timeout_s") or self.scfg.max_call_timeout_s), self.scfg.max_call_timeout_s)
        except _Gone as e:
            return self._json({"error": str(e)}, 404)
        except (_Bad, TypeError, ValueError) as e:
            return self._json({"error": str(e)}, 400)
        self.m["calls"] += 1
        t0 = time.monotonic()
        self.m["calls_waiting"] += 1
        waiting = True
        try:
            async with self._calls:
                waiting = False
                self.m["calls_waiting"] -= 1
                self.m["calls_running"] += 1
                try:
                    if inst.tool.name in self.scfg.sandbox_tools:
                        wait = self.rate.reserve(time.monotonic())
                        if wait > 0:
                            self.m["sandbox_wait_s"] += wait
                            await asyncio.sleep(wait)
                    left = timeout - (time.monotonic() - t0)
                    if left <= 0:
                        raise asyncio.TimeoutError
                    resp = await asyncio.wait_for(inst.tool.execute(inst.state, arguments), left)
                finally:
                    self.m["calls_running"] -= 1
        except asyncio.TimeoutError:
            self.m["call_timeouts"] += 1
            return self._json({"timeout": True})
        except Exception as e:  # noqa: BLE001 - answered as data, raised again in the episode (module doc)
            self.m["call_exceptions"] += 1
            return self._json({"exception": {"type": type(e).__name__, "message": str(e)}})
        finally:
            if waiting:  # cancelled (the client went away) before its turn came
                self.m["calls_waiting"] -= 1
            self.leases.touch(iid, time.monotonic())
        if resp.error is not None:
            self.m["call_errors"] += 1
        return self._json(resp.model_dump())

    async def _reward(self, request: Any) -> Any:
        try:
            _, inst = self._get(request)
        except _Gone as e:
            return self._json({"error": str(e)}, 404)
        self.m["rewards"] += 1
        try:
            r = await asyncio.wait_for(inst.tool.reward(inst.state), self.scfg.max_call_timeout_s)
        except Exception as e:  # noqa: BLE001 - answered as data
            return self._json({"exception": {"type": type(e).__name__, "message": str(e)}})
        return self._json({"reward": None if r is None else float(r)})

    async def _release(self, request: Any) -> Any:
        iid = request.match_info["iid"]
        if iid not in self.instances:
            self.m["unknown_instance"] += 1
            return self._json({"released": False, "error": f"no instance {iid}"}, 404)
        ok, err = await self.release(iid)
        return self._json({"released": ok, **({"error": err} if err else {})})

    async def release(self, iid: str) -> tuple[bool, str | None]:
        inst = self.instances.pop(iid, None)
        self.leases.drop(iid)
        if inst is None:
            return False, None
        try:
            await asyncio.wait_for(inst.tool.release(inst.state), self.scfg.max_call_timeout_s)
        except Exception as e:  # noqa: BLE001 - counted; the instance is gone either way
            self.m["release_errors"] += 1
            return True, f"{type(e).__name__}: {e}"
        self.m["releases"] += 1
        return True, None

    async def reap(self) -> int:
        """Release instances whose lease ran out (episodes that vanished); how many."""
        gone = self.leases.expired(time.monotonic())
        for iid in gone:
            self.m["lease_expired"] += 1
            await self.release(iid)
        return len(gone)

    async def _health(self, request: Any) -> Any:
        return self._json({"status": "ok", "tools": sorted(self.classes), "instances": len(self.instances)})

    def metrics(self) -> dict[str, float]:
        return {**self.m, "instances": float(len(self.instances))}

    async def _metrics(self, request: Any) -> Any:
        return self._json(self.metrics())

    async def close(self) -> None:
        for iid in list(self.instances):
            await self.release(iid)


class _Bad(ValueError):
    """A request that is not the API's shape (HTTP 400)."""


class _Gone(KeyError):
    """An instance that is not (any longer) here (HTTP 404)."""

    def __str__(self) -> str:
        return str(self.args[0])


def service_tools(cfg: ToolsConfig) -> dict[str, type[BaseTool]]:
    """Every registered tool (built-ins and loaded plugins), then a verl tool config's tools over them."""
    import agentloop.tools  # noqa: F401 - the built-ins register on import
    from agentloop.tools.registry import get_tool, list_tools

    classes = {n: get_tool(n) for n in list_tools()}
    if cfg.verl_tool_config:
        from agentloop.tools.verl_tools import verl_tool_classes

        classes.update(verl_tool_classes(cfg.verl_tool_config))
    return classes


async def serve(cfg: ToolsConfig, *, token: str | None = None, ready: Any = None) -> None:
    """Run the service until cancelled; prints (or calls `ready(url, tool names)`) once listening."""
    from aiohttp import web

    scfg = cfg.service
    check_bind(scfg.host, token, tls=bool(scfg.tls_cert))
    ssl_ctx = server_ssl(scfg)
    classes = service_tools(cfg)
    require_served_isolation(cfg, list(classes))
    service = ToolService(cfg, classes, token=token)
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, scfg.host, scfg.port, ssl_context=ssl_ctx)
    await site.start()

    async def reaper() -> None:
        while True:
            await asyncio.sleep(max(0.2, min(30.0, scfg.lease_s / 4)))
            await service.reap()

    task = asyncio.create_task(reaper(), name="tool-leases")
    try:
        port = runner.addresses[0][1] if runner.addresses else scfg.port
        url = f"{'https' if ssl_ctx else 'http'}://{scfg.host}:{port}"
        if ready is not None:
            ready(url, sorted(service.classes))
        else:
            print(f"agentloop tools: serving {', '.join(sorted(service.classes))} on {url}"
                  + (" (token required)" if token else ""), flush=True)
        await asyncio.Event().wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await service.close()
        await runner.cleanup()


def server_ssl(scfg: ToolServiceConfig) -> Any:
    """The service's TLS context from tools.service.tls_cert / tls_key (None: plain HTTP, loopback only)."""
    if not scfg.tls_cert and not scfg.tls_key:
        return None
    if not (scfg.tls_cert and scfg.tls_key):
        raise ConfigError("TLS needs both tools.service.tls_cert and tools.service.tls_key")
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(scfg.tls_cert, scfg.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load tools.service.tls_cert={scfg.tls_cert!r} / tls_key={scfg.tls_key!r}: "
                          f"{e}") from None
    return ctx


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None
