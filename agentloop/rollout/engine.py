"""RolloutEngine: runs many concurrent episodes of one agent loop and turns each into a record.

Map:
    RolloutEngine.run      (sample, repeat) pairs -> fixed pool of worker tasks -> EpisodeRecord each
    _run_episode           build the loop, seed it, run it under a timeout, score it; any exception
                           becomes an error record (AllServersDownError also stops the run)
    RolloutResult          the records plus summary numbers (reward, pass@k, tokens/s, errors, lag)
Scoring lives in `scorer.py`, the summary numbers in `summary.py`, the progress line in report.progress.

Invariant: every (sample, repeat) handed to `run` comes out exactly once, as a record (result
or error), or is counted in `not_started` when the run stops early because every server died.
Records are passed to `on_record` (the writer) as soon as they exist, so a stopped run keeps them.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from agentloop.config import Config, SamplingParams, derive_seed
from agentloop.errors import AllServersDownError, RewardError
from agentloop.loops.base import AgentLoopBase
from agentloop.records import AgentLoopOutput, EpisodeRecord, Sample
from agentloop.report.progress import emit, progress_line
from agentloop.rewards.tool_aware import combine_tool_reward
from agentloop.rollout.looplag import LoopLagMonitor
from agentloop.rollout.scorer import Scorer
from agentloop.rollout.summary import summarize
from agentloop.server_manager import ServerManager

RecordSink = Callable[[EpisodeRecord], Any]


class RolloutResult(BaseModel):
    """What one `RolloutEngine.run` produced."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    records: list[EpisodeRecord] = Field(default_factory=list)
    """Every record made, in completion order."""
    summary: dict[str, Any] = Field(default_factory=dict)
    """Aggregates: reward, pass@k, throughput, errors, loop lag, server gauges."""
    stopped: str | None = None
    """Why the run stopped early (None if it finished)."""


