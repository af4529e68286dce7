"""The server half of LoRA training (learner.lora.enabled): each step's adapter is loaded into the servers as a
versioned adapter, beside the ones in use.

weight_sync disk:
    learner half: DiskSync.publish -> Learner.save_served: weights/step-N is a PEFT adapter directory (a few MB)
    server half:  LoraHalf.load: pause (the interrupt mode's), POST /load_lora_adapter {"lora_name": "agentloop-vN",
                  "lora_path": weights/step-N} and /update_weight_version {"new_version": "N"} on every reachable
                  server, the servers marked as serving N, resume; then the older adapters no call names any more
                  are unloaded in the background, and those unloads have ended before the next pause (SGLang's
                  unload holds its LoRA lock until its last request ends: one left waiting across a pause, on a
                  request frozen by it, would hold the next load forever); an adapter still named waits for a
                  later push
weight_sync tensor (no file written while training):
    learner half: TensorSync.push_adapter: /load_lora_adapter_from_tensors + /update_weight_version, while
    server half:  LoraHalf.deliver (a SyncRequest) holds the servers paused, as PushHalf does; then the same
                  background unload. A server that comes back stale waits for the next push (no directory to
                  reload), except version 0 (the base: no adapter); a resumed run reloads weights/step-C from disk.
                  The same unload discipline.

Which adapter a request uses: the data plane names its server's version's adapter in every /generate (`lora_path`,
agentloop.client.data_plane; version 0 is the base model, which a fresh adapter equals), and every token of the
answer carries that version: SGLang keeps a request on the adapter it named until it ends, so in the retract and
in_place modes a request that spans an update goes on with its old adapter and its tokens say so; in abort mode
it is cut and continued under the new one (data plane), its tokens then carry both versions.

Map:
    LoraHalf         load (an adapter directory as `version`), resync (one stale server), deliver (a step's update)
    lora_server_args the SGLang flags launched servers get (agentloop.train.lora.server_args)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentloop.errors import RequestError
from agentloop.train.handle.protocol import PushOrder, SyncRequest, UpdateResult, WeightsOnDisk
from agentloop.train.lora import adapter_name, adapter_name_taken, server_args
from agentloop.train.weights.servers import ServerHalf, TransportError


class LoraHalf(ServerHalf):
    """learner.lora (weight_sync disk or tensor): adapters, not weights, go to the servers (module doc)."""

    name = "lora"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sm.state.lora_adapters = True
        self.loaded: dict[str, set[int]] = {}
        """Adapter versions this run loaded, per server URL (what is unloaded later)."""
        self.handed: set[int] = set()
        """Versions the learner pushed itself (weight_sync tensor) whose release it has not been told yet."""
        self.unloading: dict[str, asyncio.Future] = {}
        """The unloads started after the last push, per server URL (awaited before the next pause)."""

    async def _load_one(self, url: str, path: str, version: int) -> None:
        s = self.sm.state
        body = {"lora_name": adapter_name(version), "lora_path": path}
        try:
            try:
                out = await s.admin_post(url, "/load_lora_adapter", body)
            except RequestError as e:  # SGLang 0.5.23 answers a taken name with HTTP 400
                out = {"success": False, "error_message": str(e)}
            taken = isinstance(out, dict) and adapter_name_taken(out.get("error_message"))
            if taken and out.get("success") is False:
                # the name is taken by an older load of this version: a resumed run's, or an earlier run's on the
                # same servers (a killed run cannot unload its adapters)
                await s.admin_post(url, "/unload_lora_adapter", {"lora_name": adapter_name(version)})
                out = await s.admin_post(url, "/load_lora_adapter", body)
        except RequestError as e:
            raise TransportError(f"{url} refused the adapter of version {version} ({path}): {e}. A LoRA run's servers "
                                 "must serve LoRA: agentloop starts its own with --enable-lora; a server given by "
                                 "server.urls needs --enable-lora --max-lora-rank R --lora-target-modules ...") from e
        if isinstance(out, dict) and out.get("success") is False:
            raise TransportError(f"{url} did not load the adapter of version {version} ({path}): "
                                 f"{out.get('error_message')}")
        # the server's label follows, so /model_info says which version it serves (health re-admission reads it)
        await s.admin_post(url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self.loaded.setdefault(url, set()).add(version)

    async def _unload_idle(self, url: str, keep: int) -> None:
        """Unload the adapters older than `keep` that no call of ours names any more; the others wait for a later
        push. SGLang's unload holds its LoRA lock until the last request naming the adapter ends, and its next load
        waits for that lock: an unload still waiting when the servers are paused (a request under the old adapter,
        frozen in place or requeued) would hold the next push forever."""
        s = self.sm.state
        for v in sorted(x for x in self.loaded.get(url, set()) if x < keep):
            if s.adapter_inflight.get((url, v)):
                continue
            try:
                await s.admin_post(url, "/unload_lora_adapter", {"lora_name": adapter_name(v)})
                self.loaded[url].discard(v)
            except RequestError as e:
                s.say(f"server {url}: unloading adapter {adapter_name(v)} failed ({e}); it stays loaded")

    def _start_unloads(self, targets: list[str], keep: int) -> None:
        for u in targets:
            self.unloading[u] = self.sm.state.spawn(self._unload_idle(u, keep), name=f"unload-adapters-{u}")

    async def _settle_unloads(self) -> None:
        """Before a pause: the unloads started after the last push have ended (module doc)."""
        pending = {u: t for u, t in self.unloading.items() if not t.done()}
        self.unloading = {}
        if not pending:
            return
        limit = self.sm.state.cfg.admin_timeout_s
        _done, late = await asyncio.wait(pending.values(), timeout=limit)
        if late:
            urls = sorted(u for u, t in pending.items() if t in late)
            raise TransportError(
                f"unloading an old adapter on {', '.join(urls)} has not ended in {limit:.0f} s "
                "(manager.admin_timeout_s): SGLang waits for every request that named it, and no call of this run "
                "does. SGLang 0.5.17 never ends the count of a request aborted in its queue; agentloop patches the "
                "servers it starts (agentloop.inference.sglang_fixes), a server given by server.urls needs a fixed "
                "SGLang (0.5.23 is)")

    async def _paths(self, weights: WeightsOnDisk) -> dict[str, str]:
        staged = await self.stage(weights)
        urls = self.sm.urls
        return {u: staged for u in urls} if isinstance(staged, str) else {u.rstrip("/"): p for u, p in staged.items()}

    async def load(self, weights: WeightsOnDisk, version: int) -> float:
        """Load the adapter directory `weights` into every reachable server as `version` (module doc); seconds."""
        t0 = time.monotonic()
        paths = await self._paths(weights)
        targets = await self.sm.reachable_targets()
        await self._settle_unloads()
        await self.sm.pause(mode=self.policy.pause_mode)
        try:
            results = await asyncio.gather(*(self._load_one(u, paths[u], version) for u in targets),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            self.sm.mark_updated(version, targets)
            await self.sm.finish_update(self.policy, targets)
        finally:
            await self.sm.resume()
        self.current = weights
        self.sm.expect_version(version)
        self._start_unloads(targets, version)
        return time.monotonic() - t0

    async def resync(self, url: str) -> None:
        """Load the current adapter into one server that came back serving another version."""
        version = self.sm.expected_version
        if version is None:
            raise TransportError("no version to resync a server to")
        if version == 0:  # the base model: no adapter to load
            await self.sm.state.admin_post(url, "/update_weight_version", {"new_version": str(version),
                                                                           "abort_all_requests": False})
            return
        if self.current is None:
            raise TransportError(f"no adapter directory of version {version} to resync {url} with (weight_sync "
                                 "tensor: it stays out until the next push)")
        paths = await self._paths(self.current)
        await self._load_one(url, paths[url.rstrip("/")], version)

    async def deliver(self, step: int, event: UpdateResult | SyncRequest,
                      timeout_s: float) -> tuple[UpdateResult, float]:
        if isinstance(event, SyncRequest):  # weight_sync tensor: the learner loads the adapter itself
            return await self._pushed(step, timeout_s)
        if event.weights is None:
            raise TransportError(f"step {step}: LoRA training expects the learner's adapter on disk or a request "
                                 f"for paused servers (weight_sync tensor), got {event}")
        return event, await self.load(event.weights, step)

    def order(self, step: int, targets: list[str]) -> PushOrder:
        """The push order, with the versions the learner handed the servers that none holds any more (unloaded
        everywhere it was loaded): the learner writes the next adapters into their host memory (TensorSync)."""
        held = set().union(*self.loaded.values())
        released = sorted(self.handed - held)
        self.handed -= set(released)
        return PushOrder(step, tuple(targets), self.policy.mode, released=tuple(released))

    async def _pushed(self, step: int, timeout_s: float) -> tuple[UpdateResult, float]:
        """weight_sync tensor: pause, let the learner load adapter `step` into the reachable servers, resume."""
        t1 = time.monotonic()
        await self._settle_unloads()
        upd, targets = await self.push_paused(step, timeout_s)
        self.current = None  # no directory holds this adapter: a stale server waits for the next push
        for u in targets:
            self.loaded.setdefault(u, set()).add(step)
        self._start_unloads(targets, step)
        self.handed.add(step)
        return upd, time.monotonic() - t1


def lora_server_args(cfg: Any, device: str) -> list[str]:
    """The flags a LoRA run's launched servers get (before server.extra_args, which win)."""
    return server_args(cfg, device)


__all__ = ["LoraHalf", "lora_server_args"]
