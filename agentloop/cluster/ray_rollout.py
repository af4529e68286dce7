"""Rollout workers as Ray actors (`cluster.rollout_workers` > 0): the asynchronous schedule's episodes run in engine
processes of their own, so they are not bound to the driver's event loop.

    RolloutWorker   an async actor: its own ServerManager over the run's servers (generate calls, retries, health),
                    RolloutEngine, Scorer and group stream; runs the groups it is handed and answers with their
                    GroupOutcome. Its manager `follow`s the driver's, which makes every admin call (pause, weight
                    update, resume) and tells the workers first: a call a pause cuts short continues after the
                    resume, tokens are stamped with the servers' versions, exactly as on the driver
    WorkerStream    the driver's side: the GroupStream interface the schedule drives (submit, next, cancel,
                    cancel_all, running, running_versions, busy_fraction, stopped) over the workers, each group to
                    the least loaded one; a worker that dies ends its groups cancelled (their prompts are given out
                    again), and none is lost

The synchronous schedule and validation run on the driver's engine, as without Ray.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import ray

from agentloop.cluster.ray_servers import NAMESPACE, _cause
from agentloop.rollout.engine import GroupOutcome


class RolloutWorker:
    """One engine process (module doc). Its methods run on the actor's event loop."""

    async def start(self, config_yaml: str, urls: list[str], model_path: str, state: dict[str, Any]) -> None:
        import json

        import yaml

        from agentloop.config import config_from_tree
        from agentloop.interrupt import interrupt_policy
        from agentloop.loops import get_agent_loop
        from agentloop.models.loading import load_tokenizer_for
        from agentloop.rollout.engine import RolloutEngine
        from agentloop.rollout.run import load_plugins
        from agentloop.rollout.scorer import Scorer
        from agentloop.server_manager import ServerManager

        cfg = config_from_tree(yaml.safe_load(config_yaml), "the run's config")
        load_plugins(cfg)
        try:
            vocab = json.loads((Path(model_path) / "config.json").read_text()).get("vocab_size")
        except (OSError, ValueError):
            vocab = None
        self.sm = ServerManager(urls, cfg.manager, vocab_size=vocab,
                                cache_salt=interrupt_policy(cfg.train.interrupt).cache_salt)
        await self.sm.start()
        self.sm.follow(state)
        self.scorer = Scorer(cfg)
        self.engine = RolloutEngine(cfg, self.sm, load_tokenizer_for(cfg, Path(model_path)),
                                    get_agent_loop(cfg.rollout.loop), scorer=self.scorer, progress=False)
        self.stream = self.engine.stream()
        self.waiting: dict[int, asyncio.Future] = {}
        self.collector = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        while True:
            out = await self.stream.next()
            fut = self.waiting.pop(out.sample.group_uid, None)
            if fut is not None and not fut.done():
                fut.set_result(out)

    async def run_group(self, sample: Any, n: int, state: dict[str, Any]) -> GroupOutcome:
        """Run one group, the driver's manager's state at its submission followed first (its episodes start from
        what the driver knew: the expected version they are counted from, the pause state)."""
        self.sm.follow(state)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[sample.group_uid] = fut
        self.stream.submit(sample, n)
        return await fut

    def cancel(self, uid: int, reason: str) -> bool:
        return self.stream.cancel(uid, reason)

    def follow(self, state: dict[str, Any]) -> None:
        self.sm.follow(state)

    async def running_versions(self) -> dict[int, int | None]:
        return await self.stream.running_versions()

    def busy_fraction(self, reset: bool) -> float:
        return self.stream.busy_fraction(reset=reset)

    def stopped(self) -> str | None:
        return self.stream.stopped

    async def stop(self) -> None:
        self.collector.cancel()
        await asyncio.gather(self.collector, return_exceptions=True)
        await self.stream.cancel_all("the run ended")
        await self.scorer.close()
        await self.sm.close()


class WorkerPool:
    """The workers of one run: made, started, told the driver's manager's state, stopped."""

    def __init__(self, n: int, run: str, cpus: float):
        remote = ray.remote(max_concurrency=100_000)(RolloutWorker)
        self.workers = [remote.options(name=f"{run}-rollout{i}", namespace=NAMESPACE, num_cpus=cpus).remote()
                        for i in range(n)]

    async def start(self, config_yaml: str, urls: list[str], model_path: Path, state: dict[str, Any],
                    timeout_s: float) -> None:
        await asyncio.wait_for(asyncio.gather(*(w.start.remote(config_yaml, urls, str(model_path), state)
                                                for w in self.workers)), timeout_s)

    async def follow(self, state: dict[str, Any]) -> None:
        """The driver's ServerManager follower hook: every live worker mirrors its state before it goes on."""
        await asyncio.gather(*(w.follow.remote(state) for w in self.workers), return_exceptions=True)

    async def stop(self, grace_s: float = 30.0) -> None:
        refs = [w.stop.remote() for w in self.workers]
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), timeout=grace_s)
        for w in self.workers:
            ray.kill(w, no_restart=True)


