"""Load balancing and server health as a plain synchronous state machine (no event loop).

    ServerState   counters of one server: in-flight requests, health, failures, the weight version it serves
    Router        least-outstanding-requests choice with sticky episodes, a cap per server (its own, or one
                  for all),
                  spill-over, eject/re-admit by consecutive failures, and the version rule below

Version rule: once `expected_version` is set (training), a server is admitted only while it serves
that version. A server that comes back after an ejection is re-admitted only when its reported
version is the expected one (`readmit(idx, version)`); otherwise it stays out, marked `stale`, until a
weight push or a resync brings it to the expected version (`set_version`).

The ServerManager owns one Router and calls it from a single event loop, so no locking:
every method runs to completion between awaits. Invariant: each `acquire` that returns an
index is matched by exactly one `release` of that index.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum


class Availability(Enum):
    """Why `acquire` returned no server."""

    OK = "ok"
    FULL = "full"  # healthy servers exist but all are at their cap: wait for a release
    DOWN = "down"  # no healthy server: wait for a health check to re-admit one


@dataclass
class ServerState:
    url: str
    inflight: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    requests: int = 0
    failures: int = 0
    ejections: int = 0
    sticky_hits: int = 0
    spills: int = 0
    version: int | None = None
    """Weight version this server is known to serve (None: unknown)."""
    cap: int | None = None
    """Concurrent requests this server takes (None: the router's `max_inflight`); the ServerManager sizes it
    from what the server reports when manager.max_inflight_per_server is not set."""
    stale: bool = False
    """Answering, but serving another version than the expected one: kept out until synced."""
    asleep: bool = False
    """Lent and asleep (a server on the learner's GPUs while the learner trains): takes no request, but counts as
    alive (requests wait for a server awake instead of declaring every server down)."""


@dataclass
class Router:
    urls: list[str]
    max_inflight: int
    eject_after: int = 2
    sticky: bool = True
    sticky_capacity: int = 200_000
    expected_version: int | None = None
    servers: list[ServerState] = field(init=False)
    _sticky: "OrderedDict[str, int]" = field(init=False, default_factory=OrderedDict)
    _rr: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("Router needs at least one server url")
        self.servers = [ServerState(u) for u in self.urls]

    # ------------------------------------------------------------------ choice

    def _open(self, i: int) -> bool:
        s = self.servers[i]
        return s.healthy and not s.asleep and s.inflight < (s.cap or self.max_inflight)

    def capacity(self, idx: int) -> int:
        """Concurrent requests server `idx` takes."""
        return self.servers[idx].cap or self.max_inflight

    def set_capacity(self, idx: int, cap: int) -> None:
        """Server `idx` takes `cap` concurrent requests from now on (at least 1)."""
        self.servers[idx].cap = max(1, int(cap))

    def availability(self) -> Availability:
        if not any(s.healthy for s in self.servers):
            return Availability.DOWN
        if not any(self._open(i) for i in range(len(self.servers))):
            return Availability.FULL
        return Availability.OK

    def acquire(self, episode_id: str, avoid: frozenset[int] | set[int] = frozenset()) -> int | None:
        """Pick a server for the next request of `episode_id`, or None (see `availability`).

        Order: the episode's sticky server if open and not avoided; else the open server with
        the fewest in-flight requests, preferring ones not in `avoid` (servers that just failed
        this request); avoided servers are used only when nothing else is open.
        """
        chosen: int | None = None
        sticky = self._sticky.get(episode_id) if self.sticky else None
        if sticky is not None and sticky not in avoid and self._open(sticky):
            chosen = sticky
            self.servers[sticky].sticky_hits += 1
            self._sticky.move_to_end(episode_id)
        else:
            chosen = self._least_loaded(avoid)
            if chosen is None and avoid:
                chosen = self._least_loaded(frozenset())
            if chosen is None:
                return None
            if sticky is not None:
                self.servers[chosen].spills += 1
            if self.sticky:
                self._sticky[episode_id] = chosen
                self._sticky.move_to_end(episode_id)
                while len(self._sticky) > self.sticky_capacity:
                    self._sticky.popitem(last=False)
        s = self.servers[chosen]
        s.inflight += 1
        s.requests += 1
        return chosen

    def _least_loaded(self, avoid: frozenset[int] | set[int]) -> int | None:
        n = len(self.servers)
        best, best_load = None, None
        # Round-robin start so equal loads spread instead of piling on server 0.
        for k in range(n):
            i = (self._rr + k) % n
            if i in avoid or not self._open(i):
                continue
            load = self.servers[i].inflight
            if best_load is None or load < best_load:
                best, best_load = i, load
        if best is not None:
            self._rr = (best + 1) % n
        return best

    def release(self, idx: int) -> None:
        s = self.servers[idx]
        if s.inflight <= 0:
            raise RuntimeError(f"release of {s.url} without a matching acquire")
        s.inflight -= 1

    def end_episode(self, episode_id: str) -> None:
        self._sticky.pop(episode_id, None)

    # ------------------------------------------------------------------ health

    def record_success(self, idx: int) -> None:
        s = self.servers[idx]
        s.consecutive_failures = 0

    def record_failure(self, idx: int) -> bool:
        """Count a failed request or probe; returns True if this ejected the server."""
        s = self.servers[idx]
        s.failures += 1
        s.consecutive_failures += 1
        if s.healthy and s.consecutive_failures >= self.eject_after:
            s.healthy = False
            s.ejections += 1
            return True
        return False

    def eject(self, idx: int) -> None:
        s = self.servers[idx]
        if s.healthy:
            s.healthy = False
            s.ejections += 1

    def readmit(self, idx: int, version: int | None = None) -> bool:
        """A good probe: mark the server healthy, unless a version is expected and `version` is not it
        (then it stays out, marked stale). True if this brought an ejected server back."""
        s = self.servers[idx]
        s.consecutive_failures = 0
        if version is not None:
            s.version = version
        if self.expected_version is not None and s.version != self.expected_version:
            s.stale = True
            if s.healthy:
                s.healthy = False
                s.ejections += 1
            return False
        s.stale = False
        was_down = not s.healthy
        s.healthy = True
        return was_down

    def set_version(self, idx: int, version: int) -> None:
        """The server now serves `version` (a weight update on it succeeded)."""
        self.servers[idx].version = version

    def expect(self, version: int) -> list[int]:
        """Every admitted server must now serve `version`: servers known to serve another one are
        ejected as stale. Returns the indices ejected."""
        self.expected_version = version
        out = []
        for i, s in enumerate(self.servers):
            if s.healthy and s.version != version:
                s.healthy = False
                s.stale = True
                s.ejections += 1
                out.append(i)
        return out

    @property
    def healthy_count(self) -> int:
        return sum(s.healthy for s in self.servers)
