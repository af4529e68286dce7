"""The file protocol between the orchestrator (rollouts) and the learner ranks: one implementation of the
learner handle (agentloop.train.handle.protocol; FileLearner in agentloop.train.orchestrator.learner_process
wraps MailboxClient and the learner process), LearnerMailbox its learner side.

Both sides only need a shared filesystem, so they may run on different machines. Layout:

    RUN_DIR/mailbox/learner.json               learner rank 0: pid, host, status, next_step,
                                               resumed_step, data_position, world_size, layout (how it
                                               lays out micro-batches), heartbeat (rewritten every few
                                               seconds by a thread)
    RUN_DIR/mailbox/step-000001/batch.safetensors   orchestrator: step 1's batch as the learner trains it
                                               (agentloop.train.batch.format: each rank reads its own rows)
    RUN_DIR/mailbox/step-000001/batch.ready    orchestrator, after the batch: {"step", "num_episodes",
                                               "bytes", "data_position", "time"}
    RUN_DIR/mailbox/step-000001/sync.request   learner (weight_sync tensor|nccl), after training:
                                               {"step", "method", "time"}: pause the servers for me
    RUN_DIR/mailbox/step-000001/sync.go        orchestrator, once the servers are paused: {"step",
                                               "urls", "interrupt", "time"}: push the weights to these
                                               servers now (weight_sync.PushOrder)
    RUN_DIR/mailbox/step-000001/update.done    learner: {"step", "weights_dir" (null when the learner
                                               pushed the weights itself), "pushed", "metrics", "time"}
    RUN_DIR/mailbox/step-000001/update.failed  learner: {"step", "error", "traceback", "time"}
    RUN_DIR/mailbox/STOP                       orchestrator: {"time", "final"}: the learner exits after
                                               its current step; final (the run ended normally): it
                                               first saves the final model (a STOP older than the
                                               learner process is removed)
    RUN_DIR/mailbox/final.json                 learner, after a final STOP: {"step", "weights_dir",
                                               "checkpoint", "time"}: the HF directory and the checkpoint
                                               of the last trained step (a stale one goes at start)
    RUN_DIR/weights/step-000001/               learner: HF weights after step 1 (for SGLang's
                                               /update_weights_from_disk); with weight_sync tensor|nccl
                                               only weights/step-C of the checkpoint a learner resumed
                                               from (written before it reports ready, whatever the sync
                                               path, when missing) and those of the final step

Every file is written to a temporary name and renamed, so a reader never sees half a file.
Steps are consumed in order, one batch per step; `data_position` is opaque to the learner: it
is stored in checkpoints and reported back in learner.json after a resume.

Sequence per step (weight_sync disk): orchestrator `submit(step, batch)` -> learner trains ->
learner saves weights/step-N (and a checkpoint when due) -> learner writes update.done ->
orchestrator `wait_update(step)` returns the weights dir and metrics, and loads it into the servers.

Sequence per step (weight_sync tensor|nccl; the learner pushes, so the pause stays short):
`submit` -> learner trains (and checkpoints) -> learner writes sync.request ->
orchestrator (`wait_update_or_sync` returned a SyncRequest) pauses the servers, `allow_sync(step,
urls)` writes sync.go -> learner pushes the weights to `urls` -> update.done (`pushed: true`) ->
`wait_update` returns -> orchestrator resumes the servers (in a finally, also on failure).

Resume: a restarted learner loads its newest complete checkpoint (step C), deletes update.* and
weights of steps > C, writes weights/step-C from the checkpoint if they are missing, and reports
next_step = C + 1 in learner.json. It then trains the batches already in the mailbox (submitted before
the stop) as they are, reporting next_step and the data_position of each in learner.json; the
orchestrator's `wait_caught_up()` returns once none is left, and the run goes on from that next_step
(a batch submitted again is a no-op). Pruning (`learner.keep_weights`) never deletes the weights of
the newest complete checkpoint or of one being written, so a resume normally finds them in place.

End of a run: `stop(final=True)` -> the learner saves what the last step lacks (HF weights for
tensor|nccl, a checkpoint unless that step has one) -> final.json -> `wait_final` returns it.

Liveness: with a process handle (`process=`) the client checks the learner process itself;
otherwise it checks that learner.json's heartbeat is younger than `heartbeat_timeout_s`.

Map:
    MailboxPaths      where everything lives
    MailboxClient     orchestrator side (blocking calls; FileLearner runs them off the event loop)
    LearnerMailbox    learner rank 0 side, a handle.LearnerInbox (the loop itself is `agentloop.train.trainer.serve`)
    read_batch        a submitted step's batch, whole (TrainBatch), for tests and inspection
The errors are the handle's (MailboxError = LearnerError, MailboxTimeout = LearnerTimeout, LearnerDiedError,
LearnerFailedError), as are UpdateResult and SyncRequest.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.train.batch.format import BatchLayout, TrainBatch, check_batch
from agentloop.train.batch.prepare import prepare_batch
from agentloop.train.handle.protocol import (
    LearnerDiedError,
    LearnerError,
    LearnerFailedError,
    LearnerInbox,
    LearnerTimeout,
    PushOrder,
    SyncRequest,
    UpdateResult,
    WeightsOnDisk,
)
from agentloop.util.fsio import atomic_write_bytes, atomic_write_json

MailboxError = LearnerError
MailboxTimeout = LearnerTimeout


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class MailboxPaths:
    run_dir: Path

    @property
    def mailbox(self) -> Path:
        return self.run_dir / "mailbox"

    @property
    def weights_root(self) -> Path:
        return self.run_dir / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def learner_info(self) -> Path:
        return self.mailbox / "learner.json"

    @property
    def stop(self) -> Path:
        return self.mailbox / "STOP"

    @property
    def final(self) -> Path:
        return self.mailbox / "final.json"

    def step_dir(self, step: int) -> Path:
        return self.mailbox / f"step-{step:06d}"

    def batch(self, step: int) -> Path:
        return self.step_dir(step) / "batch.safetensors"

    def ready(self, step: int) -> Path:
        return self.step_dir(step) / "batch.ready"

    def done(self, step: int) -> Path:
        return self.step_dir(step) / "update.done"

    def failed(self, step: int) -> Path:
        return self.step_dir(step) / "update.failed"

    def sync_request(self, step: int) -> Path:
        return self.step_dir(step) / "sync.request"

    def sync_go(self, step: int) -> Path:
        return self.step_dir(step) / "sync.go"

    def weights(self, step: int) -> Path:
        return self.weights_root / f"step-{step:06d}"


class MailboxClient:
    """Orchestrator side: submit batches, wait for weight updates, stop the learner."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        process: Any = None,
        heartbeat_timeout_s: float = 120.0,
        poll_s: float = 0.2,
    ):
        """`process`: the learner's Popen (or anything with `poll()`), when this side launched it."""
        self.paths = MailboxPaths(Path(run_dir))
        self.paths.mailbox.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.poll_s = poll_s

    def submitted(self, step: int) -> bool:
        return self.paths.ready(step).exists()

    def submit(self, step: int, batch: TrainBatch, *, data_position: Any = None) -> Path:
        """Write step's batch (batch.safetensors), then its batch.ready marker. Re-submitting a ready step is a
        no-op."""
        d = self.paths.step_dir(step)
        if self.paths.ready(step).exists():
            return d
        d.mkdir(parents=True, exist_ok=True)
        data = batch.to_bytes()
        atomic_write_bytes(self.paths.batch(step), data)
        atomic_write_json(self.paths.ready(step), {"step": step, "num_episodes": batch.num_episodes,
                                                   "bytes": len(data), "data_position": data_position,
                                                   "time": time.time()})
        return d

    def submit_records(self, step: int, records: list[Any], algo: Any, *, data_position: Any = None,
                       layout: BatchLayout | None = None) -> Path:
        """Prepare step's batch from its usable records as the orchestrator does (prepare_batch with `algo`, for
        the layout the learner reported in learner.json unless `layout` is given) and submit it: for a learner
        driven by hand (tests, benchmarks)."""
        if layout is None:
            reported = (self.learner_info() or {}).get("layout")
            layout = BatchLayout.from_json(reported) if reported else BatchLayout()
        return self.submit(step, prepare_batch(records, algo, layout, step), data_position=data_position)

    def stop(self, *, final: bool = False) -> None:
        """Tell the learner to exit after its current step; `final` (the run ended normally): after saving
        the final model (`wait_final` waits for it)."""
        atomic_write_json(self.paths.stop, {"time": time.time(), "final": final})

    def wait_final(self, timeout_s: float) -> dict[str, Any]:
        """After `stop(final=True)`: wait for the learner's final.json ({"step", "weights_dir", "checkpoint"});
        LearnerDiedError if the learner exits without it, MailboxTimeout after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = _read_json(self.paths.final)
            if done is not None:
                return done
            try:
                self.check_alive()
            except LearnerDiedError as e:
                done = _read_json(self.paths.final)  # written just before it exited
                if done is not None:
                    return done
                raise LearnerDiedError(f"the learner exited without saving the final model ({e})") from e
            if time.monotonic() > deadline:
                raise MailboxTimeout(f"the learner did not save the final model within {timeout_s}s")
            time.sleep(self.poll_s)

    def learner_info(self) -> dict[str, Any] | None:
        return _read_json(self.paths.learner_info)

    def check_alive(self) -> None:
        """Raise LearnerDiedError if the learner process exited or its heartbeat is stale."""
        if self.process is not None:
            rc = self.process.poll()
            if rc is not None:
                raise LearnerDiedError(f"learner process exited with code {rc}")
            return
        info = self.learner_info()
        if info is None:
            return  # not started yet: the caller's timeout covers this
        if info.get("status") == "failed":
            raise LearnerDiedError(f"learner reported failure: {info.get('error', '?')}")
        age = time.time() - float(info.get("heartbeat", 0.0))
        if info.get("status") != "stopped" and age > self.heartbeat_timeout_s:
            raise LearnerDiedError(f"learner heartbeat is {age:.0f}s old (pid {info.get('pid')} on {info.get('host')})")

    def wait_ready(self, timeout_s: float, *, since: float | None = None) -> dict[str, Any]:
        """Wait until the learner (started after `since`, if given) has loaded and reports ready.

        Returns learner.json: `next_step` is the first step it will train, `data_position` the
        position stored in the checkpoint it resumed from (None on a fresh start).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.learner_info()
            fresh = info is not None and (since is None or info.get("started", 0) >= since)
            if fresh and info.get("status") in ("ready", "training"):
                return info
            self.check_alive()
            if time.monotonic() > deadline:
                raise MailboxTimeout(f"learner not ready after {timeout_s}s (learner.json: {info})")
            time.sleep(self.poll_s)

    def wait_caught_up(self, step_timeout_s: float) -> dict[str, Any]:
        """After `wait_ready`: wait until the learner has trained every batch already in the mailbox and return
        learner.json. A resumed learner trains the batches submitted before the stop first (from its
        checkpoint, as they are); once none is left, `next_step` and `data_position` (the state stored with
        the last batch trained) say where the run stands, and the newest weights are the only ones a caller
        needs. Each step may take `step_timeout_s`."""
        deadline, seen = time.monotonic() + step_timeout_s, None
        while True:
            info = self.learner_info() or {}
            step = info.get("next_step")
            if info.get("status") == "ready" and isinstance(step, int) and not self.paths.ready(step).exists():
                return info
            if step != seen:
                deadline, seen = time.monotonic() + step_timeout_s, step
            if isinstance(step, int) and (failed := _read_json(self.paths.failed(step))) is not None:
                raise LearnerFailedError(f"learner failed step {step}: {failed.get('error')}",
                                         step=step, traceback=failed.get("traceback", ""))
            self.check_alive()
            if time.monotonic() > deadline:
                raise MailboxTimeout(f"the learner did not train the submitted batch of step {step} within "
                                     f"{step_timeout_s}s")
            time.sleep(self.poll_s)

    def wait_update(self, step: int, timeout_s: float) -> UpdateResult:
        """Wait for step's update.done; raise LearnerFailedError / LearnerDiedError / MailboxTimeout."""
        out = self.wait_update_or_sync(step, timeout_s, sync=False)
        assert isinstance(out, UpdateResult)
        return out

    def wait_update_or_sync(self, step: int, timeout_s: float, *, sync: bool = True) -> UpdateResult | SyncRequest:
        """Like wait_update, but also return when the learner asks for paused servers (sync.request,
        not yet answered by sync.go); the caller pauses them and calls `allow_sync`."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = _read_json(self.paths.done(step))
            if done is not None:
                wdir = done.get("weights_dir")
                return UpdateResult(step=step, weights=WeightsOnDisk(str(wdir)) if wdir else None,
                                    metrics=done.get("metrics", {}), pushed=bool(done.get("pushed", False)))
            if sync and not self.paths.sync_go(step).exists():
                req = _read_json(self.paths.sync_request(step))
                if req is not None:
                    return SyncRequest(step=step, method=str(req.get("method", "")))
            failed = _read_json(self.paths.failed(step))
            if failed is not None:
                raise LearnerFailedError(f"learner failed step {step}: {failed.get('error')}",
                                         step=step, traceback=failed.get("traceback", ""))
            self.check_alive()
            if time.monotonic() > deadline:
                raise MailboxTimeout(f"no update for step {step} after {timeout_s}s")
            time.sleep(self.poll_s)

    def allow_sync(self, order: PushOrder) -> None:
        """The servers are paused in the order's interrupt mode: the learner may push its step's weights to its
        URLs (its payloads flush the prefix cache only where that mode allows it, agentloop.interrupt)."""
        atomic_write_json(self.paths.sync_go(order.step), {**order.to_json(), "time": time.time()})

    def finished_metrics(self, step: int) -> dict[str, float] | None:
        """The learner metrics of step's update.done (None: not finished)."""
        done = _read_json(self.paths.done(step))
        return None if done is None else dict(done.get("metrics", {}))


