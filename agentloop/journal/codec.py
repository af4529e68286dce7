"""The journal's record kinds and how each one's body is encoded (inside a frame, frames.py).

    body     [u32 n][n bytes of JSON (orjson)][blobs]; the JSON's "b" lists the blobs' byte lengths. Token arrays
             travel as blobs of machine words (ids int32, logprobs float64 so they come back bit-exact, masks one
             byte each, per-token versions as runs [[version, count], ...] in the JSON): ~12 bytes per model token.

Kinds (every episode record carries `g`, the episode's generation: a restart starts generation g + 1 and voids
what came before; effects carry `n`, their place in the episode's order of effects):

    HEADER        first frame of every segment: format, model, data fingerprint, config parts (journal.py)
    START         an episode started live: index, seed, loop, step
    GEN           one generate call completed: prompt length + hash (pl, ph), the TokenOutput the loop received
    EFFECT_START  a tool call (or another external effect) is about to run: its name and arguments' hash
    EFFECT_DONE   ... and what it returned (JSON)
    DONE          the episode's records as the engine made them (scored; one per segment); or, for an episode whose
                  every effect is journaled (no gap, a loop that replays), only what replaying cannot make again: its
                  score, reward info, metrics, wall time, step and how many effects it made ("light"): ~0.3 KB
                  instead of its token arrays and text, the tokens being in its GEN records already
    RESTART       the episode starts over (its loop diverged from its journal, or cannot replay): generation g
    DROP          the group (uid, attempt) will never be trained: cancelled, given out again, dropped
    TRAINED       step s's batch was handed to the learner: its uids, and the data state stored with it
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import orjson

from agentloop.journal.frames import PREFIX
from agentloop.records import EpisodeRecord, TokenOutput

HEADER, START, GEN, EFFECT_START, EFFECT_DONE, DONE, RESTART, DROP, TRAINED = range(1, 10)
KIND_NAMES = {HEADER: "header", START: "start", GEN: "gen", EFFECT_START: "effect_start", EFFECT_DONE: "effect_done",
              DONE: "done", RESTART: "restart", DROP: "drop", TRAINED: "trained"}
RUN = -1
"""uid of records that belong to no group (HEADER, TRAINED)."""

_LEN = struct.Struct("<I")
_NO_VERSION = -(2 ** 63)


def encode(kind: int, uid: int, attempt: int, repeat: int, meta: dict[str, Any], blobs: Sequence[bytes] = ()) -> bytes:
    """A record's payload (frames.frame adds length and checksum)."""
    if blobs:
        meta["b"] = [len(b) for b in blobs]
    js = orjson.dumps(meta)
    return b"".join((PREFIX.pack(kind, uid, attempt, repeat), _LEN.pack(len(js)), js, *blobs))


def decode(payload: memoryview | bytes) -> tuple[int, int, int, int, dict[str, Any], list[memoryview]]:
    """(kind, uid, attempt, repeat, meta, blobs) of a payload."""
    view = memoryview(payload)
    kind, uid, attempt, repeat = PREFIX.unpack_from(view, 0)
    (n,) = _LEN.unpack_from(view, PREFIX.size)
    start = PREFIX.size + _LEN.size
    meta = orjson.loads(view[start:start + n])
    blobs: list[memoryview] = []
    pos = start + n
    for size in meta.pop("b", ()):
        blobs.append(view[pos:pos + size])
        pos += size
    return kind, uid, attempt, repeat, meta, blobs


def prompt_hash(prompt_ids: Sequence[int]) -> int:
    """A 64-bit hash of a prompt's ids (its int32 words): what a replayed call's prompt is checked against."""
    words = prompt_ids if isinstance(prompt_ids, array) and prompt_ids.typecode == "i" else array("i", prompt_ids)
    return int.from_bytes(hashlib.blake2b(words, digest_size=8).digest(), "little")


def _ints(blob: memoryview) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    return a.tolist()


def _floats(blob: memoryview) -> list[float]:
    a = array("d")
    a.frombytes(blob)
    return a.tolist()


