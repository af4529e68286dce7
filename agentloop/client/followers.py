"""Followers: managers in other processes (Ray rollout workers) that generate on the same servers while one
leader makes the admin calls. Each pause, resume and interrupt of the leader is told to them first (versions,
pause state, interrupt count), so their calls cut short by a pause continue, and are stamped, exactly as the
leader's own.

Map:
    Followers.add      a hook the leader awaits with its state before each pause reaches the servers, before the
                       calls a flush fallback aborts, and after each resume
    Followers.state    what a follower mirrors; `seq` orders the states
    Followers.follow   a follower takes a leader's state (an older one than it has is ignored)
    Followers.tell     the leader awaits every hook (bounded by manager.admin_timeout_s; a failing one is said)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from agentloop.client.state import ManagerState


class Followers:
    """The followers part of a ServerManager (module doc). `expect_version` and `readmit` are the control plane's
    and the health part's (a followed state may move the expected version and bring stale servers back)."""

    def __init__(self, state: ManagerState, *, expect_version: Callable[[int], None],
                 readmit: Callable[[int], bool]):
        self.s = state
        self._expect_version = expect_version
        self._readmit = readmit
        self.hooks: list[Callable[[dict[str, Any]], Awaitable[None]]] = []
        self.seq = 0
        """Leader: states handed out; follower: the newest state followed."""

    def add(self, hook: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """`hook(state())` is awaited before each pause reaches the servers, before the calls a flush fallback
        aborts, and after each resume (bounded by `admin_timeout_s`; a follower that fails is said, the rest goes
        on): what a manager that `follow`s this one must know, in time."""
        self.hooks.append(hook)

    def state(self) -> dict[str, Any]:
        """What a follower mirrors (`follow`); `seq` orders the states, so an older one never undoes a newer one."""
        s = self.s
        self.seq += 1
        return {"seq": self.seq, "interrupts": s.interrupts, "pauses": s.pauses, "pause_mode": s.pause_mode,
                "unpaused": s.unpaused.is_set(), "expected": s.router.expected_version,
                "versions": {server.url: server.version for server in s.router.servers}}

    def follow(self, state: dict[str, Any]) -> None:
        """Mirror a leader's `state()` (this manager generates; the leader makes the admin calls): its interrupt
        count (a call cut short by the leader's pause continues after the resume), pause state (no call is sent
        while paused), the servers' versions (stamps) and the expected one (stale servers stay out). A state older
        than one followed already is ignored."""
        s = self.s
        if int(state.get("seq", 0)) < self.seq:
            return
        self.seq = int(state.get("seq", 0))
        s.interrupts = int(state["interrupts"])
        s.pauses = int(state["pauses"])
        s.pause_mode = state.get("pause_mode")
        for i, url in enumerate(s.urls):
            v = state["versions"].get(url)
            if v is not None:
                s.router.set_version(i, v)
        if state.get("expected") is not None and state["expected"] != s.router.expected_version:
            self._expect_version(int(state["expected"]))
        for i, server in enumerate(s.router.servers):
            if server.stale and server.version == s.router.expected_version:
                self._readmit(i)
        if state["unpaused"]:
            s.unpaused.set()
        else:
            s.unpaused.clear()
        s.changed.set()

    async def tell(self) -> None:
        """Await every hook with the current state (module doc)."""
        if not self.hooks:
            return
        state = self.state()
        results = await asyncio.gather(*(asyncio.wait_for(h(state), self.s.cfg.admin_timeout_s)
                                         for h in self.hooks), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                self.s.say(f"a follower manager did not take the servers' state: {type(r).__name__}: {r}")


__all__ = ["Followers"]
