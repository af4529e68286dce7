"""The data plane: generate calls, token ids in and token ids out, with typed retries, the continuation of calls
interrupted by a weight update, and the parsing of SGLang's answer.

Map:
    DataPlane.generate         route (Router) -> POST /generate -> TokenOutput; a call cut short by an abort-mode
                               pause continues after the resume
    DataPlane._generate_once   one call with retries on other servers; classifies failures as RetryableError /
                               FatalRequestError
    parse_generate_response    SGLang's JSON -> TokenOutput, per-token weight versions included (token_versions)

Hot path (per request, on the event loop): the prompt's ids (a TrajectoryBuilder's array, or a list) are
serialised with orjson into one POST sent over pooled keep-alive HTTP/1.1 connections (agentloop.util.http1:
a fraction of aiohttp's CPU per request; https URLs and every admin call go through aiohttp); the answer is
parsed with orjson and its ids and logprobs validated once, by TokenOutput's compiled validation (the slow
per-token diagnosis runs only when that fails). When the answer arrives, its parsing and the caller's next step
wait for room in the event loop's current iteration (agentloop.util.pacing), so a burst of answers never
blocks the loop.

Retry policy: transport errors, HTTP 5xx and timeouts are retried on another server (the
one that failed is avoided) until `max_attempts` or `retry_budget_s` runs out; 4xx and
malformed responses are never retried. A connection the server closed without answering is retried
once at once on the same server, uncounted (the keep-alive race; pooled connections also expire
before the server's keep-alive, `keepalive_s`). A request that timed out or whose caller was cancelled is
aborted on its server (tracked tasks, drained on close) so it stops burning compute there. Request
ids are uuids: SGLang aborts by rid prefix, so "7-1" would also abort "7-10". When no server is
healthy for `all_down_grace_s`, generate raises AllServersDownError, which the engine treats as fatal.

Weight versions (training). The manager knows the version each server serves (`Router`), and the
version every admitted server must serve (`expect`). Each request is stamped with its server's
version when it is submitted; where the server reports per-token spans (SGLang's
`meta_info.weight_versions`) they refine the stamp token by token, and a call that ran entirely under
one version (abort-mode interrupts guarantee it) takes the version the server reports.

Interrupts. `pause("abort")` makes in-flight calls return their partial tokens (finish "abort"); a
call interrupted that way waits for `resume` and continues itself: it re-submits prompt + partial
with the remaining budget under the new weights, and the caller gets one TokenOutput whose tokens
carry both versions. A call aborted because its server was put to sleep (a lent server on the learner's GPUs,
agentloop.client.lending) continues the same way at once on a server awake, under the same weights. `retract`
(the server re-prefills on resume) and `in_place` (old KV kept) need no
client work, except where a server cannot flush its cache with retracted requests waiting (SGLang
0.5.17): `finish_update` aborts those, and their calls continue as abort-mode ones do. What each mode
flushes, and why in_place salts the prefix cache per version instead: agentloop.interrupt. An abort not
caused by an interrupt is returned as finish "abort".
Simplification: a stop string that straddles the point of interruption is not detected.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson
from pydantic import ValidationError

from agentloop.client.health import parse_version
from agentloop.client.state import ManagerState
from agentloop.config import SamplingParams
from agentloop.errors import AllServersDownError, FatalRequestError, RetryableError, RetryBudgetExhausted, ServerError
from agentloop.records import TokenOutput
from agentloop.routing import Availability
from agentloop.util.http1 import Disconnected, HttpError, HttpTimeout
from agentloop.util.pacing import step_gate

LORA_ADAPTER_PREFIX = "agentloop-v"
"""Served adapter names (agentloop.train.lora.adapter_name): this prefix and the version."""
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_JSON_HEADERS = {"Content-Type": "application/json"}


def parse_generate_response(body: Any, server: str, *, stamp: int | None = None,
                            single_version: bool = False) -> TokenOutput:
    """Turn SGLang's /generate JSON into a TokenOutput; FatalRequestError if it is not usable.

    `stamp`: the version of the server when the request was submitted. Per-token versions come from
    the server's spans when present; else, with `single_version` (the call cannot have spanned an
    update), from the version the server reports; else every token gets the stamp.
    """
    if isinstance(body, list):  # batch form; we always send one request
        if len(body) != 1:
            raise FatalRequestError(f"expected one result, got {len(body)}", server=server)
        body = body[0]
    if not isinstance(body, dict) or "meta_info" not in body:
        raise FatalRequestError(f"response has no meta_info: {str(body)[:200]}", server=server)
    meta = body["meta_info"]
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise FatalRequestError("response has no output_token_logprobs (was return_logprob sent?)", server=server)
    try:
        ids = [e[1] for e in entries]
        lps = [e[0] for e in entries]
    except (TypeError, IndexError, KeyError) as e:
        raise FatalRequestError(f"malformed output_token_logprobs: {e}", server=server) from None
    fr = meta.get("finish_reason")
    fr_type = fr.get("type") if isinstance(fr, dict) else fr
    finish = _FINISH.get(str(fr_type), "abort" if fr_type is not None else "length")
    wv = meta.get("weight_version")
    try:  # the ids and logprobs are validated once, by the record's own (compiled) validation
        out = TokenOutput(
            token_ids=ids,
            logprobs=lps,
            finish_reason=finish,
            weight_version=None if wv is None else str(wv),
            token_versions=token_versions(len(ids), meta, stamp, single_version=single_version),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            server=server,
        )
    except (ValidationError, TypeError, ValueError):
        _explain_bad_tokens(ids, lps, server)
        raise
    out_ids = body.get("output_ids")
    if out_ids is not None and out_ids != out.token_ids and list(out_ids) != out.token_ids:
        raise FatalRequestError("output_ids and output_token_logprobs disagree", server=server)
    return out


def _explain_bad_tokens(ids: list[Any], lps: list[Any], server: str) -> None:
    """Raise FatalRequestError saying what is wrong with a response's ids or logprobs (the slow path, only
    when the compiled validation refused them)."""
    missing = [i for i, x in enumerate(lps) if x is None]
    if missing:
        # A logprob of 0.0 would claim probability 1 and skew every ratio built on it.
        raise FatalRequestError(f"the server returned no logprob for {len(missing)} sampled token(s) "
                                f"(first at position {missing[0]})", server=server)
    for x in lps:
        try:
            float(x)
        except (TypeError, ValueError) as e:
            raise FatalRequestError(f"malformed logprob in output_token_logprobs: {e}", server=server) from None
    for x in ids:
        try:
            int(x)
        except (TypeError, ValueError) as e:
            raise FatalRequestError(f"malformed output_token_logprobs: {e}", server=server) from None


def token_versions(n: int, meta: dict[str, Any], stamp: int | None, *, single_version: bool) -> list[int | None]:
    """Per-token versions of one response (see `parse_generate_response`)."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans:
        out: list[int | None] = [stamp] * n
        for sp in spans:
            try:
                v, a, b = parse_version(sp["version"]), int(sp["start"]), int(sp["end"])
            except (KeyError, TypeError, ValueError):
                return [stamp] * n
            for i in range(max(0, a), min(n, b)):
                out[i] = v if v is not None else stamp
        return out
    if single_version:
        v = parse_version(meta.get("weight_version"))
        if v is not None:
            return [v] * n
    return [stamp] * n


