"""`agentloop train`: rollouts -> learner update -> weight push, step after step.

Map:
    train_async        the whole run on one event loop: servers, learner process, the step loop
    rollout_metrics    a step's records -> train/... or val/... numbers
    recover_step_rows  on resume: metrics.jsonl rows of redone steps dropped, a finished step's row restored
Parts elsewhere: LearnerProcess (learner_process.py), DataCursor (cursor.py), the mailbox
(mailbox.py), StepLog and the progress line (agentloop.report).

Synchronous on-policy schedule: every episode of step N is sampled with the weights of step
N-1; the servers get the new weights (pause -> /update_weights_from_disk -> flush -> resume)
before step N+1's rollouts start, and each record's `weight_versions` says so. With
`learner.weight_sync` tensor|nccl the learner pushes them itself: `_learner_update` pauses the
servers when the learner asks (mailbox sync.request) and resumes them once it is done.

Resume: the learner resumes from its last checkpoint and reports `next_step` and the data
position stored with it; the servers load that step's weights before rolling out again. After a
kill: a step whose batch was already submitted keeps its rollouts (the learner trains that very
batch), the partial rollouts file of the step in flight is replaced, and metrics.jsonl keeps one
line per step (`recover_step_rows`). The learner gets SIGTERM when this process dies, even by
SIGKILL, so it never outlives the run to race a resumed one.
Ctrl-C: the learner gets STOP (then SIGTERM/SIGKILL after a deadline), servers are stopped by
`serving`, and the last checkpoint stays usable.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from agentloop.config import Config, DataConfig, dump_config, validate_for_training
from agentloop.data import load_samples
from agentloop.errors import AgentLoopError
from agentloop.inference.serving import serving
from agentloop.loops import get_agent_loop
from agentloop.models.loading import load_tokenizer_for
from agentloop.records import EpisodeRecord, Sample, read_records
from agentloop.report.progress import emit, fmt_fields, progress_line
from agentloop.report.steplog import ENTROPY_KEY, KL_KEY, StepLog
from agentloop.rollout.engine import RolloutEngine, RolloutResult
from agentloop.rollout.scorer import Scorer
from agentloop.train.cursor import DataCursor
from agentloop.train.learner_process import LearnerProcess
from agentloop.util.rundir import RecordWriter, make_run_dir, write_json
from agentloop.util.runtime import run_async


class TrainingError(AgentLoopError):
    """The training run cannot go on (learner died, servers gone, ...)."""


# ---------------------------------------------------------------------------- data order


def _data(path: str | None, builtin: str, max_samples: int | None = None) -> list[Sample]:
    return load_samples(DataConfig(path=path, builtin=builtin, max_samples=max_samples))


# ---------------------------------------------------------------------------- metrics


def rollout_metrics(records: list[EpisodeRecord], prefix: str) -> dict[str, float]:
    ok = [r for r in records if r.error is None and r.reward is not None]
    n = max(1, len(ok))
    m: dict[str, float] = {
        f"{prefix}/reward": sum(r.reward for r in ok) / n if ok else 0.0,
        f"{prefix}/accuracy": sum(r.reward >= 1.0 - 1e-9 for r in ok) / n if ok else 0.0,
        f"{prefix}/errors": float(sum(r.error is not None for r in records)),
        f"{prefix}/episodes": float(len(records)),
        f"{prefix}/response_tokens": sum(len(r.response_ids) for r in records) / max(1, len(records)),
        f"{prefix}/model_tokens": sum(r.num_model_tokens for r in records) / max(1, len(records)),
        f"{prefix}/turns": sum(r.num_turns for r in records) / max(1, len(records)),
    }
    if any("tool_calls" in r.metrics for r in records):
        m[f"{prefix}/tool_call_rate"] = sum(r.metrics.get("tool_calls", 0) > 0 for r in records) / max(1, len(records))
        m[f"{prefix}/tool_calls"] = sum(r.metrics.get("tool_calls", 0) for r in records) / max(1, len(records))
    return m


def recover_step_rows(log: StepLog, first: int, paths: Any, run_dir: Path) -> None:
    """A (resumed) run goes on at step `first`: drop the lines of steps >= first (they are redone,
    e.g. after the last checkpoint), and log a step < first that the learner finished but that
    has no line (killed between its update and its line) from its rollouts and update.done."""
    log.truncate_from(first)
    last = first - 1
    done, recs = paths.done(last), run_dir / "rollouts" / f"step-{last:06d}.jsonl"
    if last >= 1 and not any(r.get("step") == last for r in log.rows) and done.is_file() and recs.is_file():
        metrics = json.loads(done.read_text()).get("metrics", {})
        row: dict[str, Any] = {"step": float(last), **rollout_metrics(list(read_records(recs)), "train")}
        row.update({f"learner/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        log.log(row)


_PROGRESS_LABELS = {
    "train/reward": "reward", "train/accuracy": "accuracy", "train/tool_call_rate": "tool calls",
    KL_KEY: "kl", ENTROPY_KEY: "entropy", "train/response_tokens": "resp len",
    "val/reward": "val reward", "val/accuracy": "val accuracy", "val/tool_call_rate": "val tool calls",
}
"""Progress-line fields: metrics key -> label (keys missing from a row are left out)."""


# ---------------------------------------------------------------------------- the run


def resolve_train_model(cfg: Config) -> Path:
    if cfg.model.path:
        from agentloop.models.loading import resolve_model

        return resolve_model(cfg)
    if cfg.train.warm_start:
        from agentloop.models.warmstart import ensure_warm_model

        print("agentloop train: building (once, cached) the warm-started tiny model ...", file=sys.stderr, flush=True)
        return ensure_warm_model()
    from agentloop.models.modelzoo import ensure_tiny_model

    return ensure_tiny_model()


async def _push_weights(sm: Any, cfg: Config, weights_dir: Path, version: str) -> float:
    t0 = time.monotonic()
    await sm.pause(mode=cfg.train.pause_mode)
    try:
        # update_weights_from_disk flushes the prefix cache itself (cached KV of old weights is stale).
        await sm.update_weights_from_disk(str(weights_dir), weight_version=version)
    finally:
        await sm.resume()
    return time.monotonic() - t0


async def _learner_update(sm: Any, cfg: Config, client: Any, step: int) -> tuple[Any, float, float]:
    """Wait for the learner's step and get its weights into the servers: (UpdateResult, learner s, sync s).

    disk: the learner saved weights/step-N and we load it. tensor|nccl: the learner asks for paused
    servers, pushes itself, and we resume the servers whatever happens.
    """
    from agentloop.train.mailbox import UpdateResult

    t0 = time.monotonic()
    ev = await asyncio.to_thread(client.wait_update_or_sync, step, cfg.train.update_timeout_s)
    t_learn = time.monotonic() - t0
    if isinstance(ev, UpdateResult):
        return ev, t_learn, await _push_weights(sm, cfg, ev.weights_dir, str(step))
    t1 = time.monotonic()
    await sm.pause(mode=cfg.train.pause_mode)
    try:
        client.allow_sync(step, list(sm.urls))
        upd = await asyncio.to_thread(client.wait_update, step, cfg.train.update_timeout_s)
    finally:
        await sm.resume()
    return upd, t_learn, time.monotonic() - t1


async def train_async(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from agentloop.train.mailbox import MailboxClient, MailboxError

    loop_cls = get_agent_loop(cfg.rollout.loop)
    train_samples = _data(cfg.train.data_path, cfg.train.builtin)
    val_samples = _data(cfg.train.val_path, cfg.train.val_builtin, cfg.train.val_max_samples) \
        if cfg.train.val_every else []
    scorer = Scorer(cfg)
    model_path = resolve_train_model(cfg)
    tokenizer = load_tokenizer_for(cfg, model_path)
    log = StepLog(cfg, run_dir)
    learner = LearnerProcess(cfg, run_dir, model_path)
    t_start = time.time()
    proc = learner.start()
    client = MailboxClient(run_dir, process=proc)
    final: dict[str, Any] = {"run_dir": str(run_dir), "model": str(model_path)}
    print(f"agentloop train: {cfg.train.steps} steps x {cfg.train.prompts_per_step} prompts x "
          f"{cfg.rollout.n_samples} samples, loop {cfg.rollout.loop}, model {model_path}\n"
          f"  run dir {run_dir} (learner log: {learner.log_path})", file=sys.stderr, flush=True)
    try:
        async with serving(cfg, model_path, run_dir) as sm:
            try:
                info = await asyncio.to_thread(client.wait_ready, cfg.train.learner_ready_timeout_s, since=t_start - 1)
            except AgentLoopError as e:
                raise TrainingError(f"learner did not start: {e}\n--- learner.log tail ---\n{learner.log_tail()}") from e
            first = int(info.get("next_step") or 1)
            cursor = DataCursor(train_samples, cfg.rollout.seed, int(info.get("data_position") or 0))
            recover_step_rows(log, first, client.paths, run_dir)
            if first > 1:
                prev = client.paths.weights(first - 1)
                if prev.is_dir():
                    await _push_weights(sm, cfg, prev, str(first - 1))
                print(f"agentloop train: resumed at step {first} (data position {cursor.position})",
                      file=sys.stderr, flush=True)
            engine = RolloutEngine(cfg, sm, tokenizer, loop_cls, scorer=scorer, progress=False)
            if first == 1 and val_samples:
                row = {"step": 0.0, **await _validate(engine, val_samples, 0, run_dir)}
                log.log(row)
                emit(progress_line(0, cfg.train.steps, "steps", fmt_fields(
                    row, _PROGRESS_LABELS, ["val/reward", "val/accuracy", "val/tool_call_rate"])))
            for step in range(first, cfg.train.steps + 1):
                t0 = time.monotonic()
                batch = cursor.take(cfg.train.prompts_per_step)
                rollouts = run_dir / "rollouts"
                rollouts.mkdir(exist_ok=True)
                path = rollouts / f"step-{step:06d}.jsonl"
                if client.paths.ready(step).exists() and path.is_file():
                    # Submitted before a kill: the learner trains that batch (submit is a no-op), so keep
                    # the complete rollouts it was made from rather than sampling the step again.
                    res = RolloutResult(records=list(read_records(path)))
                else:
                    path.unlink(missing_ok=True)  # partial rollouts of the step in flight at a kill
                    with RecordWriter(path) as writer:
                        res = await engine.run(batch, step=step, on_record=writer)
                if res.stopped:
                    raise TrainingError(f"rollouts of step {step} stopped: {res.stopped}")
                t_roll = time.monotonic() - t0
                usable = [r for r in res.records if r.error is None]
                if not usable:
                    raise TrainingError(f"step {step}: every episode failed; first error: {res.records[0].error}")
                client.submit(step, usable, data_position=cursor.position)
                try:
                    upd, t_learn, t_sync = await _learner_update(sm, cfg, client, step)
                except MailboxError as e:
                    raise TrainingError(f"learner failed at step {step}: {e}\n--- learner.log tail ---\n"
                                        f"{learner.log_tail()}") from e
                row: dict[str, Any] = {"step": float(step), **rollout_metrics(res.records, "train")}
                row.update({f"learner/{k}": float(v) for k, v in upd.metrics.items() if isinstance(v, (int, float))})
                # reward_s is summed over episodes and overlaps rollout_s (episodes are scored as they end)
                row.update({"time/rollout_s": t_roll, "time/learner_s": t_learn, "time/sync_s": t_sync,
                            "time/reward_s": sum(r.metrics.get("reward_time_s", 0.0) for r in res.records),
                            "time/step_s": time.monotonic() - t0,
                            "rollout/tokens_per_s": res.summary.get("tokens_per_s", 0.0)})
                if cfg.train.val_every and val_samples and (step % cfg.train.val_every == 0
                                                            or step == cfg.train.steps):
                    row.update(await _validate(engine, val_samples, step, run_dir))
                log.log(row)
                log.curves()
                emit(progress_line(step, cfg.train.steps, "steps", fmt_fields(
                    row, _PROGRESS_LABELS, ["train/reward", "train/accuracy", "train/tool_call_rate", KL_KEY,
                                            ENTROPY_KEY, "train/response_tokens", "val/reward", "val/accuracy"])
                    + [f"rollout {t_roll:.0f}s learner {t_learn:.0f}s sync {t_sync:.1f}s"]))
                final["last_weights"] = "pushed" if upd.pushed else str(upd.weights_dir)
            client.stop()
    finally:
        if proc.poll() is None:
            client.stop()
        rc = learner.stop()
        log.close()
        final["learner_exit"] = rc
    final["curves"] = str(log.curves())
    ckpts = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
    final["checkpoint"] = str(ckpts[-1]) if ckpts else None
    final["metrics"] = log.rows[-1] if log.rows else {}
    write_json(run_dir / "train_summary.json", final)
    return final


async def _validate(engine: RolloutEngine, samples: list[Sample], step: int, run_dir: Path) -> dict[str, float]:
    vdir = run_dir / "validation"
    vdir.mkdir(exist_ok=True)
    with RecordWriter(vdir / f"step-{step:06d}.jsonl") as writer:
        res = await engine.run(samples, n_samples=1, step=step, on_record=writer)
    return rollout_metrics(res.records, "val")


def run_train(cfg: Config) -> tuple[Path, dict[str, Any]]:
    from agentloop.rollout.run import load_plugins

    validate_for_training(cfg)
    load_plugins(cfg)
    if cfg.learner.checkpoint_every is None:
        cfg.learner.checkpoint_every = max(1, min(10, cfg.train.steps // 4 or 1))
    if cfg.learner.total_steps is None:
        cfg.learner.total_steps = cfg.train.steps
    run_dir = make_run_dir(cfg)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir, run_async(train_async(cfg, run_dir))
