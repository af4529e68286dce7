"""RayLearner: the learner's ranks as Ray actors in a placement group, batches and control through Ray.

    LearnerRank   one rank: a threaded actor; `run` joins the torch.distributed group (rank 0's node address and a
                  port rank 0 picked, RANK/WORLD_SIZE/MASTER_* set by us, not by torchrun) and runs the learner loop
                  (agentloop.train.trainer.serve, FSDP2 as on one host) in `cluster.learner_dir`; rank 0's loop reads
                  its messages from a RayInbox that the orchestrator's calls (`submit`, `stop`, `allow_sync`) fill,
                  while `run` is still going (the actor takes several calls at once)
    RayInbox      the learner side of the handle in memory: the loop's LearnerInbox, the driver's queries
    RayLearner    the orchestrator's LearnerHandle: makes the placement group's rank actors (or takes the
                  backend's, colocated), starts `run` on each, and turns their answers and deaths into the handle's
                  results and errors (an actor that died is LearnerDiedError naming it, never a hang)

No shared filesystem: a step's batch goes to rank 0 as its file's bytes (agentloop.train.batch.format), which rank 0
broadcasts and each rank reads its own rows from; results come back as
values, and the weights a server loads are fetched from rank 0 (`manifest`, `read_chunk`) by the server pool, once
per node. What stays on the learner's nodes is `cluster.learner_dir`: weights/, checkpoints/ and learner.log; it
must be a path every learner node reaches (a shared filesystem when ranks span nodes) for checkpoints to be
resumable.

Resume: a restarted learner loads its newest checkpoint (step C) from learner_dir; the batches submitted before the
stop lived in the old actors' memory, so the run goes on at step C + 1 from the data position stored with C (the
prompts of the steps after C are given out again, each position still trained once).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import ray

from agentloop.cluster.ray_servers import _cause, actor_options
from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.inference.launcher import pick_free_port
from agentloop.train.batch.format import check_batch
from agentloop.train.handle.protocol import (
    FinalResult,
    LearnerDiedError,
    LearnerFailedError,
    LearnerHandle,
    LearnerInbox,
    LearnerInfo,
    LearnerTimeout,
    PushOrder,
    SyncRequest,
    UpdateResult,
    WeightsOnDisk,
)
from agentloop.util.fsio import atomic_write_json


class RayInbox(LearnerInbox):
    """Rank 0's inbox in memory (module doc): the loop's side and the driver's queries, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.info: dict[str, Any] = {"status": "loading", "pid": os.getpid()}
        self.batches: dict[int, tuple[bytes, dict[str, Any]]] = {}
        self.stop_req: bool | None = None
        self.results: dict[int, tuple[str, Any]] = {}  # step -> ("done", payload) | ("failed", payload)
        self.sync_requests: dict[int, str] = {}
        self.orders: dict[int, dict[str, Any]] = {}
        self.final_result: dict[str, Any] | None = None
        self.results_dir: Path | None = None
        """Where each step's result is also written (the learner's directory): a resumed run restores the row of a
        step the learner finished before a stop (agentloop.train.orchestrator.loop.recover_step_rows)."""

    # the loop's side (LearnerInbox) ----------------------------------------------------------
    def start(self) -> None:
        return None

    def report(self, **fields: Any) -> None:
        with self._lock:
            self.info.update(fields)
            self.info["heartbeat"] = time.time()

    def poll(self, step: int) -> tuple[Any, ...] | None:
        with self._lock:
            item = self.batches.pop(step, None)
            stop = self.stop_req
        if item is not None:
            data, meta = item
            try:
                check_batch(data)  # every rank then reads its own share of these bytes
                return ("batch", data, meta)
            except Exception as e:  # noqa: BLE001 - unreadable batch: every rank stops, the orchestrator is told
                self.failed(step, e)
                return ("bad_batch", f"{type(e).__name__}: {e}")
        return None if stop is None else ("stop", stop)

    def done(self, step: int, weights_dir: str | None, metrics: dict[str, float], *, pushed: bool) -> None:
        payload = {"weights_dir": weights_dir, "metrics": metrics, "pushed": pushed}
        if self.results_dir is not None:
            self.results_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.results_dir / f"step-{step:06d}.json", payload)
        with self._lock:
            self.results[step] = ("done", payload)

    def failed(self, step: int, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with self._lock:
            self.results[step] = ("failed", {"error": f"{type(exc).__name__}: {exc}", "traceback": tb})

    def ask_push(self, step: int, method: str, timeout_s: float) -> PushOrder:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self.sync_requests[step] = method
            while step not in self.orders:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LearnerTimeout(f"step {step}: the orchestrator did not pause the servers within {timeout_s}s")
                self._changed.wait(left)
            return PushOrder.from_json(self.orders[step])

    def final(self, step: int, weights_dir: str | None, checkpoint: str | None) -> None:
        with self._lock:
            self.final_result = {"step": step, "weights_dir": weights_dir, "checkpoint": checkpoint}

    def forget_after(self, step: int) -> None:
        with self._lock:
            for s in [s for s in self.results if s > step]:
                del self.results[s]
        if self.results_dir is not None:
            for f in self.results_dir.glob("step-*.json"):
                if f.stem[5:].isdigit() and int(f.stem[5:]) > step:
                    f.unlink(missing_ok=True)

    def close(self, status: str = "stopped", **fields: Any) -> None:
        self.report(status=status, **fields)

    # the driver's side ------------------------------------------------------------------------
    def submit(self, step: int, data: bytes, meta: dict[str, Any]) -> None:
        with self._lock:
            self.batches.setdefault(step, (data, meta))

    def allow_sync(self, order: dict[str, Any]) -> None:
        with self._changed:
            self.orders[int(order["step"])] = order
            self._changed.notify_all()

    def stop(self, final: bool) -> None:
        with self._lock:
            self.stop_req = bool(final) or bool(self.stop_req)

    def poll_result(self, step: int) -> tuple[str, Any] | None:
        """("done"|"failed", payload), ("sync", method) while the loop waits for paused servers, or None."""
        with self._lock:
            if step in self.results:
                return self.results[step]
            if step in self.sync_requests and step not in self.orders:
                return ("sync", self.sync_requests[step])
            return None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {**self.info, "pending": sorted(self.batches)}


class LearnerRank:
    """One learner rank (module doc); rank 0 also answers the orchestrator."""

    def __init__(self, run: str, rank: int):
        self.run = run
        self.rank = rank
        self.inbox = RayInbox()
        self.log_path: Path | None = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0's: the process group's rendezvous)."""
        return ray.util.get_node_ip_address(), pick_free_port("0.0.0.0")

    def run_loop(self, world: int, master: tuple[str, int], learner_dir: str, model_path: str, config_yaml: str,
                 resume: bool, max_len: int | None) -> int:
        """Join the process group and run the learner loop until it stops; its exit code."""
        import logging

        from agentloop.config import config_from_tree, validate_for_training
        from agentloop.train.trainer.main import log_to_stdout
        from agentloop.train.trainer.serve import logger, serve

        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        d = Path(learner_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.inbox.results_dir = d / "steps"
        self.log_path = d / ("learner.log" if self.rank == 0 else f"learner-rank{self.rank}.log")
        log_to_stdout(self.rank)
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter(f"%(asctime)s learner[{self.rank}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        import yaml

        cfg = validate_for_training(config_from_tree(yaml.safe_load(config_yaml), "the run's config"))
        (d / "config.yaml").write_text(config_yaml)
        try:
            return serve(d, model_path, cfg.algo, cfg.learner, resume=resume, max_len=max_len,
                         inbox=(lambda started: self.inbox) if self.rank == 0 else None)
        except Exception as e:  # noqa: BLE001 - logged with its traceback; the exit code tells the handle
            logger.exception("failed: %s: %s", type(e).__name__, e)
            return 1
        finally:
            handler.close()

    # rank 0: the orchestrator's calls ---------------------------------------------------------
    def submit(self, step: int, data: bytes, meta: dict[str, Any]) -> None:
        self.inbox.submit(step, data, meta)

    def allow_sync(self, order: dict[str, Any]) -> None:
        self.inbox.allow_sync(order)

    def stop(self, final: bool) -> None:
        self.inbox.stop(final)

    def poll_result(self, step: int) -> tuple[str, Any] | None:
        return self.inbox.poll_result(step)

    def snapshot(self) -> dict[str, Any]:
        return self.inbox.snapshot()

    def final_result(self) -> dict[str, Any] | None:
        return self.inbox.final_result

    def finished(self, learner_dir: str, step: int) -> dict[str, float] | None:
        """The learner metrics of a step finished by this or an earlier learner of the run (its results file)."""
        f = Path(learner_dir) / "steps" / f"step-{step:06d}.json"
        try:
            return dict(json.loads(f.read_text()).get("metrics", {}))
        except (OSError, ValueError):
            return None

    def weights_path(self, learner_dir: str, step: int) -> str | None:
        d = Path(learner_dir) / "weights" / f"step-{step:06d}"
        return str(d) if d.is_dir() else None

    def manifest(self, path: str) -> list[tuple[str, int]]:
        """(relative path, size) of every file under `path` (an HF weights directory), for a node's copy of it."""
        root = Path(path)
        return [(str(f.relative_to(root)), f.stat().st_size) for f in sorted(root.rglob("*")) if f.is_file()]

    def read_chunk(self, path: str, rel: str, offset: int, length: int) -> bytes:
        """`length` bytes of one file of `path` from `offset` (a node fetches a directory chunk by chunk: no object
        the size of a model)."""
        root = Path(path).resolve()
        f = (root / rel).resolve()
        if root not in f.parents:
            raise ValueError(f"{rel!r} is not a file under {path}")
        with f.open("rb") as fh:
            fh.seek(offset)
            return fh.read(length)

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None:
            return ""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class RayLearner(LearnerHandle):
    """The orchestrator's side (module doc)."""

    def __init__(self, cfg: Config, run_dir: Path, model_path: Path, *, run: str, gpus: float,
                 placement_group: Any = None, poll_s: float = 0.1, query_timeout_s: float = 30.0,
                 rank_cls: type = LearnerRank, rank_kwargs: dict[str, Any] | None = None):
        """`rank_cls` (with `rank_kwargs`): the rank actor's class, LearnerRank (a scripted one in the handle's
        contract tests)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_path = model_path
        self.run = run
        self.gpus = gpus
        self.world = cfg.learner.world_size
        self.learner_dir = cfg.cluster.learner_dir or str(run_dir)
        self.poll_s = poll_s
        self.query_timeout_s = query_timeout_s
        """The bound of a question to rank 0 that is not a wait of the protocol's (a finished step's metrics, the
        log's tail): past it the answer is "nothing known"."""
        self.placement_group = placement_group
        self.rank_cls = rank_cls
        self.rank_kwargs = dict(rank_kwargs or {})
        self._own_pg = False
        self.ranks: list[Any] = []
        self.runs: list[Any] = []
        self._submitted: set[int] = set()
        self._finished: dict[int, dict[str, float]] = {}
        self._ended: dict[int, str] = {}  # rank -> why its loop ended (exit code or the actor's death)

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        from ray.util.placement_group import placement_group

        c = self.cfg.cluster
        if self.placement_group is None:
            bundle = {"CPU": c.cpus_per_actor, **({"GPU": self.gpus} if self.gpus else {}), **c.learner_resources}
            self.placement_group = placement_group([dict(bundle) for _ in range(self.world)],
                                                   strategy="SPREAD" if c.placement == "spread" else "PACK",
                                                   name=f"{self.run}-learner")
            self._own_pg = True
        timeout = self.cfg.train.learner_ready_timeout_s
        try:
            await asyncio.wait_for(self.placement_group.ready(), timeout)
        except asyncio.TimeoutError:
            raise LearnerTimeout(f"the learner's placement group ({self.world} bundle(s): "
                                 f"{self.placement_group.bundle_specs}) was not placed within {timeout:g}s; the "
                                 f"cluster has {ray.available_resources()} free") from None
        self._check_placement()
        remote = ray.remote(max_concurrency=16)(self.rank_cls)
        for r in range(self.world):
            opts = actor_options(c, self.gpus, name=f"{self.run}-learner-rank{r}", resources={},
                                 placement_group=self.placement_group, bundle=r)
            self.ranks.append(remote.options(**opts).remote(self.run, r, **self.rank_kwargs))
        master = await self.ranks[0].address.remote()
        config_yaml = (self.run_dir / "config.yaml").read_text()
        self.runs = [rank.run_loop.remote(self.world, master, self.learner_dir, str(self.model_path), config_yaml,
                                          self.cfg.train.resume, self.cfg.model.context_length)
                     for rank in self.ranks]

    def _check_placement(self) -> None:
        """ConfigError when the ranks landed on several nodes that share no filesystem: rank 0 makes each checkpoint's
        directory and every rank writes its shard into it, so the ranks must see one cluster.learner_dir."""
        from ray.util.placement_group import placement_group_table

        nodes = set(placement_group_table(self.placement_group)["bundles_to_node_id"].values())
        if len(nodes) > 1 and not self.cfg.cluster.shared_fs:
            raise ConfigError(
                f"the learner's {self.world} ranks were placed on {len(nodes)} nodes and cluster.shared_fs is false: "
                f"every rank writes its shard of each checkpoint into cluster.learner_dir ({self.learner_dir}), which "
                "a resume reads whole; put cluster.learner_dir on a filesystem every learner node mounts and set "
                "cluster.shared_fs=true, or keep the ranks on one node (cluster.placement=pack, "
                "cluster.learner_resources naming one node's resource)")

    # ------------------------------------------------------------------ liveness

    def _check(self) -> None:
        """LearnerDiedError when a rank's loop ended (its actor died, or it exited) before the handle stopped it."""
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            r = self.runs.index(ref)
            if r in self._ended:
                continue
            try:
                code = ray.get(ref)
                self._ended[r] = f"exited with code {code}"
            except ray.exceptions.RayActorError as e:
                self._ended[r] = f"its actor died ({_cause(e)})"
            except ray.exceptions.RayError as e:
                self._ended[r] = f"it failed ({_cause(e)})"
        if self._ended:
            r = min(self._ended)
            raise LearnerDiedError(f"learner rank {r} ({self.run}-learner-rank{r}, a Ray actor) {self._ended[r]}")

    async def _call(self, ref: Any, what: str) -> Any:
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            self._check()
            raise LearnerDiedError(f"learner rank 0 ({self.run}-learner-rank0) died during {what}: "
                                   f"{_cause(e)}") from None

    async def _wait(self, probe, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            out = await probe()
            if out is not None:
                return out
            self._check()
            if time.monotonic() > deadline:
                raise LearnerTimeout(f"{what} within {timeout_s}s")
            await asyncio.sleep(self.poll_s)

    # ------------------------------------------------------------------ the protocol

    def _info(self, snap: dict[str, Any]) -> LearnerInfo:
        return LearnerInfo(next_step=int(snap.get("next_step") or 1), resumed_step=snap.get("resumed_step"),
                           data_position=snap.get("data_position"), world_size=int(snap.get("world_size") or 1),
                           layout=dict(snap.get("layout") or {}), probe=snap.get("probe"))

    async def wait_ready(self, timeout_s: float) -> LearnerInfo:
        async def probe():
            snap = await self._call(self.ranks[0].snapshot.remote(), "its start")
            return snap if snap.get("status") in ("ready", "training") else None

        return self._info(await self._wait(probe, timeout_s, "the learner was not ready"))

    async def wait_caught_up(self, step_timeout_s: float) -> LearnerInfo:
        async def probe():
            snap = await self._call(self.ranks[0].snapshot.remote(), "its start")
            return snap if snap.get("status") == "ready" and not snap.get("pending") else None

        return self._info(await self._wait(probe, step_timeout_s, "the learner did not train its pending batches"))

    def submitted(self, step: int) -> bool:
        return step in self._submitted

    async def submit(self, step: int, batch: Any, *, data_position: Any = None) -> None:
        if step in self._submitted:
            return
        data = await asyncio.to_thread(batch.to_bytes)
        await self._call(self.ranks[0].submit.remote(step, data, {"data_position": data_position}), f"step {step}")
        self._submitted.add(step)

    def _result(self, step: int, ev: tuple[str, Any]) -> UpdateResult | SyncRequest:
        kind, payload = ev
        if kind == "sync":
            return SyncRequest(step=step, method=str(payload))
        if kind == "failed":
            raise LearnerFailedError(f"learner failed step {step}: {payload['error']}", step=step,
                                     traceback=payload.get("traceback", ""))
        wdir = payload.get("weights_dir")
        self._finished[step] = dict(payload.get("metrics", {}))
        return UpdateResult(step=step, weights=WeightsOnDisk(wdir, host=self.ranks[0]) if wdir else None,
                            metrics=dict(payload.get("metrics", {})), pushed=bool(payload.get("pushed")))

    async def wait_update_or_sync(self, step: int, timeout_s: float) -> UpdateResult | SyncRequest:
        async def probe():
            return await self._call(self.ranks[0].poll_result.remote(step), f"step {step}")

        return self._result(step, await self._wait(probe, timeout_s, f"no update for step {step}"))

    async def allow_sync(self, step: int, order: Any) -> None:
        await self._call(self.ranks[0].allow_sync.remote(order.to_json()), f"step {step}'s push")

    async def wait_update(self, step: int, timeout_s: float) -> UpdateResult:
        async def probe():
            ev = await self._call(self.ranks[0].poll_result.remote(step), f"step {step}")
            return None if ev is None or ev[0] == "sync" else ev

        out = self._result(step, await self._wait(probe, timeout_s, f"no update for step {step}"))
        assert isinstance(out, UpdateResult)
        return out

    async def finished_metrics(self, step: int) -> dict[str, float] | None:
        if step in self._finished:
            return self._finished[step]
        if not self.ranks:
            return None
        try:  # a step an earlier learner of the run finished (read on the learner's node; once, at a resume)
            return await asyncio.wait_for(self.ranks[0].finished.remote(self.learner_dir, step), self.query_timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return None

    async def weights(self, step: int) -> WeightsOnDisk | None:
        path = await self._call(self.ranks[0].weights_path.remote(self.learner_dir, step), "a weights lookup")
        return WeightsOnDisk(path, host=self.ranks[0]) if path else None

    async def stop(self, *, final: bool = False) -> None:
        if self.ranks and not self._ended:
            try:
                await self.ranks[0].stop.remote(final)
            except ray.exceptions.RayActorError:
                pass  # gone already: `wait_final` / `close` say so

    async def wait_final(self, timeout_s: float) -> FinalResult:
        async def probe():
            try:
                return await self.ranks[0].final_result.remote()
            except ray.exceptions.RayActorError as e:
                raise LearnerDiedError(f"the learner died before saving the final model: {_cause(e)}") from None

        try:
            done = await self._wait(probe, timeout_s, "the learner did not save the final model")
        except LearnerDiedError:
            final = await self._final_if_any()
            if final is None:
                raise
            done = final
        return FinalResult(step=done.get("step"), weights_dir=done.get("weights_dir"),
                           checkpoint=done.get("checkpoint"))

    async def _final_if_any(self) -> dict[str, Any] | None:
        try:
            return await self.ranks[0].final_result.remote()
        except ray.exceptions.RayActorError:
            return None

    async def failure_context(self) -> str:
        lines = [f"learner rank {r}: {why}" for r, why in sorted(self._ended.items())]
        try:
            tail = await asyncio.wait_for(self.ranks[0].log_tail.remote(), self.query_timeout_s) if self.ranks else ""
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            tail = ""
        if tail:
            lines.append(f"--- learner.log tail (rank 0's node, {self.learner_dir}) ---\n{tail}")
        return "\n".join(lines)

    def where(self) -> str:
        return (f"learner: {self.world} Ray actor(s) {self.run}-learner-rank*, files in {self.learner_dir} on the "
                "learner's nodes")

    async def close(self) -> int | None:
        code: int | None = None
        if self.ranks:
            await self.stop()
            grace = 30.0 if not self._ended else 0.0
            done, _ = await asyncio.to_thread(ray.wait, self.runs, num_returns=len(self.runs), timeout=grace)
            if self.runs and self.runs[0] in done:
                try:
                    code = int(await self.runs[0])  # done already: no wait
                except (ray.exceptions.RayError, TypeError, ValueError):
                    code = None
            for a in self.ranks:
                ray.kill(a, no_restart=True)
        # also when the start stopped before any rank (a placement refused): its group must not hold the resources
        if self._own_pg and self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        self.ranks, self.runs = [], []
        return code


__all__ = ["LearnerRank", "RayInbox", "RayLearner"]