class LearnerMailbox(LearnerInbox):
    """Learner rank 0 side: heartbeat, batch polling, results."""

    def __init__(self, run_dir: str | Path, *, heartbeat_s: float = 5.0, started: float | None = None):
        """`started`: when this learner process started (default now); a STOP file older than
        that was meant for an earlier learner and is removed."""
        self.paths = MailboxPaths(Path(run_dir))
        self.paths.mailbox.mkdir(parents=True, exist_ok=True)
        self.paths.weights_root.mkdir(parents=True, exist_ok=True)
        self.heartbeat_s = heartbeat_s
        started = time.time() if started is None else started
        self._info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(),
                                      "started": started, "status": "loading"}
        try:
            if self.paths.stop.stat().st_mtime < started:
                self.paths.stop.unlink()
        except FileNotFoundError:
            pass
        self.paths.final.unlink(missing_ok=True)  # an earlier learner's: this one writes its own at the end
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # heartbeat -------------------------------------------------------------------------------
    def update_info(self, **fields: Any) -> None:
        with self._lock:
            self._info.update(fields)
            self._info["heartbeat"] = time.time()
            atomic_write_json(self.paths.learner_info, self._info)

    def start_heartbeat(self) -> None:
        self.update_info()
        self._thread = threading.Thread(target=self._beat, name="learner-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.update_info()

    def close(self, status: str = "stopped", **fields: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
        self.update_info(status=status, **fields)

    # protocol --------------------------------------------------------------------------------
    def stop_requested(self) -> bool:
        return self.paths.stop.exists()

    def stop_request(self) -> dict[str, Any] | None:
        """The STOP request ({"final": bool, ...}) or None. A STOP that is not JSON (an older orchestrator's
        timestamp) is a plain, non-final one."""
        try:
            text = self.paths.stop.read_text()
        except FileNotFoundError:
            return None
        try:
            req = json.loads(text)
        except ValueError:
            req = None
        return req if isinstance(req, dict) else {"final": False}

    def write_final(self, step: int, weights_dir: Path | None, checkpoint: Path | None) -> None:
        """The final model is saved: its HF directory and checkpoint (after a final STOP)."""
        atomic_write_json(self.paths.final, {
            "step": step, "weights_dir": None if weights_dir is None else str(weights_dir),
            "checkpoint": None if checkpoint is None else str(checkpoint), "time": time.time()})

    def batch_ready(self, step: int) -> bool:
        return self.paths.ready(step).exists()

    def checked_batch(self, step: int) -> tuple[Path, dict[str, Any]]:
        """Step's batch file, its size and header checked (each rank then reads its own share of it), and the
        batch.ready marker's fields; MailboxError / BatchFormatError when it cannot be read."""
        meta = _read_json(self.paths.ready(step)) or {}
        path = self.paths.batch(step)
        size = path.stat().st_size
        if "bytes" in meta and meta["bytes"] != size:
            raise MailboxError(f"step {step}: batch.ready says {meta['bytes']} bytes, {path.name} has {size}")
        check_batch(path)
        return path, meta

    def read_batch(self, step: int) -> tuple[TrainBatch, dict[str, Any]]:
        """Step's batch, whole, and the batch.ready marker's fields (tests, inspection)."""
        path, meta = self.checked_batch(step)
        return TrainBatch.load(path), meta

    def write_done(self, step: int, weights_dir: Path | None, metrics: dict[str, float], *,
                   pushed: bool = False) -> None:
        self.paths.step_dir(step).mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.paths.done(step), {"step": step, "weights_dir": None if weights_dir is None
                                                  else str(weights_dir), "pushed": pushed,
                                                  "metrics": metrics, "time": time.time()})

    def request_sync(self, step: int, method: str) -> None:
        """Ask the orchestrator to pause the servers for this step's push."""
        self.paths.step_dir(step).mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.paths.sync_request(step), {"step": step, "method": method, "time": time.time()})

    def wait_sync_go(self, step: int, timeout_s: float, poll_s: float = 0.05) -> dict[str, Any]:
        """The orchestrator's sync.go for `step` ({"urls": [...], "interrupt": mode}); MailboxTimeout after
        timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            go = _read_json(self.paths.sync_go(step))
            if go is not None:
                return go
            if time.monotonic() > deadline:
                raise MailboxTimeout(f"step {step}: the orchestrator did not pause the servers within {timeout_s}s")
            time.sleep(poll_s)

    def write_failed(self, step: int, exc: BaseException) -> None:
        self.paths.step_dir(step).mkdir(parents=True, exist_ok=True)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        atomic_write_json(self.paths.failed(step), {"step": step, "error": f"{type(exc).__name__}: {exc}",
                                                    "traceback": tb, "time": time.time()})

    def forget_after(self, step: int) -> None:
        """Forget results of steps > step (after resuming from a checkpoint of `step`); their batches stay."""
        for d in self.paths.mailbox.glob("step-*"):
            try:
                s = int(d.name.split("-", 1)[1])
            except ValueError:
                continue
            if s > step:
                for name in ("update.done", "update.failed", "sync.request", "sync.go"):
                    (d / name).unlink(missing_ok=True)

    # the LearnerInbox protocol ----------------------------------------------------------------
    def start(self) -> None:
        self.start_heartbeat()

    def submitted_through(self, step: int) -> int:
        k = step - 1
        while self.batch_ready(k + 1):
            k += 1
        return k

    def report(self, **fields: Any) -> None:
        self.update_info(**fields)

    def poll(self, step: int) -> tuple[Any, ...] | None:
        if self.batch_ready(step):
            try:
                path, meta = self.checked_batch(step)
            except Exception as e:  # noqa: BLE001 - unreadable batch: every rank stops, the orchestrator is told
                self.write_failed(step, e)
                return ("bad_batch", f"{type(e).__name__}: {e}")
            return ("batch", str(path), meta)
        stop = self.stop_request()
        return None if stop is None else ("stop", bool(stop.get("final")))

    def done(self, step: int, weights_dir: str | None, metrics: dict[str, float], *, pushed: bool) -> None:
        self.write_done(step, None if weights_dir is None else Path(weights_dir), metrics, pushed=pushed)

    def failed(self, step: int, exc: BaseException) -> None:
        self.write_failed(step, exc)

    def ask_push(self, step: int, method: str, timeout_s: float) -> PushOrder:
        self.request_sync(step, method)
        return PushOrder.from_json(self.wait_sync_go(step, timeout_s))

    def final(self, step: int, weights_dir: str | None, checkpoint: str | None) -> None:
        self.write_final(step, None if weights_dir is None else Path(weights_dir),
                         None if checkpoint is None else Path(checkpoint))


def read_batch(run_dir: str | Path, step: int) -> TrainBatch:
    """The batch submitted for `step` in run_dir's mailbox, whole."""
    return TrainBatch.load(MailboxPaths(Path(run_dir)).batch(step))


__all__ = [
    "LearnerDiedError",
    "LearnerFailedError",
    "LearnerMailbox",
    "MailboxClient",
    "MailboxError",
    "MailboxPaths",
    "MailboxTimeout",
    "SyncRequest",
    "UpdateResult",
    "read_batch",
]
