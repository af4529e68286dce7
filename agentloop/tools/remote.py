"""Tools run by tool services (`agentloop tools serve`, agentloop.tools.service) instead of this process.

With `tools.server_url` set, tool_agent_loop gets a RemoteTool per tool name, made from the service's catalog
(name, description, parameters: the same schema, so the same prompt), and calls it like a local tool; the
records are the same token for token as with local tools and the same seeds (tests/integration/
test_tool_service_real.py).

    ServiceBalancer   plain class: which service gets a new instance (fewest live instances among those not
                      failing; a service that failed is skipped for `_DOWN_S`, then tried again)
    ToolServicePool   one per (urls, token) and event loop: an aiohttp session (closed by its keeper task when
                      the loop shuts down), the catalog (fetched once), create/execute/reward/release calls, each
                      under a deadline
    RemoteTool        a BaseTool whose instance lives on one service

Failures: an exception or timeout inside the tool comes back as data and is raised here again under the
same type name and message (so tool_agent_loop words and counts it exactly as for a local tool). A service
that cannot be reached, fails or answers garbage turns the call into error text for the model
("error: tool service ...", counted in the record as a tool error and in `tool/<name>/service_errors`); a
create that no service takes gives an instance whose calls all answer that way: never a hung episode (every
request has a deadline) and never a crash. The catalog is the exception: without it the prompt cannot be
rendered, so an episode that starts while no service answers is an error record (ToolServiceError).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from agentloop.errors import AgentLoopError
from agentloop.records import Sample
from agentloop.tools.base import BaseTool, ToolResponse
from agentloop.tools.config import ToolsConfig
from agentloop.tools.service import token_from_env

_DOWN_S = 5.0
"""Seconds a service that failed is passed over for new instances."""


class ToolServiceError(AgentLoopError):
    """No tool service could answer (the catalog, or a create that every service refused)."""


class RemoteToolException(Exception):
    """Base of the exceptions a tool raised on the service, raised again here under the tool's type name."""


_RAISED: dict[str, type[RemoteToolException]] = {}


def _raised(type_name: str, message: str) -> RemoteToolException:
    cls = _RAISED.get(type_name)
    if cls is None:
        cls = _RAISED[type_name] = type(type_name if type_name.isidentifier() else "ToolError",
                                        (RemoteToolException,), {"__module__": __name__})
    return cls(message)


class ServiceBalancer:
    """Where new instances go (no event loop; see the module docstring)."""

    def __init__(self, n: int):
        self.live = [0] * n
        self.down_until = [0.0] * n
        self.failures = [0] * n

    def order(self, now: float) -> list[int]:
        """Services to try for a new instance, best first: the up ones by live instances, then the down ones."""
        up = sorted((i for i in range(len(self.live)) if self.down_until[i] <= now), key=lambda i: self.live[i])
        down = sorted((i for i in range(len(self.live)) if self.down_until[i] > now), key=lambda i: self.down_until[i])
        return up + down

    def failed(self, i: int, now: float) -> None:
        self.failures[i] += 1
        self.down_until[i] = now + _DOWN_S

    def ok(self, i: int) -> None:
        self.down_until[i] = 0.0


class _ServiceFailed(Exception):
    """The service could not be reached or answered outside the API."""


@dataclass
class RemoteInstance:
    """An instance on service `idx` (or, with `dead` set, one no service took: its calls answer with error text)."""

    idx: int
    iid: str | None
    dead: str | None = None
    released: bool = field(default=False)


