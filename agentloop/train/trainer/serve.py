"""The learner loop: rank 0 polls the learner handle's inbox and broadcasts what it heard; every rank trains the
step's batch, checkpoints when due and publishes the weights through the weight transport's learner half; the
end of a run saves what the last step lacks.

Map:
    serve            the loop (the inbox is the file mailbox, or the Ray learner's: agentloop.cluster); an exit code.
                     Rank 0 broadcasts where the step's batch is (its file, or its bytes), each rank reads its own
                     share (agentloop.train.batch.format.RankBatch)
    plan_final_save  what the end of a run still writes (pure); save_final writes it, for every sync path
    EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT   serve's exit codes (the learner process's)

Who calls whom: serve -> Learner (agentloop.train.trainer.learner) and the inbox (agentloop.train.handle) and the
learner half of the weight transport (agentloop.train.weights: save or push); the Learner never touches the inbox.

Rank 0's log goes through the `agentloop.train.trainer` logger (installed by agentloop.train.trainer.main): one
line when the model is loaded, when it is ready (fresh or resumed), per step (loss, grad norm, KL, entropy,
tokens/s, time, where the weights went) before the step's update.done appears, per checkpoint, and when it stops,
times out or fails.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.train.batch.format import RankBatch
from agentloop.train.config import AlgoConfig, LearnerConfig
from agentloop.train.trainer.distributed import broadcast
from agentloop.train.trainer.learner import Learner

logger = logging.getLogger("agentloop.train.trainer")

EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 2
MERGED_DIR = "merged"
"""LoRA runs: the final weights/step-N (the adapter) holds the merged HF model in this subdirectory."""


def serve(
    run_dir: str | Path,
    model_path: str | Path,
    algo: AlgoConfig,
    cfg: LearnerConfig,
    *,
    resume: bool = True,
    heartbeat_s: float = 5.0,
    max_len: int | None = None,
    inbox: Any = None,
) -> int:
    """Train the steps the inbox hands over until a stop; returns an exit code (EXIT_OK / EXIT_FAILED /
    EXIT_TIMEOUT).

    `run_dir` holds the learner's files (weights/, checkpoints/, learner_config.json). `inbox`: how rank 0 hears
    from the orchestrator (handle.LearnerInbox; called on rank 0 only, with the time this learner started): by
    default the file mailbox in run_dir (agentloop.train.handle.mailbox.LearnerMailbox). Rank 0 polls it and broadcasts
    one message per poll ("wait", "batch", "stop", "timeout") so the other ranks never sit in a collective
    longer than `poll_s`.
    """
    import torch.distributed as dist

    from agentloop.train.handle.mailbox import LearnerMailbox, MailboxPaths
    from agentloop.train.handle.protocol import LearnerError
    from agentloop.train.trainer.checkpoint import latest_checkpoint
    from agentloop.train.weights.sync import sync_from_config

    started = time.time()
    paths = MailboxPaths(Path(run_dir))
    learner = Learner(model_path, algo, cfg, max_len=max_len)
    rank = learner.rank
    if rank == 0:
        logger.info("model %s loaded in %.1fs: %d rank(s) on %s, %s, run dir %s", model_path, time.time() - started,
                    learner.world, learner.device_type, str(learner.compute_dtype).replace("torch.", ""), run_dir)
    dev = learner.device if learner.device_type == "cuda" else None
    box = None
    if rank == 0:
        box = inbox(started) if callable(inbox) else LearnerMailbox(run_dir, heartbeat_s=heartbeat_s, started=started)
    syncer = None
    code = EXIT_OK
    try:
        syncer = sync_from_config(cfg)  # the learner half of the weight transport (agentloop.train.weights.servers)
        syncer.check(learner)
        if box is not None:
            box.start()
            paths.weights_root.mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "learner_config.json").write_text(json.dumps(
                {"algo": algo.model_dump(), "learner": cfg.model_dump(), "model": str(model_path),
                 "world_size": learner.world}, indent=1))
        for note in learner.notes:
            if rank == 0:
                print(f"agentloop learner: {note}", file=sys.stderr, flush=True)
        ck = latest_checkpoint(paths.checkpoints) if (resume and rank == 0) else None
        ck = broadcast(str(ck) if ck else None, dev)
        data_position = None
        resumed_step = None
        if ck is not None:
            meta = learner.load_checkpoint(ck)
            data_position, resumed_step = meta.data_position, meta.step
            if not broadcast(paths.weights(meta.step).is_dir() if rank == 0 else None, dev):
                # The orchestrator reloads its servers from weights/step-C after a resume. Pushing paths write
                # no HF weights while training, and weights pruned by an older learner are gone: any sync
                # path, they are written now, once, from the checkpoint just loaded.
                learner.save_served(paths.weights(meta.step))
                if rank == 0:
                    logger.info("weights of checkpoint step %d were missing: written to %s", meta.step,
                                paths.weights(meta.step))
        next_step = learner.step + 1
        ckpt_step = resumed_step  # the newest checkpoint asked for (it may still be written in the background)
        probe = learner.probe() if ck is None else None  # collective: every rank runs the forward
        if box is not None:
            box.forget_after(learner.step)
            _clear_weights_after(paths, learner.step)
        # Batches submitted before the run stopped (steps next_step..replay_through) are trained again first, while
        # the orchestrator waits for that (wait_caught_up) with no step loop running: none is pushed, the last one's
        # weights are written for the servers to load (WeightSync.publish_replayed).
        replay_through = broadcast(box.submitted_through(next_step) if box is not None else None, dev)
        if box is not None and replay_through >= next_step:
            logger.info("steps %d-%d were submitted before the stop: trained again first, their weights pushed to no "
                        "server (the servers load weights/step-%d once this learner has caught up)", next_step,
                        replay_through, replay_through)
        if box is not None:
            box.report(status="ready", next_step=next_step, resumed_step=resumed_step,
                       data_position=data_position, world_size=learner.world, layout=learner.layout().to_json(),
                       probe=probe)
            logger.info("ready for step %d (%s)", next_step,
                        f"resumed from checkpoint {ck}" if ck is not None else "fresh start")
        waited_since = time.monotonic()
        ckpt_written: float | None = None  # seconds the last background checkpoint took, until reported
        while True:
            msg: Any = None
            if box is not None:
                msg = box.poll(next_step)
                if msg is None:
                    msg = ("timeout",) if time.monotonic() - waited_since > cfg.batch_timeout_s else ("wait",)
            msg = broadcast(msg, dev)
            if msg[0] == "wait":
                # a background checkpoint goes into place as soon as its files are written, also while the
                # learner waits for a batch (a run killed during long rollouts keeps it)
                written = learner.checkpoint_written_s()
                if written is not None:
                    ckpt_written = written
                time.sleep(cfg.poll_s)
                continue
            if msg[0] == "stop":
                if rank == 0:
                    logger.info("STOP received before step %d: %s", next_step,
                                "saving the final model" if msg[1] else "exiting")
                if msg[1]:  # the run ended normally: the last step reaches disk, whatever the sync path
                    weights_dir, ck_dir = save_final(learner, paths, data_position, dev)
                    if box is not None:
                        box.final(learner.step, None if weights_dir is None else str(weights_dir),
                                  None if ck_dir is None else str(ck_dir))
                        logger.info("final model of step %d: HF weights %s, checkpoint %s", learner.step,
                                    weights_dir, ck_dir)
                break
            if msg[0] == "bad_batch":
                raise LearnerError(f"step {next_step}: unreadable batch: {msg[1]}")
            if msg[0] == "timeout":
                if box is not None:
                    box.report(status="failed", error=f"no batch for step {next_step} in {cfg.batch_timeout_s}s")
                    logger.error("no batch for step %d within learner.batch_timeout_s=%gs: exiting with code %d",
                                 next_step, cfg.batch_timeout_s, EXIT_TIMEOUT)
                code = EXIT_TIMEOUT
                break
            _, source, meta = msg
            step = next_step
            try:
                t_read = time.perf_counter()
                batch = RankBatch.read(source, rank)  # this rank's rows only (the file's, or the bytes handed over)
                read_s = time.perf_counter() - t_read
                if batch.step != step:
                    raise ValueError(f"the batch handed over for step {step} is step {batch.step}'s")
                if box is not None:
                    box.report(status="training", step=step)
                    logger.info("step %d: training on %d episodes", step, batch.num_episodes)
                t_step = time.perf_counter()
                metrics = learner.train_batch(batch)
                metrics["time/batch_read_s"] = read_s
                # checkpoint_every None (null) = never
                ckpt_due = cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0
                data_position = meta.get("data_position")
                written = learner.checkpoint_written_s()
                if written is not None or ckpt_written is not None:
                    metrics["time/checkpoint_written_s"] = written if written is not None else ckpt_written
                    ckpt_written = None
                if ckpt_due:
                    t = time.perf_counter()  # the part of the save the step waits for
                    background = cfg.checkpoint_background == "on" or (cfg.checkpoint_background == "auto"
                                                                        and learner.device_type == "cuda")
                    ck_dir = learner.save_checkpoint(paths.checkpoints, data_position=data_position,
                                                     background=background)
                    ckpt_step = step
                    metrics["time/checkpoint_s"] = time.perf_counter() - t
                    if rank == 0:
                        logger.info("step %d: checkpoint saved to %s", step, ck_dir)
                # disk saves weights/step-N (the servers load it); tensor|nccl push after the orchestrator paused
                # the servers (it answers the request with where to push, in which interrupt mode)
                if step <= replay_through:
                    pub = syncer.publish_replayed(learner, step, paths.weights(step), last=step == replay_through)
                else:
                    pub = syncer.publish(learner, step, paths.weights(step), ask=lambda s, method: _ask_push(
                        box, s, method, dev, cfg.weight_sync_timeout_s))
                metrics.update(pub.metrics)
                if box is not None:
                    logger.info("step %d done: %s", step, _step_summary(
                        metrics, time.perf_counter() - t_step, "pushed to the servers" if pub.pushed
                        else f"weights in {pub.weights_dir}" if pub.weights_dir is not None
                        else "replayed, weights not published"))
                    box.done(step, None if pub.weights_dir is None else str(pub.weights_dir), metrics,
                             pushed=pub.pushed)
                    _prune_weights(paths, cfg.keep_weights, protect=_checkpoint_steps(paths, ckpt_step))
                    # next_step and data_position together say where the run stands (wait_caught_up)
                    box.report(status="ready", next_step=step + 1, last_step=step, data_position=data_position)
            except Exception as e:
                if box is not None:
                    box.failed(step, e)
                    box.report(status="failed", error=f"{type(e).__name__}: {e}")
                raise
            next_step = step + 1
            waited_since = time.monotonic()
        return code
    except Exception:
        code = EXIT_FAILED
        raise
    finally:
        if syncer is not None and rank == 0:
            syncer.close()
        if box is not None:
            box.close(status="stopped" if code == EXIT_OK else "failed")
        learner.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _clear_weights_after(paths: Any, step: int) -> None:
    """Weights of steps > step go (the learner resumed from a checkpoint of `step`: they are redone)."""
    for d in paths.weights_root.glob("step-*"):
        try:
            s = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        if s > step:
            shutil.rmtree(d, ignore_errors=True)


def _prune_weights(paths: Any, keep: int | None, *, protect: Any = ()) -> None:
    """Delete all but the newest `keep` weights/step-N directories, never those of the steps in `protect`
    (the newest checkpoint's: a resume loads them into the servers)."""
    if keep is None:
        return
    dirs = sorted((d for d in paths.weights_root.glob("step-*") if d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
    keep_steps = set(protect)
    for d in dirs[:-keep]:
        if int(d.name[5:]) not in keep_steps:
            shutil.rmtree(d, ignore_errors=True)


def _checkpoint_steps(paths: Any, requested: int | None) -> set[int]:
    """Steps whose weights/step-N a resume may need: the newest complete checkpoint's and the newest one
    asked for (still being written in the background, or complete)."""
    from agentloop.train.trainer.checkpoint import latest_checkpoint, read_meta

    ck = latest_checkpoint(paths.checkpoints)
    return {s for s in (read_meta(ck).step if ck is not None else None, requested) if s is not None}


@dataclass(frozen=True)
class FinalPlan:
    """What the end of a run still has to write (`plan_final_save`)."""

    save_weights: bool
    """Write weights/step-N (HF) of the last trained step N."""
    save_checkpoint: bool
    """Write a resumable checkpoint of step N."""


def plan_final_save(step: int, weights_on_disk: bool, checkpoint_step: int | None) -> FinalPlan:
    """At the end of a run the last trained step `step` must be on disk twice: as an HF directory
    (weights/step-N: disk sync wrote it at the step, tensor|nccl never do while training) and as a
    resumable checkpoint (unless the newest complete one, `checkpoint_step`, is of that step). Nothing
    trained (step 0, a learner that never got a batch): nothing to write."""
    if step <= 0:
        return FinalPlan(save_weights=False, save_checkpoint=False)
    return FinalPlan(save_weights=not weights_on_disk, save_checkpoint=checkpoint_step != step)


def save_final(learner: Learner, paths: Any, data_position: Any, dev: Any) -> tuple[Path | None, Path | None]:
    """Collective, the same for every sync path: after a final STOP, write what `plan_final_save` says the
    last step lacks; returns (its HF directory, its checkpoint), (None, None) if nothing was trained.
    `data_position` is the one stored with the last step's batch, as a periodic checkpoint would store it."""
    from agentloop.train.trainer.checkpoint import latest_checkpoint, read_meta

    if learner.step <= 0:
        return None, None
    learner.wait_checkpoint()  # a background checkpoint of the last step counts once it is in place
    facts = None
    if learner.rank == 0:
        ck = latest_checkpoint(paths.checkpoints)
        facts = (paths.weights(learner.step).is_dir(), read_meta(ck).step if ck is not None else None,
                 None if ck is None else str(ck))
    weights_on_disk, ck_step, ck_path = broadcast(facts, dev)
    plan = plan_final_save(learner.step, weights_on_disk, ck_step)
    weights_dir = paths.weights(learner.step)
    if plan.save_weights:
        learner.save_served(weights_dir)
    if learner.lora is not None:  # the export of a LoRA run: the adapter (weights_dir) and the merged model
        learner.save_hf(weights_dir / MERGED_DIR)
    if plan.save_checkpoint:
        return weights_dir, learner.save_checkpoint(paths.checkpoints, data_position=data_position, background=False)
    return weights_dir, Path(ck_path)


def _step_summary(metrics: dict[str, float], seconds: float, weights: str) -> str:
    keys = (("actor/loss", "loss"), ("actor/grad_norm", "grad_norm"), ("actor/kl_ref", "kl"),
            ("actor/entropy", "entropy"), ("perf/tokens_per_s", "tok/s"))
    parts = [f"{label} {metrics[k]:.4g}" for k, label in keys if isinstance(metrics.get(k), (int, float))]
    return ", ".join(parts + [f"{seconds:.1f}s", weights])


def _ask_push(box: Any, step: int, method: str, dev: Any, timeout_s: float) -> Any:
    """Collective (weight_sync tensor|nccl): rank 0 asks the orchestrator to pause the servers and waits for its
    answer (a PushOrder: where to push, in which interrupt mode); every rank learns the outcome, so no rank
    waits in a gather for a push that will not come."""
    from agentloop.train.handle.protocol import LearnerError

    out: Any = None
    if box is not None:
        try:
            out = ("go", box.ask_push(step, method, timeout_s))
        except (LearnerError, ValueError) as e:
            out = ("fail", str(e))
    out = broadcast(out, dev)
    if out[0] != "go":
        raise LearnerError(out[1])
    return out[1]


__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_TIMEOUT", "FinalPlan", "plan_final_save", "save_final", "serve",
           "MERGED_DIR"]
