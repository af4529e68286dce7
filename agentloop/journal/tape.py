"""EpisodeTape: one episode's effects, recorded as they happen and served back in order on a resume.

A loop is a coroutine, so its state cannot be saved; its effects can. Everything an episode learns from outside
comes through two doors: `generate` (the server manager's, which the engine hands the loop wrapped by
`TapedServerManager`) and `effect` (AgentLoopBase.effect / tool_call: a tool call or another outside action).
The tape numbers them in the order the loop makes them (n = 0, 1, ...) and journals each one:

    generate   the call's prompt length and hash, then the TokenOutput the loop received (GEN)
    effect     EFFECT_START (name, arguments' hash) before it runs, EFFECT_DONE with its result after

Resumed, the loop runs again from the start with the same sample and seed, and the tape answers its effects from
the journal (`replay`) instead of performing them: a generate call returns the journaled TokenOutput without
contacting a server (its prompt must be the journaled one: same length, same hash), a tool call its journaled
result without running. When the journal runs out the episode goes on live, from the journaled tokens. Then:
    - a call that does not match its journaled one (another kind, prompt, name or arguments): the loop is not
      deterministic; `ReplayDiverged` (and `diverged`): the engine restarts the episode, counted, named
    - an effect journaled as started but not finished (running at the kill): run again when it is idempotent
      (counted), else `EffectNotReplayable`: the episode ends as an error record naming the tool
    - a stateful tool (its instance keeps what earlier calls did): its journaled calls are run again to rebuild
      that state when it is idempotent (their journaled results are what the loop sees); otherwise the episode
      cannot be continued and restarts
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from agentloop.errors import AgentLoopError, EpisodeError
from agentloop.journal import codec
from agentloop.journal.reader import Effect, EpisodeLog
from agentloop.records import Sample, TokenOutput


class ReplayDiverged(AgentLoopError):
    """A resumed episode's loop made another effect than the one journaled at its place (not deterministic)."""


class EffectNotReplayable(EpisodeError):
    """An effect was running when the journal ended and is not idempotent: running it again could repeat it."""


