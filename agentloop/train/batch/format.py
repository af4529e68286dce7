"""A step's batch as the learner trains it: one safetensors file, prepared by the orchestrator, of which each
learner rank reads only what it trains.

The orchestrator holds the step's GRPO groups, so it computes what the learner would otherwise rebuild from
whole records: the episodes that enter the loss with their advantages, the step's batch metrics, the
mini-batches, and every rank's packed micro-batches (which episodes share a row, which rows share a forward).
The file holds exactly that (token ids, masks, behaviour logprobs, versions, advantages, the plan) and nothing
else: no text, no message lists, no record fields the learner never reads. One array form end to end: the
orchestrator's numpy arrays (agentloop.train.batch.episodes.Episodes) are written as they are, a rank reads views
of its own rows back, and agentloop.train.trainer.collate turns them into its micro-batches' tensors.

File form (safetensors; FORMAT names this layout):
    __metadata__  format, step, layout (BatchLayout), minis, plan ([mini-batch][rank][micro-batch][row] ->
                  episode indices), metrics, ranks ([token start, token end, response start, response end] of
                  each rank's slice), unversioned (an episode whose model tokens lack a weight version, -1: none);
                  JSON strings
    per episode   n values each, in the orchestrator's episode order (the plan's indices), read whole by every
                  rank (a few bytes an episode): prompt_len, size, model_tokens, advantage, reward, uid,
                  has_versions, start, rstart (where its tokens and response positions start)
    per token     ids (int32), and per response token response_mask (uint8), logprobs (float32), versions
                  (int32): laid out rank by rank, each rank's episodes back to back in the order of its
                  micro-batches, so a rank's rows are one contiguous slice of each array
    per record    ok_rewards, ok_groups, ok_lengths, ok_episode: what verl's order of a step re-estimates
                  advantages from (agentloop.train.trainer.verl_order)
A 512-episode step of ~900 tokens each is ~3 MB; a rank of W reads the per-episode arrays and ~1/W of the rest.

Map:
    BatchLayout    what the plan depends on that only the learner knows (ranks, packed or padded rows, prompt
                   sharing, the FLOP model's row cost, token budget, padding): reported by the learner when
                   it is ready (LearnerInfo.layout), so the orchestrator plans for the learner it talks to
    TrainBatch     one step, whole (the orchestrator's; prepare_batch in agentloop.train.batch.prepare):
                   to_bytes / load, for_rank (in memory)
    RankBatch      one rank's share, read from the file or the bytes (RankBatch.read): the per-episode arrays,
                   its own rows, the plan, the metrics
    check_batch    the file's header and metadata, without reading its arrays (learner rank 0, before every rank
                   reads its share)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from agentloop.errors import AgentLoopError
from agentloop.train.batch.episodes import Episodes, Prepared

FORMAT = "agentloop-batch/2"
"""The layout this module writes and reads (the metadata's `format`)."""

_DTYPES = {"I32": np.int32, "I64": np.int64, "U8": np.uint8, "F32": np.float32, "F64": np.float64}
_PER_EPISODE = ("prompt_len", "size", "model_tokens", "advantage", "reward", "uid", "has_versions", "start", "rstart")
_PER_TOKEN = ("ids",)
_PER_RESPONSE = ("response_mask", "logprobs", "versions")
_PER_RECORD = ("ok_rewards", "ok_groups", "ok_lengths", "ok_episode")
_META = ("format", "step", "layout", "minis", "plan", "metrics", "ranks", "unversioned")


class BatchFormatError(AgentLoopError):
    """A batch's bytes are not a step's batch of this format."""


@dataclass(frozen=True)
class BatchLayout:
    """How the learner lays out micro-batches (Learner.layout); the orchestrator's plan follows it."""

    world: int = 1
    """Learner ranks."""
    layout: Literal["padded", "packed"] = "padded"
    """A row per episode (or shared prompt), or every row of a micro-batch back to back (learner.attention)."""
    share: Literal["on", "off", "auto"] = "off"
    """learner.share_prompt as the learner resolved it for its attention."""
    row_cost: tuple[float, float] | None = None
    """The FLOP model's RowCost (per token, per pair) of the learner's model: share=auto decides with it."""
    budget: int = 8192
    """learner.micro_batch_tokens."""
    pad_multiple: int = 1
    """Packed rows are padded to a multiple of this."""
    pad_id: int = 0
    """The model's pad token."""
    mini_batches: int = 1
    """learner.mini_batches."""
    seed: int = 0
    """learner.seed (the mini-batch shuffle of step s is seeded with seed * 1_000_003 + s)."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["row_cost"] = list(self.row_cost) if self.row_cost is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BatchLayout:
        d = dict(d)
        if d.get("row_cost") is not None:
            d["row_cost"] = tuple(float(x) for x in d["row_cost"])
        return cls(**d)


@dataclass
class _Shared:
    """What a whole batch and a rank's share have in common."""

    step: int
    layout: BatchLayout
    episodes: Episodes
    """Per-episode arrays of every episode; the token arrays of those held (all, or the rank's own)."""
    uid: np.ndarray
    """int64 [n]: each episode's GRPO group (the prompt's stream position), -1 when unknown."""
    ok_rewards: np.ndarray
    """float64: rewards of every usable record (Prepared.ok_rewards)."""
    ok_groups: np.ndarray
    """int64: their group numbers."""
    ok_lengths: np.ndarray
    """int64: their model-token counts."""
    ok_episode: np.ndarray
    """int64: per usable record, its episode index, -1 when it is not in the loss."""
    minis: list[list[int]]
    """The mini-batches (episode indices)."""
    plan: list[list[list[list[list[int]]]]]
    """[mini-batch][rank][micro-batch][row] -> episode indices (agentloop.train.batch.packing.plan_ranks)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """batch/*, reward/*, adv/*, async/* numbers of the step (the learner reports them with its own)."""
    unversioned: int = -1
    """An episode with a model token of unknown weight version (algo.proximal=interpolate refuses it); -1: none."""

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def episode_tokens(self) -> int:
        """Tokens the model reads, over every episode of the step."""
        return int(self.episodes.lengths.sum())

    def prepared(self) -> Prepared:
        """The batch as agentloop.train.batch.episodes.prepare_episodes made it (verl's order re-estimates from
        it)."""
        return Prepared(episodes=self.episodes, metrics=dict(self.metrics), ok_rewards=self.ok_rewards,
                        ok_groups=self.ok_groups, ok_lengths=self.ok_lengths, ok_episode=self.ok_episode,
                        uids=self.uid)


@dataclass
class TrainBatch(_Shared):
    """One step's batch, whole: the orchestrator's (module doc). Its token arrays are laid out rank by rank;
    `ranks[r]` is rank r's (token start, token end, response start, response end)."""

    ranks: list[tuple[int, int, int, int]] = field(default_factory=list)

    def tokens(self, i: int) -> list[int]:
        """Episode i's prompt + response token ids."""
        return self.episodes[i].ids.tolist()

    def response_ids(self, i: int) -> list[int]:
        e = self.episodes[i]
        return e.ids[e.prompt_len:].tolist()

    def _arrays(self) -> dict[str, np.ndarray]:
        e = self.episodes
        out = {name: getattr(e, name) for name in _PER_EPISODE if name != "uid"}
        out.update(uid=self.uid, ids=e.ids, response_mask=e.response_mask, logprobs=e.logprobs, versions=e.versions,
                   ok_rewards=self.ok_rewards, ok_groups=self.ok_groups, ok_lengths=self.ok_lengths,
                   ok_episode=self.ok_episode)
        return {k: np.ascontiguousarray(v) for k, v in out.items()}

    def _meta(self) -> dict[str, str]:
        return {"format": FORMAT, "step": str(self.step), "layout": json.dumps(self.layout.to_json()),
                "minis": json.dumps(self.minis, separators=(",", ":")),
                "plan": json.dumps(self.plan, separators=(",", ":")), "metrics": json.dumps(self.metrics),
                "ranks": json.dumps(self.ranks), "unversioned": str(self.unversioned)}

    def to_bytes(self) -> bytes:
        """The safetensors file (module doc)."""
        from safetensors.numpy import save

        return save(self._arrays(), metadata=self._meta())

    @classmethod
    def load(cls, source: str | Path | bytes) -> TrainBatch:
        """A whole batch from its file or bytes (inspection, tests)."""
        src = _Source.open(source)
        try:
            head, meta = src.header()
            arrays = {name: src.array(head, name) for name in (*_PER_EPISODE, *_PER_TOKEN, *_PER_RESPONSE,
                                                               *_PER_RECORD)}
        finally:
            src.close()
        eps = _episodes(arrays, arrays)
        return cls(**_common(meta, arrays, eps), ranks=[tuple(r) for r in json.loads(meta["ranks"])])

    def for_rank(self, rank: int) -> RankBatch:
        """Rank `rank`'s share, in memory (views): what RankBatch.read gives that rank from the file."""
        t0, t1, r0, r1 = self.ranks[rank] if self.ranks else (0, 0, 0, 0)
        e = self.episodes
        held = (e.start >= t0) & (e.start < t1) if len(e) else np.zeros(0, bool)
        mine = Episodes(prompt_len=e.prompt_len, size=e.size, model_tokens=e.model_tokens, advantage=e.advantage,
                        reward=e.reward, has_versions=e.has_versions, start=np.where(held, e.start - t0, -1),
                        rstart=np.where(held, e.rstart - r0, -1), ids=e.ids[t0:t1],
                        response_mask=e.response_mask[r0:r1], logprobs=e.logprobs[r0:r1], versions=e.versions[r0:r1])
        fields = {k: getattr(self, k) for k in ("step", "layout", "uid", "ok_rewards", "ok_groups", "ok_lengths",
                                                "ok_episode", "minis", "plan", "metrics", "unversioned")}
        return RankBatch(**fields, episodes=mine, rank=rank)


@dataclass
class RankBatch(_Shared):
    """One learner rank's share of a step's batch (module doc): every per-episode array, its own rows' token
    arrays (`episodes[i]` of another rank's episode is an IndexError), the plan and the metrics."""

    rank: int = 0
    read_bytes: int = 0
    """Bytes read from the source (its header included)."""

    @classmethod
    def read(cls, source: str | Path | bytes, rank: int) -> RankBatch:
        """Rank `rank`'s share from the batch file (only the header, the per-episode arrays and its own slices
        of the token arrays are read) or from the file's bytes."""
        src = _Source.open(source)
        try:
            head, meta = src.header()
            ranks = json.loads(meta["ranks"])
            if ranks and not 0 <= rank < len(ranks):
                raise BatchFormatError(f"the batch was planned for {len(ranks)} rank(s); this is rank {rank}")
            t0, t1, r0, r1 = ranks[rank] if ranks else (0, 0, 0, 0)
            whole = {name: src.array(head, name) for name in (*_PER_EPISODE, *_PER_RECORD)}
            rows = {name: src.array(head, name, t0, t1) for name in _PER_TOKEN}
            rows.update({name: src.array(head, name, r0, r1) for name in _PER_RESPONSE})
            read_bytes = src.read_bytes
        finally:
            src.close()
        start, rstart = whole["start"], whole["rstart"]
        held = (start >= t0) & (start < t1)
        whole = {**whole, "start": np.where(held, start - t0, -1), "rstart": np.where(held, rstart - r0, -1)}
        return cls(**_common(meta, whole, _episodes(whole, rows)), rank=rank, read_bytes=read_bytes)

    def my_micro_batches(self, j: int) -> list[list[list[int]]]:
        """This rank's micro-batches (rows of episode indices) of mini-batch j."""
        return self.plan[j][self.rank]


def check_batch(source: str | Path | bytes) -> dict[str, Any]:
    """The batch's step, layout and plan from its header and metadata (BatchFormatError when they are not this
    format's, or an array runs past the end), without reading any array: learner rank 0 checks a batch before
    every rank reads its share."""
    src = _Source.open(source)
    try:
        _, meta = src.header()
    finally:
        src.close()
    return {"step": int(meta["step"]), "layout": json.loads(meta["layout"])}


# ---------------------------------------------------------------------------- reading


def _episodes(per_episode: dict[str, np.ndarray], tokens: dict[str, np.ndarray]) -> Episodes:
    return Episodes(**{k: per_episode[k] for k in _PER_EPISODE if k != "uid"},
                    **{k: tokens[k] for k in (*_PER_TOKEN, *_PER_RESPONSE)})


def _common(meta: dict[str, str], arrays: dict[str, np.ndarray], eps: Episodes) -> dict[str, Any]:
    return {"step": int(meta["step"]), "layout": BatchLayout.from_json(json.loads(meta["layout"])),
            "episodes": eps, "uid": arrays["uid"], "ok_rewards": arrays["ok_rewards"],
            "ok_groups": arrays["ok_groups"], "ok_lengths": arrays["ok_lengths"], "ok_episode": arrays["ok_episode"],
            "minis": json.loads(meta["minis"]), "plan": json.loads(meta["plan"]),
            "metrics": json.loads(meta["metrics"]), "unversioned": int(meta["unversioned"])}


class _Source:
    """The bytes of a batch: a file read at positions (os.pread: only what is asked for) or a buffer."""

    def __init__(self, fd: int | None, buf: memoryview | None, size: int):
        self.fd, self.buf, self.size = fd, buf, size
        self.read_bytes = 0
        self._base = 0

    @classmethod
    def open(cls, source: str | Path | bytes) -> _Source:
        if isinstance(source, (bytes, bytearray, memoryview)):
            buf = memoryview(source)
            return cls(None, buf, len(buf))
        fd = os.open(source, os.O_RDONLY)
        return cls(fd, None, os.fstat(fd).st_size)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _read(self, offset: int, length: int) -> bytes | memoryview:
        if offset < 0 or offset + length > self.size:
            raise BatchFormatError(f"batch truncated: {offset + length} bytes needed, {self.size} there")
        self.read_bytes += length
        if self.buf is not None:
            return self.buf[offset:offset + length]
        assert self.fd is not None
        out = os.pread(self.fd, length, offset)
        if len(out) != length:
            raise BatchFormatError(f"batch truncated: {offset + length} bytes needed, {offset + len(out)} read")
        return out

    def header(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The safetensors header (name -> dtype, shape, data offsets) and our metadata, checked."""
        if self.size < 8:
            raise BatchFormatError("not a batch file (shorter than a safetensors header)")
        n = int.from_bytes(bytes(self._read(0, 8)), "little")
        if n <= 0 or n > 100 * 2**20:
            raise BatchFormatError("not a batch file (no safetensors header)")
        try:
            head = json.loads(bytes(self._read(8, n)))
        except (ValueError, UnicodeDecodeError) as e:
            raise BatchFormatError(f"not a batch file (unreadable safetensors header: {e})") from None
        if not isinstance(head, dict):
            raise BatchFormatError("not a batch file (its safetensors header is no object)")
        meta = head.pop("__metadata__", None) or {}
        fmt = meta.get("format")
        if fmt != FORMAT:
            raise BatchFormatError(f"a batch of format {fmt!r}; this learner reads {FORMAT!r}")
        missing = [k for k in _META if k not in meta] + \
            [k for k in (*_PER_EPISODE, *_PER_TOKEN, *_PER_RESPONSE, *_PER_RECORD) if k not in head]
        if missing:
            raise BatchFormatError(f"batch without {', '.join(missing)}")
        self._base = 8 + n
        end = max((int(v["data_offsets"][1]) for v in head.values()), default=0)
        if self._base + end > self.size:
            raise BatchFormatError(f"batch truncated: its arrays end at byte {self._base + end}, the file at "
                                   f"{self.size}")
        return head, meta

    def array(self, head: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """1-d array `name`, or its elements [lo, hi)."""
        spec = head[name]
        dt = np.dtype(_DTYPES[spec["dtype"]])
        begin, end = (int(x) for x in spec["data_offsets"])
        count = (end - begin) // dt.itemsize
        lo, hi = (0, count) if lo is None else (lo, hi)
        if not 0 <= lo <= hi <= count:
            raise BatchFormatError(f"batch array {name}: elements [{lo}, {hi}) of {count}")
        raw = self._read(self._base + begin + lo * dt.itemsize, (hi - lo) * dt.itemsize)
        return np.frombuffer(raw, dtype=dt)


__all__ = ["FORMAT", "BatchFormatError", "BatchLayout", "RankBatch", "TrainBatch", "check_batch"]
