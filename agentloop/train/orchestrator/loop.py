"""`agentloop train`: rollouts -> learner update -> weight push, on one event loop.

Map:
    train_async        the run (a coroutine): data, model, learner process, servers, then one of the schedules
    Trainer            what both schedules share: submit a batch, wait for the learner, push its weights
                       (pause in `train.interrupt` mode -> update -> resume), check versions, log a step
    Trainer.run_sync_schedule   the synchronous schedule: roll out a step's prompts, train, push, repeat
    Trainer.run_async_schedule  the asynchronous schedule (train.schedule=async): a producer keeps groups in
                       flight under the admission rule, the learner trains as soon as B eligible groups are
                       ready, too-stale groups are cancelled early and their prompts given out again
    rollout_metrics    a step's records -> train/... or val/... numbers
    version_check      per-token and per-turn weight versions against the window the schedule allows
    recover_step_rows  on resume: metrics.jsonl rows of redone steps dropped, a finished step's row restored
    finish_learner     the normal end: a final STOP, then wait (deadline) for the learner's final weights and checkpoint
Parts elsewhere: the schedule's rules (schedule: Staleness, Admission, GroupBuffer, and AsyncSchedule, the
object `run_async_schedule` drives), the episode journal (journaling, agentloop.journal), LearnerProcess
(learner_process), DataCursor (cursor), the step's batch (agentloop.train.batch), the learner handle
(agentloop.train.handle), StepLog and the progress line (agentloop.report), the group stream
(agentloop.rollout.stream.GroupStreamProtocol), the model checks before anything starts
(agentloop.train.model_support) and of what the servers serve before step 1 (served_model).

Versions: v = the weights after v learner updates (initial: 0). Step s trains version s-1 into s;
with `train.max_staleness` η every trained token was sampled by a version in [s-1-η, s-1]
(η = 0: exactly s-1, the synchronous schedule). The async schedule with η = 0 gives the same prompts,
seeds, batches and so the same records and weights as the synchronous one.

Accounting (async): every admitted group ends exactly once as trained (its usable records in a
batch), cancelled (too stale, or in flight when the run ends; counted, the prompt given out again
unless the run is ending), and every episode of a trained group as a trained record, an error
record or an aborted record (both counted, neither trained).

Resume: the learner resumes from its last checkpoint (step C) and trains the batches submitted before
the stop (steps C+1..k, as they are); the run goes on at step k+1 (`wait_caught_up`) with the data
state stored with batch k (C's when k = C): the next new position and the positions handed out but
not trained, which are given out again first, so every position is trained exactly once, and the
fingerprint of the rows they index (other rows are an error unless forced). With the episode journal
(journal.enabled, the default) those prompts are not rolled out again from scratch: each journaled group goes
on where it stood (its finished episodes as they were, the others from their last journaled token), unless
its oldest token is now too stale (dropped, counted; the prompt given out again). The config of a resumed run
is its saved config.yaml plus the values given now (agentloop.train.orchestrator.resume, applied by the CLI).
The servers load weights/step-k before rolling out (the newest; weights/step-C are kept from pruning and written
from the checkpoint when missing; missing weights are an error). Admission counts from version k, so
the run keeps the groups in flight a fresh run keeps (η = 0: the synchronous schedule). A step whose
batch was already submitted keeps its rollouts (the batch the learner trained), the partial rollouts
file of a step in flight is replaced, and metrics.jsonl keeps one line per step. The learner gets SIGTERM
when this process dies, even by SIGKILL, so it never outlives the run to race a resumed one.
Ctrl-C: the learner gets STOP (then SIGTERM/SIGKILL after a deadline), servers are stopped by
`serving`, and the last checkpoint stays usable.

End of a run (`finish_learner`): the learner gets a final STOP and saves the last step's HF weights
(weights/step-N; tensor|nccl write them only now) and a checkpoint of it (unless that step has one),
then exits; the run waits for that (`train.update_timeout_s`) before it is done, and the summary
names both directories.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from agentloop.config import Config, lent_server_indices, validate_for_training
from agentloop.data import TrainData, load_train_data
from agentloop.errors import AgentLoopError, failure_kind
from agentloop.inference.serving import serving
from agentloop.interrupt import interrupt_policy
from agentloop.loops import get_agent_loop
from agentloop.models.loading import load_tokenizer_for
from agentloop.records import EpisodeRecord, Sample, read_records
from agentloop.report.progress import emit, fmt_fields, progress_line
from agentloop.report.steplog import ENTROPY_KEY, KL_KEY, StepLog
from agentloop.rollout.engine import GroupOutcome, RolloutEngine
from agentloop.rollout.looplag import LoopLagMonitor
from agentloop.rollout.scorer import Scorer
from agentloop.rollout.stream import GroupStreamProtocol
from agentloop.server_manager import ServerManager, parse_version
from agentloop.tools.sandbox import require_isolation
from agentloop.train.batch.format import BatchLayout
from agentloop.train.batch.prepare import prepare_batch
from agentloop.train.handle.protocol import LearnerError, LearnerHandle, UpdateResult
from agentloop.train.model_support import require_model_support
from agentloop.train.orchestrator.backend import Backend, LocalBackend
from agentloop.train.orchestrator.cursor import DataCursor
from agentloop.train.orchestrator.journaling import JournalRows, journal_dir, open_run_journal, step_uids
from agentloop.train.orchestrator.lending import Lender
from agentloop.train.orchestrator.schedule import AsyncSchedule, Command, Retry, Staleness
from agentloop.train.orchestrator.served_model import align_served_weights, check_served_model
from agentloop.train.planning.preflight import Preflight, run_preflight, say_lines
from agentloop.train.planning.render import plan_summary, served_kv_tokens
from agentloop.train.probe import check_served_logprobs
from agentloop.train.weights.lora_servers import LoraHalf
from agentloop.train.weights.servers import ServerHalf, Stage, same_path, server_half
from agentloop.util.rundir import RecordWriter, make_run_dir, write_json
from agentloop.util.runtime import run_async


class TrainingError(AgentLoopError):
    """The training run cannot go on (learner died, servers gone, ...)."""


INFRA_RETRIES = 2
"""Attempts (Sample.attempt, which stale re-dispatches also count) after which the async schedule stops
giving out again a prompt whose group failed for an infrastructure cause."""


# ---------------------------------------------------------------------------- metrics


def rollout_metrics(records: list[EpisodeRecord], prefix: str) -> dict[str, float]:
    """Per-episode numbers; an episode of several segments (openai_agent_loop) counts once, its tokens all."""
    segments, records = records, [r for r in records if r.segment == 0]
    ok = [r for r in records if r.error is None and r.reward is not None]
    n = max(1, len(ok))
    m: dict[str, float] = {
        f"{prefix}/reward": sum(r.reward for r in ok) / n if ok else 0.0,
        f"{prefix}/accuracy": sum(r.reward >= 1.0 - 1e-9 for r in ok) / n if ok else 0.0,
        f"{prefix}/errors": float(sum(r.error is not None for r in records)),
        f"{prefix}/aborted": float(sum(r.error is None and r.finish_reason == "abort" for r in records)),
        f"{prefix}/episodes": float(len(records)),
        f"{prefix}/response_tokens": sum(len(r.response_ids) for r in segments) / max(1, len(records)),
        f"{prefix}/model_tokens": sum(r.num_model_tokens for r in segments) / max(1, len(records)),
        f"{prefix}/turns": sum(r.num_turns for r in segments) / max(1, len(records)),
        f"{prefix}/reward_errors": float(sum(r.metrics.get("reward_errors", 0) for r in records)),
        f"{prefix}/reward_timeouts": float(sum(r.metrics.get("reward_timeouts", 0) for r in records)),
    }
    if any("tool_calls" in r.metrics for r in records):
        m[f"{prefix}/tool_call_rate"] = sum(r.metrics.get("tool_calls", 0) > 0 for r in records) / max(1, len(records))
        m[f"{prefix}/tool_calls"] = sum(r.metrics.get("tool_calls", 0) for r in records) / max(1, len(records))
    return m


def trainable(r: EpisodeRecord) -> bool:
    """Whether a record may go to the learner: scored (a normal episode, length-cut included; a reward that
    raised or timed out scored it `reward.failure_score`), or failed by the policy's fault (an episode
    timeout, scored `reward.failure_score` by `batch_records`). Never a server abort or another
    infrastructure failure (agentloop.errors.failure_kind), which take their whole group out."""
    kind = failure_kind(r.error, r.finish_reason)
    return kind == "policy" or (kind == "ok" and r.reward is not None)


def reward_means(usable: list[EpisodeRecord]) -> dict[str, float]:
    """The trained reward's mean over episodes (segment 0), with the policy failures at reward.failure_score and
    without them: a failure score far from the reward's floor shows as a gap between the two."""
    eps = [r for r in usable if r.segment == 0 and r.reward is not None]
    clean = [r for r in eps if r.error is None and not r.metrics.get("reward_errors")
             and not r.metrics.get("reward_timeouts")]

    out = {}
    for key, rs in (("train/reward_mean_with_failures", eps), ("train/reward_mean_without_failures", clean)):
        if rs:  # a step without any such episode has no mean (left out, never NaN)
            out[key] = sum(float(r.reward) for r in rs) / len(rs)
    return out