class WorkerStream:
    """The GroupStream interface over rollout workers (module doc); runs on the driver's event loop."""

    def __init__(self, pool: WorkerPool, sm: Any):
        self.pool = pool
        self.sm = sm
        """The driver's ServerManager: its expected version is a group's submitted one, its state goes with it."""
        self._where: dict[int, Any] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        self._load = {w: 0 for w in pool.workers}
        self._done: asyncio.Queue[GroupOutcome] = asyncio.Queue()
        self._busy_s, self._busy_since, self._t0 = 0.0, None, time.monotonic()
        self.stopped: str | None = None
        self.counts = {"submitted": 0, "completed": 0, "cancelled": 0, "episodes_cancelled": 0}

    @property
    def running(self) -> int:
        return len(self._tasks)

    def running_uids(self) -> list[int]:
        return list(self._tasks)

    def submit(self, sample: Any, n: int) -> None:
        uid = sample.group_uid
        if uid in self._tasks:
            raise ValueError(f"group {uid} is already in this stream")
        worker = min(self.pool.workers, key=lambda w: self._load[w])
        self._load[worker] += 1
        self._where[uid] = worker
        if not self._tasks:
            self._busy_since = time.monotonic()
        self._tasks[uid] = asyncio.create_task(self._group(worker, sample, n, self.sm.expected_version,
                                                           self.sm.follower_state()), name=f"remote-group-{uid}")
        self.counts["submitted"] += 1

    async def _group(self, worker: Any, sample: Any, n: int, version: Any, state: dict[str, Any]) -> None:
        uid = sample.group_uid
        try:
            out = await worker.run_group.remote(sample, n, state)
            if out.cancelled is None:
                self.counts["completed"] += 1
            elif out.cancelled.startswith("every server went down"):
                self.stopped = self.stopped or out.cancelled
        except ray.exceptions.RayActorError as e:  # the worker died: the group is cancelled, its prompt given again
            out = GroupOutcome(sample=sample, n=n, submitted_version=version,
                               cancelled=f"its rollout worker died: {_cause(e)}")
        except ray.exceptions.RayError as e:  # the worker refused it (its stream stopped): cancelled, named
            out = GroupOutcome(sample=sample, n=n, submitted_version=version,
                               cancelled=f"its rollout worker failed it: {_cause(e)}")
        except asyncio.CancelledError:
            out = GroupOutcome(sample=sample, n=n, submitted_version=version, cancelled="cancelled")
        if out.cancelled is not None:
            self.counts["cancelled"] += 1
            self.counts["episodes_cancelled"] += n
        self._tasks.pop(uid, None)
        self._where.pop(uid, None)
        self._load[worker] -= 1
        if not self._tasks and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None
        self._done.put_nowait(out)

    def cancel(self, uid: int, reason: str) -> bool:
        worker = self._where.get(uid)
        if worker is None:
            return False
        worker.cancel.remote(uid, reason)  # its outcome comes back cancelled, with the reason
        return True

    async def next(self, timeout: float | None = None) -> GroupOutcome:
        return await (asyncio.wait_for(self._done.get(), timeout) if timeout is not None else self._done.get())

    async def running_versions(self) -> dict[int, int | None]:
        """Each running group's started version, as its worker saw it (None: not started yet)."""
        maps = await asyncio.gather(*(w.running_versions.remote() for w in self.pool.workers),
                                    return_exceptions=True)
        seen: dict[int, int | None] = {}
        for m in maps:
            if isinstance(m, dict):
                seen.update(m)
        return {u: seen.get(u) for u in self._tasks}

    def busy_fraction(self, reset: bool = False) -> float:
        """Share of the time since the last reset with a group running on some worker."""
        now = time.monotonic()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        frac = busy / max(1e-9, now - self._t0)
        if reset:
            self._busy_s, self._t0 = 0.0, now
            if self._busy_since is not None:
                self._busy_since = now
        return min(1.0, frac)

    async def cancel_all(self, reason: str) -> list[GroupOutcome]:
        for uid in list(self._tasks):
            self.cancel(uid, reason)
        out = []
        while self._tasks:
            out.append(await self._done.get())
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out


__all__ = ["RolloutWorker", "WorkerPool", "WorkerStream"]
