"""Journal: a training run's episode journal, `RUN_DIR/journal/` (docs/journal.md, "Nothing lost at a crash").

Map:
    journal_header   what a journal is valid for: the model, the data fingerprint (the cursor's), the rollout
                     config's parts that shape an episode (loop, sampling, tools, reward, template, context, seed)
    Journal.open     read what an earlier process left (reader.py), check its headers against this run's
                     (JournalMismatchError naming what differs, or moved aside with journal.on_mismatch=discard),
                     start this process's writer (writer.py)
    Journal.plan_resume  which journaled groups go on: those handed out and not trained (per the learner's data
                     state), not dropped, whose oldest token is within the staleness bound of the first step; the
                     others are dropped (counted) and their prompts given out again as before
    Journal.tape     an episode's tape (tape.py): recording, or replaying what the journal holds for it
    Journal.episode_done / group_dropped / trained   an episode's records; a group that will never be trained; a
                     step's batch handed to the learner: then the segment is closed and the closed segments are
                     compacted (without the trained and dropped groups) on a thread of their own
    Journal.counts   journal/... numbers for each step's row (episodes resumed, tokens reused, ...)

Directory: `<writer>-<n>.jal` segments (`d` for this process; Ray rollout workers write their own), `c-<n>.jal`
the compacted ones. Each segment starts with a HEADER; records are frames (frames.py) of codec.py's kinds.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agentloop.errors import ConfigError
from agentloop.journal import codec
from agentloop.journal.config import JournalConfig
from agentloop.journal.frames import frame, iter_prefixes, scan
from agentloop.journal.reader import EpisodeLog, JournalState, read_journal, segment_files
from agentloop.journal.tape import EpisodeTape
from agentloop.journal.writer import SegmentWriter, fsync_dir
from agentloop.records import Sample

FORMAT = 1


class JournalMismatchError(ConfigError):
    """The journal in the run dir was written for another model, data file or rollout config."""


def _digest(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def journal_header(cfg: Any, model: str, data_fingerprint: str) -> dict[str, Any]:
    """What a journal is valid for (module doc). `cfg`: the run's Config."""
    reward = cfg.reward.model_dump(mode="json", exclude={"workers", "executor", "timeout_s"})
    parts = {"rollout.loop": cfg.rollout.loop, "rollout.n_samples": cfg.rollout.n_samples,
             "rollout.seed": cfg.rollout.seed, "sampling": _digest(cfg.sampling.model_dump(mode="json")),
             "tools": _digest(cfg.tools.model_dump(mode="json")), "reward": _digest(reward),
             "data.apply_chat_template": cfg.data.apply_chat_template,
             "model.context_length": cfg.model.context_length, "agent": _digest(cfg.agent.model_dump(mode="json"))}
    return {"format": FORMAT, "model": model, "data": data_fingerprint, "config": parts}