def group_key(r: EpisodeRecord) -> int:
    """The GRPO group of a record: its uid (the row index for records without one)."""
    return r.uid if r.uid is not None else r.index


def version_check(records: list[EpisodeRecord], step: int, staleness: Staleness) -> dict[str, float]:
    """Versions of a step's trained records against the schedule: every model token (and every turn's
    reported version) must lie in [step-1-η, step-1]. Also the staleness numbers of the step."""
    lo, hi = staleness.min_version(step), step - 1
    bad = unknown = 0
    lags: Counter[int] = Counter()
    for r in records:
        vs = [v for v, m in zip(r.token_versions, r.response_mask) if m]
        if not vs:  # a loop that built its output without TrajectoryBuilder: versions unknown
            unknown += r.num_model_tokens > 0
            continue
        turns = [parse_version(w) for w in r.weight_versions]
        bad += any(v is None or not lo <= v <= hi for v in vs) or any(t is not None and not lo <= t <= hi
                                                                       for t in turns)
        lags.update(staleness.lag(v, step) for v in vs if v is not None)
    n_tok = sum(lags.values())
    m: dict[str, float] = {"versions/violations": float(bad), "versions/unknown": float(unknown),
                           "versions/violation_rate": bad / max(1, len(records)),
                           "staleness/lag_mean": sum(k * c for k, c in lags.items()) / max(1, n_tok),
                           "staleness/lag_max": float(max(lags, default=0))}
    for k in range(staleness.max_staleness + 1):
        m[f"staleness/lag_{k}_share"] = lags.get(k, 0) / max(1, n_tok)
    return m


