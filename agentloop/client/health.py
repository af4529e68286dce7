"""Health and re-admission: the probes of every server, the ejection of dead ones, and the re-admission of
recovered ones only once they serve the expected weights.

Map:
    Health.probe_all     one round: an admitted server answers GET /health (or answered a request lately), an
                         ejected one is tried for re-admission
    Health.try_readmit   a probe through its scheduler (/health_generate), then /model_info's weight_version; a
                         stale server is reloaded by the resync hook first, when there is one
    Health.readmit       Router.readmit, counted and said
    Health.run           the loop (every manager.health_interval_s), started by the manager
    Health.check_health, model_info, server_info, reported_version   what one server says
    Health.wait_ready    every server answers /health (servers given by URL)

A paused SGLang parks probes and then marks itself unhealthy, so nothing is probed while the servers are paused.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from agentloop.client.state import ManagerState
from agentloop.errors import ServerError


def parse_version(v: Any) -> int | None:
    """A server's weight_version label as our integer version (None for labels we did not set)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v.strip())
    return None


class Health:
    """The health part of a ServerManager (module doc)."""

    def __init__(self, state: ManagerState):
        self.s = state

    def readmit(self, i: int, version: int | None = None) -> bool:
        """Router.readmit, counted and said."""
        s = self.s
        if s.router.readmit(i, version):
            s.stats["readmissions"] += 1
            s.say(f"server {s.urls[i]} re-admitted at version {s.router.servers[i].version} "
                  f"({s.router.healthy_count}/{len(s.urls)} healthy)")
            return True
        return False

    async def check_health(self, idx: int) -> bool:
        """Liveness of an admitted server (GET /health)."""
        return await self.probe_health(idx) == "ok"

    async def probe_health(self, idx: int) -> str:
        """GET /health: "ok"; "refused" when nothing listens at the server's address (its process is gone, whatever
        it answered lately); "failed" for any other failure (a timeout, an error status: a busy server can miss
        its probe)."""
        s = self.s
        to = aiohttp.ClientTimeout(total=s.cfg.health_timeout_s)
        try:
            async with s.require_session().get(s.urls[idx] + "/health", timeout=to) as resp:
                await resp.read()
                return "ok" if resp.status == 200 else "failed"
        except aiohttp.ClientConnectorError as e:
            return "refused" if isinstance(e.os_error, ConnectionRefusedError) else "failed"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return "failed"

    async def model_info(self, idx: int, timeout: float | None = None) -> dict[str, Any] | None:
        """What the server says it serves (GET /model_info: model_path, model_type, architectures,
        weight_version, ...), None when it does not answer with a JSON object."""
        info = await self.s.get_ok(self.s.urls[idx], "/model_info", timeout or self.s.cfg.health_timeout_s)
        return info if isinstance(info, dict) else None

    async def server_info(self, idx: int, timeout: float | None = None) -> dict[str, Any] | None:
        """The server's state and settings (GET /server_info, older SGLang /get_server_info: its arguments and
        each scheduler's internal state, max_total_num_tokens among them), None when it does not say."""
        for path in ("/server_info", "/get_server_info"):
            info = await self.s.get_ok(self.s.urls[idx], path, timeout or self.s.cfg.health_timeout_s)
            if isinstance(info, dict):
                return info
        return None

    async def reported_version(self, idx: int) -> int | None:
        """The weight version the server says it serves (GET /model_info), None when it does not say."""
        info = await self.model_info(idx)
        return parse_version(info.get("weight_version")) if info is not None else None

    async def try_readmit(self, idx: int) -> None:
        """An ejected server: a probe through its scheduler, then its version; resync when stale."""
        s = self.s
        url = s.urls[idx]
        if idx in s.needs_continue:  # it failed a pause or continue: it may still be paused
            await s.continue_quietly([idx])
        if await s.get_ok(url, "/health_generate", s.cfg.health_timeout_s + 20.0) is None:
            s.router.record_failure(idx)
            return
        version = await self.reported_version(idx)
        expected = s.router.expected_version
        if expected is not None and version != expected and s.resync is not None:
            try:
                await s.resync(url)
                s.stats["resyncs"] += 1
                version = await self.reported_version(idx)
            except Exception as e:  # noqa: BLE001 - it stays out; the next probe tries again
                s.say(f"server {url}: resync to version {expected} failed: {type(e).__name__}: {e}")
                return
        if expected is None and version is None:
            version = s.router.servers[idx].version
        if s.router.servers[idx].healthy:  # the resync's update already brought it back
            return
        was_stale = s.router.servers[idx].stale
        if self.readmit(idx, version):
            return
        if s.router.servers[idx].stale and not was_stale:
            s.stats["stale_servers"] += 1
            s.say(f"server {url} answers but serves version {version}, expected {expected}: kept out")

    async def probe_all(self) -> None:
        s = self.s
        if not s.unpaused.is_set():
            # SGLang parks probes behind a pause and then marks itself unhealthy: never probe one.
            return

        async def one(i: int) -> None:
            server = s.router.servers[i]
            if server.asleep:
                return  # its memory is released: it is woken (and checked) before it serves again
            if server.healthy:
                probe = await self.probe_health(i)
                if probe == "ok":
                    s.router.record_success(i)
                elif probe != "refused" and time.monotonic() - s.answered_at[i] < s.cfg.answered_grace_s:
                    # A server answering requests is alive, whatever its probe says: under heavy load
                    # SGLang's /health can miss its timeout, and ejecting the only server ends the run. A refused
                    # connection is no busy server: its process is gone, and one restarted at the same address
                    # (a Ray actor's restart) would otherwise be taken back at the weights it never loaded.
                    s.router.record_success(i)
                else:
                    s.note_failure(i)
            else:
                await self.try_readmit(i)

        await asyncio.gather(*(one(i) for i in range(len(s.urls))))
        s.changed.set()

    async def run(self) -> None:
        """The health loop: a round of probes every manager.health_interval_s until the manager closes."""
        while not self.s.closed:
            await asyncio.sleep(self.s.cfg.health_interval_s)
            await self.probe_all()

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every server answers /health (used after connecting to external servers)."""
        s = self.s
        deadline = time.monotonic() + timeout
        pending = set(range(len(s.urls)))
        while pending:
            for i in list(pending):
                if await self.check_health(i):
                    pending.discard(i)
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise ServerError("server(s) not healthy within %.0fs: %s"
                                  % (timeout, ", ".join(s.urls[i] for i in sorted(pending))))
            await asyncio.sleep(0.5)


__all__ = ["Health", "parse_version"]
