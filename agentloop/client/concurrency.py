"""Concurrency that follows the servers: each server's limit on requests in flight, raised while it has room and
lowered before it queues or preempts (AIMD), from what the server reports. Plain synchronous control (no event
loop, no I/O); the ServerManager's capacity part polls the servers and applies the limits (agentloop.client.capacity).

    LoadSignal          one server's load: requests running and waiting, KV token usage, requests it retracted
                        (preempted), the most it runs at once
    parse_loads         SGLang's /v1/loads answer (0.5.x: per data-parallel rank) -> LoadSignal (pure)
    ConcurrencyControl  per-server limits (manager.concurrency), one `observe` per poll

The rule, per server and poll (manager.concurrency):
    overloaded  requests wait in its queue (more than `max_queued`), it retracted requests, or its KV usage is at
                or above `kv_hard`: the limit is multiplied by `decrease` (not below `min_limit`), at most once
                until the requests in flight have drained to the lowered limit (the queue the server reports
                still reflects the old limit until then; halving again on the same evidence would collapse it)
    room        KV usage below `kv_soft` and settled (risen by less than `kv_settle` since the previous poll: it lags,
                an admitted request's KV grows over its whole generation), nothing waiting, and the limit is what
                holds requests back (in flight >= `busy_frac` of it): the limit grows by `increase` (not above
                `max_limit`, nor above the requests the server runs at once: beyond those a request only waits in
                its queue)
    otherwise   (KV between the soft and the hard mark, or the limit not reached) the limit holds
Why before the queue: a request waiting in the server's queue holds an episode without progress, and a retracted
one re-prefills its whole context later; a limit just below either keeps every admitted request running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agentloop.config import ConcurrencyConfig


@dataclass(frozen=True)
class LoadSignal:
    """What one server reports about its load (summed over its data-parallel ranks; KV usage: the fullest)."""

    running: int
    """Requests its scheduler runs now."""
    waiting: int
    """Requests in its waiting queue."""
    kv_usage: float
    """Fraction of its KV token pool in use (0..1)."""
    retracted: int = 0
    """Requests it retracted (preempted for lack of KV) and holds for later."""
    max_running: int | None = None
    """The most requests it runs at once (max_running_requests), when it says."""


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def parse_loads(body: Any) -> LoadSignal | None:
    """SGLang 0.5.x's GET /v1/loads?include=core,queues -> LoadSignal; None when the answer does not say (an older
    server, or a fake without the endpoint)."""
    if not isinstance(body, dict) or not isinstance(body.get("loads"), list) or not body["loads"]:
        return None
    running = waiting = retracted = max_running = 0
    kv = 0.0
    for ld in body["loads"]:
        if not isinstance(ld, dict):
            return None
        r, w, usage = _int(ld.get("num_running_reqs")), _int(ld.get("num_waiting_reqs")), ld.get("token_usage")
        if r is None or w is None or not isinstance(usage, (int, float)) or isinstance(usage, bool):
            return None
        running += r
        waiting += w
        kv = max(kv, float(usage))
        q = ld.get("queues")
        if isinstance(q, dict):
            retracted += _int(q.get("retracted")) or 0
        mr = _int(ld.get("max_running_requests"))
        max_running = max_running + mr if mr and max_running is not None else None
    return LoadSignal(running=running, waiting=waiting, kv_usage=kv, retracted=retracted,
                      max_running=max_running or None)


class ConcurrencyControl:
    """Per-server limits on requests in flight (module doc). `observe` once per poll and server; `limit(i)` is what
    the router caps server i at."""

    def __init__(self, n_servers: int, cfg: ConcurrencyConfig, *, hard_cap: int | None = None):
        """`hard_cap`: a cap above the config's `max_limit` never to exceed (manager.max_inflight_per_server)."""
        if n_servers < 1:
            raise ValueError("ConcurrencyControl needs at least one server")
        self.cfg = cfg
        self.max_limit = min(cfg.max_limit, hard_cap) if hard_cap else cfg.max_limit
        start = max(cfg.min_limit, min(cfg.initial, self.max_limit))
        self.limits = [start] * n_servers
        self.signals: list[LoadSignal | None] = [None] * n_servers
        self._drain_to: list[int | None] = [None] * n_servers
        """After a decrease: the limit in-flight requests must drain to before another decrease."""
        self.increases = 0
        self.decreases = 0

    def limit(self, idx: int) -> int:
        return self.limits[idx]

    def observe(self, idx: int, sig: LoadSignal, inflight: int) -> int:
        """Server `idx` reported `sig` while the client had `inflight` requests on it: its new limit."""
        c = self.cfg
        prev = self.signals[idx]
        self.signals[idx] = sig
        settled = prev is None or sig.kv_usage - prev.kv_usage < c.kv_settle
        cur = self.limits[idx]
        top = self.max_limit if sig.max_running is None else min(self.max_limit, sig.max_running)
        drain = self._drain_to[idx]
        if drain is not None and inflight <= drain:
            self._drain_to[idx] = drain = None
        overloaded = sig.waiting > c.max_queued or sig.retracted > 0 or sig.kv_usage >= c.kv_hard
        if overloaded:
            if drain is None:
                new = max(c.min_limit, min(cur - 1, math.floor(cur * c.decrease)))
                if new < cur:
                    self.decreases += 1
                    self._drain_to[idx] = new
                cur = new
        elif (sig.kv_usage < c.kv_soft and settled and sig.waiting == 0 and inflight >= c.busy_frac * cur
              and cur < top):
            cur = min(top, cur + c.increase)
            self.increases += 1
        cur = max(c.min_limit, min(cur, self.max_limit))
        self.limits[idx] = cur
        return cur

    def gauges(self) -> dict[str, float]:
        """`server/conc_...`: the limits (sum), the signal (KV usage: the fullest server; waiting, running,
        retracted: summed) and the changes so far; per server `server/{i}/conc_limit`, `server/{i}/kv_usage`."""
        sigs = [s for s in self.signals if s is not None]
        g = {"server/conc_limit": float(sum(self.limits)),
             "server/conc_increases": float(self.increases), "server/conc_decreases": float(self.decreases),
             "server/conc_kv_usage": max((s.kv_usage for s in sigs), default=0.0),
             "server/conc_waiting": float(sum(s.waiting for s in sigs)),
             "server/conc_running": float(sum(s.running for s in sigs)),
             "server/conc_retracted": float(sum(s.retracted for s in sigs))}
        for i, lim in enumerate(self.limits):
            g[f"server/{i}/conc_limit"] = float(lim)
            s = self.signals[i]
            if s is not None:
                g[f"server/{i}/kv_usage"] = s.kv_usage
                g[f"server/{i}/waiting"] = float(s.waiting)
        return g


__all__ = ["ConcurrencyControl", "LoadSignal", "parse_loads"]