class ToolServicePool:
    """Calls to the tool services of `urls` (see the module docstring)."""

    def __init__(self, urls: list[str], token: str | None, cfg: ToolsConfig):
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.balancer = ServiceBalancer(len(self.urls))
        self._catalog: dict[str, dict[str, Any]] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._keeper: asyncio.Task | None = None
        self.errors = 0

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            ssl_ctx: Any = True
            if self.cfg.server_ca_file:
                import ssl

                ssl_ctx = ssl.create_default_context(cafile=self.cfg.server_ca_file)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=ssl_ctx),
                                                  headers=self.headers)
            self._keeper = asyncio.get_running_loop().create_task(self._keep(), name="tool-service-session")
        return self._session

    async def _keep(self) -> None:
        """Owns the session: closes it when cancelled (by `close`, or by asyncio.run at the loop's end)."""
        try:
            await asyncio.Event().wait()
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None

    async def request(self, idx: int, method: str, path: str, body: Any, timeout: float) -> dict[str, Any]:
        """One API call to service `idx`: its JSON answer (HTTP 200) or _ServiceFailed saying why."""
        url = self.urls[idx] + path
        try:
            async with self.session().request(method, url, json=body,
                                              timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                text = await r.text()
                if r.status != 200:
                    raise _ServiceFailed(f"{url} answered HTTP {r.status}: {text[:300]}")
                out = orjson.loads(text) if text else None
        except asyncio.TimeoutError:
            raise _ServiceFailed(f"{url} did not answer within {timeout:g}s") from None
        except aiohttp.ClientError as e:
            raise _ServiceFailed(f"{url}: {type(e).__name__}: {e}") from None
        except ValueError as e:
            raise _ServiceFailed(f"{url} sent a non-JSON body: {e}") from None
        if not isinstance(out, dict):
            raise _ServiceFailed(f"{url} sent {type(out).__name__}, not an object")
        return out

    async def catalog(self) -> dict[str, dict[str, Any]]:
        """The services' tools by name (the first service that answers; fetched once)."""
        if self._catalog is not None:
            return self._catalog
        problems = []
        for i in self.balancer.order(time.monotonic()):
            try:
                body = await self.request(i, "GET", "/v1/tools", None, self.cfg.remote_timeout_s)
                catalog = {t["name"]: t for t in body["tools"]}
            except (_ServiceFailed, KeyError, TypeError) as e:
                self.balancer.failed(i, time.monotonic())
                problems.append(str(e))
                continue
            bare = sorted(n for n, t in catalog.items() if t.get("sandboxed") and not t.get("isolated"))
            if bare and not self.cfg.allow_unisolated_service:
                raise ToolServiceError(
                    f"the tool service {self.urls[i]} runs {bare} (model-written code) without isolation; use an "
                    "isolated service, or accept it with tools.allow_unisolated_service=true")
            self._catalog = catalog
            return self._catalog
        raise ToolServiceError("no tool service answered for its catalog: " + "; ".join(problems))

    async def create(self, tool: str, episode: Sample, kwargs: dict[str, Any]) -> RemoteInstance:
        body = {"tool": tool, "episode": episode.model_dump(mode="json"), "kwargs": kwargs}
        problems = []
        for i in self.balancer.order(time.monotonic()):
            try:
                out = await self.request(i, "POST", "/v1/instances", body, self.cfg.remote_timeout_s)
            except _ServiceFailed as e:
                self.balancer.failed(i, time.monotonic())
                problems.append(str(e))
                continue
            self.balancer.ok(i)
            if "exception" in out:
                raise _raised(out["exception"].get("type", "ToolError"), out["exception"].get("message", ""))
            self.balancer.live[i] += 1
            return RemoteInstance(idx=i, iid=str(out["instance_id"]))
        self.errors += 1
        return RemoteInstance(idx=-1, iid=None, dead="; ".join(problems))

    def failed(self, inst: RemoteInstance, why: str) -> ToolResponse:
        self.errors += 1
        if inst.idx >= 0:
            self.balancer.failed(inst.idx, time.monotonic())
        return ToolResponse(text=f"error: tool service unavailable: {why}", error="service_unavailable",
                            metrics={"service_errors": 1.0})

    def drop(self, inst: RemoteInstance) -> None:
        if inst.idx >= 0 and not inst.released:
            inst.released = True
            self.balancer.live[inst.idx] -= 1


_POOLS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, ToolServicePool]]" = \
    weakref.WeakKeyDictionary()


