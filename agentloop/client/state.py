"""What the parts of a ServerManager share: the servers' table (a Router), the pause state, the counters, the
connections and the two HTTP calls every part makes besides /generate.

One ManagerState per manager, used from one event loop (no locking: every method runs to completion between
awaits). The parts read and write it; they never reach into each other's attributes.

Map:
    ManagerState.get_ok, admin_post   GET a JSON answer (None on any failure) / POST an admin call (RequestError)
    ManagerState.note_failure         a failed request or probe, counted, the server ejected after enough of them
    ManagerState.continue_quietly     best effort: servers we may have left paused go on generating
    ManagerState.spawn, say           background tasks drained at close; event lines (ejections, re-admissions)
    ManagerState.gauges               `server/...` numbers for progress lines and metrics
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from agentloop.config import ManagerConfig
from agentloop.errors import RequestError, ServerError
from agentloop.routing import Router
from agentloop.util.http1 import Http1Pool

DEFAULT_MAX_INFLIGHT = 256
"""The cap of a server that does not report its capacity, while manager.max_inflight_per_server is null."""

ResyncHook = Callable[[str], Awaitable[None]]
"""Loads the current weights into the server at this url (called before re-admitting a stale server)."""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


class ManagerState:
    """The shared state of one ServerManager (see the module doc); its fields are the parts' common ground."""

    def __init__(self, urls: list[str], cfg: ManagerConfig, *, vocab_size: int | None = None,
                 initial_version: int | None = None, on_event: Callable[[str], None] | None = None,
                 cache_salt: bool = False, resync: ResyncHook | None = None):
        if not urls:
            raise ServerError("ServerManager needs at least one server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg
        self.vocab_size = vocab_size
        """When known, prompts with ids outside [0, vocab_size) are refused client-side."""
        self.router = Router(self.urls, cfg.max_inflight_per_server or DEFAULT_MAX_INFLIGHT, cfg.eject_after_failures,
                             sticky=cfg.sticky)
        for i in range(len(self.urls)):
            self.router.servers[i].version = initial_version
        self.resync = resync
        """Reloads the current weights into one stale server before it is re-admitted (None: it waits for a push)."""
        self.cache_salt = cache_salt
        """Requests carry a per-version `extra_key` (the in_place interrupt mode)."""
        self.lora_adapters = False
        """LoRA training (agentloop.train.weights.lora_servers): version v > 0 is the adapter `agentloop-v<v>`, each
        request names its server's adapter (`lora_path`) and all its tokens carry that version."""
        self.adapter_inflight: Counter[tuple[str, int]] = Counter()
        """LoRA: this client's /generate calls in flight per (server url, adapter version): an adapter is unloaded
        only once none names it (lora_servers), as SGLang holds its LoRA lock until the last one ends."""
        self.on_event = on_event
        self.session: aiohttp.ClientSession | None = None
        """Admin calls, health probes and https /generate."""
        self.http: Http1Pool | None = None
        """Pooled HTTP/1.1 connections for http /generate (agentloop.util.http1)."""
        self.background: set[asyncio.Task] = set()
        self.changed = asyncio.Event()
        """Set whenever capacity, health or the pause state may have changed: waiters re-check."""
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.pause_mode: str | None = None
        self.interrupts = 0
        """Abort-mode pauses (and flush fallbacks) so far: an abort seen across one is an interrupt."""
        self.pauses = 0
        """Pauses of any mode so far."""
        self.paused: set[int] = set()
        """Servers sent a pause since the last resume (close continues them, whatever happened)."""
        self.needs_continue: set[int] = set()
        """Ejected after failing a pause or continue: sent a continue before they are probed."""
        self.latencies: deque[float] = deque(maxlen=4096)
        self.stats = {"requests": 0, "retries": 0, "errors": 0, "timeouts": 0, "ejections": 0,
                      "readmissions": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0,
                      "interrupted_calls": 0, "continued_calls": 0, "stale_servers": 0, "resyncs": 0,
                      "cancelled_calls": 0, "dropped_connections": 0, "flushes_refused": 0, "admin_failures": 0}
        self.down_since: float | None = None
        """Since when no server has been admitted (AllServersDownError after manager.all_down_grace_s)."""
        self.asleep: set[int] = set()
        """Lent servers put to sleep (agentloop.client.lending): no requests, no probes, woken before they serve."""
        self.evictions: Counter[str] = Counter()
        """Times each server was put to sleep: an abort a sleep caused is an interrupt its call continues elsewhere."""
        self.answered_at = [float("-inf")] * len(self.urls)
        """Last successful request per server (a server answering requests is alive, whatever its probe says)."""
        self.closed = False

    # ------------------------------------------------------------------ housekeeping

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        """A background task, kept until done and drained when the manager closes."""
        t = asyncio.create_task(coro, name=name)  # type: ignore[arg-type]
        self.background.add(t)
        t.add_done_callback(self.background.discard)
        return t

    def say(self, line: str) -> None:
        if self.on_event is not None:
            self.on_event(line)

    def require_session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise ServerError("ServerManager is not started (use `async with ServerManager(...)`)")
        return self.session

    def require_http(self) -> Http1Pool:
        if self.http is None:
            raise ServerError("ServerManager is not started (use `async with ServerManager(...)`)")
        return self.http

    def note_failure(self, idx: int) -> None:
        """A failed request or probe of server idx; said when it ejects the server."""
        if self.router.record_failure(idx):
            self.stats["ejections"] += 1
            self.say(f"server {self.urls[idx]} ejected after {self.router.servers[idx].consecutive_failures} "
                     f"failures ({self.router.healthy_count}/{len(self.urls)} healthy)")

    # ------------------------------------------------------------------ HTTP besides /generate

    async def get_ok(self, url: str, path: str, timeout: float) -> Any:
        """GET url+path; the JSON body (or True for a non-JSON 200), None on any failure."""
        to = aiohttp.ClientTimeout(total=timeout)
        try:
            async with self.require_session().get(url + path, timeout=to) as resp:
                text = await resp.text()
                if resp.status != 200:
                    return None
                try:
                    return json.loads(text) if text.strip() else True
                except json.JSONDecodeError:
                    return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def admin_post(self, url: str, path: str, payload: dict[str, Any] | None,
                         timeout: float | None = None) -> Any:
        """POST an admin call to one server; its JSON answer (or text). RequestError on HTTP >= 400, a timeout
        (default manager.admin_timeout_s) or a transport error."""
        to = aiohttp.ClientTimeout(total=timeout or self.cfg.admin_timeout_s)
        try:
            async with self.require_session().post(url + path, json=payload or {}, timeout=to) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise RequestError(f"{url}{path} answered HTTP {resp.status}: {text[:300]}", server=url,
                                       status=resp.status)
                try:
                    return json.loads(text) if text else None
                except json.JSONDecodeError:
                    return text
        except asyncio.TimeoutError:
            raise RequestError(f"{url}{path} timed out after {to.total}s", server=url) from None
        except aiohttp.ClientError as e:
            raise RequestError(f"{url}{path}: {type(e).__name__}: {e}", server=url) from None

    async def continue_quietly(self, idxs: list[int]) -> None:
        """Best effort, short timeout: servers we may have left paused go on generating."""
        async def one(i: int) -> None:
            try:
                await self.admin_post(self.urls[i], "/continue_generation", {}, timeout=self.cfg.health_timeout_s)
                self.needs_continue.discard(i)
            except Exception:  # noqa: BLE001 - best effort: the server may be gone, or the run ending
                pass

        await asyncio.gather(*(one(i) for i in idxs))

    # ------------------------------------------------------------------ gauges

    def gauges(self) -> dict[str, float]:
        lat = list(self.latencies)
        g: dict[str, float] = {
            "server/healthy": float(self.router.healthy_count),
            "server/total": float(len(self.urls)),
            "server/inflight": float(sum(s.inflight for s in self.router.servers)),
            "server/latency_p50_s": _percentile(lat, 0.50),
            "server/latency_p99_s": _percentile(lat, 0.99),
            "server/prefix_cache_hit_rate": (self.stats["cached_tokens"] / self.stats["prompt_tokens"]
                                             if self.stats["prompt_tokens"] else 0.0),
        }
        for k, v in self.stats.items():
            g[f"server/{k}"] = float(v)
        if self.http is not None:  # connections: open, opened, connect retries, waits for one (p99, max)
            for k, v in self.http.stats().items():
                g[f"server/{k}"] = v
        for i, s in enumerate(self.router.servers):
            g[f"server/{i}/inflight"] = float(s.inflight)
            g[f"server/{i}/healthy"] = float(s.healthy)
            g[f"server/{i}/requests"] = float(s.requests)
            g[f"server/{i}/capacity"] = float(self.router.capacity(i))
            g[f"server/{i}/asleep"] = float(s.asleep)
        return g


__all__ = ["DEFAULT_MAX_INFLIGHT", "ManagerState", "ResyncHook"]