class DataPlane:
    """The generate part of a ServerManager (module doc). `on_full` is the capacity part's: every admitted server
    was found at its cap."""

    def __init__(self, state: ManagerState, *, on_full: Callable[[], None]):
        self.s = state
        self._on_full = on_full

    async def generate(self, episode_id: str, *, prompt_ids: Sequence[int],
                       sampling_params: SamplingParams | dict[str, Any]) -> TokenOutput:
        """Generate from `prompt_ids` on some server; the episode sticks to one server when it can.

        A call interrupted by an abort-mode pause continues after `resume` (see the module doc)."""
        s = self.s
        prompt = prompt_ids  # kept as given (a TrajectoryBuilder's array stays compact while the call waits)
        if not len(prompt):
            raise FatalRequestError("prompt_ids is empty")
        if s.vocab_size is not None:
            lo, hi = min(prompt), max(prompt)
            if lo < 0 or hi >= s.vocab_size:
                raise FatalRequestError(f"prompt_ids hold token id {lo if lo < 0 else hi} outside the "
                                        f"vocabulary [0, {s.vocab_size})")
        sp = sampling_params.to_sglang() if isinstance(sampling_params, SamplingParams) else dict(sampling_params)
        budget = int(sp.get("max_new_tokens", 128))
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int | None] = []
        interrupted = 0
        t0 = time.monotonic()
        while True:
            left = budget - len(ids)
            call_sp = sp if not ids else {**sp, "max_new_tokens": left}
            epoch = s.interrupts
            evicted = dict(s.evictions)
            out = await self._generate_once(episode_id, prompt if not ids else [*prompt, *ids], call_sp)
            ids += out.token_ids
            lps += out.logprobs
            vers += out.token_versions
            # its server was put to sleep meanwhile (a lent server, agentloop.client.lending): go on on another
            slept = s.evictions.get(out.server or "", 0) != evicted.get(out.server or "", 0)
            if out.finish_reason == "abort" and (s.interrupts != epoch or slept) and len(ids) < budget:
                interrupted += 1
                s.stats["interrupted_calls"] += 1
                continue  # a weight update cut it: go on under the new weights once resumed
            break
        if interrupted:
            s.stats["continued_calls"] += 1
        out.token_ids, out.logprobs, out.token_versions = ids, lps, vers
        out.interrupted = interrupted
        out.latency_s = time.monotonic() - t0
        return out

    async def _generate_once(self, episode_id: str, prompt_ids: Sequence[int], sp: dict[str, Any]) -> TokenOutput:
        """One call with retries on other servers (no continuation)."""
        s = self.s
        t0 = time.monotonic()
        deadline = t0 + s.cfg.retry_budget_s
        avoid: set[int] = set()
        attempt = 0
        dropped_once = False
        last_err: Exception | None = None
        while True:
            await self._wait_unpaused(deadline)
            idx = await self._acquire(episode_id, avoid, deadline, last_err)
            attempt += 1
            rid = uuid.uuid4().hex
            stamp = s.router.servers[idx].version
            data = self._request_body(prompt_ids, sp, rid, stamp)
            url = s.urls[idx]
            ts = time.monotonic()
            pauses = s.pauses
            named = (url, stamp) if s.lora_adapters and stamp else None
            if named is not None:
                s.adapter_inflight[named] += 1
            try:
                s.stats["requests"] += 1
                raw = await self._post_generate(url, data, timeout=max(0.001, min(s.cfg.request_timeout_s,
                                                                                  deadline - ts)))
                # The answer's parsing and the caller's next step (decode, tools, the next request) wait for room
                # in this loop iteration: a burst of answers never runs as one long iteration (util.pacing).
                await step_gate().enter()
                try:
                    body = orjson.loads(raw)
                except orjson.JSONDecodeError as e:
                    raise FatalRequestError(f"{url} sent a non-JSON body: {e}", server=url) from None
                # Abort-mode interrupts abort whatever runs across them, so a call finished without an
                # interrupt in between, or cut by one, ran under one version: the one the server reports.
                single = s.pauses == pauses or s.pause_mode == "abort"
                out = parse_generate_response(body, url, stamp=stamp, single_version=single)
                if s.lora_adapters:
                    # the request named adapter version `stamp`, and SGLang keeps a request on the adapter it
                    # named until it ends (an update loads another adapter beside it): every token is stamp's
                    out.token_versions = [stamp] * len(out.token_ids)
                    out.weight_version = None if stamp is None else str(stamp)
            except asyncio.CancelledError:
                s.stats["cancelled_calls"] += 1
                s.spawn(self._abort_quietly(url, rid), name=f"abort-{rid}")
                raise
            except RetryableError as e:
                if isinstance(e, _Dropped) and not dropped_once:
                    # The server closed the connection without answering: on a pooled connection that is
                    # the keep-alive race (it closed the idle connection as we sent), not a failing
                    # server. Once per call it is retried at once, on the same server, uncounted; a dead
                    # server then refuses the new connection and is counted as usual.
                    dropped_once = True
                    s.stats["dropped_connections"] += 1
                    s.spawn(self._abort_quietly(url, rid), name=f"abort-{rid}")  # in case it did arrive
                    attempt -= 1
                    continue
                s.note_failure(idx)
                last_err = e
                avoid.add(idx)
                if isinstance(e, _Timeout):
                    s.stats["timeouts"] += 1
                    s.spawn(self._abort_quietly(url, rid), name=f"abort-{rid}")
                if attempt >= s.cfg.max_attempts or time.monotonic() >= deadline:
                    s.stats["errors"] += 1
                    raise RetryBudgetExhausted(
                        f"generate for episode {episode_id} failed after {attempt} attempt(s) in "
                        f"{time.monotonic() - t0:.1f}s; last error: {e}") from e
                s.stats["retries"] += 1
                await asyncio.sleep(min(5.0, s.cfg.retry_backoff_s * 2 ** (attempt - 1)))
                continue
            except FatalRequestError:
                s.stats["errors"] += 1
                raise
            finally:
                s.router.release(idx)
                if named is not None:
                    s.adapter_inflight[named] -= 1
                    if s.adapter_inflight[named] <= 0:
                        del s.adapter_inflight[named]
                s.changed.set()
            s.router.record_success(idx)
            s.answered_at[idx] = time.monotonic()
            latency = time.monotonic() - ts
            s.latencies.append(latency)
            s.stats["prompt_tokens"] += out.prompt_tokens or len(prompt_ids)
            s.stats["cached_tokens"] += out.cached_tokens
            s.stats["output_tokens"] += len(out.token_ids)
            out.latency_s = latency
            out.attempts = attempt
            return out

    def _request_body(self, prompt_ids: Sequence[int], sp: dict[str, Any], rid: str, stamp: int | None) -> bytes:
        """The /generate body. The ids list exists only while it is serialised, and the bytes are copied out of
        orjson's 64 KiB output buffer: a request in flight holds ~2 KB, not 64 KB plus a list of Python ints."""
        s = self.s
        ids = prompt_ids.tolist() if isinstance(prompt_ids, array) else prompt_ids
        payload: dict[str, Any] = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                                   "logprob_start_len": -1, "rid": rid, "stream": False}
        if s.cache_salt and stamp is not None:
            payload["extra_key"] = f"agentloop-v{stamp}"
        if s.lora_adapters and stamp:  # version 0 is the base model (a fresh adapter's B is zero)
            payload["lora_path"] = f"{LORA_ADAPTER_PREFIX}{stamp}"
        return bytes(memoryview(orjson.dumps(payload)))

    def end_episode(self, episode_id: str) -> None:
        """Forget the episode's sticky server (the engine calls this when an episode ends)."""
        self.s.router.end_episode(episode_id)

    async def _acquire(self, episode_id: str, avoid: set[int], deadline: float,
                       last_err: Exception | None) -> int:
        s = self.s
        while True:
            idx = s.router.acquire(episode_id, avoid)
            if idx is not None:
                s.down_since = None
                return idx
            now = time.monotonic()
            availability = s.router.availability()
            if availability is Availability.FULL:
                self._on_full()  # the capacity part asks the servers, once at a time; waiters wake when caps change
            if availability is Availability.DOWN:
                if s.down_since is None:
                    s.down_since = now
                if now - s.down_since >= s.cfg.all_down_grace_s:
                    raise AllServersDownError(
                        f"all {len(s.urls)} server(s) are down ({', '.join(s.urls)}) for "
                        f"{now - s.down_since:.0f}s" + (f"; last error: {last_err}" if last_err else ""))
            if now >= deadline:
                raise RetryBudgetExhausted(f"no server could take episode {episode_id} within the retry budget"
                                           + (f"; last error: {last_err}" if last_err else ""))
            s.changed.clear()
            wait = min(deadline - now, s.cfg.health_interval_s)
            if s.down_since is not None:
                wait = min(wait, max(0.01, s.down_since + s.cfg.all_down_grace_s - now))
            try:
                await asyncio.wait_for(s.changed.wait(), timeout=max(0.01, wait))
            except asyncio.TimeoutError:
                pass

    async def _wait_unpaused(self, deadline: float) -> None:
        s = self.s
        if s.unpaused.is_set():
            return
        # A pause (weight sync) is not a failure: it does not consume the retry budget's attempts,
        # but it is bounded by admin_timeout_s so a forgotten resume cannot hang the run.
        try:
            await asyncio.wait_for(s.unpaused.wait(), timeout=s.cfg.admin_timeout_s)
        except asyncio.TimeoutError:
            raise ServerError(f"servers stayed paused for over {s.cfg.admin_timeout_s}s") from None

    async def _post_generate(self, url: str, data: bytes, timeout: float) -> bytes:
        """POST /generate; the answer's body (HTTP 2xx). Failures classified for the retry policy (module doc)."""
        s = self.s
        if url.startswith("https://"):
            status, raw = await self._post_aiohttp(url, data, timeout)
        else:
            try:
                status, raw = await s.require_http().post(url, "/generate", data, timeout=timeout,
                                                          connect_timeout=s.cfg.connect_timeout_s)
            except HttpTimeout:
                raise _Timeout(f"{url} did not answer within {timeout:.1f}s", server=url) from None
            except Disconnected as e:
                raise _Dropped(f"{url} closed the connection without answering: {e}", server=url) from None
            except HttpError as e:  # could not connect, or not HTTP: the server is not serving
                raise RetryableError(f"{url}: {type(e).__name__}: {e}", server=url) from None
        if status >= 500:
            raise RetryableError(f"{url} answered HTTP {status}: {raw[:300].decode('utf-8', 'replace')}",
                                 server=url, status=status)
        if status >= 400:
            raise FatalRequestError(f"{url} rejected the request (HTTP {status}): "
                                    f"{raw[:500].decode('utf-8', 'replace')}", server=url, status=status)
        return raw

    async def _post_aiohttp(self, url: str, data: bytes, timeout: float) -> tuple[int, bytes]:
        s = self.s
        to = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, s.cfg.connect_timeout_s))
        try:
            async with s.require_session().post(url + "/generate", data=data, headers=_JSON_HEADERS,
                                                timeout=to) as resp:
                return resp.status, await resp.read()
        except asyncio.TimeoutError:
            raise _Timeout(f"{url} did not answer within {timeout:.1f}s", server=url) from None
        except aiohttp.ServerDisconnectedError as e:
            raise _Dropped(f"{url} closed the connection without answering: {e}", server=url) from None
        except aiohttp.ClientError as e:
            raise RetryableError(f"{url}: {type(e).__name__}: {e}", server=url) from None
        except OSError as e:
            raise RetryableError(f"{url}: {type(e).__name__}: {e}", server=url) from None

    async def _abort_quietly(self, url: str, rid: str) -> None:
        s = self.s
        try:
            await s.admin_post(url, "/abort_request", {"rid": rid}, timeout=s.cfg.health_timeout_s)
        except Exception:  # noqa: BLE001 - best effort: the server may be the reason we are here
            pass


class _Dropped(RetryableError):
    """The server closed the connection before answering (retryable; see `_generate_once`)."""


class _Timeout(RetryableError):
    """An attempt that hit its timeout (retryable; the request is aborted on its server)."""


__all__ = ["DataPlane", "parse_generate_response", "token_versions"]
