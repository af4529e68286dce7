"""RolloutEngine: runs many concurrent episodes of one agent loop and turns each into a record.

Map:
    RolloutEngine.stream   a GroupStream: GRPO groups submitted one by one, each coming out of
                           `next()` once, as soon as its last episode ends (asynchronous training); it
                           implements rollout/stream.py's GroupStreamProtocol, as the Ray workers' stream does
    RolloutEngine.run      a wrapper that submits every sample's group to a GroupStream and collects
                           the records: the eval path and the synchronous schedule
    _run_episode           build the loop, seed it, run it under its deadline, score it; any exception
                           becomes an error record (AllServersDownError also stops the run); a timed-out
                           episode keeps the turns it finished; a reward that raises or times out scores
                           reward.failure_score (counted in the record's metrics). With a journal (a stream's
                           `journal`): recorded, or continued from where it stood (rollout/journaled.py)
    RolloutResult          the records plus summary numbers (reward, pass@k, tokens/s, errors, lag)
Scoring lives in `scorer.py`, the summary numbers in `summary.py`, the progress line in report.progress.
Every episode, whichever path runs it, holds one of the engine's `rollout.max_concurrency` slots.

Invariants. `run`: every (sample, repeat) handed to it comes out exactly once, as a record (result
or error; an episode of several segments as one record per segment, `segment` 0 first), or is
counted in `not_started` when the run stops early because every server died.
Records are passed to `on_record` (the writer) as soon as they exist, so a stopped run keeps them.
`GroupStream`: every submitted group comes out of `next()` exactly once, complete (one record per
episode, results and error records) or cancelled (with the reason, its episodes counted, none of its
records kept), whatever fails: an exception no record can hold (the record sink failed, e.g. a full
disk) stops the stream with that reason (`stopped`), and every group still comes out, so `run()` and
`close()` always return. An episode that ended by a server abort is kept with finish_reason "abort" and no
reward: it is not scored, and training leaves it out (counted).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentloop.config import Config, SamplingParams, derive_seed
from agentloop.errors import AgentLoopError, AllServersDownError, EpisodeTimeout, RewardError
from agentloop.journal import Journal, ReplayDiverged
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder, watch_trajectories
from agentloop.records import AgentLoopOutput, EpisodeRecord, Sample, json_problem
from agentloop.report.progress import emit, progress_line
from agentloop.rewards.pool import RewardTimeout
from agentloop.rewards.tool_aware import combine_tool_reward
from agentloop.rollout.journaled import journaled_started_version, run_journaled
from agentloop.rollout.looplag import LoopLagMonitor
from agentloop.rollout.scorer import Scorer, reward_extra_info
from agentloop.rollout.summary import summarize
from agentloop.server_manager import ServerManager
from agentloop.util.pacing import StepGate, step_gate
from agentloop.util.runtime import freeze_heap

RecordSink = Callable[[EpisodeRecord], Any]


class Deadline:
    """`async with Deadline(s)`: cancels the current task after `s` seconds and raises TimeoutError out of the
    block; `expired()` says whether it was this deadline (and not a TimeoutError from inside) that fired.
    asyncio.timeout does this from Python 3.11 on; this one runs on 3.10 too."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._fired = False
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None

    def expired(self) -> bool:
        return self._fired

    def _fire(self) -> None:
        self._fired = True
        assert self._task is not None
        self._task.cancel()

    async def __aenter__(self) -> "Deadline":
        self._task = asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_later(self.seconds, self._fire)
        return self

    async def __aexit__(self, et: Any, e: Any, tb: Any) -> bool:
        assert self._handle is not None and self._task is not None
        self._handle.cancel()
        if self._fired and et is asyncio.CancelledError:
            uncancel = getattr(self._task, "uncancel", None)  # 3.11+: another cancel still pending wins
            if uncancel is not None and uncancel() > 0:
                return False
            raise TimeoutError(f"the deadline of {self.seconds:g}s passed") from e
        return False