def service_pool(cfg: ToolsConfig) -> ToolServicePool:
    """The running loop's pool for `cfg.server_url` (one session and catalog per loop, shared by episodes)."""
    token = token_from_env()
    pools = _POOLS.setdefault(asyncio.get_running_loop(), {})
    key = (tuple(cfg.server_url), token)
    pool = pools.get(key)
    if pool is None:
        pool = pools[key] = ToolServicePool(cfg.server_url, token, cfg)
    return pool


class RemoteTool(BaseTool):
    """A tool of the catalog, run by a tool service (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], pool: ToolServicePool, config: ToolsConfig | None = None):
        super().__init__(config)
        self.pool = pool
        self.name = spec["name"]  # type: ignore[misc] - per object: one class stands for every remote tool
        self.description = spec.get("description", "")  # type: ignore[misc]
        self.parameters = spec.get("parameters") or {"type": "object", "properties": {}}  # type: ignore[misc]
        self.verl_style = bool(spec.get("verl_style", False))  # type: ignore[misc]
        # the service keeps the episode's instance (create/release there): a resumed episode cannot rebuild it
        # unless the tool says its calls may run again
        self.stateful = True  # type: ignore[misc]
        self.idempotent = bool(spec.get("idempotent", False))  # type: ignore[misc]

    async def create(self, episode: Sample, **kwargs: Any) -> RemoteInstance:
        return await self.pool.create(self.name, episode, kwargs)

    async def execute(self, instance: RemoteInstance, arguments: dict[str, Any]) -> ToolResponse:
        if instance.dead is not None:
            return self.pool.failed(instance, instance.dead)
        # the service stops the call at tool_timeout_s; the loop's own wait_for does too: a little slack here
        timeout = self.config.tool_timeout_s
        try:
            out = await self.pool.request(instance.idx, "POST", f"/v1/instances/{instance.iid}/execute",
                                          {"arguments": arguments, "timeout_s": timeout}, timeout + 5.0)
        except _ServiceFailed as e:
            return self.pool.failed(instance, str(e))
        if out.get("timeout"):
            raise asyncio.TimeoutError
        if "exception" in out:
            raise _raised(out["exception"].get("type", "ToolError"), out["exception"].get("message", ""))
        try:
            return ToolResponse.model_validate(out)
        except ValueError as e:
            return self.pool.failed(instance, f"malformed answer: {e}")

    async def reward(self, instance: RemoteInstance) -> float | None:
        if instance.dead is not None:
            return None
        try:
            out = await self.pool.request(instance.idx, "POST", f"/v1/instances/{instance.iid}/reward", {},
                                          self.pool.cfg.remote_timeout_s)
        except _ServiceFailed:
            self.pool.failed(instance, "reward")
            return None
        if "exception" in out:
            raise _raised(out["exception"].get("type", "ToolError"), out["exception"].get("message", ""))
        r = out.get("reward")
        return None if r is None else float(r)

    async def release(self, instance: RemoteInstance) -> None:
        if instance.dead is not None or instance.released:
            return
        self.pool.drop(instance)
        try:
            out = await self.pool.request(instance.idx, "DELETE", f"/v1/instances/{instance.iid}", None,
                                          self.pool.cfg.remote_timeout_s)
        except _ServiceFailed:
            # the service is gone or unreachable: its lease releases the instance there
            self.pool.errors += 1
            return
        if out.get("error"):
            raise _raised("ReleaseError", str(out["error"]))


def remote_tool(cfg: ToolsConfig, name: str) -> RemoteTool:
    """The RemoteTool `name` of the running loop's pool, whose catalog was fetched (`await pool.catalog()`)."""
    pool = service_pool(cfg)
    catalog = pool._catalog
    if catalog is None:
        raise ToolServiceError("the tool services' catalog was not fetched yet")
    if name not in catalog:
        raise ToolServiceError(f"the tool service(s) {', '.join(pool.urls)} have no tool {name!r}; "
                               f"they have {sorted(catalog)}")
    return RemoteTool(catalog[name], pool, cfg)