class RolloutEngine:
    """Runs episodes of one registered loop against a ServerManager, `max_concurrency` at a time."""

    def __init__(self, cfg: Config, server_manager: ServerManager, tokenizer: Any,
                 loop_cls: type[AgentLoopBase], *, scorer: Scorer | None = None,
                 loop_kwargs: dict[str, Any] | None = None, progress: bool = True,
                 progress_stream: Any = None):
        self.cfg = cfg
        self.sm = server_manager
        self.tokenizer = tokenizer
        self.loop_cls = loop_cls
        self.scorer = scorer or Scorer(cfg)
        self.loop_kwargs = loop_kwargs or {}
        self.progress = progress
        self.progress_stream = progress_stream or sys.stderr
        self.lag = LoopLagMonitor()

    def sampling_params(self, sample: Sample) -> SamplingParams:
        seed = derive_seed(self.cfg.rollout.seed, sample.index, sample.repeat)
        return SamplingParams(**self.cfg.sampling.model_dump(), seed=seed)

    async def run(self, samples: list[Sample], *, n_samples: int | None = None, step: int | None = None,
                  on_record: RecordSink | None = None) -> RolloutResult:
        n = n_samples or self.cfg.rollout.n_samples
        work = [s.with_repeat(r) for s in samples for r in range(n)]
        result = RolloutResult()
        stop_reason: list[str] = []
        it = iter(work)
        started = 0
        t0 = time.monotonic()
        self.lag.start()

        async def emit(rec: EpisodeRecord) -> None:
            result.records.append(rec)
            if on_record is not None:
                r = on_record(rec)
                if inspect.isawaitable(r):
                    await r

        async def worker() -> None:
            nonlocal started
            for sample in it:
                if stop_reason:
                    return
                started += 1
                try:
                    rec = await self._run_episode(sample, step)
                except AllServersDownError as e:
                    if not stop_reason:
                        stop_reason.append(str(e))
                    await emit(self._error_record(sample, e, step, 0.0))
                    return
                await emit(rec)

        n_workers = max(1, min(self.cfg.rollout.max_concurrency, len(work)))
        workers = [asyncio.create_task(worker(), name=f"episode-worker-{i}") for i in range(n_workers)]
        progress_task = asyncio.create_task(self._progress(result, len(work), t0)) if self.progress else None
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            if progress_task is not None:
                progress_task.cancel()
                await asyncio.gather(progress_task, return_exceptions=True)
            await self.lag.stop()
        wall = time.monotonic() - t0
        result.summary = summarize(result.records, n, wall)
        result.summary["not_started"] = len(work) - started
        result.summary.update(self.lag.gauges())
        result.summary.update({k: v for k, v in self.sm.gauges().items() if k.count("/") == 1})
        if stop_reason:
            result.stopped = stop_reason[0]
        if self.progress:
            self._print_progress(result, len(work), t0, final=True)
        return result

    async def _run_episode(self, sample: Sample, step: int | None) -> EpisodeRecord:
        t0 = time.monotonic()
        sp = self.sampling_params(sample)
        try:
            loop = self.loop_cls(server_manager=self.sm, tokenizer=self.tokenizer, config=self.cfg,
                                 **self.loop_kwargs)
            out = await asyncio.wait_for(loop.run(sample, sp), timeout=self.cfg.rollout.episode_timeout_s)
            if not isinstance(out, AgentLoopOutput):
                raise TypeError(f"{self.loop_cls.__name__}.run returned {type(out).__name__}, "
                                "not AgentLoopOutput")
        except AllServersDownError:
            raise
        except asyncio.TimeoutError:
            return self._error_record(sample, TimeoutError(
                f"episode exceeded rollout.episode_timeout_s={self.cfg.rollout.episode_timeout_s}"), step,
                time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - an episode's failure becomes data, never a crash
            return self._error_record(sample, e, step, time.monotonic() - t0)
        finally:
            self.sm.end_episode(sample.episode_id)
        reward, info = out.reward, {}
        error = out.error
        if error is None and reward is None:
            t_score = time.monotonic()
            try:
                reward, info = await self.scorer.score(sample, self.scorer.solution_text(sample, out, self.tokenizer))
                reward, tool_info = combine_tool_reward(reward, out.extra, self.cfg.reward.tools)
                info = {**info, **tool_info}
            except RewardError as e:
                error = f"RewardError: {e}"
            except Exception as e:  # noqa: BLE001
                error = f"RewardError: {type(e).__name__}: {e}"
            # summed per step by `agentloop train` (time/reward_s): scoring runs inside the rollout phase
            out.metrics["reward_time_s"] = time.monotonic() - t_score
        return EpisodeRecord(
            **out.model_dump(exclude={"reward", "error"}),
            reward=reward, error=error, reward_info=info,
            episode_id=sample.episode_id, index=sample.index, repeat=sample.repeat,
            data_source=sample.data_source, loop=self.loop_cls.name or self.loop_cls.__name__, seed=sp.seed or 0,
            ground_truth=sample.ground_truth, wall_s=time.monotonic() - t0, step=step,
        )

    def _error_record(self, sample: Sample, e: BaseException, step: int | None, wall: float) -> EpisodeRecord:
        return EpisodeRecord(
            prompt_ids=[], response_ids=[], response_mask=[], response_logprobs=[], num_turns=0,
            finish_reason="error", error=f"{type(e).__name__}: {e}",
            episode_id=sample.episode_id, index=sample.index, repeat=sample.repeat,
            data_source=sample.data_source, loop=self.loop_cls.name or self.loop_cls.__name__,
            seed=self.sampling_params(sample).seed or 0, ground_truth=sample.ground_truth, wall_s=wall, step=step,
        )

    async def _progress(self, result: RolloutResult, total: int, t0: float) -> None:
        while True:
            await asyncio.sleep(self.cfg.rollout.progress_interval_s)
            self._print_progress(result, total, t0)

    def _print_progress(self, result: RolloutResult, total: int, t0: float, final: bool = False) -> None:
        recs = result.records
        done = len(recs)
        wall = max(1e-9, time.monotonic() - t0)
        toks = sum(r.num_model_tokens for r in recs)
        rewards = [r.reward for r in recs if r.reward is not None]
        errs = sum(r.error is not None for r in recs)
        g = self.sm.gauges()
        lag = self.lag.gauges()
        fields = [f"{toks / wall:,.0f} tok/s", f"errors {errs}", f"inflight {int(g['server/inflight'])}",
                  f"healthy {int(g['server/healthy'])}/{len(self.sm.urls)}",
                  f"reward {sum(rewards) / len(rewards) if rewards else float('nan'):.3f}",
                  f"lag p99 {lag['loop/lag_p99_ms']:.1f}ms"]
        emit(progress_line(done, total, "episodes", fields, elapsed_s=wall), self.progress_stream)
