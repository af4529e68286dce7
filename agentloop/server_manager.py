"""ServerManager: the only way agentloop talks to SGLang servers (token ids in, token ids out).

Its public face; the work is done by parts that each hold one role (agentloop.client), wired here:
    generate, end_episode            the data plane (agentloop.client.data_plane): routing, typed retries,
                                     continuation of calls interrupted by a weight update, SGLang's answer parsed
    pause, resume, finish_update, flush_prefix_cache, flush_cache, abort_all, update_weights_from_disk,
    expect_version, mark_updated, push_targets, reachable_targets
                                     the control plane (agentloop.client.control_plane): admin calls broadcast to
                                     the servers (a server that fails one is ejected, the rest go on; updates also
                                     reach stale ones), the weight version every admitted server must serve
    probe_all, check_health, model_info, server_info, reported_version, wait_ready, set_resync
                                     health and re-admission (agentloop.client.health): dead servers ejected,
                                     recovered ones re-admitted only once they serve the expected weights
    add_follower, follower_state, follow
                                     followers (agentloop.client.followers): managers in other processes (Ray
                                     rollout workers) generating on the same servers while this one makes the
                                     admin calls
    sleep_servers, wake_servers      lent servers (agentloop.client.lending): servers on the learner's GPUs put to
                                     sleep while it trains (their calls continue elsewhere) and woken after
    size_from_servers                capacity (agentloop.client.capacity): each server's cap on concurrent requests,
                                     fixed, reported, or following its load (manager.concurrency.adaptive)
    gauges                           `server/...` numbers for progress lines and metrics
    on_close, start, close           the lifecycle: what lives as long as the manager (the agent gateway) closes
                                     first; servers paused when the manager closes are sent a continue (a run that
                                     dies never leaves --server-url servers paused)

The retry policy, the weight versions and the interrupts are described where they live: agentloop.client.data_plane.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from agentloop.client.capacity import Capacity, reported_capacity
from agentloop.client.control_plane import ControlPlane
from agentloop.client.data_plane import DataPlane, parse_generate_response, token_versions
from agentloop.client.followers import Followers
from agentloop.client.health import Health, parse_version
from agentloop.client.lending import Lending
from agentloop.client.state import DEFAULT_MAX_INFLIGHT, ManagerState, ResyncHook
from agentloop.config import ManagerConfig, SamplingParams
from agentloop.errors import ServerError
from agentloop.interrupt import InterruptPolicy
from agentloop.records import TokenOutput
from agentloop.routing import Router
from agentloop.util.http1 import Http1Pool


class ServerManager:
    """Routes token-in/token-out generate calls over N SGLang servers.

    Use as `async with ServerManager(urls, cfg) as sm:`; all methods must run on one event loop.
    """

    def __init__(self, urls: list[str], config: ManagerConfig | None = None, *, vocab_size: int | None = None,
                 initial_version: int | None = None, on_event: Callable[[str], None] | None = None,
                 cache_salt: bool = False, resync: ResyncHook | None = None):
        """`vocab_size`: when known, prompts with ids outside [0, vocab_size) are rejected client-side
        (SGLang 0.5.23 crashes its scheduler on such ids instead of answering 400).
        `initial_version`: the weight version the servers start with (training: 0, or the resumed step).
        `on_event`: receives one line per ejection, re-admission and stale server (a trainer prints them).
        `cache_salt`: send a per-version `extra_key`, so the prefix cache never serves KV of other weights (the
        in_place interrupt mode, where SGLang cannot flush its cache on an update: agentloop.interrupt).
        `resync`: reloads the current weights into one server before it is re-admitted (also `set_resync`, for a
        hook made after the manager: a trainer's weight transport)."""
        self.state = ManagerState(urls, config or ManagerConfig(), vocab_size=vocab_size,
                                  initial_version=initial_version, on_event=on_event, cache_salt=cache_salt,
                                  resync=resync)
        self.health = Health(self.state)
        self.capacity = Capacity(self.state)
        self.followers = Followers(self.state, expect_version=lambda v: self.control.expect_version(v),
                                   readmit=self.health.readmit)
        self.control = ControlPlane(self.state, followers=self.followers, readmit=self.health.readmit)
        self.data = DataPlane(self.state, on_full=self.capacity.on_full)
        self.lending = Lending(self.state, drain=self.control._drain, flush_one=self.control._flush_one)
        self._health_task: asyncio.Task | None = None
        self._follow_task: asyncio.Task | None = None
        self._closers: list[Callable[[], Awaitable[None]]] = []

    # ------------------------------------------------------------------ what the parts share

    @property
    def urls(self) -> list[str]:
        return self.state.urls

    @property
    def cfg(self) -> ManagerConfig:
        return self.state.cfg

    @property
    def vocab_size(self) -> int | None:
        return self.state.vocab_size

    @property
    def router(self) -> Router:
        return self.state.router

    @property
    def http(self) -> Http1Pool:
        """The pooled HTTP/1.1 connections /generate goes over (agentloop.util.http1; https goes through aiohttp)."""
        return self.state.require_http()

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.state.require_session()

    @property
    def cache_salt(self) -> bool:
        """Requests carry a per-version `extra_key` (the constructor's `cache_salt`)."""
        return self.state.cache_salt

    @property
    def on_event(self) -> Callable[[str], None] | None:
        """Where event lines go (the constructor's `on_event`)."""
        return self.state.on_event

    @property
    def resync(self) -> ResyncHook | None:
        """The hook that reloads the current weights into a stale server (the constructor's, or `set_resync`)."""
        return self.state.resync

    def set_resync(self, hook: ResyncHook | None) -> None:
        """Install the resync hook (see the constructor) once what makes it exists."""
        self.state.resync = hook

    def gauges(self) -> dict[str, float]:
        """`server/...` numbers: health, in-flight calls, latency, cache hits, counters, connections, per server;
        the concurrency limits and the load signal they follow (`server/conc_...`, agentloop.client.concurrency)."""
        return {**self.state.gauges(), **self.capacity.gauges(), **self.lending.gauges()}

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "ServerManager":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        s = self.state
        if s.session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=s.cfg.keepalive_s)
            s.session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)
        if s.http is None:
            s.http = Http1Pool(keepalive_s=s.cfg.keepalive_s, max_connecting=s.cfg.max_connecting_per_server,
                               connect_attempt_s=s.cfg.connect_attempt_s)
            for i, url in enumerate(s.urls):
                if url.startswith("http://"):
                    s.http.set_limit(url, s.router.capacity(i))  # a connection per request it may carry
        if self._health_task is None:
            # Every server starts inside the grace: the first wave of a run can keep a server from answering
            # for a while (a cold 2-core CPU server took 15 s for its first 128 episodes, and its probes
            # timed out meanwhile), so failed probes count only once it has had that long to answer.
            s.answered_at = [time.monotonic()] * len(s.urls)
            self._health_task = asyncio.create_task(self.health.run(), name="server-health")
        if self._follow_task is None and self.capacity.control is not None:
            self._follow_task = asyncio.create_task(self.capacity.follow(), name="server-concurrency")

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Await `fn()` first thing when the manager closes: what lives as long as it and serves through it
        (the agent gateway) is closed before the manager stops answering."""
        if self.state.closed:
            raise ServerError("ServerManager is closed")
        self._closers.append(fn)

    async def close(self) -> None:
        s = self.state
        closers, self._closers = self._closers, []
        for fn in reversed(closers):
            await fn()
        s.closed = True
        if s.asleep and s.session is not None:  # lent servers we leave: their memory back (best effort)
            for i in sorted(s.asleep):
                try:
                    await s.admin_post(s.urls[i], "/resume_memory_occupation", {}, timeout=s.cfg.health_timeout_s)
                except Exception:  # noqa: BLE001 - best effort: the server may be gone, or the run ending
                    pass
        if s.paused and s.session is not None:
            # The run is ending while servers are paused (an exception, Ctrl-C, the learner's death):
            # servers we did not launch (--server-url) would stay paused for whoever uses them next.
            await s.continue_quietly(sorted(s.paused))
            s.paused.clear()
        for task in (self._health_task, self._follow_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._health_task = self._follow_task = None
        if s.background:  # aborts of cancelled calls: give them their (short) timeout to land
            await asyncio.wait(set(s.background), timeout=s.cfg.health_timeout_s + 1.0)
            for t in s.background:
                t.cancel()
            await asyncio.gather(*s.background, return_exceptions=True)
            s.background.clear()
        if s.session is not None:
            await s.session.close()
            s.session = None
        if s.http is not None:
            s.http.close()
            s.http = None

    # ------------------------------------------------------------------ the data plane

    async def generate(self, episode_id: str, *, prompt_ids: Sequence[int],
                       sampling_params: SamplingParams | dict[str, Any]) -> TokenOutput:
        """Generate from `prompt_ids` on some server; the episode sticks to one server when it can. A call
        interrupted by an abort-mode pause continues after `resume` (agentloop.client.data_plane)."""
        return await self.data.generate(episode_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

    async def sleep_servers(self, urls: Sequence[str], *, release: bool = True,
                            tags: Sequence[str] = ("kv_cache",)) -> None:
        """Put these (lent) servers to sleep: no new requests, their calls continue on the others, their memory
        released (agentloop.client.lending)."""
        await self.lending.sleep([self._index(u) for u in urls], release=release, tags=tags)

    async def wake_servers(self, urls: Sequence[str], *, release: bool = True,
                           tags: Sequence[str] = ("kv_cache",)) -> None:
        """Wake servers put to sleep by `sleep_servers` (same `release` and `tags`)."""
        await self.lending.wake([self._index(u) for u in urls], release=release, tags=tags)

    def _index(self, url: str) -> int:
        try:
            return self.state.urls.index(url.rstrip("/"))
        except ValueError:
            raise ServerError(f"{url} is not one of this manager's servers ({', '.join(self.state.urls)})") from None

    def end_episode(self, episode_id: str) -> None:
        """Forget the episode's sticky server (the engine calls this when an episode ends)."""
        self.data.end_episode(episode_id)

    # ------------------------------------------------------------------ versions

    @property
    def expected_version(self) -> int | None:
        return self.state.router.expected_version

    def server_versions(self) -> dict[str, int | None]:
        return {s.url: s.version for s in self.state.router.servers}

    def expect_version(self, version: int) -> None:
        """From now on every admitted server must serve `version` (servers known to serve another are ejected as
        stale until updated or resynced)."""
        self.control.expect_version(version)

    def mark_updated(self, version: int, urls: list[str]) -> None:
        """A weight push (by the learner) brought these servers to `version`."""
        self.control.mark_updated(version, urls)

    def push_targets(self) -> list[str]:
        """Servers a weight push must reach: admitted ones and those kept out only for their version."""
        return self.control.push_targets()

    async def reachable_targets(self) -> list[str]:
        """`push_targets` plus servers ejected for failures that answer now (ControlPlane.reachable_targets)."""
        return await self.control.reachable_targets()

    # ------------------------------------------------------------------ the control plane

    async def pause(self, mode: str = "in_place") -> None:
        """Stop admitting new requests and pause generation on every admitted server, in `mode` (in_place, abort,
        retract: agentloop.interrupt). A server that fails the pause is ejected; when every one fails, none is
        left paused and ServerError is raised (ControlPlane.pause)."""
        await self.control.pause(mode)

    async def resume(self) -> None:
        """Continue generation on every admitted server and on every one paused since the last resume; ServerError
        only when every one fails."""
        await self.control.resume()

    async def finish_update(self, policy: InterruptPolicy, urls: list[str] | None = None) -> None:
        """After a weight update reached the servers (`urls`, default the push targets), before `resume`: the flush
        `policy` needs, with a fallback where a server refuses it (ControlPlane.finish_update)."""
        await self.control.finish_update(policy, urls)

    async def flush_prefix_cache(self, urls: list[str]) -> None:
        """Empty these servers' prefix caches (paused, or kept out of rotation), whatever waits in their queues."""
        await self.control.flush_prefix_cache(urls)

    async def abort_all(self) -> None:
        await self.control.abort_all()

    async def flush_cache(self) -> list[str]:
        """Empty every admitted server's prefix cache; the urls of the servers that still refused at
        manager.flush_timeout_s (ControlPlane.flush_cache)."""
        return await self.control.flush_cache()

    async def update_weights_from_disk(self, model_path: str | Mapping[str, str],
                                       weight_version: int | str | None = None, *, flush_cache: bool = True,
                                       urls: list[str] | None = None) -> list[Any]:
        """Load HF weights into the servers (`urls`, default: admitted ones and version-stale ones) from one
        directory, or one per server URL (ControlPlane.update_weights_from_disk)."""
        return await self.control.update_weights_from_disk(model_path, weight_version, flush_cache=flush_cache,
                                                           urls=urls)

    # ------------------------------------------------------------------ health

    async def probe_all(self) -> None:
        """One round of health probes and re-admissions (the health loop runs one every health_interval_s)."""
        await self.health.probe_all()

    async def check_health(self, idx: int) -> bool:
        """Liveness of an admitted server (GET /health)."""
        return await self.health.check_health(idx)

    async def model_info(self, idx: int, timeout: float | None = None) -> dict[str, Any] | None:
        """What the server says it serves (GET /model_info), None when it does not answer with a JSON object."""
        return await self.health.model_info(idx, timeout)

    async def server_info(self, idx: int, timeout: float | None = None) -> dict[str, Any] | None:
        """The server's state and settings (GET /server_info, older SGLang /get_server_info), None when it does
        not say."""
        return await self.health.server_info(idx, timeout)

    async def reported_version(self, idx: int) -> int | None:
        """The weight version the server says it serves (GET /model_info), None when it does not say."""
        return await self.health.reported_version(idx)

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every server answers /health (used after connecting to external servers)."""
        await self.health.wait_ready(timeout)

    # ------------------------------------------------------------------ followers, capacity

    def add_follower(self, hook: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """`hook(follower_state())` is awaited before each pause reaches the servers, before the calls a flush
        fallback aborts, and after each resume (Followers.add)."""
        self.followers.add(hook)

    def follower_state(self) -> dict[str, Any]:
        """What a follower mirrors (`follow`)."""
        return self.followers.state()

    def follow(self, state: dict[str, Any]) -> None:
        """Mirror a leader's `follower_state` (Followers.follow)."""
        self.followers.follow(state)

    async def size_from_servers(self) -> None:
        """Size each server's cap on concurrent requests from the capacity it reports, unless
        manager.max_inflight_per_server was set (Capacity.size_from_servers)."""
        await self.capacity.size_from_servers()


__all__ = ["DEFAULT_MAX_INFLIGHT", "ResyncHook", "ServerManager", "parse_generate_response", "parse_version",
           "reported_capacity", "token_versions"]
