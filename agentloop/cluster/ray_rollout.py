"""Rollout workers as Ray actors (`cluster.rollout_workers` > 0): the asynchronous schedule's episodes run in engine
processes of their own, so they are not bound to the driver's event loop.

    RolloutWorker   an async actor: its own ServerManager over the run's servers (generate calls, retries, health),
                    RolloutEngine, Scorer and group stream; runs the groups it is handed and answers with their
                    GroupOutcome. Its manager `follow`s the driver's, which makes every admin call (pause, weight
                    update, resume) and tells the workers first: a call a pause cuts short continues after the
                    resume, tokens are stamped with the servers' versions, exactly as on the driver
    WorkerStream    the driver's side: the stream the schedule drives (agentloop.rollout.stream.GroupStreamProtocol,
                    as the engine's GroupStream) over the workers, each group to the least loaded one; a worker
                    that dies ends its groups cancelled (their prompts are given out again), and none is lost

With the episode journal (journal.enabled, the driver's `Journal`): each worker journals its episodes into the run's
journal directory as a writer of its own (`w<pid>-<n>.jal` segments, header and settings the driver's); a group the
driver resumes from the journal is read back from disk by the worker that gets it. A worker that dies does not cost
its groups: each is handed to a live worker, which reads their journaled episodes (the dead worker wrote them up to
its last write) and continues them from there, on whichever server answers. The workers' journal numbers join the
driver's (`journal/...` in each step's row), and they close their segments at every step boundary so the driver's
compaction takes them in.

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
        self.cfg = cfg
        self.journal: Any = None
        self.stream: Any = None  # made with the first group (and its journal, when the driver keeps one)
        self.waiting: dict[int, asyncio.Future] = {}
        self.collector: asyncio.Task | None = None
        self._counts_sent: dict[str, int] = {}

    def _ensure_stream(self, journal: dict[str, Any] | None) -> None:
        if self.stream is not None:
            return
        if journal is not None:
            import os

            from agentloop.journal import Journal

            self.journal = Journal(Path(journal["dir"]), self.cfg.journal, journal["header"], writer=f"w{os.getpid()}")
        self.stream = self.engine.stream(journal=self.journal)
        self.collector = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        while True:
            out = await self.stream.next()
            fut = self.waiting.pop(out.sample.group_uid if out.key is None else out.key, None)
            if fut is not None and not fut.done():
                fut.set_result(out)

    async def run_group(self, sample: Any, n: int, state: dict[str, Any], journal: dict[str, Any] | None = None,
                        load: bool = False, key: int | None = None) -> GroupOutcome:
        """Run one group, the driver's manager's state at its submission followed first (its episodes start from
        what the driver knew: the expected version they are counted from, the pause state). `journal`: the driver's
        journal (directory, header); `load`: the group is journaled (a resume, or its worker died): read its episodes
        from disk first, to continue them; `key`: the group's key in the driver's stream (None: its group_uid)."""
        self.sm.follow(state)
        self._ensure_stream(journal)
        if load and self.journal is not None:
            await self.journal.load_group(sample.group_uid, sample.attempt)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[sample.group_uid if key is None else key] = fut
        self.stream.submit(sample, n, key=key)
        return await fut

    def cancel(self, uid: int, reason: str) -> bool:
        return self.stream is not None and self.stream.cancel(uid, reason)

    def journal_counts(self) -> dict[str, int]:
        """This worker's journal numbers since the last call (the driver adds them to its own)."""
        if self.journal is None:
            return {}
        now = dict(self.journal.counts)
        out = {k: v - self._counts_sent.get(k, 0) for k, v in now.items() if v != self._counts_sent.get(k, 0)}
        self._counts_sent = now
        return out

    def rotate_journal(self) -> None:
        """Close the open segment (a step boundary): the driver's compaction takes closed segments in."""
        if self.journal is not None:
            self.journal.writer.rotate()

    def follow(self, state: dict[str, Any]) -> None:
        self.sm.follow(state)

    async def running_versions(self) -> dict[int, int | None]:
        return await self.stream.running_versions() if self.stream is not None else {}

    def busy_fraction(self, reset: bool) -> float:
        return self.engine.busy_fraction(reset=reset)

    def stopped(self) -> str | None:
        return self.stream.stopped if self.stream is not None else None

    async def stop(self) -> None:
        if self.collector is not None:
            self.collector.cancel()
            await asyncio.gather(self.collector, return_exceptions=True)
        if self.stream is not None:
            await self.stream.cancel_all("the run ended")
        if self.journal is not None:
            self.journal.close()
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

    def rotate_journals(self) -> None:
        """Every worker closes its journal segment (fire and forget: a dead worker's segments are closed anyway)."""
        for w in self.workers:
            w.rotate_journal.remote()

    async def stop(self, grace_s: float = 30.0) -> None:
        refs = [w.stop.remote() for w in self.workers]
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), timeout=grace_s)
        for w in self.workers:
            ray.kill(w, no_restart=True)