def version_runs(versions: Sequence[int | None]) -> list[list[int | None]]:
    """[[version, count], ...]: a call's tokens are nearly always of one or two versions."""
    if not versions:
        return []
    if versions.count(versions[0]) == len(versions):  # one version: counted in C, no loop
        return [[versions[0], len(versions)]]
    runs: list[list[int | None]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1  # type: ignore[operator]
        else:
            runs.append([v, 1])
    return runs


def from_runs(runs: list[list[Any]]) -> list[int | None]:
    out: list[int | None] = []
    for v, k in runs:
        out.extend([v] * k)
    return out


# ---------------------------------------------------------------------------- GEN


def gen_meta(g: int, n: int, prompt_len: int, phash: int, out: TokenOutput) -> tuple[dict[str, Any], list[bytes]]:
    meta = {"g": g, "n": n, "pl": prompt_len, "ph": phash, "f": out.finish_reason, "w": out.weight_version,
            "vr": version_runs(out.token_versions), "i": out.interrupted, "c": out.cached_tokens,
            "p": out.prompt_tokens, "s": out.server, "l": out.latency_s, "a": out.attempts}
    return meta, [array("i", out.token_ids).tobytes(), array("d", out.logprobs).tobytes()]


def token_output(meta: dict[str, Any], blobs: list[memoryview]) -> TokenOutput:
    """The TokenOutput a GEN record holds, exactly as the loop received it."""
    out = TokenOutput.model_construct(
        token_ids=_ints(blobs[0]), logprobs=_floats(blobs[1]), finish_reason=meta["f"], weight_version=meta["w"],
        token_versions=from_runs(meta["vr"]), interrupted=meta["i"], cached_tokens=meta["c"],
        prompt_tokens=meta["p"], server=meta["s"], latency_s=meta["l"], attempts=meta["a"])
    return out


# ---------------------------------------------------------------------------- DONE

_TOKEN_FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "token_versions")


def done_meta(g: int, records: list[EpisodeRecord]) -> tuple[dict[str, Any], list[bytes]]:
    """The episode's records: their token arrays as blobs, every other field in the JSON."""
    metas: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for r in records:
        d = {k: v for k, v in r.__dict__.items() if k not in _TOKEN_FIELDS and k != "segments"}
        d["tv"] = bool(r.token_versions)
        metas.append(d)
        blobs += [array("i", r.prompt_ids).tobytes(), array("i", r.response_ids).tobytes(),
                  bytes(r.response_mask), array("d", r.response_logprobs).tobytes(),
                  array("q", [_NO_VERSION if v is None else v for v in r.token_versions]).tobytes()]
    return {"g": g, "records": metas}, blobs


def done_light(g: int, rec: EpisodeRecord, effects: int) -> dict[str, Any]:
    """A finished episode's DONE when replaying its journaled effects rebuilds its tokens and text (codec doc)."""
    return {"g": g, "light": True, "reward": rec.reward, "reward_info": rec.reward_info, "metrics": rec.metrics,
            "finish_reason": rec.finish_reason, "wall_s": rec.wall_s, "step": rec.step, "effects": effects}


def done_records(meta: dict[str, Any], blobs: list[memoryview]) -> list[EpisodeRecord]:
    out = []
    for i, d in enumerate(meta["records"]):
        b = blobs[5 * i:5 * i + 5]
        vers = array("q")
        vers.frombytes(b[4])
        d = dict(d)
        has_versions = d.pop("tv")
        out.append(EpisodeRecord.model_validate({
            **d, "prompt_ids": _ints(b[0]), "response_ids": _ints(b[1]), "response_mask": list(bytes(b[2])),
            "response_logprobs": _floats(b[3]),
            "token_versions": [None if v == _NO_VERSION else v for v in vers] if has_versions else []}))
    return out


def oldest_of_runs(runs: list[list[Any]]) -> int | None:
    known = [v for v, _ in runs if v is not None]
    return min(known) if known else None