def args_hash(arguments: Any) -> int:
    try:
        data = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        data = repr(arguments).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class EpisodeTape:
    """One episode's recorder and replayer (module doc). Made by `Journal.tape` (`journal`: that Journal)."""

    def __init__(self, journal: Any, sample: Sample, log: EpisodeLog | None = None, *, record: bool = True):
        self.journal = journal
        self.uid, self.attempt, self.repeat = sample.group_uid, sample.attempt, sample.repeat
        self.log = log
        self.g = log.g if log is not None else 0
        self.replay: list[Effect] = log.replay() if log is not None else []
        self.seq = 0
        self.record = record
        """Journal this episode's effects (False: a loop that cannot replay them, or the journal ended: a gap)."""
        self.diverged: str | None = None
        self.went_live = False
        """A call found nothing left to replay: the episode goes on live from there."""
        self.complete = True
        """Every effect this episode made is journaled (no call left out), so replaying rebuilds it whole."""
        self.done_fields: dict[str, Any] | None = None
        """A light DONE (codec.done_light) of the episode finished before the kill, to apply once replayed whole."""
        self.reused_tokens = 0
        self._last_gen: Effect | None = None
        self._checked_continuation = False

    @property
    def replaying(self) -> bool:
        return self.seq < len(self.replay)

    @property
    def resumed(self) -> bool:
        """It holds journaled effects to replay."""
        return bool(self.replay)

    def server_manager(self, sm: Any) -> "TapedServerManager":
        return TapedServerManager(sm, self)

    # ------------------------------------------------------------------ writing

    def _put(self, kind: int, meta: dict[str, Any], size: int = 256, *, always: bool = False) -> None:
        uid, attempt, repeat = self.uid, self.attempt, self.repeat
        self._put_encoder(lambda: codec.encode(kind, uid, attempt, repeat, meta), size, always=always)

    def _put_encoder(self, encode: Callable[[], bytes], size: int, *, always: bool = False) -> None:
        if not (self.record or always):
            return
        if not self.journal.put(encode, size):
            self.record = False  # its journal ends here: a resume replays up to this gap and goes on live
            self.journal.counts["episodes_with_gap"] += 1

    def start(self, meta: dict[str, Any]) -> None:
        """The episode started live (not from the journal); journaled even when its effects are not (a loop that
        cannot replay them), so a resume counts it as restarted."""
        self._put(codec.START, {"g": self.g, **meta}, always=True)

    def restart(self, why: str) -> None:
        """Start over live: the journaled effects are void (a new generation)."""
        self.g += 1
        self.replay, self.seq, self.diverged, self._last_gen = [], 0, None, None
        self._put(codec.RESTART, {"g": self.g, "why": why})
        self.journal.counts["episodes_restarted"] += 1
        self.journal.note_restart(why)

    def _diverge(self, why: str) -> ReplayDiverged:
        self.diverged = why
        return ReplayDiverged(why)

    # ------------------------------------------------------------------ generate

    async def generate(self, sm: Any, episode_id: str, prompt_ids: Sequence[int], sampling_params: Any) -> TokenOutput:
        n = self.seq
        self.seq += 1
        if n < len(self.replay):
            e = self.replay[n]
            if e.kind != "gen":
                raise self._diverge(f"effect {n}: a generate call where the journal has {e.kind} {e.name!r}")
            if e.prompt_len != len(prompt_ids) or e.prompt_hash != codec.prompt_hash(prompt_ids):
                raise self._diverge(f"effect {n}: the generate call's prompt ({len(prompt_ids)} tokens) is not the "
                                    f"journaled one ({e.prompt_len} tokens)")
            assert e.out is not None
            self._last_gen = e
            self.reused_tokens += len(e.out.token_ids)
            self.journal.counts["tokens_reused"] += len(e.out.token_ids)
            self.journal.counts["calls_reused"] += 1
            return e.out.model_copy(update={"token_ids": list(e.out.token_ids), "logprobs": list(e.out.logprobs),
                                            "token_versions": list(e.out.token_versions)})
        self.went_live = True
        if self._last_gen is not None and not self._checked_continuation:
            self._check_continuation(prompt_ids)
        plen, phash = len(prompt_ids), codec.prompt_hash(prompt_ids)  # now: the loop's array grows after the call
        out = await sm.generate(episode_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        # a call a server aborted (not one a weight update cut: the manager continues those) is no completed
        # effect: left out, so an episode continued after it asks again
        if out.finish_reason == "abort":
            self.complete = False
        elif self.record:
            g, uid, attempt, repeat = self.g, self.uid, self.attempt, self.repeat

            def encode() -> bytes:  # on the writer thread: the TokenOutput is not changed once returned
                meta, blobs = codec.gen_meta(g, n, plen, phash, out)
                return codec.encode(codec.GEN, uid, attempt, repeat, meta, blobs)

            self._put_encoder(encode, 64 + 12 * len(out.token_ids))
        return out

    def _check_continuation(self, prompt_ids: Sequence[int]) -> None:
        """The first live call after a replay: its prompt should extend the last replayed call's prompt and
        output, i.e. be the journaled tokens (counted either way; a loop may legitimately start a new sequence)."""
        self._checked_continuation = True
        e = self._last_gen
        assert e is not None and e.out is not None
        k, ids = e.prompt_len, e.out.token_ids
        ok = (len(prompt_ids) >= k + len(ids) and codec.prompt_hash(prompt_ids[:k]) == e.prompt_hash
              and list(prompt_ids[k:k + len(ids)]) == list(ids))
        self.journal.counts["continuations_exact" if ok else "continuations_new_sequence"] += 1

    # ------------------------------------------------------------------ effects (tool calls, ...)

    async def effect(self, name: str, arguments: Any, run: Callable[[], Awaitable[Any]], *, idempotent: bool,
                     stateful: bool) -> Any:
        n = self.seq
        self.seq += 1
        ah = args_hash(arguments)
        if n < len(self.replay):
            e = self.replay[n]
            if e.kind != "effect" or e.name != name or e.args_hash != ah:
                what = "a generate call" if e.kind == "gen" else f"{e.name!r} with other arguments" \
                    if e.name == name else repr(e.name)
                raise self._diverge(f"effect {n}: {name!r} where the journal has {what}")
            if e.done:
                if stateful:
                    if not idempotent:
                        raise self._diverge(f"tool {name!r} keeps state between calls (stateful) and is not "
                                            "idempotent: its journaled calls cannot rebuild that state")
                    await run()  # rebuild the instance's state; the loop sees the journaled result
                    self.journal.counts["effects_rerun_for_state"] += 1
                self.journal.counts["effects_reused"] += 1
                return e.value
            if not idempotent:
                self.journal.counts["episodes_failed_unreplayable"] += 1
                raise EffectNotReplayable(
                    f"tool {name!r} was running when the run stopped and is not idempotent (BaseTool.idempotent = "
                    "False): running it again could repeat what it did, so the episode cannot be continued")
            self.journal.counts["effects_rerun"] += 1
            value = await run()
            self._put_effect_done(n, name, ah, value)
            return value
        self.went_live = True
        self._put(codec.EFFECT_START, {"g": self.g, "n": n, "name": name, "ah": ah})
        value = await run()
        self._put_effect_done(n, name, ah, value)
        return value

    def _put_effect_done(self, n: int, name: str, ah: int, value: Any) -> None:
        try:
            orjson.dumps(value)
        except TypeError:  # not JSON: cannot be journaled, so the episode's journal ends before this effect
            self.record = False
            self.complete = False
            self.journal.counts["episodes_with_gap"] += 1
            return
        self._put(codec.EFFECT_DONE, {"g": self.g, "n": n, "name": name, "ah": ah, "v": value})

    # ------------------------------------------------------------------ the end

    def replayed_done(self, finish_reason: str) -> dict[str, Any] | None:
        """The journaled score of an episode that finished before the kill, once its loop replayed every effect
        again without going live (None: it did not, so it is scored as any episode)."""
        d = self.done_fields
        if d is None or self.went_live or self.diverged or self.seq != d["effects"] or \
                finish_reason != d["finish_reason"]:
            return None
        return d

    def done(self, records: list[Any]) -> None:
        """The episode's finished records: light when replaying its journaled effects rebuilds them (every effect
        journaled, no error), else whole (they stand alone, gap or not)."""
        if self.journal.closed:
            return
        g, uid, attempt, repeat = self.g, self.uid, self.attempt, self.repeat
        if self.record and self.complete and all(r.error is None for r in records):
            light = codec.done_light(g, records[0], self.seq)
            self._put_encoder(lambda: codec.encode(codec.DONE, uid, attempt, repeat, light), 512)
            return

        def encode() -> bytes:
            meta, blobs = codec.done_meta(g, records)
            return codec.encode(codec.DONE, uid, attempt, repeat, meta, blobs)

        size = 512 + sum(21 * (len(r.prompt_ids) + len(r.response_ids)) for r in records)
        if not self.journal.put(encode, size):
            self.journal.counts["episodes_with_gap"] += 1


class TapedServerManager:
    """The server manager a journaled episode's loop sees: `generate` goes through the tape, everything else is the
    manager's."""

    def __init__(self, sm: Any, tape: EpisodeTape):
        self._sm = sm
        self._tape = tape

    async def generate(self, episode_id: str, *, prompt_ids: Sequence[int], sampling_params: Any) -> TokenOutput:
        return await self._tape.generate(self._sm, episode_id, prompt_ids, sampling_params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sm, name)
