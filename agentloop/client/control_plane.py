"""The control plane: admin calls broadcast to the servers around a weight update, and the weight versions the
servers must serve.

Map:
    ControlPlane.broadcast     an admin call to every admitted server (or some): a server that fails it is ejected
                               and the rest go on; ServerError only when every one fails
    ControlPlane.pause/resume  stop and restart generation, in an interrupt mode (agentloop.interrupt); the servers
                               paused are remembered until resumed (the manager continues them when it closes)
    ControlPlane.finish_update after an update, before resume: the flush the interrupt mode needs, with a fallback
                               where a server refuses it (flush_prefix_cache)
    ControlPlane.update_weights_from_disk   HF weights into the servers (updates also reach stale ones)
    ControlPlane.flush_cache, abort_all     benches' and tools' admin calls
    ControlPlane.expect_version, mark_updated, push_targets, reachable_targets   the versions every admitted server
                               must serve, and the servers a weight push must reach

Followers (agentloop.client.followers) are told each pause, resume and interrupt before it reaches the servers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from agentloop.client.followers import Followers
from agentloop.client.health import parse_version
from agentloop.client.state import ManagerState
from agentloop.errors import RequestError, ServerError
from agentloop.interrupt import InterruptPolicy


class ControlPlane:
    """The control part of a ServerManager (module doc). `readmit` is the health part's: an update that brings a
    stale server to the expected version re-admits it."""

    def __init__(self, state: ManagerState, *, followers: Followers, readmit: Callable[[int], bool]):
        self.s = state
        self.followers = followers
        self._readmit = readmit

    # ------------------------------------------------------------------ versions

    def expect_version(self, version: int) -> None:
        """From now on every admitted server must serve `version` (servers known to serve another
        are ejected as stale until updated or resynced)."""
        s = self.s
        if self.followers.hooks:
            s.spawn(self.followers.tell(), name="tell-followers")
        for i in s.router.expect(version):
            s.stats["stale_servers"] += 1
            s.say(f"server {s.urls[i]} serves version {s.router.servers[i].version}, "
                  f"expected {version}: kept out until it is updated")
        s.changed.set()

    def mark_updated(self, version: int, urls: list[str]) -> None:
        """A weight push (by the learner) brought these servers to `version`."""
        s = self.s
        for u in urls:
            i = s.urls.index(u.rstrip("/"))
            s.router.set_version(i, version)
            if s.router.servers[i].stale:
                self._readmit(i)
        s.changed.set()

    def push_targets(self) -> list[str]:
        """Servers a weight push must reach: admitted ones and those kept out only for their version."""
        return [server.url for server in self.s.router.servers if server.healthy or server.stale]

    async def reachable_targets(self) -> list[str]:
        """`push_targets` plus servers ejected for failures that answer now: a push that skipped them
        would leave them on old weights with nothing to bring them back (tensor/nccl keep no copy)."""
        s = self.s
        push = set(self.push_targets())
        ejected = [server.url for server in s.router.servers if server.url not in push]
        # probed together: this runs while every server is paused for the push
        answers = await asyncio.gather(*(s.get_ok(u, "/model_info", s.cfg.health_timeout_s) for u in ejected))
        answering = {u for u, a in zip(ejected, answers) if a is not None}
        return [server.url for server in s.router.servers if server.url in push or server.url in answering]

    # ------------------------------------------------------------------ broadcast

    async def broadcast(self, path: str, payload: dict[str, Any] | None = None, *,
                        idxs: list[int] | None = None) -> list[Any]:
        """POST an admin call to every admitted server (or `idxs`); the answers of those that took it.

        A server that fails it is ejected and the others go on: the health loop brings it back once it
        answers a probe through its scheduler and serves the expected weights (reloaded first when stale);
        one that failed a pause or a continue is sent a continue before that probe, since a paused SGLang
        parks probes. Only when every server fails is it an error (ServerError)."""
        s = self.s
        if idxs is None:
            idxs = [i for i, server in enumerate(s.router.servers) if server.healthy]
        results = await asyncio.gather(*(s.admin_post(s.urls[i], path, payload) for i in idxs),
                                       return_exceptions=True)
        failed = [(i, r) for i, r in zip(idxs, results) if isinstance(r, BaseException)]
        if failed and len(failed) == len(idxs):
            raise ServerError(f"{path} failed on {len(failed)}/{len(idxs)} server(s): {failed[0][1]}")
        for i, err in failed:
            if path in ("/pause_generation", "/continue_generation"):
                s.needs_continue.add(i)
            if s.router.servers[i].healthy:
                s.router.eject(i)
                s.stats["ejections"] += 1
            s.stats["admin_failures"] += 1
            s.say(f"server {s.urls[i]} failed {path} ({err}); ejected until it answers again "
                  f"({s.router.healthy_count}/{len(s.urls)} healthy)")
        if failed:
            s.changed.set()
        return [r for r in results if not isinstance(r, BaseException)]

    # ------------------------------------------------------------------ pause / resume

    async def pause(self, mode: str = "in_place") -> None:
        """Stop admitting new requests and pause generation on every admitted server.

        mode: "in_place" keeps in-flight requests (resumed by `resume`), "abort" aborts them (calls of
        `generate` continue themselves after `resume`), "retract" lets the server requeue them.
        A server that fails the pause is ejected (see `broadcast`); when every one fails, none is left
        paused (each is sent a continue) and ServerError is raised.
        """
        s = self.s
        s.unpaused.clear()
        s.pause_mode = mode
        s.pauses += 1
        targets = [i for i, server in enumerate(s.router.servers) if server.healthy]
        s.paused.update(targets)  # remembered until resumed: `close` continues them whatever happens
        try:
            if mode == "abort":
                s.interrupts += 1
            await self.followers.tell()  # their calls this pause cuts short continue, as ours do
            if mode == "abort":
                await self._abort_and_drain()
            await self.broadcast("/pause_generation", {"mode": mode}, idxs=targets)
        except BaseException:
            await s.continue_quietly(sorted(s.paused))
            s.paused.clear()
            s.unpaused.set()
            s.changed.set()
            await self.followers.tell()
            raise

    async def _abort_and_drain(self, rounds: int = 4, wait_s: float = 0.25) -> None:
        """Abort what runs and wait for those calls to come back, before an abort-mode pause.

        SGLang's abort-mode /pause_generation aborts everything, then polls for the requests' end in 1 s
        sleeps: with anything in flight it costs >= 1 s (measured: 1.06 s per weight sync under async load
        on an H100 vs 0.21 s with nothing in flight). Aborted calls answer within milliseconds, so we abort
        first and let the pause find nothing running. A call that reached a server after an abort gets the
        next round; whatever is left after the rounds, the pause itself aborts."""
        s = self.s

        def busy() -> bool:
            return any(server.inflight for server in s.router.servers)

        for _ in range(rounds):
            if not busy():
                return
            try:
                await self.broadcast("/abort_request", {"rid": "", "abort_all": True})
            except ServerError:
                return  # only a shortcut: the pause itself aborts what runs, and says if it fails
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                s.changed.clear()  # cleared before the check, so a release after it wakes us
                if not busy():
                    break
                try:  # set by every call's release; the short cap guards a wake-up taken by another waiter
                    await asyncio.wait_for(s.changed.wait(),
                                           timeout=min(0.02, max(0.001, deadline - time.monotonic())))
                except asyncio.TimeoutError:
                    pass

    async def resume(self) -> None:
        """Continue generation on every admitted server and on every one paused since the last resume.
        A server that fails it is ejected (see `broadcast`); ServerError only when every one fails."""
        s = self.s
        targets = sorted({i for i, server in enumerate(s.router.servers) if server.healthy} | s.paused)
        try:
            await self.broadcast("/continue_generation", {}, idxs=targets)
        finally:
            s.paused.clear()
            s.unpaused.set()
            s.changed.set()
            await self.followers.tell()

    # ------------------------------------------------------------------ flushes

    async def finish_update(self, policy: InterruptPolicy, urls: list[str] | None = None) -> None:
        """After a weight update reached the servers (`urls`, default the push targets), before `resume`:
        flush their prefix caches where `policy.flush_after` says so (retract).

        A server that refuses the flush (SGLang 0.5.17 counts retracted requests waiting in its queue as
        busy; 0.5.23 does not) gets those requests aborted: they answer with their partial tokens, and since
        the abort counts as an interrupt their calls continue under the new weights once resumed, as in abort
        mode. It is flushed again once they have answered; one that still refuses is ejected, so it never
        serves KV of the old weights (it is resynced before it comes back)."""
        if policy.flush_after:
            await self.flush_prefix_cache(urls if urls is not None else self.push_targets())

    async def flush_prefix_cache(self, urls: list[str]) -> None:
        """Empty these servers' prefix caches (paused, or kept out of rotation), whatever waits in their queues (see
        `finish_update`: refused flushes abort the waiting requests, then flush; a server that still
        refuses is ejected)."""
        await asyncio.gather(*(self._flush_paused(self.s.urls.index(u.rstrip("/"))) for u in urls))

    async def _flush_paused(self, i: int) -> None:
        s = self.s
        url = s.urls[i]
        try:
            if await self._flush_one(i, time.monotonic()):  # one try: retracted requests waiting make it refuse
                return
            first: Exception | str = "refused"
        except RequestError as e:
            first = e
        s.interrupts += 1  # the calls aborted below continue themselves after resume
        await self.followers.tell()  # and so do the followers' calls
        try:
            await s.admin_post(url, "/abort_request", {"rid": "", "abort_all": True})
            await self._drain(lambda: s.router.servers[i].inflight > 0, s.cfg.admin_timeout_s)
            if await self._flush_one(i, time.monotonic() + s.cfg.flush_timeout_s):
                return
            e2: Exception | str = f"still refused after {s.cfg.flush_timeout_s:g}s of retries"
        except (RequestError, ServerError) as e:
            e2 = e
        # Its prefix cache holds KV of the old weights: serving it would sample under no version at all.
        s.router.eject(i)
        s.stats["ejections"] += 1
        s.say(f"server {url} kept its prefix cache after the weight update ({first}; then {e2}); "
              "ejected until resynced")
        s.changed.set()

    async def _flush_one(self, i: int, deadline: float) -> bool:
        """POST /flush_cache to server i; True once it flushed. A refusal (HTTP 400) is retried with back-off
        until `deadline` (then False), never counted as the server's failure: SGLang flushes only a fully idle
        scheduler, and one whose requests just ended is not idle for a moment (its last batch or its overlap
        queue still set: "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 0").
        Other failures (the server down, a timeout) raise RequestError."""
        s = self.s
        delay = 0.05
        while True:
            try:
                await s.admin_post(s.urls[i], "/flush_cache", None)
                return True
            except RequestError as e:
                if e.status != 400:
                    raise
                s.stats["flushes_refused"] += 1
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(delay, left))  # back-off: the scheduler needs an iteration or two
            delay = min(1.0, delay * 2)

    async def _drain(self, busy: Callable[[], bool], timeout: float) -> None:
        """Wait until `busy()` is false (re-checked whenever a call releases its server); ServerError after
        `timeout` seconds."""
        s = self.s
        deadline = time.monotonic() + timeout
        while True:
            s.changed.clear()  # cleared before the check, so a release after it wakes us
            if not busy():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerError(f"calls did not drain within {timeout}s")
            try:
                await asyncio.wait_for(s.changed.wait(), timeout=min(0.05, left))
            except asyncio.TimeoutError:
                pass

    async def abort_all(self) -> None:
        await self.broadcast("/abort_request", {"rid": "", "abort_all": True})

    async def flush_cache(self) -> list[str]:
        """Empty every admitted server's prefix cache (benches, before each side). A refusal is retried with back-off
        for `manager.flush_timeout_s` and never ejects the server (`_flush_one`); returns the urls of the servers that
        still refused at that deadline (their cache kept; said once each). A server that fails otherwise (down,
        timing out) is ejected as for any admin call; ServerError only when every server failed that way."""
        s = self.s
        idxs = [i for i, server in enumerate(s.router.servers) if server.healthy]
        deadline = time.monotonic() + s.cfg.flush_timeout_s
        results = await asyncio.gather(*(self._flush_one(i, deadline) for i in idxs), return_exceptions=True)
        failed = [(i, r) for i, r in zip(idxs, results) if isinstance(r, BaseException)]
        if failed and len(failed) == len(idxs):
            raise ServerError(f"/flush_cache failed on {len(failed)}/{len(idxs)} server(s): {failed[0][1]}")
        for i, err in failed:
            s.router.eject(i)
            s.stats["ejections"] += 1
            s.stats["admin_failures"] += 1
            s.say(f"server {s.urls[i]} failed /flush_cache ({err}); ejected until it answers again "
                  f"({s.router.healthy_count}/{len(s.urls)} healthy)")
        if failed:
            s.changed.set()
        kept = [s.urls[i] for i, r in zip(idxs, results) if r is False]
        for url in kept:
            s.say(f"server {url} refused /flush_cache for {s.cfg.flush_timeout_s:g}s; its prefix cache is kept")
        return kept

    # ------------------------------------------------------------------ weight updates

    async def update_weights_from_disk(self, model_path: str | Mapping[str, str],
                                       weight_version: int | str | None = None, *, flush_cache: bool = True,
                                       urls: list[str] | None = None) -> list[Any]:
        """Load HF weights into the servers (`urls`, default: admitted ones and version-stale ones) from
        `model_path`: one directory every server reads, or one per server URL (servers on other nodes each read
        their own copy).

        A server that fails the update is ejected (it is resynced before it comes back) as long as one
        succeeded; with none succeeding it is an error."""
        s = self.s

        def payload(i: int) -> dict[str, Any]:
            path = model_path if isinstance(model_path, str) else model_path[s.urls[i]]
            body: dict[str, Any] = {"model_path": path, "flush_cache": flush_cache}
            if weight_version is not None:
                body["weight_version"] = str(weight_version)
            return body

        if not isinstance(model_path, str):
            model_path = {u.rstrip("/"): p for u, p in model_path.items()}
        to = urls if urls is not None else await self.reachable_targets()
        targets = [s.urls.index(u.rstrip("/")) for u in to]
        results = await asyncio.gather(*(s.admin_post(s.urls[i], "/update_weights_from_disk", payload(i))
                                         for i in targets), return_exceptions=True)
        version = parse_version(weight_version)
        ok, failures = [], []
        for i, r in zip(targets, results):
            if isinstance(r, BaseException) or (isinstance(r, dict) and r.get("success") is False):
                failures.append((i, r.get("message") if isinstance(r, dict) else r))
            else:
                ok.append(r)
                if version is not None:
                    s.router.set_version(i, version)
                if s.router.servers[i].stale:
                    self._readmit(i)
        if failures and (not ok or urls is not None):
            i, why = failures[0]
            raise ServerError(f"{s.urls[i]} refused the weight update: {why}")
        for i, why in failures:
            s.router.eject(i)
            s.stats["ejections"] += 1
            s.say(f"server {s.urls[i]} failed the weight update ({why}); ejected until resynced")
        s.changed.set()
        return ok


__all__ = ["ControlPlane"]
