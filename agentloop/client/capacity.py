"""Capacity: each server's cap on concurrent requests, from the capacity it reports, unless
manager.max_inflight_per_server sets one for all. A fixed default of 256 split a 512-episode GPU rollout into two
waves while the server's KV cache sat at 8%.

Map:
    reported_capacity        a server's /server_info -> the concurrent requests it runs at once (pure)
    Capacity.size_from_servers  ask every server not sized yet and set the caps (Router, connection pool)
    Capacity.on_full         the data plane found every admitted server at its cap: size them, once at a time
    Capacity.follow          manager.concurrency.adaptive: poll each server's load (/v1/loads) and set its cap by
                             agentloop.client.concurrency's rule (AIMD between soft and hard caps)

Asked when it matters: the first time every admitted server is at its cap, so a run that never fills the default
cap never asks. A server that does not say keeps the default; it is asked again after `RESIZE_AFTER_S` when the
servers are full again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentloop.client.concurrency import ConcurrencyControl, parse_loads
from agentloop.client.state import ManagerState

RESIZE_AFTER_S = 30.0
"""A server that did not report its capacity is asked again no sooner than this."""

SILENT_POLLS = 3
"""manager.concurrency.adaptive: a server whose /v1/loads answers nothing usable this many polls in a row (an older
SGLang, another engine) gets the cap it reports (/server_info), or keeps its limit, and is no longer polled."""


def reported_capacity(info: Any) -> int | None:
    """Concurrent requests a server says it runs at once, from its /server_info (SGLang 0.5.23; /get_server_info
    in older ones): the scheduler's effective max_running_requests summed over its data-parallel ranks
    (`internal_states`), else the `max_running_requests` it was launched with. None when it says neither."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list) and states and all(isinstance(x, dict) for x in states):
        per = [x.get("effective_max_running_requests_per_dp", x.get("max_running_requests")) for x in states]
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in per):
            return sum(per)
    v = info.get("max_running_requests")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


