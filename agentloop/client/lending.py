"""Lent servers: servers on the learner's GPUs that take episodes while the learner waits for a batch and give
their memory back while it trains (server.lend_learner_gpus). The ServerManager part that puts them to sleep and
wakes them; when to do either is agentloop.train.orchestrator.lending's schedule (plain synchronous).

Map:
    Lending.sleep   route new requests away (ServerState.asleep), abort what runs on them (each call continues at
                    once on a server awake, under the same weights: the data plane counts the sleep as an interrupt
                    of that server), wait until nothing is in flight there, wait until its scheduler is idle (a
                    flush it accepts), then release its memory (/release_memory_occupation; SGLang asserts that
                    the scheduler is idle, hence the flush first). Only a server whose /server_info says it runs
                    with the memory saver on a GPU is released: SGLang's CPU engine dies on the call (measured,
                    0.5.23: it calls torch.cuda.synchronize), and without the saver it frees nothing
    Lending.wake    resume its memory (/resume_memory_occupation), empty its prefix cache (KV made before the
                    release is gone, and a weight push may have happened), take requests again

Versions: a sleeping server keeps its weights resident (server.lend_release holds the KV cache and the CUDA graphs
only), so it receives every weight push as the others do and wakes serving the expected version.
Every await crossing the process boundary is bounded: admin calls by manager.admin_timeout_s, the drain by the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from agentloop.client.state import ManagerState
from agentloop.errors import RequestError, ServerError


class Lending:
    """The sleep/wake part of a ServerManager (module doc). `drain` and `flush_one` are the control plane's."""

    def __init__(self, state: ManagerState, *, drain, flush_one):
        self.s = state
        self._drain = drain
        self._flush_one = flush_one
        self.sleeps = 0
        self.wakes = 0
        self.sleep_s = 0.0
        """Seconds spent putting servers to sleep (drain + release), summed."""
        self.can_release: dict[int, bool] = {}
        """Per server, from its /server_info once: started with SGLang's memory saver on a GPU (else a release is a
        no-op at best, and SGLang's CPU engine dies on it: it synchronizes CUDA)."""
        self.released: set[int] = set()

    async def _releasable(self, i: int) -> bool:
        s = self.s
        if i not in self.can_release:
            info = await s.get_ok(s.urls[i], "/server_info", s.cfg.health_timeout_s)
            ok = isinstance(info, dict) and info.get("enable_memory_saver") is True \
                and str(info.get("device", "cuda")).split(":")[0] not in ("cpu", "")
            self.can_release[i] = ok
            if not ok:
                s.say(f"server {s.urls[i]} keeps its memory while asleep (it runs without SGLang's memory saver on a "
                      "GPU: --enable-memory-saver, a CUDA device); it only stops taking episodes")
        return self.can_release[i]

    async def sleep(self, idxs: Sequence[int], *, release: bool = True, tags: Sequence[str] = ("kv_cache",)) -> None:
        """Put servers `idxs` to sleep (module doc). ServerError if one does not drain or refuses the release (it is
        then ejected: its memory state is unknown, and health checks re-admit it once it answers)."""
        s = self.s
        t0 = time.monotonic()
        idxs = [i for i in idxs if i not in s.asleep]
        for i in idxs:
            s.router.servers[i].asleep = True
            s.asleep.add(i)
            s.evictions[s.urls[i]] += 1
        s.changed.set()
        for i in idxs:
            url = s.urls[i]
            try:
                if s.router.servers[i].inflight:
                    await s.admin_post(url, "/abort_request", {"rid": "", "abort_all": True})
                    await self._drain(lambda i=i: s.router.servers[i].inflight > 0, s.cfg.admin_timeout_s)
                if release and await self._releasable(i):
                    # SGLang releases only an idle scheduler (it asserts): a flush it accepts proves that
                    if not await self._flush_one(i, time.monotonic() + s.cfg.flush_timeout_s):
                        raise ServerError(f"server {url} did not become idle within {s.cfg.flush_timeout_s:g}s")
                    await s.admin_post(url, "/release_memory_occupation", {"tags": list(tags)})
                    self.released.add(i)
            except (RequestError, ServerError) as e:
                s.router.eject(i)
                s.stats["ejections"] += 1
                s.say(f"server {url} could not be put to sleep ({e}); ejected")
                raise ServerError(f"putting server {url} to sleep failed: {e}") from e
        self.sleeps += len(idxs)
        self.sleep_s += time.monotonic() - t0

    async def wake(self, idxs: Sequence[int], *, release: bool = True,
                   tags: Sequence[str] = ("kv_cache",)) -> None:
        """Wake servers `idxs` (module doc): they take requests again once their memory is back."""
        s = self.s
        for i in [i for i in idxs if i in s.asleep]:
            url = s.urls[i]
            try:
                if i in self.released:
                    await s.admin_post(url, "/resume_memory_occupation", {"tags": list(tags)})
                    self.released.discard(i)
                    if not await self._flush_one(i, time.monotonic() + s.cfg.flush_timeout_s):
                        raise ServerError(f"server {url} refused to flush its cache after waking")
            except (RequestError, ServerError) as e:
                s.router.eject(i)
                s.stats["ejections"] += 1
                s.say(f"server {url} could not be woken ({e}); ejected")
                s.router.servers[i].asleep = False
                s.asleep.discard(i)
                raise ServerError(f"waking server {url} failed: {e}") from e
            s.router.servers[i].asleep = False
            s.asleep.discard(i)
            self.wakes += 1
        s.changed.set()

    def gauges(self) -> dict[str, float]:
        return {"server/asleep": float(len(self.s.asleep)), "server/sleeps": float(self.sleeps),
                "server/wakes": float(self.wakes), "server/sleep_s": self.sleep_s}


__all__ = ["Lending"]