class RolloutResult(BaseModel):
    """What one `RolloutEngine.run` produced."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    records: list[EpisodeRecord] = Field(default_factory=list)
    """Every record made, in completion order."""
    summary: dict[str, Any] = Field(default_factory=dict)
    """Aggregates: reward, pass@k, throughput, errors, loop lag, server gauges."""
    stopped: str | None = None
    """Why the run stopped early (None if it finished)."""


class GroupOutcome(BaseModel):
    """One GRPO group as it left a GroupStream: complete, or cancelled."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    sample: Sample
    """The dispatched prompt (repeat 0); its `uid` is the group key."""
    records: list[EpisodeRecord] = Field(default_factory=list)
    """One record per episode (per segment of an episode that has several), in repeat order (empty when
    cancelled)."""
    cancelled: str | None = None
    """Why the group was cancelled (None: complete)."""
    n: int
    """Episodes in the group."""
    submitted_version: int | None = None
    """The expected weight version when the group was submitted."""
    key: int | None = None
    """The key it was submitted under (None: its sample's `group_uid`)."""

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version among the group's sampled tokens (the submission's when none)."""
        vs = [r.oldest_version for r in self.records]
        known = [v for v in vs if v is not None]
        return min(known) if known else self.submitted_version


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
        freeze_heap()  # the tokenizer, config and reward workers live as long as the engine (see freeze_heap)
        self._slots = asyncio.Semaphore(cfg.rollout.max_concurrency)
        self._active = 0  # episodes running now
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._busy_window_t0 = time.monotonic()

    @property
    def gate(self) -> StepGate:
        """The running event loop's step gate, set to this engine's slice (`rollout.step_slice_ms`)."""
        gate = step_gate()
        gate.slice_s = self.cfg.rollout.step_slice_ms / 1000
        return gate

    def _episode_started(self) -> None:
        if self._active == 0:
            self._busy_since = time.monotonic()
        self._active += 1

    def _episode_ended(self) -> None:
        self._active -= 1
        if self._active == 0 and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    def busy_fraction(self, reset: bool = False) -> float:
        """Share of wall time, since the last reset, with at least one episode running (the servers
        had work); 1 - it is the time they sat idle waiting for the learner."""
        now = time.monotonic()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        frac = busy / max(1e-9, now - self._busy_window_t0)
        if reset:
            self._busy_s, self._busy_window_t0 = 0.0, now
            if self._busy_since is not None:
                self._busy_since = now
        return min(1.0, frac)

    def sampling_params(self, sample: Sample) -> SamplingParams:
        parts: list[int | str] = [self.cfg.rollout.seed, sample.group_uid, sample.repeat]
        if sample.attempt:
            parts.append(f"attempt{sample.attempt}")
        return SamplingParams(**self.cfg.sampling.model_dump(), seed=derive_seed(*parts))

    def stream(self, *, step: int | None = None, journal: Journal | None = None) -> "GroupStream":
        """A stream of GRPO groups (see GroupStream); close it with `await stream.close()`. `journal`: its episodes
        are journaled, and continued from the journal where it holds them (agentloop.journal)."""
        return GroupStream(self, step=step, journal=journal)

    async def run(self, samples: list[Sample], *, n_samples: int | None = None, step: int | None = None,
                  on_record: RecordSink | None = None, journal: Journal | None = None) -> RolloutResult:
        """Every sample's group through a GroupStream, collected: records in completion order, each
        handed to `on_record` as soon as it exists (so a stopped run keeps them); `journal`: see `stream`."""
        n = n_samples or self.cfg.rollout.n_samples
        total = n * len(samples)
        result = RolloutResult()
        tally = _Tally()
        t0 = time.monotonic()
        self.lag.start()

        async def emit(rec: EpisodeRecord) -> None:
            result.records.append(rec)
            tally.add(rec)
            if on_record is not None:
                r = on_record(rec)
                if inspect.isawaitable(r):
                    await r

        stream = GroupStream(self, step=step, on_episode=emit, error_record_on_stop=True, journal=journal)
        progress_task = asyncio.create_task(self._progress(tally, total, t0)) if self.progress else None
        try:
            for i, s in enumerate(samples):
                stream.submit(s, n, key=i)
            for _ in samples:
                await stream.next()
        finally:
            await stream.close()
            if progress_task is not None:
                progress_task.cancel()
                await asyncio.gather(progress_task, return_exceptions=True)
            await self.lag.stop()
        wall = time.monotonic() - t0
        result.summary = summarize(result.records, n, wall)
        result.summary["not_started"] = total - sum(r.segment == 0 for r in result.records)
        result.summary.update(self.lag.gauges())
        result.summary.update({k: v for k, v in self.sm.gauges().items() if k.count("/") == 1})
        result.stopped = stream.stopped
        if self.progress:
            self._print_progress(tally, total, t0, final=True)
        return result

    async def _run_episode(self, sample: Sample, step: int | None,
                           journal: Journal | None = None) -> EpisodeRecord | list[EpisodeRecord]:
        """The episode's record; with a journal, its records (one per segment), journaled (rollout/journaled.py)."""
        self._episode_started()
        try:
            if journal is not None:
                return await run_journaled(self, sample, step, journal)
            return await self._run_episode_inner(sample, step)
        finally:
            self._episode_ended()

    async def _run_episode_inner(self, sample: Sample, step: int | None, tape: Any = None) -> EpisodeRecord:
        """`tape`: the episode's journal tape (agentloop.journal.tape): the loop's generate calls and effects go
        through it; ReplayDiverged leaves here (the journaled runner restarts the episode)."""
        t0 = time.monotonic()
        sp = self.sampling_params(sample)
        built = watch_trajectories()  # this episode's task only: each episode runs in its own task
        deadline = Deadline(self.cfg.rollout.episode_timeout_s)
        try:
            loop = self.loop_cls(server_manager=self.sm if tape is None else tape.server_manager(self.sm),
                                 tokenizer=self.tokenizer, config=self.cfg, **self.loop_kwargs)
            loop.trajectories = built
            if tape is not None:
                loop.effects = tape
                if tape.replaying and not await loop.restore(sample, tape.log):
                    tape.restart(f"{self.loop_cls.__name__} is not resumable (AgentLoopBase.resumable / restore)")
            async with deadline:
                out = await loop.run(sample, sp)
            if tape is not None and tape.diverged:  # the loop caught the divergence itself: its output is void
                raise ReplayDiverged(tape.diverged)
            if not isinstance(out, AgentLoopOutput):
                raise TypeError(f"{self.loop_cls.__name__}.run returned {type(out).__name__}, "
                                "not AgentLoopOutput")
        except (AllServersDownError, ReplayDiverged):
            raise
        except (TimeoutError, asyncio.TimeoutError) as e:
            # only the episode's own deadline is the policy's timeout; a TimeoutError an environment raised
            # inside the loop (a socket, an HTTP client) is that environment's failure (infra)
            if deadline.expired():
                return self._timeout_record(sample, built, step, time.monotonic() - t0)
            return self._error_record(sample, e, step, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - an episode's failure becomes data, never a crash
            return self._error_record(sample, e, step, time.monotonic() - t0)
        finally:
            self.sm.end_episode(sample.episode_id)
        if tape is not None and (done := tape.replayed_done(out.finish_reason)) is not None:
            # finished before a kill and replayed whole from the journal: its journaled score, not a new one
            out.metrics = dict(done["metrics"])
            return record_of(out, reward=done["reward"], error=None, reward_info=done["reward_info"],
                             episode_id=sample.episode_id, index=sample.index, uid=sample.uid, repeat=sample.repeat,
                             data_source=sample.data_source, loop=self.loop_cls.name or self.loop_cls.__name__,
                             seed=sp.seed or 0, ground_truth=sample.ground_truth, wall_s=done["wall_s"],
                             step=done["step"])
        try:
            return await self._scored_record(sample, sp, out, step, t0)
        except Exception as e:  # noqa: BLE001 - e.g. a plugin's non-JSON `extra`: the record names the key
            return self._error_record(sample, e, step, time.monotonic() - t0)

    async def _scored_record(self, sample: Sample, sp: SamplingParams, out: AgentLoopOutput, step: int | None,
                             t0: float) -> EpisodeRecord:
        """The loop's output scored (unless it failed, was aborted or scored itself) as an EpisodeRecord.
        A reward that raises or times out scores `reward.failure_score`, counted in the record's metrics
        (`reward_errors` / `reward_timeouts`) and named in `reward_info["reward_error"]`."""
        bad = json_problem(out.extra)  # a loop may have changed `extra` after building its output
        if bad:
            raise ValueError(f"{self.loop_cls.__name__} returned {bad}")
        reward, info = out.reward, {}
        error = out.error
        if error is None and reward is None and out.finish_reason != "abort":
            t_score = time.monotonic()
            try:
                text = self.scorer.solution_text(sample, out, self.tokenizer)
            except RewardError as e:  # nothing scores this data source: no fault of the output
                error = f"RewardError: {e}"
            else:
                try:
                    reward, info = await self.scorer.score(sample, text, reward_extra_info(sample, out))
                    await self.gate.enter()  # scores come back in bursts: the records they finish are paced
                    reward, tool_info = combine_tool_reward(reward, out.extra, self.cfg.reward.tools)
                    info = {**info, **tool_info}
                except Exception as e:  # noqa: BLE001 - the reward rejected the output: the lowest score
                    kind = "reward_timeouts" if isinstance(e, RewardTimeout) else "reward_errors"
                    out.metrics[kind] = 1.0
                    reward = self.cfg.reward.failure_score
                    info = {"reward_error": f"{type(e).__name__}: {e}"}
            # summed per step by `agentloop train` (time/reward_s): scoring runs inside the rollout phase
            out.metrics["reward_time_s"] = time.monotonic() - t_score
        return record_of(out, reward=None if reward is None else float(reward), error=error, reward_info=info,
                         episode_id=sample.episode_id, index=sample.index, uid=sample.uid, repeat=sample.repeat,
                         data_source=sample.data_source, loop=self.loop_cls.name or self.loop_cls.__name__,
                         seed=sp.seed or 0, ground_truth=sample.ground_truth, wall_s=time.monotonic() - t0,
                         step=step)

    def _timeout_record(self, sample: Sample, built: list[TrajectoryBuilder], step: int | None,
                        wall: float) -> EpisodeRecord:
        """An episode cut by `rollout.episode_timeout_s`: an error record (EpisodeTimeout) that keeps the
        turns the loop finished, when it built them with a TrajectoryBuilder; training scores it at
        `reward.failure_score` (agentloop.errors.failure_kind)."""
        e = EpisodeTimeout(f"episode exceeded rollout.episode_timeout_s={self.cfg.rollout.episode_timeout_s:g}")
        if built and built[-1].prompt_ids:
            try:
                partial = built[-1].build(finish_reason="timeout", error=f"EpisodeTimeout: {e}")
            except ValueError:  # a builder the loop left inconsistent: keep the failure, not its tokens
                partial = None
            if partial is not None:
                return EpisodeRecord(
                    **partial.model_dump(), episode_id=sample.episode_id, index=sample.index, uid=sample.uid,
                    repeat=sample.repeat, data_source=sample.data_source,
                    loop=self.loop_cls.name or self.loop_cls.__name__, seed=self.sampling_params(sample).seed or 0,
                    ground_truth=sample.ground_truth, wall_s=wall, step=step)
        return self._error_record(sample, e, step, wall, finish_reason="timeout")

    def _error_record(self, sample: Sample, e: BaseException, step: int | None, wall: float, *,
                      finish_reason: str = "error") -> EpisodeRecord:
        return EpisodeRecord(
            prompt_ids=[], response_ids=[], response_mask=[], response_logprobs=[], num_turns=0,
            finish_reason=finish_reason, error=f"{type(e).__name__}: {_describe(e)}",
            episode_id=sample.episode_id, index=sample.index, uid=sample.uid, repeat=sample.repeat,
            data_source=sample.data_source, loop=self.loop_cls.name or self.loop_cls.__name__,
            seed=self.sampling_params(sample).seed or 0, ground_truth=sample.ground_truth, wall_s=wall, step=step,
        )

    async def _progress(self, tally: "_Tally", total: int, t0: float) -> None:
        while True:
            await asyncio.sleep(self.cfg.rollout.progress_interval_s)
            self._print_progress(tally, total, t0)

    def _print_progress(self, tally: "_Tally", total: int, t0: float, final: bool = False) -> None:
        wall = max(1e-9, time.monotonic() - t0)
        g = self.sm.gauges()
        lag = self.lag.gauges()
        mean = tally.reward_sum / tally.rewards if tally.rewards else float("nan")
        fields = [f"{tally.tokens / wall:,.0f} tok/s", f"errors {tally.errors}",
                  f"inflight {int(g['server/inflight'])}",
                  f"healthy {int(g['server/healthy'])}/{len(self.sm.urls)}", f"reward {mean:.3f}",
                  f"lag p50/p99/max {lag['loop/lag_p50_ms']:.1f}/{lag['loop/lag_p99_ms']:.1f}/"
                  f"{lag['loop/lag_max_ms']:.0f}ms"]
        emit(progress_line(tally.episodes, total, "episodes", fields, elapsed_s=wall), self.progress_stream)


class _Tally:
    """Running totals for the progress line, kept as records arrive (a line never walks every record)."""

    def __init__(self) -> None:
        self.episodes = self.errors = self.tokens = self.rewards = 0
        self.reward_sum = 0.0

    def add(self, rec: EpisodeRecord) -> None:
        self.tokens += rec.num_model_tokens
        if rec.segment:
            return
        self.episodes += 1
        self.errors += rec.error is not None
        if rec.reward is not None:
            self.rewards += 1
            self.reward_sum += rec.reward


def record_of(out: AgentLoopOutput, **identity: Any) -> EpisodeRecord:
    """The EpisodeRecord of a loop's output plus the engine's fields, sharing the output's token lists.

    The output was validated token by token when it was made (AgentLoopOutput's validators, or a
    TrajectoryBuilder that holds its invariants by construction); only what a loop may have changed since is
    checked again here (equal lengths: O(1)), not every token a second time. The engine's own fields are
    its values, not input."""
    n = len(out.response_ids)
    if len(out.response_mask) != n or len(out.response_logprobs) != n or (out.token_versions and
                                                                          len(out.token_versions) != n):
        raise ValueError(f"the loop changed its output after building it: response_ids ({n}), response_mask "
                         f"({len(out.response_mask)}), response_logprobs ({len(out.response_logprobs)}) and "
                         f"token_versions ({len(out.token_versions)}) differ in length")
    fields = {k: v for k, v in out.__dict__.items() if k not in ("reward", "error")}
    fields.update(identity)
    return EpisodeRecord.model_construct(**fields)


def _describe(e: BaseException) -> str:
    """An exception's message for a record; a pydantic ValidationError (a loop building a bad output) as
    its errors' messages only, without the input it echoes (a whole `extra` can be long)."""
    if isinstance(e, ValidationError):
        return "; ".join((f"{'.'.join(map(str, err['loc']))}: " if err["loc"] else "") + err["msg"]
                         for err in e.errors(include_url=False, include_input=False))
    return str(e)


class GroupStream:
    """GRPO groups in flight; each submitted group comes out of `next()` exactly once (a
    rollout.stream.GroupStreamProtocol).

    Each group runs its episodes concurrently (each holding an engine slot, taken in submission order);
    it comes out complete when its last episode ends, or cancelled (`cancel`, `cancel_all`, or every
    server down). Records of a cancelled group are dropped, its episodes counted. Groups are keyed by
    their uid unless `submit` is given a key. `on_episode` sees every record as it is made; with
    `error_record_on_stop` the episode that found every server down ends as an error record (the eval
    path) rather than cancelling its group. All methods run on the engine's loop.
    """

    def __init__(self, engine: RolloutEngine, *, step: int | None = None,
                 on_episode: Callable[[EpisodeRecord], Awaitable[None]] | None = None,
                 error_record_on_stop: bool = False, journal: Journal | None = None):
        self.engine = engine
        self.step = step
        self.journal = journal
        """Episodes journaled and continued from the journal (agentloop.journal); None: neither."""
        self.on_episode = on_episode
        self.error_record_on_stop = error_record_on_stop
        self._tasks: dict[int, asyncio.Task] = {}
        self._samples: dict[int, Sample] = {}
        self._versions: dict[int, int | None] = {}
        self._started: dict[int, int | None] = {}
        self._sizes: dict[int, int] = {}
        self._cancel_reason: dict[int, str] = {}
        self._abandoned: set[int] = set()
        """Groups cancel_all gave up on: their task still runs, its outcome is already out."""
        self._done: asyncio.Queue[GroupOutcome] = asyncio.Queue()
        self.stopped: str | None = None
        """Why nothing more can finish (every server went down, the record sink failed): the stream cancels
        what is left and takes no more."""
        self.counts = {"submitted": 0, "completed": 0, "cancelled": 0, "episodes_cancelled": 0}

    @property
    def running(self) -> int:
        """Groups submitted and not yet out of `next()` (running or finished, not collected)."""
        return len(self._tasks)

    def running_uids(self) -> list[int]:
        return list(self._tasks)

    async def running_versions(self) -> dict[int, int | None]:
        """uid -> `started_version` of every group in flight (async: a stream of remote workers asks them)."""
        return {u: self._started.get(u) for u in self._tasks}

    def busy_fraction(self, reset: bool = False) -> float:
        """The engine's `busy_fraction`: the share of time with an episode running."""
        return self.engine.busy_fraction(reset=reset)

    def submitted_version(self, uid: int) -> int | None:
        return self._versions.get(uid)

    def started_version(self, uid: int) -> int | None:
        """The expected weight version when the group's first episode started running (None: none has
        started yet). Its tokens are of this version or newer."""
        return self._started.get(uid)

    def submit(self, sample: Sample, n: int, *, key: int | None = None) -> None:
        """Start a group of `n` episodes of `sample`, keyed by `key` (default its `group_uid`; a key must
        be new in this stream)."""
        uid = sample.group_uid if key is None else key
        if uid in self._tasks:
            raise ValueError(f"group {uid} is already in this stream")
        if self.stopped:
            raise AgentLoopError(f"the group stream stopped: {self.stopped}")
        self._samples[uid] = sample
        self._sizes[uid] = n
        self._versions[uid] = self.engine.sm.expected_version
        self._tasks[uid] = asyncio.create_task(self._group(uid, sample, n), name=f"group-{uid}")
        self.counts["submitted"] += 1

    def cancel(self, uid: int, reason: str) -> bool:
        """Cancel a running group (its outcome still comes out of `next()`, cancelled)."""
        task = self._tasks.get(uid)
        if task is None or task.done():
            return False
        self._cancel_reason[uid] = reason
        task.cancel()
        return True

    async def next(self, timeout: float | None = None) -> GroupOutcome:
        """The next group to finish (complete or cancelled)."""
        out = await (asyncio.wait_for(self._done.get(), timeout) if timeout is not None else self._done.get())
        return out

    def ready(self) -> int:
        """Finished groups waiting to be taken with `next()`."""
        return self._done.qsize()

    async def cancel_all(self, reason: str) -> list[GroupOutcome]:
        """Cancel every running group and return every outcome not yet taken (cancelled or complete). Groups
        whose episodes do not finish their clean-up within `rollout.cancel_timeout_s` (a tool or agent that
        hangs in it) are given up on: they come out cancelled, saying so, and their tasks are left behind."""
        for uid in list(self._tasks):
            self.cancel(uid, reason)
        out = []
        limit = self.engine.cfg.rollout.cancel_timeout_s

        async def collect() -> None:
            while self._tasks:
                out.append(await self._done.get())

        try:
            await asyncio.wait_for(collect(), limit)
        except asyncio.TimeoutError:
            for uid in list(self._tasks):
                self._abandoned.add(uid)
                del self._tasks[uid]
                self._started.pop(uid, None)
                n = self._sizes[uid]  # counted as cancelled by its task already, when the cancel reached it
                out.append(GroupOutcome(sample=self._samples[uid], n=n, submitted_version=self._versions[uid],
                                        key=uid, cancelled=f"{reason} (its episodes did not stop within "
                                                  f"rollout.cancel_timeout_s={limit:g}: abandoned)"))
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out

    async def close(self) -> None:
        await self.cancel_all("stream closed")

    def _stop(self, reason: str, but: int | None = None) -> None:
        """Nothing more can finish (every server is down, records cannot be written): cancel every other
        group, take no new ones."""
        if self.stopped:
            return
        self.stopped = reason
        for other in list(self._tasks):
            if other != but:
                self.cancel(other, reason)

    async def _group(self, uid: int, sample: Sample, n: int) -> None:
        eps = [asyncio.create_task(self._episode(uid, sample.with_repeat(r)), name=f"episode-{uid}-{r}")
               for r in range(n)]
        outcome: GroupOutcome | None = None
        try:
            records = [r for segments in await asyncio.gather(*eps) for r in segments]
            outcome = GroupOutcome(sample=sample, records=records, n=n, submitted_version=self._versions[uid],
                                   key=uid)
            self.counts["completed"] += 1
        except (asyncio.CancelledError, Exception) as e:  # noqa: BLE001 - the group comes out cancelled, named
            # Cancelled, or a failure no record can hold (the record sink failed): the group comes out
            # cancelled, with the reason, whatever happens to its other episodes.
            why = None if isinstance(e, asyncio.CancelledError) else f"{type(e).__name__}: {e}"
            outcome = GroupOutcome(sample=sample, n=n, submitted_version=self._versions[uid], key=uid,
                                   cancelled=self._cancel_reason.get(uid) or self.stopped or why or "cancelled")
            self.counts["cancelled"] += 1
            self.counts["episodes_cancelled"] += n
            for t in eps:
                t.cancel()
            await asyncio.gather(*eps, return_exceptions=True)
        finally:
            if outcome is None:  # cancelled again while its episodes were being cancelled
                outcome = GroupOutcome(sample=sample, n=n, submitted_version=self._versions[uid], key=uid,
                                       cancelled=self._cancel_reason.get(uid) or self.stopped or "cancelled")
            if uid in self._abandoned:  # cancel_all already put out its outcome
                self._abandoned.discard(uid)
            else:
                del self._tasks[uid]
                self._started.pop(uid, None)
                self._done.put_nowait(outcome)

    async def _episode(self, uid: int, sample: Sample) -> list[EpisodeRecord]:
        async with self.engine._slots:
            # thousands of episodes admitted at once start a few per loop iteration (agentloop.util.pacing)
            await self.engine.gate.enter()
            if self.stopped:  # nothing can finish any more (servers down, sink failed): never started
                raise asyncio.CancelledError
            if uid not in self._started:  # a resumed group: as old as its oldest journaled token
                self._started[uid] = journaled_started_version(self.journal, uid, self.engine.sm.expected_version)
            try:
                rec = await self.engine._run_episode(sample, self.step, self.journal)
            except AllServersDownError as e:
                self._stop(f"every server went down: {e}", but=uid)
                if not self.error_record_on_stop:
                    raise asyncio.CancelledError from e
                rec = self.engine._error_record(sample, e, self.step, 0.0)
            except Exception as e:  # noqa: BLE001 - the engine's last resort: one record per episode, always
                rec = self.engine._error_record(sample, e, self.step, 0.0)
        try:  # one record per segment of the episode (most have one); a journaled episode's already are
            records = rec if isinstance(rec, list) else rec.split_segments()
        except Exception as e:  # noqa: BLE001 - segments that make no record: the episode's failure, as a record
            records = [self.engine._error_record(sample, e, self.step, 0.0)]
        if self.on_episode is not None:
            try:
                for r in records:
                    await self.on_episode(r)
            except Exception as e:  # the sink (the record writer) failed: no later record could be kept either
                self._stop(f"the record sink failed: {type(e).__name__}: {e}", but=uid)
                raise
        return records