class WorkerStream:
    """A rollout.stream.GroupStreamProtocol over rollout workers (module doc); runs on the driver's event loop."""

    def __init__(self, pool: WorkerPool, sm: Any, journal: Any = None):
        self.pool = pool
        self.sm = sm
        """The driver's ServerManager: its expected version is a group's submitted one, its state goes with it."""
        self.journal = journal
        """The driver's episode journal (agentloop.journal.Journal; None: off): the workers journal into its
        directory, and a dead worker's groups go on elsewhere from it."""
        self._journal_spec = ({"dir": str(journal.directory), "header": journal.header}
                              if journal is not None else None)
        self._dead: set[Any] = set()
        if journal is not None:
            journal.on_trained.append(pool.rotate_journals)
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

    def submit(self, sample: Any, n: int, *, key: int | None = None) -> None:
        uid = sample.group_uid if key is None else key
        if uid in self._tasks:
            raise ValueError(f"group {uid} is already in this stream")
        worker = self._least_loaded()
        self._load[worker] += 1
        self._where[uid] = worker
        if not self._tasks:
            self._busy_since = time.monotonic()
        self._tasks[uid] = asyncio.create_task(self._group(worker, uid, sample, n, self.sm.expected_version,
                                                           self.sm.follower_state()), name=f"remote-group-{uid}")
        self.counts["submitted"] += 1

    def _least_loaded(self) -> Any:
        live = [w for w in self.pool.workers if w not in self._dead] or self.pool.workers
        return min(live, key=lambda w: self._load[w])

    async def _run_on(self, worker: Any, uid: int, sample: Any, n: int, state: dict[str, Any],
                      load: bool) -> GroupOutcome:
        out = await worker.run_group.remote(sample, n, state, self._journal_spec, load, uid)
        if self.journal is not None:
            try:
                self.journal.counts.update(await worker.journal_counts.remote())
            except ray.exceptions.RayError:
                pass
        return out

    async def _group(self, worker: Any, uid: int, sample: Any, n: int, version: Any, state: dict[str, Any]) -> None:
        resumed = self.journal is not None and self.journal.is_resumed(sample)
        try:
            try:
                out = await self._run_on(worker, uid, sample, n, state, resumed)
            except ray.exceptions.RayActorError:
                # the worker died: with the journal its group goes on from what that worker journaled, on another
                # live worker (the same attempt: its seeds, its episode ids); without it, cancelled below
                self._dead.add(worker)
                if self.journal is None or all(w in self._dead for w in self.pool.workers):
                    raise
                self._load[worker] -= 1
                worker = self._least_loaded()
                self._load[worker] += 1
                self._where[uid] = worker
                self.journal.counts["groups_moved_from_dead_worker"] += 1
                out = await self._run_on(worker, uid, sample, n, self.sm.follower_state(), True)
                if out.cancelled is None:
                    self.journal.counts["groups_continued_after_worker_death"] += 1
            if out.cancelled is None:
                self.counts["completed"] += 1
            elif out.cancelled.startswith("every server went down"):
                self.stopped = self.stopped or out.cancelled
        except ray.exceptions.RayActorError as e:  # the worker died: the group is cancelled, its prompt given again
            out = GroupOutcome(sample=sample, n=n, submitted_version=version, key=uid,
                               cancelled=f"its rollout worker died: {_cause(e)}")
        except ray.exceptions.RayError as e:  # the worker refused it (its stream stopped): cancelled, named
            out = GroupOutcome(sample=sample, n=n, submitted_version=version, key=uid,
                               cancelled=f"its rollout worker failed it: {_cause(e)}")
        except asyncio.CancelledError:
            out = GroupOutcome(sample=sample, n=n, submitted_version=version, key=uid,
                               cancelled="cancelled")
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