class Capacity:
    """The capacity part of a ServerManager (module doc)."""

    def __init__(self, state: ManagerState):
        self.s = state
        self.sized: set[int] = set()
        """Servers whose cap came from their own report."""
        self.asked: dict[int, float] = {}
        """When each server was last asked for its capacity."""
        self.sizing = False
        self.control: ConcurrencyControl | None = None
        """manager.concurrency.adaptive: the per-server limits that follow the servers (None: off)."""
        if state.cfg.concurrency.adaptive:
            self.control = ConcurrencyControl(len(state.urls), state.cfg.concurrency,
                                              hard_cap=state.cfg.max_inflight_per_server)
            for i in range(len(state.urls)):
                state.router.set_capacity(i, self.control.limit(i))
        self.silent: dict[int, int] = {}
        """Polls in a row a server's /v1/loads said nothing usable; at SILENT_POLLS it falls back (poll_once)."""

    def on_full(self) -> None:
        """Every admitted server is at its cap: ask them for their capacity in the background (one ask at a time;
        waiters wake when caps change), unless the caps are fixed or known."""
        s = self.s
        if self.control is not None:
            return  # the limits follow the servers' load (follow)
        if s.cfg.max_inflight_per_server is None and len(self.sized) < len(s.urls) and not self.sizing:
            self.sizing = True
            s.spawn(self._size_then_clear(), name="size-servers")

    async def size_from_servers(self) -> None:
        """Size each server's cap on concurrent requests from the capacity it reports (`reported_capacity`:
        its scheduler's max_running_requests), unless manager.max_inflight_per_server was set (then that
        number holds for every server); see the module doc for when."""
        s = self.s
        if s.cfg.max_inflight_per_server is not None or self.control is not None:
            return
        now = time.monotonic()
        todo = [i for i in range(len(s.urls))
                if i not in self.sized and now - self.asked.get(i, float("-inf")) >= RESIZE_AFTER_S]
        for i in todo:
            self.asked[i] = now
        caps = await asyncio.gather(*(self._server_capacity(i) for i in todo))
        for i, cap in zip(todo, caps):
            if cap is not None:
                self.sized.add(i)
                s.router.set_capacity(i, cap)
                if s.http is not None and s.urls[i].startswith("http://"):
                    s.http.set_limit(s.urls[i], cap)
                s.say(f"server {s.urls[i]}: up to {cap} concurrent requests (its max_running_requests)")
        if any(c is not None for c in caps):
            s.changed.set()

    async def follow(self) -> None:
        """Poll every admitted server's load each manager.concurrency.poll_s and set its cap by the control's rule
        (runs as long as the manager; a server that does not answer, or while servers are paused for a weight
        update, keeps its cap: a paused server's queue says nothing about its capacity)."""
        s, ctl = self.s, self.control
        if ctl is None:
            return
        while True:
            await asyncio.sleep(s.cfg.concurrency.poll_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        """One poll of every admitted server (follow); the new caps wake waiting requests."""
        s, ctl = self.s, self.control
        if ctl is None or s.paused or not s.unpaused.is_set():
            return
        idxs = [i for i, st in enumerate(s.router.servers) if st.healthy and self.silent.get(i, 0) < SILENT_POLLS]
        bodies = await asyncio.gather(*(s.get_ok(s.urls[i], "/v1/loads?include=core,queues",
                                                 s.cfg.health_timeout_s) for i in idxs))
        if s.paused or not s.unpaused.is_set():
            return  # a pause began while we asked: what they said is the pause's, not their load
        changed = False
        for i, body in zip(idxs, bodies):
            sig = parse_loads(body)
            if sig is None:
                self.silent[i] = self.silent.get(i, 0) + 1
                if self.silent[i] == SILENT_POLLS:
                    s.spawn(self._fall_back(i), name=f"fall-back-{i}")
                continue
            self.silent[i] = 0
            old = s.router.capacity(i)
            new = ctl.observe(i, sig, s.router.servers[i].inflight)
            if new != old:
                s.router.set_capacity(i, new)
                if s.http is not None and s.urls[i].startswith("http://"):
                    s.http.set_limit(s.urls[i], new)
                changed = True
        if changed:
            s.changed.set()

    async def _fall_back(self, i: int) -> None:
        """Server i does not report its load: the cap it reports, else the limit it has (SILENT_POLLS)."""
        s = self.s
        cap = await self._server_capacity(i)
        if cap is not None:
            cap = min(cap, s.cfg.max_inflight_per_server or cap, s.cfg.concurrency.max_limit)
            s.router.set_capacity(i, cap)
            if self.control is not None:
                self.control.limits[i] = cap
            if s.http is not None and s.urls[i].startswith("http://"):
                s.http.set_limit(s.urls[i], cap)
            s.changed.set()
        s.say(f"server {s.urls[i]} does not report its load (/v1/loads): its cap stays at {s.router.capacity(i)}"
              + (" (its max_running_requests)" if cap is not None else ""))

    def gauges(self) -> dict[str, float]:
        """The control's `server/conc_...` numbers; without it, the fixed caps as `server/conc_limit`."""
        if self.control is not None:
            return self.control.gauges()
        return {"server/conc_limit": float(sum(self.s.router.capacity(i) for i in range(len(self.s.urls))))}

    async def _size_then_clear(self) -> None:
        try:
            await self.size_from_servers()
        finally:
            self.sizing = False

    async def _server_capacity(self, idx: int) -> int | None:
        for path in ("/server_info", "/get_server_info"):
            info = await self.s.get_ok(self.s.urls[idx], path, self.s.cfg.health_timeout_s)
            cap = reported_capacity(info)
            if cap is not None:
                return cap
        return None


__all__ = ["RESIZE_AFTER_S", "Capacity", "reported_capacity"]
