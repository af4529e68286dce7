"""A step's batch as the learner trains it, prepared by the orchestrator and sent in a compact binary form.

The orchestrator holds the step's GRPO groups, so it computes what the learner would otherwise rebuild from
whole records: the episodes that enter the loss with their advantages, the step's batch metrics, the
mini-batches, and every rank's packed micro-batches (which episodes share a row, which rows share a forward).
The learner receives exactly that (token ids, masks, behaviour logprobs, versions, advantages, the plan) and
only turns its own rank's share into tensors (agentloop.train.trainer.collate.collate_micro_batches). No text, no
message lists, no record fields the learner never reads travel.

Map:
    BatchLayout    what the plan depends on that only the learner knows (ranks, packed or padded rows, prompt
                   sharing, the FLOP model's row cost, token budget, padding): reported by the learner when
                   it is ready (LearnerInfo.layout), so the orchestrator plans for the learner it talks to
    TrainBatch     one step: episodes as flat arrays, per-episode scalars, the plan, the metrics, and what
                   verl's order of a step re-estimates from (agentloop.train.trainer.verl_order)
    prepare_batch  (agentloop.train.batch.prepare) records -> TrainBatch, on the orchestrator's side
    TrainBatch.encode / decode   the binary form (below)

Binary form: b"ALTB" + format version (u32) + header length (u64) + a JSON header (step, layout, metrics, the
plan, and for each array its dtype, shape and byte offset) + the arrays' bytes, each 8-byte aligned. Decoding
reads the arrays in place (numpy views of the buffer). A 512-episode step of ~900 tokens each is ~3 MB.

Imports torch (CPU) lazily, for the advantage estimators and the mini-batch shuffle: the orchestrator never
imports the learner (FSDP, the model).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from agentloop.errors import AgentLoopError

if TYPE_CHECKING:
    from agentloop.train.batch.episodes import Episode, Prepared

MAGIC = b"ALTB"
FORMAT = 1


class BatchFormatError(AgentLoopError):
    """A batch's bytes are not a TrainBatch of this format."""


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
class TrainBatch:
    """One step's batch (module doc). Episode i's tokens are ids[id_off[i]:id_off[i+1]]; its response part
    (mask, logprobs, versions) is the slice [resp_off[i]:resp_off[i+1]] of those arrays."""

    step: int
    layout: BatchLayout
    ids: np.ndarray
    """int32: every episode's prompt_ids + response_ids, back to back."""
    id_off: np.ndarray
    """int64 [n + 1]."""
    prompt_len: np.ndarray
    """int32 [n]."""
    response_mask: np.ndarray
    """uint8, per response token."""
    logprobs: np.ndarray
    """float32, per response token: the behaviour policy's (the servers') logprobs."""
    versions: np.ndarray
    """int32, per response token: the weight version that sampled it, -1 unknown (meaningless where
    has_versions is 0)."""
    has_versions: np.ndarray
    """uint8 [n]: whether the record carried token versions."""
    advantage: np.ndarray
    """float64 [n]."""
    reward: np.ndarray
    """float64 [n]."""
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
    """[mini-batch][rank][micro-batch][row] -> episode indices (agentloop.train.trainer.collate.plan_ranks)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """batch/*, reward/*, adv/*, async/* numbers of the step (the learner reports them with its own)."""

    _ARRAYS = ("ids", "id_off", "prompt_len", "response_mask", "logprobs", "versions", "has_versions", "advantage",
               "reward", "uid", "ok_rewards", "ok_groups", "ok_lengths", "ok_episode")

    @property
    def num_episodes(self) -> int:
        return int(self.prompt_len.shape[0])

    @property
    def resp_off(self) -> np.ndarray:
        lens = np.diff(self.id_off) - self.prompt_len
        return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

    def tokens(self, i: int) -> list[int]:
        """Episode i's prompt + response token ids."""
        return self.ids[self.id_off[i]:self.id_off[i + 1]].tolist()

    def response_ids(self, i: int) -> list[int]:
        return self.ids[self.id_off[i] + self.prompt_len[i]:self.id_off[i + 1]].tolist()

    def episodes(self) -> list[Episode]:
        """The episodes the plan indexes, as agentloop.train.trainer.collate collates them."""
        from agentloop.train.batch.episodes import Episode

        ro = self.resp_off
        out = []
        for i in range(self.num_episodes):
            a, b = int(ro[i]), int(ro[i + 1])
            out.append(Episode(ids=self.tokens(i), prompt_len=int(self.prompt_len[i]),
                               response_mask=self.response_mask[a:b].tolist(),
                               rollout_logprobs=self.logprobs[a:b].tolist(), advantage=float(self.advantage[i]),
                               reward=float(self.reward[i]),
                               versions=self.versions[a:b].tolist() if self.has_versions[i] else None))
        return out

    def prepared(self, episodes: list[Episode] | None = None) -> Prepared:
        """The batch as agentloop.train.trainer.collate.prepare_episodes made it (verl's order re-estimates from it)."""
        import torch

        from agentloop.train.batch.episodes import Prepared

        return Prepared(episodes=episodes if episodes is not None else self.episodes(), metrics=dict(self.metrics),
                        ok_rewards=torch.from_numpy(self.ok_rewards.astype(np.float64)),
                        ok_groups=torch.from_numpy(self.ok_groups.astype(np.int64)),
                        ok_lengths=torch.from_numpy(self.ok_lengths.astype(np.int64)),
                        ok_episode=self.ok_episode.tolist(), uids=self.uid.tolist())

    # ------------------------------------------------------------------ binary form

    def encode(self) -> bytes:
        specs, chunks, off = {}, [], 0
        for name in self._ARRAYS:
            a = np.ascontiguousarray(getattr(self, name))
            specs[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": off}
            raw = a.tobytes()
            pad = (-len(raw)) % 8
            chunks.append(raw + b"\0" * pad)
            off += len(raw) + pad
        header = json.dumps({"step": self.step, "layout": self.layout.to_json(), "minis": self.minis,
                             "plan": self.plan, "metrics": self.metrics, "arrays": specs},
                            separators=(",", ":")).encode()
        header += b" " * ((-len(header)) % 8)
        return b"".join([MAGIC, struct.pack("<IQ", FORMAT, len(header)), header, *chunks])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> TrainBatch:
        buf = memoryview(data)
        if bytes(buf[:4]) != MAGIC:
            raise BatchFormatError("not a TrainBatch (bad magic)")
        fmt, hlen = struct.unpack("<IQ", bytes(buf[4:16]))
        if fmt != FORMAT:
            raise BatchFormatError(f"TrainBatch format {fmt}, this learner reads format {FORMAT}")
        try:
            header = json.loads(bytes(buf[16:16 + hlen]))
        except ValueError as e:
            raise BatchFormatError(f"unreadable TrainBatch header: {e}") from None
        base = 16 + hlen
        arrays = {}
        for name in cls._ARRAYS:
            spec = header["arrays"][name]
            dt = np.dtype(spec["dtype"])
            n = int(np.prod(spec["shape"], dtype=np.int64))
            start = base + spec["offset"]
            if start + n * dt.itemsize > len(buf):
                raise BatchFormatError(f"TrainBatch truncated in array {name}")
            arrays[name] = np.frombuffer(buf, dtype=dt, count=n, offset=start).reshape(spec["shape"])
        return cls(step=int(header["step"]), layout=BatchLayout.from_json(header["layout"]), minis=header["minis"],
                   plan=header["plan"], metrics=header["metrics"], **arrays)


__all__ = ["BatchFormatError", "BatchLayout", "TrainBatch"]