def header_mismatch(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between a stored header and this run's, each named: `model: A -> B`."""
    out = []
    if stored.get("format") != current["format"]:
        out.append(f"format: {stored.get('format')!r} -> {current['format']!r}")
    for key, what in (("model", "model"), ("data", "data (the training rows' fingerprint)")):
        if stored.get(key) != current[key]:
            out.append(f"{what}: {stored.get(key)!r} -> {current[key]!r}")
    old, new = stored.get("config") or {}, current["config"]
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            out.append(f"config {k}: {old.get(k)!r} -> {new.get(k)!r}")
    return out


@dataclass
class ResumePlan:
    """What `plan_resume` decided (also the numbers the start of a resumed run prints)."""

    groups: dict[int, int] = field(default_factory=dict)
    """uid -> the journaled attempt that goes on."""
    oldest: dict[int, int | None] = field(default_factory=dict)
    """uid -> the oldest weight version its journaled tokens hold."""
    episodes: int = 0
    finished_episodes: int = 0
    tokens: int = 0
    """Model tokens of the journaled effects and finished records that go on (what a resume reuses)."""
    dropped_stale: list[tuple[int, int, int | None]] = field(default_factory=list)
    """(uid, attempt, oldest version) of groups too stale for the first step."""
    episodes_dropped_stale: int = 0
    already_trained: int = 0
    damaged_records: int = 0

    def line(self) -> str:
        return (f"journal: {len(self.groups)} group(s) go on from where they stood ({self.episodes} episodes, "
                f"{self.finished_episodes} of them finished, {self.tokens} model tokens reused), "
                f"{len(self.dropped_stale)} dropped as too stale ({self.episodes_dropped_stale} episodes, prompts "
                f"given out again), {self.damaged_records} damaged record(s) dropped")


class Journal:
    """A run's episode journal (module doc). Its methods run on the event loop's thread, except where said."""

    def __init__(self, directory: Path, cfg: JournalConfig, header: dict[str, Any], *, writer: str = "d",
                 state: JournalState | None = None):
        self.directory = directory
        self.cfg = cfg
        self.header = header
        self.state = state or JournalState()
        self.counts: Counter[str] = Counter({k: 0 for k in ("compactions", "compaction_failures",
                                                             "compacted_bytes_in", "compacted_bytes_out")})
        """journal/... numbers. The compactor's thread adds to its own keys only, present from the start, so a reader
        on the event loop never sees the dict change size."""
        self.restart_reasons: Counter[str] = Counter()
        self.closed = False
        self._index: dict[tuple[int, int, int], EpisodeLog] = {}
        self._oldest: dict[int, int | None] = {}
        self._trained: set[int] = set(self.state.trained)
        self._dropped: set[tuple[int, int]] = set(self.state.dropped)
        self._compactor = ThreadPoolExecutor(1, thread_name_prefix="journal-compact")
        self._compaction: Future | None = None
        self.on_trained: list[Callable[[], Any]] = []
        """Called at every step boundary after the segment is closed (Ray rollout workers close theirs)."""
        self._resumed: set[tuple[int, int]] = set()
        self._scan_waiters: list[tuple[set[int], asyncio.Future]] = []
        self._scan_task: asyncio.Task | None = None
        self._earlier: list[Path] = []
        """Segments an earlier process left, and the last compaction's output: the next compaction's inputs with
        the segments closed since (guarded by `_carry_lock`: the writer's and the compactor's threads share it)."""
        self._carry_lock = threading.Lock()
        header_payload = codec.encode(codec.HEADER, codec.RUN, 0, 0, dict(header))
        self.writer = SegmentWriter(directory, writer, lambda: header_payload,
                                    write_interval_ms=cfg.write_interval_ms, fsync_interval_ms=cfg.fsync_interval_ms,
                                    max_queue_mb=cfg.max_queue_mb, segment_mb=cfg.segment_mb)

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, directory: Path, cfg: JournalConfig, header: dict[str, Any], *, writer: str = "d",
             say: Callable[[str], None] | None = None) -> "Journal":
        """Open (or start) the journal in `directory` (module doc)."""
        directory.mkdir(parents=True, exist_ok=True)
        for tmp in directory.glob("*.tmp"):  # a compaction killed before its rename: its inputs are intact
            tmp.unlink(missing_ok=True)
        state = read_journal(directory)
        if state.records and not state.headers:
            raise JournalMismatchError(f"{directory} holds {state.records} journal record(s) but no readable header "
                                       "saying which run they belong to; move it aside to start a new journal")
        problems = sorted({p for h in state.headers for p in header_mismatch(h, header)})
        if problems:
            if cfg.on_mismatch == "refuse":
                raise JournalMismatchError(
                    f"the journal in {directory} was written for another run: " + "; ".join(problems) +
                    ". Resume with the run's own model, data and settings, or set journal.on_mismatch=discard "
                    "(the journal is moved aside and the episodes in it are rolled out again)")
            aside = directory.with_name(f"{directory.name}.discarded-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(str(directory), str(aside))
            directory.mkdir(parents=True)
            if say is not None:
                say(f"journal: {directory} was written for another run ({'; '.join(problems)}); moved to {aside}")
            state = JournalState()
        j = cls(directory, cfg, header, writer=writer, state=state)
        j.counts["records_damaged"] += state.damaged_records
        j._earlier = [p for p in state.files if p.exists()]
        return j

    # ------------------------------------------------------------------ resume

    def plan_resume(self, *, handed_out: Callable[[int], bool], floor_version: int | None) -> ResumePlan:
        """Which journaled groups go on (module doc). `handed_out(uid)`: the learner's data state says uid was
        handed out and not trained; `floor_version`: the oldest weight version the first step may train (None:
        any). Groups too stale are journaled as dropped; their prompts go out again the cursor's way."""
        plan = ResumePlan(damaged_records=self.state.damaged_records)
        for uid, attempts in sorted(self.state.groups().items()):
            if not handed_out(uid):
                plan.already_trained += 1
                self._trained.add(uid)  # in a batch whose TRAINED record the kill cut off: compacted away
                continue
            attempt = max(attempts)
            eps = attempts[attempt]
            for a in attempts:
                if a != attempt:
                    self.group_dropped(uid, a, "superseded by a later attempt")
            vs = [v for e in eps if (v := e.oldest_version) is not None]
            oldest = min(vs) if vs else None
            if floor_version is not None and oldest is not None and oldest < floor_version:
                plan.dropped_stale.append((uid, attempt, oldest))
                plan.episodes_dropped_stale += len(eps)
                self.group_dropped(uid, attempt, f"stale at resume: oldest token of version {oldest}, "
                                                 f"the first step needs >= {floor_version}")
                continue
            plan.groups[uid] = attempt
            plan.oldest[uid] = oldest
            self._oldest[uid] = oldest
            for e in eps:
                self._index[(uid, attempt, e.repeat)] = e
                plan.episodes += 1
                plan.finished_episodes += e.finished
                recs = e.records()
                plan.tokens += sum(r.num_model_tokens for r in recs) if recs is not None else e.model_tokens
        self.counts["groups_dropped_stale"] += len(plan.dropped_stale)
        self.counts["episodes_dropped_stale"] += plan.episodes_dropped_stale
        self.counts["tokens_journaled_at_resume"] += plan.tokens
        self.resume_plan = plan
        self.state.episodes = {}  # what goes on is in the index now: the rest need not stay in memory
        return plan

    def resumed_sample(self, sample: Sample) -> Sample:
        """The prompt as the journal has it in flight (its attempt, so its seeds and episode ids), or as given."""
        plan = getattr(self, "resume_plan", None)
        if plan is None or sample.uid is None or sample.uid not in plan.groups:
            return sample
        attempt = plan.groups.pop(sample.uid)
        self._resumed.add((sample.uid, attempt))
        return sample if attempt == sample.attempt else sample.model_copy(update={"attempt": attempt})

    def is_resumed(self, sample: Sample) -> bool:
        """Whether this prompt was given out to go on from the journal (`resumed_sample`)."""
        return (sample.group_uid, sample.attempt) in self._resumed

    def oldest_version(self, uid: int) -> int | None:
        """The oldest version among a resumed group's journaled tokens (None: none, or not resumed)."""
        return self._oldest.get(uid)

    def episode_log(self, sample: Sample) -> EpisodeLog | None:
        return self._index.get((sample.group_uid, sample.attempt, sample.repeat))

    async def _scan(self, uids: set[int]) -> JournalState:
        """The journal's records of `uids`, read from disk once everything this writer was given is written.
        Requests made while a scan is pending share it (a server dying fails many episodes at once)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._scan_waiters.append((set(uids), fut))
        if self._scan_task is None or self._scan_task.done():
            self._scan_task = loop.create_task(self._scan_batches(), name="journal-scan")
        return await fut

    async def _scan_batches(self) -> None:
        while self._scan_waiters:
            waiters, self._scan_waiters = self._scan_waiters, []
            await self.sync()
            uids = set().union(*(u for u, _ in waiters))
            try:
                state = await asyncio.to_thread(read_journal, self.directory, uids)
            except Exception as e:  # noqa: BLE001 - handed to each waiter
                for _, f in waiters:
                    if not f.done():
                        f.set_exception(e)
                continue
            for _, f in waiters:
                if not f.done():
                    f.set_result(state)

    async def reload_episode(self, sample: Sample) -> EpisodeLog | None:
        """An episode's journaled effects, read back from disk (to continue it after a server failure)."""
        state = await self._scan({sample.group_uid})
        return state.episodes.get((sample.group_uid, sample.attempt, sample.repeat))

    async def load_group(self, uid: int, attempt: int) -> int:
        """Read a group's journaled episodes from disk into the index `tape` serves from (a group whose rollout
        worker died, continued elsewhere). Returns how many episodes it found."""
        state = await self._scan({uid})
        if (uid, attempt) in state.dropped:
            return 0
        found = 0
        for (u, a, r), ep in state.episodes.items():
            if u == uid and a == attempt:
                self._index[(u, a, r)] = ep
                found += 1
                v = ep.oldest_version
                if v is not None:
                    old = self._oldest.get(uid)
                    self._oldest[uid] = v if old is None else min(old, v)
        return found

    # ------------------------------------------------------------------ episodes

    def tape(self, sample: Sample, *, record: bool = True) -> EpisodeTape:
        """The episode's tape: replaying what the journal holds for it (taken from the index), or new."""
        log = self._index.pop((sample.group_uid, sample.attempt, sample.repeat), None)
        return EpisodeTape(self, sample, log, record=record)

    def tape_from(self, sample: Sample, log: EpisodeLog | None, *, g: int) -> EpisodeTape:
        """A tape replaying `log`'s effects of generation `g` (an episode continued after a failure)."""
        if log is not None:
            log.done.clear()  # its failed end is not journaled; what it did before is
            log.g = g
        tape = EpisodeTape(self, sample, log)
        tape.g = g
        return tape

    def put(self, encode: Callable[[], bytes], size: int) -> bool:
        if self.closed:
            return False
        ok = self.writer.put(encode, size)
        if not ok:
            self.counts["records_dropped_queue_full"] += 1
        return ok

    def note_restart(self, why: str) -> None:
        self.restart_reasons[why.split(":", 1)[0][:80]] += 1

    def group_dropped(self, uid: int, attempt: int, why: str) -> None:
        """The group (uid, attempt) will never be trained (cancelled, given out again with another attempt, dropped
        for an infrastructure failure): its records are void."""
        if (uid, attempt) in self._dropped:
            return
        self._dropped.add((uid, attempt))
        self.put(lambda: codec.encode(codec.DROP, uid, attempt, 0, {"why": why}), 128)

    # ------------------------------------------------------------------ step boundaries

    def trained(self, step: int, uids: Iterable[int], data_state: Any) -> None:
        """Step `step`'s batch went to the learner (its mailbox keeps it): its groups' records are no longer needed.
        The segment is closed and the closed ones compacted on the compactor's thread."""
        uids = sorted(set(uids))
        self._trained.update(uids)
        self.put(lambda: codec.encode(codec.TRAINED, codec.RUN, 0, 0, {"step": step, "uids": uids,
                                                                         "data_state": data_state}),
                 64 + 8 * len(uids))
        rotated = self.writer.rotate()
        for hook in self.on_trained:
            hook()
        if self.cfg.compact:
            # the sets as of now, taken here on the event loop's thread (the callback runs on the writer's)
            void = (frozenset(self._trained), frozenset(self._dropped))
            rotated.add_done_callback(lambda _: self._schedule_compaction(step, data_state, *void))

    def _schedule_compaction(self, step: int, data_state: Any, trained: frozenset[int],
                             dropped: frozenset[tuple[int, int]]) -> None:
        # on the writer thread (a future's callback): segments it closed are final; the compaction itself runs on
        # the compactor's thread, one at a time (inputs not taken now wait for the next step boundary)
        if self.closed or (self._compaction is not None and not self._compaction.done()):
            return
        with self._carry_lock:
            inputs = list(dict.fromkeys(self._earlier + self.writer.closed_segments + self._others_closed()))
            if not inputs:
                return
            self._earlier = []
        self.writer.closed_segments = []
        out = self.directory / f"c-{self._next_compact_index():06d}.jal"
        try:
            self._compaction = self._compactor.submit(compact_segments, inputs, out, trained, dropped,
                                                      step, data_state, self.writer.header())
            self._compaction.add_done_callback(lambda f: self._compacted(f, inputs, out))
        except RuntimeError:  # the compactor is shut down: the journal is closing
            pass

    def _others_closed(self) -> list[Path]:
        """Segments other writers (Ray rollout workers) closed: each one's segments but its newest, which it may
        still be writing (a writer closes one only to open the next)."""
        by_writer: dict[str, list[Path]] = {}
        for p in self.directory.glob("*.jal"):
            name, _, index = p.stem.rpartition("-")
            if name not in ("c", self.writer.name) and index.isdigit():
                by_writer.setdefault(name, []).append(p)
        return [p for paths in by_writer.values() for p in sorted(paths)[:-1]]

    def _next_compact_index(self) -> int:
        return 1 + max((int(p.stem[2:]) for p in self.directory.glob("c-*.jal") if p.stem[2:].isdigit()), default=0)

    def _compacted(self, fut: Future, inputs: list[Path], out: Path) -> None:
        try:
            stats = fut.result()
        except Exception:  # noqa: BLE001 - a failed compaction leaves its inputs in place: nothing is lost
            self.counts["compaction_failures"] += 1
            with self._carry_lock:  # tried again at the next step boundary
                self._earlier = [p for p in inputs if p.exists()] + self._earlier
            return
        with self._carry_lock:  # the next compaction rewrites this output with what was closed since
            self._earlier.append(out)
        self.counts["compactions"] += 1
        self.counts["compacted_bytes_in"] += stats["bytes_in"]
        self.counts["compacted_bytes_out"] += stats["bytes_out"]

    def settle(self, timeout_s: float = 60.0) -> None:
        """Block until what was journaled is written and a compaction started by then has finished (tests, close)."""
        self.writer.sync().result(timeout_s)  # after the rotation callbacks that schedule compactions
        if self._compaction is not None:
            self._compaction.result(timeout_s)

    async def sync(self) -> None:
        """Wait until everything journaled so far is written and fsynced (the step boundary's durability point)."""
        if self.closed:
            return
        fut = self.writer.sync()
        try:
            await asyncio.wrap_future(fut)
        except Exception:  # noqa: BLE001 - a failing disk turns the journal off (writer.error), not the run
            pass

    def gauges(self) -> dict[str, float]:
        """journal/... numbers (cumulative) for a step's row."""
        w = self.writer.stats
        out = {f"journal/{k}": float(v) for k, v in dict(self.counts).items()}
        out.update({"journal/bytes_written": float(w["bytes"]), "journal/records_written": float(w["records"]),
                    "journal/fsyncs": float(w["fsyncs"]), "journal/queued_bytes": float(self.writer.queued_bytes),
                    "journal/writer_failed": float(self.writer.error is not None)})
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.writer.close()
        self._compactor.shutdown(wait=True)


def compact_segments(inputs: list[Path], out: Path, trained: frozenset[int], dropped: frozenset[tuple[int, int]],
                     step: int, data_state: Any, header: bytes) -> dict[str, int]:
    """Rewrite `inputs` as one segment `out` without the records of trained or dropped groups (their DROP records
    stay while the uid is not trained, so a straggling record of a dropped attempt stays void), keeping one TRAINED
    record (the step's data state); then delete the inputs. Crash-safe: `out` is written as `out.tmp`, fsynced,
    renamed, the directory fsynced, and only then are the inputs deleted (a kill in between leaves records twice,
    which reading folds once)."""
    parts = [frame(header)]
    bytes_in = 0
    for path in inputs:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        bytes_in += len(data)
        frames, _ = scan(data)  # damaged stretches are dropped here: they were counted when read at open
        for kind, uid, attempt, _, payload in iter_prefixes(frames):
            if kind in (codec.HEADER, codec.TRAINED):
                continue
            if uid in trained or (kind != codec.DROP and (uid, attempt) in dropped):
                continue
            parts.append(frame(bytes(payload)))
    # the learner's data state names what is trained (plan_resume); the uids need not be listed again
    parts.append(frame(codec.encode(codec.TRAINED, codec.RUN, 0, 0, {"step": step, "uids": [],
                                                                        "data_state": data_state})))
    tmp = out.with_name(out.name + ".tmp")
    data = b"".join(parts)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(out)
    fsync_dir(out.parent)
    for path in inputs:
        if path != out:
            path.unlink(missing_ok=True)
    return {"bytes_in": bytes_in, "bytes_out": len(data), "segments_in": len(inputs)}


def journal_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in segment_files(directory))