def _write_records(path: Path, records: list[EpisodeRecord]) -> None:
    with RecordWriter(path) as writer:
        for r in records:
            writer(r)


async def recover_step_rows(log: StepLog, first: int, learner: LearnerHandle, run_dir: Path) -> None:
    """A (resumed) run goes on at step `first`: drop the lines of steps >= first (they are redone,
    e.g. after the last checkpoint), and log a step < first that the learner finished but that
    has no line (killed between its update and its line) from its rollouts and the learner's metrics."""
    log.truncate_from(first)
    last = first - 1
    recs = run_dir / "rollouts" / f"step-{last:06d}.jsonl"
    if last >= 1 and not any(r.get("step") == last for r in log.rows) and recs.is_file() \
            and (metrics := await learner.finished_metrics(last)) is not None:
        row: dict[str, Any] = {"step": float(last), **rollout_metrics(list(read_records(recs)), "train")}
        row.update({f"learner/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        log.log(row)


_PROGRESS_LABELS = {
    "train/reward": "reward", "train/accuracy": "accuracy", "train/tool_call_rate": "tool calls",
    KL_KEY: "kl", ENTROPY_KEY: "entropy", "train/response_tokens": "resp len",
    "val/reward": "val reward", "val/accuracy": "val accuracy", "val/tool_call_rate": "val tool calls",
    "staleness/lag_mean": "lag", "async/groups_cancelled": "cancelled",
    "train/groups_dropped_infra": "groups dropped", "train/episodes_policy_failed": "policy failures",
    "loop/lag_p99_ms": "loop lag p99 ms",
}
"""Progress-line fields: metrics key -> label (keys missing from a row are left out)."""

_PROGRESS_IF_NONZERO = {"train/groups_dropped_infra", "train/episodes_policy_failed"}
"""Failure counts shown only in the steps that had some."""

_PROGRESS_KEYS = ["train/reward", "train/accuracy", "train/tool_call_rate", KL_KEY, ENTROPY_KEY,
                  "train/response_tokens", "val/reward", "val/accuracy", "staleness/lag_mean",
                  "async/groups_cancelled", "train/groups_dropped_infra", "train/episodes_policy_failed",
                  "loop/lag_p99_ms"]


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


class Trainer:
    """The pieces both schedules share (see the module doc). `learner`: the learner handle
    (agentloop.train.handle.protocol; the file mailbox or Ray); `layout`: how the learner lays out micro-batches
    (LearnerInfo.layout), which the step's batch is planned for; `stage`: where the servers read the learner's HF
    directories (the server pool's; default: the path as is); `streams`: see the attribute."""

    def __init__(self, cfg: Config, run_dir: Path, sm: ServerManager, engine: RolloutEngine,
                 learner: LearnerHandle, log: StepLog, cursor: DataCursor, val_samples: list[Sample], *,
                 layout: BatchLayout | None = None, stage: Stage = same_path,
                 streams: Callable[[Any], GroupStreamProtocol] | None = None,
                 journal: Any = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.sm = sm
        self.engine = engine
        self.learner = learner
        self.log = log
        self.cursor = cursor
        self.val_samples = val_samples
        self.layout = layout or BatchLayout()
        self.journal = journal
        """The episode journal (agentloop.journal.Journal; None: journal.enabled=false)."""
        self.journal_rows = JournalRows(journal, journal_dir(cfg, run_dir)) if journal is not None else None
        self.streams = streams
        """Makes the asynchronous schedule's group stream, given the journal (None: the engine's, episodes on this
        event loop; the Ray backend's rollout workers: agentloop.cluster.ray_rollout)."""
        # the synchronous schedule is η = 0 whatever train.max_staleness says (its default is the async one's)
        self.staleness = Staleness(cfg.train.max_staleness if cfg.train.schedule == "async" else 0)
        self.interrupt = interrupt_policy(cfg.train.interrupt)
        half = LoraHalf if cfg.learner.lora.enabled else server_half(cfg.learner.weight_sync)  # adapters, or weights
        self.weights: ServerHalf = half(sm, self.interrupt, learner, stage=stage)
        """The weight transport's server half (agentloop.train.weights.servers); also the servers' resync."""
        self._cache_seen = (0.0, 0.0)  # the servers' cached and prompt tokens at the last step's row
        self.final: dict[str, Any] = {}
        self.loop_lag = LoopLagMonitor()
        lent = lent_server_indices(cfg)
        self.lender: Lender | None = Lender(sm, [sm.urls[i] for i in lent], release=bool(cfg.server.lend_release),
                                            tags=cfg.server.lend_release) if lent else None
        """server.lend_learner_gpus: the servers on the learner's GPUs, asleep while it trains (lending)."""
        """Event-loop lag while a schedule runs: `loop/lag_*_ms` of each step's row (since the previous one)."""
        (run_dir / "rollouts").mkdir(exist_ok=True)

    # ------------------------------------------------------------------ weights

    async def learner_update(self, step: int) -> tuple[UpdateResult, float, float]:
        """Wait for the learner's step and get its weights into the servers (the transport's server half):
        (result, learner s, sync s)."""
        t0 = time.monotonic()
        timeout = self.cfg.train.update_timeout_s
        ev = await self.learner.wait_update_or_sync(step, timeout)
        t_learn = time.monotonic() - t0
        upd, t_sync = await self.weights.deliver(step, ev, timeout)
        return upd, t_learn, t_sync

    async def resume_weights(self, first: int) -> None:
        """Before step `first` (> 1) rolls out, the servers must serve the weights of step first-1."""
        prev = await self.learner.weights(first - 1)
        if prev is None:
            raise TrainingError(
                f"cannot resume at step {first}: the weights of step {first - 1} are missing (weights/step-"
                f"{first - 1:06d} of the learner's run dir); the servers would serve the initial weights. Restore "
                "them, or start a new run (train.resume=false)")
        await self.weights.load(prev, first - 1)

    # ------------------------------------------------------------------ a step

    def batch_records(self, step: int, records: list[EpisodeRecord]) -> tuple[list[EpisodeRecord], dict[str, float]]:
        """The step's records in uid order, stamped with the step; what the learner trains; version checks.

        Whole GRPO groups only: a group with an infrastructure failure (a server abort, a spent retry
        budget, a loop that raised) is left out whole, never trained partial; a policy failure (an
        episode timeout) stays in its group as a copy scored `reward.failure_score`, so the group's
        advantages are computed over all its episodes and the failure gets the negative one."""
        records = sorted(records, key=lambda r: (group_key(r), r.repeat))
        for r in records:
            r.step = step
        usable: list[EpisodeRecord] = []
        dropped = policy_failed = 0
        for _, group in itertools.groupby(records, key=group_key):
            group = list(group)
            if not all(trainable(r) for r in group):
                dropped += 1
                continue
            for r in group:
                if r.error is not None:  # a policy failure (trainable): the lowest score, its tokens kept
                    r = r.model_copy(update={"reward": self.cfg.reward.failure_score})
                policy_failed += r.error is not None or bool(r.metrics.get("reward_errors")) \
                    or bool(r.metrics.get("reward_timeouts"))
                usable.append(r)
        checks = version_check(usable, step, self.staleness)
        checks["train/groups_dropped_infra"] = float(dropped)
        checks["train/episodes_policy_failed"] = float(policy_failed)
        checks.update(reward_means(usable))
        limit = self.cfg.train.max_version_violations
        if checks["versions/violation_rate"] > limit:
            raise TrainingError(
                f"step {step}: {int(checks['versions/violations'])} of {len(usable)} records hold tokens "
                f"sampled outside versions [{self.staleness.min_version(step)}, {step - 1}] "
                f"(train.max_version_violations={limit}); servers {self.sm.server_versions()}")
        return usable, checks

    async def train_step(self, step: int, records: list[EpisodeRecord], t0: float, t_roll: float,
                         extra: dict[str, Any], *, write: bool = True,
                         next_ready: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Write the step's rollouts (unless the caller did), train on them, push the weights, log the step."""
        # Step-boundary work (the version check over every token, the rollouts file, the metrics row and the
        # curves page) runs in a thread, awaited in order: episodes still in flight (async schedule) keep the loop.
        usable, checks = await asyncio.to_thread(self.batch_records, step, records)
        if not usable:
            first_err = next((r.error or r.finish_reason for r in records), "no records")
            raise TrainingError(f"step {step}: no trainable episode; first error: {first_err}")
        path = self.run_dir / "rollouts" / f"step-{step:06d}.jsonl"
        submitted = self.learner.submitted(step)  # a resumed run: the batch the learner trained stays
        if write and not (submitted and path.is_file()):
            try:
                await asyncio.to_thread(_write_records, path, records)
            except OSError as e:  # e.g. a full disk: the message names the file
                raise TrainingError(f"step {step}: {e}") from e
        data_state = extra.pop("_data_state")
        if self.lender is not None:  # the learner trains only beside lent servers asleep (lending)
            await self.lender.before_train()
        if not submitted:
            try:  # advantages and every rank's micro-batches, off the event loop (agentloop.train.batch.prepare)
                batch = await asyncio.to_thread(prepare_batch, usable, self.cfg.algo, self.layout, step)
            except ValueError as e:
                raise TrainingError(f"step {step}: {e}") from e
            await self.learner.submit(step, batch, data_position=data_state)
        if self.journal is not None:  # its groups are the mailbox's now: their journal records can go
            self.journal.trained(step, step_uids(records), data_state)
        try:
            upd, t_learn, t_sync = await self.learner_update(step)
        except LearnerError as e:
            raise TrainingError(f"learner failed at step {step}: {e}\n{await self.learner.failure_context()}") from e
        if self.lender is not None:  # the step's weights are in every server: the lent ones serve again
            await self.lender.after_update(next_ready() if next_ready is not None and step < self.cfg.train.steps
                                           else False)
            extra.update(self.lender.metrics())
        checks["train/groups_dropped_infra"] += extra.pop("_groups_dropped_infra", 0)
        row: dict[str, Any] = {"step": float(step), **rollout_metrics(records, "train"), **checks, **extra}
        row.update({f"learner/{k}": float(v) for k, v in upd.metrics.items() if isinstance(v, (int, float))})
        g = self.sm.gauges()
        cached, prompt = g["server/cached_tokens"], g["server/prompt_tokens"]
        step_cached, step_prompt = cached - self._cache_seen[0], prompt - self._cache_seen[1]
        self._cache_seen = (cached, prompt)
        # reward_s is summed over episodes and overlaps rollout_s (episodes are scored as they end)
        row.update({"time/rollout_s": t_roll, "time/learner_s": t_learn, "time/sync_s": t_sync,
                    "time/reward_s": sum(r.metrics.get("reward_time_s", 0.0) for r in records),
                    "time/step_s": time.monotonic() - t0,
                    "rollout/tokens_per_s": sum(r.num_model_tokens for r in records) / max(1e-9, t_roll),
                    "server/healthy": g["server/healthy"], "server/total": g["server/total"],
                    "server/ejections": g["server/ejections"], "server/readmissions": g["server/readmissions"],
                    "server/retries": g["server/retries"],
                    # prompt tokens the servers' prefix caches served since the last step (a flush per update
                    # empties them; in_place keeps them, isolated per version)
                    "server/prefix_cache_hit_rate": step_cached / step_prompt if step_prompt else 0.0,
                    "server/flushes_refused": g["server/flushes_refused"],
                    # the concurrency limits and the load they follow (manager.concurrency; the sum of the fixed
                    # caps when not adaptive)
                    **{k: v for k, v in g.items() if k.startswith("server/conc_") or k.endswith(
                        ("/conc_limit", "/kv_usage", "/waiting"))},
                    **self.loop_lag.gauges(reset=True)})
        if self.journal_rows is not None:
            row.update(self.journal_rows.row())
        if self.cfg.train.val_every and self.val_samples and (step % self.cfg.train.val_every == 0
                                                              or step == self.cfg.train.steps):
            row.update(await self.validate(step))
        await asyncio.to_thread(self._log_row, row)
        servers = f"servers {int(g['server/healthy'])}/{int(g['server/total'])}"
        keys = [k for k in _PROGRESS_KEYS if k not in _PROGRESS_IF_NONZERO or row.get(k)]
        emit(progress_line(step, self.cfg.train.steps, "steps", fmt_fields(row, _PROGRESS_LABELS, keys)
                           + [f"rollout {t_roll:.0f}s learner {t_learn:.0f}s sync {t_sync:.1f}s", servers]))
        self.final["last_weights"] = "pushed" if upd.pushed else str(upd.weights_dir)
        return row

    def _log_row(self, row: dict[str, Any]) -> None:
        self.log.log(row)
        self.log.curves()

    async def validate(self, step: int) -> dict[str, float]:
        vdir = self.run_dir / "validation"
        vdir.mkdir(exist_ok=True)
        with RecordWriter(vdir / f"step-{step:06d}.jsonl") as writer:
            res = await self.engine.run(self.val_samples, n_samples=1, step=step, on_record=writer)
        if res.stopped:
            raise TrainingError(f"validation at step {step} stopped: {res.stopped}")
        return rollout_metrics(res.records, "val")

    # ------------------------------------------------------------------ the synchronous schedule

    async def run_sync_schedule(self, first: int) -> None:
        B = self.cfg.train.prompts_per_step
        self.loop_lag.start()
        for step in range(first, self.cfg.train.steps + 1):
            t0 = time.monotonic()
            batch = self.cursor.take(B)
            if self.journal is not None:  # a journaled group goes on where it stood (its attempt: its seeds)
                batch = [self.journal.resumed_sample(s) for s in batch]
            path = self.run_dir / "rollouts" / f"step-{step:06d}.jsonl"
            path.unlink(missing_ok=True)  # partial rollouts of the step in flight at a kill
            with RecordWriter(path) as writer:  # each record as it ends: a stopped run keeps them
                res = await self.engine.run(batch, step=step, on_record=writer, journal=self.journal)
            if res.stopped:
                raise TrainingError(f"rollouts of step {step} stopped: {res.stopped}")
            t_roll = time.monotonic() - t0
            await self.train_step(step, res.records, t0, t_roll, {"_data_state": self.cursor.state()}, write=False)

    # ------------------------------------------------------------------ the asynchronous schedule

    async def run_async_schedule(self, first: int) -> None:
        """Drive the schedule's object (schedule.AsyncSchedule): a producer admits prompts as it allows, a
        collector reports finished groups, the step loop takes batches; its commands (give a prompt out again,
        cancel a running group) are carried out here, on the cursor and the stream."""
        cfg = self.cfg
        self.loop_lag.start()
        B, n = cfg.train.prompts_per_step, cfg.rollout.n_samples
        sched: AsyncSchedule[GroupOutcome] = AsyncSchedule(B, cfg.train.max_staleness,
                                                           total=(cfg.train.steps - first + 1) * B,
                                                           first_step=first, infra_retries=INFRA_RETRIES)
        journal = self.journal
        stream: GroupStreamProtocol = (self.streams(journal) if self.streams is not None
                                       else self.engine.stream(journal=journal))
        changed = asyncio.Event()

        def carry_out(cmds: list[Command]) -> None:
            for c in cmds:
                if isinstance(c, Retry):
                    if journal is not None:  # given out again as another attempt: this one is void
                        journal.group_dropped(c.sample.group_uid, c.sample.attempt, "given out again")
                    self.cursor.retry(c.sample)
                else:
                    stream.cancel(c.uid, c.reason)

        async def produce() -> None:
            while True:
                k = sched.admit()
                if k and not stream.stopped:
                    for s in self.cursor.take(k):
                        if journal is not None:  # a journaled group goes on where it stood (its attempt: its seeds)
                            s = journal.resumed_sample(s)
                        stream.submit(s, n)
                        sched.started(s)
                changed.clear()
                await changed.wait()

        async def collect() -> None:
            while True:
                out = await stream.next()
                continued = sum(r.metrics.get("interrupted_calls", 0) > 0 for r in out.records)
                carry_out(sched.group_done(out, complete=all(trainable(r) for r in out.records),
                                           continued=continued))
                changed.set()

        tasks = [asyncio.create_task(produce(), name="producer"), asyncio.create_task(collect(), name="collector")]
        logged: Counter[str] = Counter(sched.counts)  # counts as of the last step's row
        try:
            for step in range(first, cfg.train.steps + 1):
                t0 = time.monotonic()
                carry_out(sched.step_begins(step, await stream.running_versions()))
                while (groups := sched.take(step)) is None:
                    if stream.stopped:
                        raise TrainingError(f"rollouts of step {step} stopped: {stream.stopped}")
                    for t in tasks:
                        if t.done() and t.exception() is not None:
                            raise t.exception()  # type: ignore[misc]
                    changed.clear()
                    try:
                        await asyncio.wait_for(changed.wait(), timeout=1.0)
                    except asyncio.TimeoutError:
                        pass
                t_roll = time.monotonic() - t0
                records = [r for g in groups for r in g.records]
                extra = {"_data_state": self.cursor.state(untrained=sched.untrained()),
                         "async/groups_in_flight": float(stream.running),
                         "async/groups_buffered": float(len(sched)),
                         "async/busy_frac": stream.busy_fraction(reset=True)}
                # what happened since the previous step's row, written in this step's row
                delta = sched.since(logged, ("groups_cancelled", "episodes_cancelled", "episodes_continued",
                                             "groups_dropped_infra"))
                for k in ("groups_cancelled", "episodes_cancelled", "episodes_continued"):
                    extra[f"async/{k}"] = float(delta[k])
                extra["_groups_dropped_infra"] = delta["groups_dropped_infra"]
                logged = Counter(sched.counts)
                await self.train_step(step, records, t0, t_roll, extra,
                                      next_ready=lambda s=step: sched.buffer.eligible(s + 1) >= B)
                sched.version_pushed(step)
                changed.set()
        finally:
            sched.end()
            await self.loop_lag.stop()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            left = await stream.cancel_all("the run ended")
            kept = sum(o.cancelled is None for o in left) + len(sched)
            self.final["async"] = {**{k: int(v) for k, v in sched.counts.items()},
                                   "groups_left_at_end": len(left) + len(sched),
                                   "groups_left_complete": kept}


def load_data(cfg: Config) -> TrainData:
    """The run's training and validation rows (the `data` section; validation only with train.val_every > 0),
    and `cfg.data` resolved to what they are (the held-out slice's size, no unused built-in set)."""
    data = load_train_data(cfg.data, validate=bool(cfg.train.val_every))
    cfg.data = data.config
    return data


async def train_async(cfg: Config, run_dir: Path, data: TrainData | None = None, *,
                      force: bool = False, model_path: Path | None = None,
                      backend: Backend | None = None) -> dict[str, Any]:
    """The run; `data` as `load_data(cfg)` made it (loaded here when None). `force`: go on from a checkpoint
    whose data position was stored for other training rows (`agentloop train --force-data`). `model_path`: as
    the preflight resolved it (None: resolved here). `backend`: where the servers and the learner run (default:
    this host, agentloop.train.orchestrator.backend.LocalBackend)."""
    loop_cls = get_agent_loop(cfg.rollout.loop)
    data = data if data is not None else load_data(cfg)
    train_samples, val_samples = data.train, data.val
    scorer = Scorer(cfg, on_note=lambda line: print(f"agentloop train: {line}", file=sys.stderr, flush=True))
    model_path = model_path if model_path is not None else resolve_train_model(cfg)
    # refused before anything starts when the learner cannot run the model exactly (it checks again itself)
    support = require_model_support(model_path, max_len=cfg.model.context_length)
    tokenizer = load_tokenizer_for(cfg, model_path)
    backend = backend or LocalBackend()
    await backend.start()
    log = StepLog(cfg, run_dir)
    pool = backend.server_pool(cfg, model_path, run_dir)
    learner = backend.learner(cfg, run_dir, model_path)
    final: dict[str, Any] = {"run_dir": str(run_dir), "model": str(model_path)}
    journal = None
    kv_tokens: list[int | None] = []
    sched = (f"async, max_staleness {cfg.train.max_staleness}, interrupt {cfg.train.interrupt}"
             if cfg.train.schedule == "async" else "sync")
    print(f"agentloop train: {cfg.train.steps} steps x {cfg.train.prompts_per_step} prompts x "
          f"{cfg.rollout.n_samples} samples, loop {cfg.rollout.loop}, schedule {sched}, model {model_path}\n"
          f"  run dir {run_dir} ({learner.where()})\n"
          f"  data: {len(train_samples)} training rows of {data.train_source}; validation: {data.val_source}"
          + "".join(f"\n  model: {line}" for line in support.applied), file=sys.stderr, flush=True)
    try:
        await learner.start()
        async with serving(cfg, model_path, run_dir, pool=pool, initial_version=0,
                           on_event=lambda line: print(f"agentloop train: {line}", file=sys.stderr, flush=True),
                           cache_salt=interrupt_policy(cfg.train.interrupt).cache_salt) as sm:
            served = await check_served_model(sm, model_path)  # the servers serve model.path, or an error now
            kv_tokens = await served_kv_tokens(sm) if (run_dir / "plan.json").is_file() else []
            try:
                info = await learner.wait_ready(cfg.train.learner_ready_timeout_s)
            except AgentLoopError as e:
                raise TrainingError(f"learner did not start: {e}\n{await learner.failure_context()}") from e
            try:
                # A resumed learner first trains the batches submitted before the stop: the run goes on from
                # where that leaves it (reading next_step any earlier races the learner, pairs it with another
                # step's data position and loads weights that pruning may be deleting).
                info = await learner.wait_caught_up(cfg.train.update_timeout_s)
            except AgentLoopError as e:
                raise TrainingError(f"learner failed on a batch submitted before the stop: {e}\n"
                                    f"{await learner.failure_context()}") from e
            first = info.next_step
            position = info.data_position
            cursor = DataCursor.from_state(train_samples, cfg.rollout.seed, position, source=data.train_source,
                                           force=force)
            if not cursor.matches(position):
                print(f"agentloop train: --force-data: the training rows ({data.train_source}) differ from those the "
                      "checkpoint's data position was stored for; going on from that position over the new rows",
                      file=sys.stderr, flush=True)
            await recover_step_rows(log, first, learner, run_dir)
            staleness = Staleness(cfg.train.max_staleness if cfg.train.schedule == "async" else 0)
            journal = open_run_journal(cfg, run_dir, model_path, cursor, first=first,
                                       floor_version=staleness.min_version(first) if first > 1 else None,
                                       say=lambda line: print(f"agentloop train: {line}", file=sys.stderr, flush=True))
            engine = RolloutEngine(cfg, sm, tokenizer, loop_cls, scorer=scorer, progress=False)
            layout = BatchLayout.from_json(info.layout) if info.layout else BatchLayout(world=info.world_size)
            streams = await backend.rollout_streams(cfg, sm, model_path, run_dir)
            if streams is not None:
                print(f"agentloop train: the asynchronous schedule's episodes run on {cfg.cluster.rollout_workers} "
                      "rollout worker(s) (Ray actors), this process makes the servers' admin calls",
                      file=sys.stderr, flush=True)
            trainer = Trainer(cfg, run_dir, sm, engine, learner, log, cursor, val_samples, layout=layout,
                              stage=lambda w: pool.stage(w.path, w.host), streams=streams, journal=journal)
            sm.set_resync(trainer.weights.resync)
            await align_served_weights(sm, served, model_path, first)  # fresh run: every server at version 0
            if first == 1 and info.probe and cfg.train.server_logprob_tol is not None:
                # what /model_info cannot tell (other weights on another host): the servers against the learner
                await check_served_logprobs(sm, info.probe, cfg.train.server_logprob_tol,
                                            say=lambda line: print(f"agentloop train: {line}", file=sys.stderr,
                                                                   flush=True))
            sm.expect_version(0)
            if first > 1:
                await trainer.resume_weights(first)
                ck = info.resumed_step
                replayed = first - 1 - (ck or 0)
                print(f"agentloop train: resumed at step {first} (data position {cursor.position}): the learner "
                      f"resumed from {f'checkpoint {ck}' if ck else 'the initial weights'}"
                      + (f" and trained the {replayed} batch(es) submitted before the stop" if replayed else "")
                      + f"; {cursor.pending_retries} prompts to give out again; servers loaded "
                      f"{trainer.weights.current.path if trainer.weights.current else None}",
                      file=sys.stderr, flush=True)
            if first == 1 and val_samples:
                row = {"step": 0.0, **await trainer.validate(0)}
                log.log(row)
                emit(progress_line(0, cfg.train.steps, "steps", fmt_fields(
                    row, _PROGRESS_LABELS, ["val/reward", "val/accuracy", "val/tool_call_rate"])))
            if cfg.train.schedule == "sync":
                await trainer.run_sync_schedule(first)
            else:
                await trainer.run_async_schedule(first)
            await trainer.loop_lag.stop()
            final.update(trainer.final)
            final.update(await finish_learner(cfg, learner))
    finally:
        if journal is not None:
            journal.close()
        await scorer.close()
        try:
            final["learner_exit"] = await learner.close()
        finally:
            log.close()
            await backend.close()
    final["curves"] = str(log.curves())
    final["metrics"] = log.rows[-1] if log.rows else {}
    final["plan"] = plan_summary(run_dir, log.rows, kv_tokens)  # the GPU plan next to what was measured
    write_json(run_dir / "train_summary.json", final)
    return final


async def finish_learner(cfg: Config, learner: LearnerHandle) -> dict[str, Any]:
    """The run ended normally: the learner saves the final model (HF weights of the last step for every sync
    path, and its checkpoint unless it has one) and exits; waited for up to `train.update_timeout_s`.
    Returns {"last_weights": the HF directory, "checkpoint": the checkpoint directory}."""
    await learner.stop(final=True)
    try:
        done = await learner.wait_final(cfg.train.update_timeout_s)
    except LearnerError as e:
        raise TrainingError(f"the learner did not save the final model: {e}\n{await learner.failure_context()}") from e
    return {"last_weights": done.weights_dir, "checkpoint": done.checkpoint}


def resolve_learner_defaults(cfg: Config) -> None:
    """Learner settings that follow from the run: the schedule's length and, when the user did not
    set it, a checkpoint period (an explicit `learner.checkpoint_every: null` means never)."""
    if cfg.learner.checkpoint_every is None and "checkpoint_every" not in cfg.learner.model_fields_set:
        cfg.learner.checkpoint_every = max(1, min(10, cfg.train.steps // 4 or 1))
    if cfg.learner.total_steps is None:
        cfg.learner.total_steps = cfg.train.steps


def prepare_train(cfg: Config, *, dry_run: bool = False) -> tuple[Path, Preflight]:
    """Check the config and run the preflight (agentloop.train.planning.preflight): data, rewards, template, prompts,
    model, tools, the GPU memory plan; on CUDA the unset keys it sizes are set in `cfg`. Nothing is started.
    Returns (the model directory, the preflight); the caller prints it and raises on its failures."""
    from agentloop.rollout.run import load_plugins

    validate_for_training(cfg)
    # rows may bring the python tool or the code reward: refuse unisolated model code up front
    require_isolation(cfg.tools.python, "agentloop train")
    load_plugins(cfg)
    resolve_learner_defaults(cfg)
    model_path = resolve_train_model(cfg)
    return model_path, run_preflight(cfg, model_path, dry_run=dry_run)


def dry_run(cfg: Config) -> Preflight:
    """`agentloop train --dry-run`: the preflight's lines on stdout; ConfigError when a check failed."""
    _, pre = prepare_train(cfg, dry_run=True)
    say_lines(pre, print, "agentloop train --dry-run: preflight, nothing started")
    pre.raise_for_failures()
    print(f"agentloop train --dry-run: all {len(pre.checks)} checks passed")
    return pre


def run_train(cfg: Config, *, force: bool = False, backend: Backend | None = None) -> tuple[Path, dict[str, Any]]:
    """`agentloop train`: the preflight (bad rows, a missing reward or a plan that does not fit fail before
    anything starts), the run dir (config.yaml: the config as resolved, data and the plan's keys included;
    plan.json: the GPU plan), the run. `force`, `backend`: see `train_async`."""
    model_path, pre = prepare_train(cfg)
    say_lines(pre, lambda line: print(line, file=sys.stderr, flush=True), "agentloop train: preflight")
    pre.raise_for_failures()
    run_dir = make_run_dir(cfg)
    pre.save(run_dir)
    return run_dir, run_async(train_async(cfg, run_dir, pre.data, force=force, model_path=model_path,
                                          backend=backend))
