"""ServerManager: the only way agentloop talks to SGLang servers (token ids in, token ids out).

Map:
    ServerManager.generate     route (Router) -> POST /generate -> TokenOutput, typed retries, and
                               continuation of calls interrupted by a weight update
    _attempt                   one attempt; classifies failures as RetryableError / FatalRequestError
    parse_generate_response    SGLang's JSON -> TokenOutput, per-token weight versions included
    _health_loop               probes servers; ejects dead ones, re-admits recovered ones only once
                               they serve the expected weights (probe that runs the scheduler, then
                               /model_info's weight_version; a resync hook can reload the weights)
    pause/resume/abort_all/flush_cache/update_weights_from_disk/mark_updated
                               admin calls broadcast to the servers (updates also reach stale ones); a
                               server that fails one is ejected and the rest go on; servers paused
                               when the manager closes are sent a continue (a run that dies never
                               leaves --server-url servers paused)
    finish_update              after an update, before resume: the flush the interrupt mode needs
                               (agentloop.interrupt), with a fallback where a server refuses it
    size_from_servers          each server's cap on concurrent requests from its reported max_running_requests
                               (when manager.max_inflight_per_server is not set), asked when all are full
    gauges                     `server/...` numbers for progress lines and metrics
    on_close                   what lives as long as the manager and serves through it (the agent gateway)
    add_follower / follow      managers in other processes (Ray rollout workers) that generate on the same servers
                               while this one makes the admin calls: each pause, resume and interrupt is told to
                               them first (versions, pause state, interrupt count), so their calls cut short by a
                               pause continue, and are stamped, exactly as this manager's own

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
carry both versions. `retract` (the server re-prefills on resume) and `in_place` (old KV kept) need no
client work, except where a server cannot flush its cache with retracted requests waiting (SGLang
0.5.17): `finish_update` aborts those, and their calls continue as abort-mode ones do. What each mode
flushes, and why in_place salts the prefix cache per version instead: agentloop.interrupt. An abort not
caused by an interrupt is returned as finish "abort".
Simplification: a stop string that straddles the point of interruption is not detected.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import orjson
from pydantic import ValidationError

from agentloop.config import ManagerConfig, SamplingParams
from agentloop.errors import (
    AllServersDownError,
    FatalRequestError,
    RequestError,
    RetryableError,
    RetryBudgetExhausted,
    ServerError,
)
from agentloop.interrupt import InterruptPolicy
from agentloop.records import TokenOutput
from agentloop.routing import Availability, Router
from agentloop.util.http1 import Disconnected, Http1Pool, HttpError, HttpTimeout
from agentloop.util.pacing import step_gate

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_JSON_HEADERS = {"Content-Type": "application/json"}
_RESIZE_AFTER_S = 30.0
DEFAULT_MAX_INFLIGHT = 256
"""The cap of a server that does not report its capacity, while manager.max_inflight_per_server is null."""
"""A server that did not report its capacity is asked again no sooner than this."""

ResyncHook = Callable[[str], Awaitable[None]]
"""Loads the current weights into the server at this url (called before re-admitting a stale server)."""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


def parse_version(v: Any) -> int | None:
    """A server's weight_version label as our integer version (None for labels we did not set)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v.strip())
    return None


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


def reported_capacity(info: Any) -> int | None:
    """Concurrent requests a server says it runs at once, from its /server_info (SGLang 0.5.23; /get_server_info
    in older ones): the scheduler's effective max_running_requests summed over its data-parallel ranks
    (`internal_states`), else the `max_running_requests` it was launched with. None when it says neither."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list) and states and all(isinstance(x, dict) for x in states):
        per = [x.get("effective_max_running_requests_per_dp", x.get("max_running_requests")) for x in states]
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in per):
            return sum(per)
    v = info.get("max_running_requests")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


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


class ServerManager:
    """Routes token-in/token-out generate calls over N SGLang servers.

    Use as `async with ServerManager(urls, cfg) as sm:`; all methods must run on one event loop.
    """

    def __init__(self, urls: list[str], config: ManagerConfig | None = None, *, vocab_size: int | None = None,
                 initial_version: int | None = None, on_event: Callable[[str], None] | None = None,
                 cache_salt: bool = False, resync: ResyncHook | None = None):
        """`vocab_size`: when known, prompts with ids outside [0, vocab_size) are rejected client-side
        (SGLang 0.5.23 crashes its scheduler on such ids instead of answering 400).
        `initial_version`: the weight version the servers start with (training: 0, or the resumed step).
        `on_event`: receives one line per ejection, re-admission and stale server (a trainer prints them).
        `cache_salt`: send a per-version `extra_key`, so the prefix cache never serves KV of other weights (the
        in_place interrupt mode, where SGLang cannot flush its cache on an update: agentloop.interrupt).
        `resync`: reloads the current weights into one server before it is re-admitted (also `set_resync`, for a
        hook made after the manager: a trainer's weight transport)."""
        if not urls:
            raise ServerError("ServerManager needs at least one server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = config or ManagerConfig()
        self.vocab_size = vocab_size
        self.router = Router(self.urls, self.cfg.max_inflight_per_server or DEFAULT_MAX_INFLIGHT,
                             self.cfg.eject_after_failures, sticky=self.cfg.sticky)
        for i in range(len(self.urls)):
            self.router.servers[i].version = initial_version
        self._resync = resync
        self._cache_salt = cache_salt
        self._on_event = on_event
        self._session: aiohttp.ClientSession | None = None
        self._http: Http1Pool | None = None
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._changed = asyncio.Event()  # set whenever capacity or health may have changed
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._pause_mode: str | None = None
        self._interrupts = 0  # abort-mode pauses so far: an abort seen across one is an interrupt
        self._pauses = 0  # pauses of any mode so far
        self._paused: set[int] = set()  # servers sent a pause since the last resume
        self._needs_continue: set[int] = set()  # ejected after failing a pause/continue: continue them first
        self._latencies: deque[float] = deque(maxlen=4096)
        self._stats = {"requests": 0, "retries": 0, "errors": 0, "timeouts": 0, "ejections": 0,
                       "readmissions": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0,
                       "interrupted_calls": 0, "continued_calls": 0, "stale_servers": 0, "resyncs": 0,
                       "cancelled_calls": 0, "dropped_connections": 0, "flushes_refused": 0, "admin_failures": 0}
        self._down_since: float | None = None
        self._answered_at = [float("-inf")] * len(self.urls)  # last successful request per server
        self._closed = False
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._followers: list[Callable[[dict[str, Any]], Awaitable[None]]] = []
        self._state_seq = 0  # leader: states handed out; follower: the newest state followed
        self._sized: set[int] = set()  # servers whose cap came from their own report
        self._asked: dict[int, float] = {}  # when each server was last asked for its capacity
        self._sizing = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "ServerManager":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=self.cfg.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)
        if self._http is None:
            self._http = Http1Pool(keepalive_s=self.cfg.keepalive_s, max_connecting=self.cfg.max_connecting_per_server,
                                   connect_attempt_s=self.cfg.connect_attempt_s)
            for i, url in enumerate(self.urls):
                if url.startswith("http://"):
                    self._http.set_limit(url, self.router.capacity(i))  # a connection per request it may carry
        if self._health_task is None:
            # Every server starts inside the grace: the first wave of a run can keep a server from answering
            # for a while (a cold 2-core CPU server took 15 s for its first 128 episodes, and its probes
            # timed out meanwhile), so failed probes count only once it has had that long to answer.
            self._answered_at = [time.monotonic()] * len(self.urls)
            self._health_task = asyncio.create_task(self._health_loop(), name="server-health")

    # ------------------------------------------------------------------ followers

    def add_follower(self, hook: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """`hook(follower_state())` is awaited before each pause reaches the servers, before the calls a flush
        fallback aborts, and after each resume (bounded by `admin_timeout_s`; a follower that fails is said, the
        rest goes on): what a manager that `follow`s this one must know, in time."""
        self._followers.append(hook)

    def follower_state(self) -> dict[str, Any]:
        """What a follower mirrors (`follow`); `seq` orders the states, so an older one never undoes a newer one."""
        self._state_seq += 1
        return {"seq": self._state_seq, "interrupts": self._interrupts, "pauses": self._pauses,
                "pause_mode": self._pause_mode,
                "unpaused": self._unpaused.is_set(), "expected": self.router.expected_version,
                "versions": {s.url: s.version for s in self.router.servers}}

    def follow(self, state: dict[str, Any]) -> None:
        """Mirror a leader's `follower_state` (this manager generates; the leader makes the admin calls): its
        interrupt count (a call cut short by the leader's pause continues after the resume), pause state (no call
        is sent while paused), the servers' versions (stamps) and the expected one (stale servers stay out). A state
        older than one followed already is ignored."""
        if int(state.get("seq", 0)) < self._state_seq:
            return
        self._state_seq = int(state.get("seq", 0))
        self._interrupts = int(state["interrupts"])
        self._pauses = int(state["pauses"])
        self._pause_mode = state.get("pause_mode")
        for i, url in enumerate(self.urls):
            v = state["versions"].get(url)
            if v is not None:
                self.router.set_version(i, v)
        if state.get("expected") is not None and state["expected"] != self.router.expected_version:
            self.expect_version(int(state["expected"]))
        for i, s in enumerate(self.router.servers):
            if s.stale and s.version == self.router.expected_version:
                self._readmit(i)
        if state["unpaused"]:
            self._unpaused.set()
        else:
            self._unpaused.clear()
        self._changed.set()

    async def _tell_followers(self) -> None:
        if not self._followers:
            return
        state = self.follower_state()
        results = await asyncio.gather(*(asyncio.wait_for(h(state), self.cfg.admin_timeout_s)
                                         for h in self._followers), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                self._say(f"a follower manager did not take the servers' state: {type(r).__name__}: {r}")

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Await `fn()` first thing when the manager closes: what lives as long as it and serves through it
        (the agent gateway) is closed before the manager stops answering."""
        if self._closed:
            raise ServerError("ServerManager is closed")
        self._closers.append(fn)

    async def close(self) -> None:
        closers, self._closers = self._closers, []
        for fn in reversed(closers):
            await fn()
        self._closed = True
        if self._paused and self._session is not None:
            # The run is ending while servers are paused (an exception, Ctrl-C, the learner's death):
            # servers we did not launch (--server-url) would stay paused for whoever uses them next.
            await self._continue_quietly(sorted(self._paused))
            self._paused.clear()
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._background:  # aborts of cancelled calls: give them their (short) timeout to land
            await asyncio.wait(set(self._background), timeout=self.cfg.health_timeout_s + 1.0)
            for t in self._background:
                t.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self._background.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._http is not None:
            self._http.close()
            self._http = None

    @property
    def http(self) -> Http1Pool:
        """The pooled HTTP/1.1 connections /generate goes over (agentloop.util.http1; https goes through aiohttp)."""
        if self._http is None:
            raise ServerError("ServerManager is not started (use `async with ServerManager(...)`)")
        return self._http

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ServerError("ServerManager is not started (use `async with ServerManager(...)`)")
        return self._session

    @property
    def cache_salt(self) -> bool:
        """Requests carry a per-version `extra_key` (the constructor's `cache_salt`)."""
        return self._cache_salt

    @property
    def on_event(self) -> Callable[[str], None] | None:
        """Where event lines go (the constructor's `on_event`)."""
        return self._on_event

    @property
    def resync(self) -> ResyncHook | None:
        """The hook that reloads the current weights into a stale server (the constructor's, or `set_resync`)."""
        return self._resync

    def set_resync(self, hook: ResyncHook | None) -> None:
        """Install the resync hook (see the constructor) once what makes it exists."""
        self._resync = hook

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        t = asyncio.create_task(coro, name=name)  # type: ignore[arg-type]
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    def _say(self, line: str) -> None:
        if self._on_event is not None:
            self._on_event(line)

    # ------------------------------------------------------------------ versions

    @property
    def expected_version(self) -> int | None:
        return self.router.expected_version

    def server_versions(self) -> dict[str, int | None]:
        return {s.url: s.version for s in self.router.servers}

    def expect_version(self, version: int) -> None:
        """From now on every admitted server must serve `version` (servers known to serve another
        are ejected as stale until updated or resynced)."""
        if self._followers:
            self._spawn(self._tell_followers(), name="tell-followers")
        for i in self.router.expect(version):
            self._stats["stale_servers"] += 1
            self._say(f"server {self.urls[i]} serves version {self.router.servers[i].version}, "
                      f"expected {version}: kept out until it is updated")
        self._changed.set()

    def _readmit(self, i: int, version: int | None = None) -> bool:
        """Router.readmit, counted and said."""
        if self.router.readmit(i, version):
            self._stats["readmissions"] += 1
            self._say(f"server {self.urls[i]} re-admitted at version {self.router.servers[i].version} "
                      f"({self.router.healthy_count}/{len(self.urls)} healthy)")
            return True
        return False

    def mark_updated(self, version: int, urls: list[str]) -> None:
        """A weight push (by the learner) brought these servers to `version`."""
        for u in urls:
            i = self.urls.index(u.rstrip("/"))
            self.router.set_version(i, version)
            if self.router.servers[i].stale:
                self._readmit(i)
        self._changed.set()

    def push_targets(self) -> list[str]:
        """Servers a weight push must reach: admitted ones and those kept out only for their version."""
        return [s.url for s in self.router.servers if s.healthy or s.stale]

    async def reachable_targets(self) -> list[str]:
        """`push_targets` plus servers ejected for failures that answer now: a push that skipped them
        would leave them on old weights with nothing to bring them back (tensor/nccl keep no copy)."""
        push = set(self.push_targets())
        ejected = [s.url for s in self.router.servers if s.url not in push]
        # probed together: this runs while every server is paused for the push
        answers = await asyncio.gather(*(self._get_ok(u, "/model_info", self.cfg.health_timeout_s) for u in ejected))
        answering = {u for u, a in zip(ejected, answers) if a is not None}
        return [s.url for s in self.router.servers if s.url in push or s.url in answering]

    # ------------------------------------------------------------------ generate

    async def generate(self, episode_id: str, *, prompt_ids: Sequence[int],
                       sampling_params: SamplingParams | dict[str, Any]) -> TokenOutput:
        """Generate from `prompt_ids` on some server; the episode sticks to one server when it can.

        A call interrupted by an abort-mode pause continues after `resume` (see the module doc)."""
        prompt = prompt_ids  # kept as given (a TrajectoryBuilder's array stays compact while the call waits)
        if not len(prompt):
            raise FatalRequestError("prompt_ids is empty")
        if self.vocab_size is not None:
            lo, hi = min(prompt), max(prompt)
            if lo < 0 or hi >= self.vocab_size:
                raise FatalRequestError(f"prompt_ids hold token id {lo if lo < 0 else hi} outside the "
                                        f"vocabulary [0, {self.vocab_size})")
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
            epoch = self._interrupts
            out = await self._generate_once(episode_id, prompt if not ids else [*prompt, *ids], call_sp)
            ids += out.token_ids
            lps += out.logprobs
            vers += out.token_versions
            if out.finish_reason == "abort" and self._interrupts != epoch and len(ids) < budget:
                interrupted += 1
                self._stats["interrupted_calls"] += 1
                continue  # a weight update cut it: go on under the new weights once resumed
            break
        if interrupted:
            self._stats["continued_calls"] += 1
        out.token_ids, out.logprobs, out.token_versions = ids, lps, vers
        out.interrupted = interrupted
        out.latency_s = time.monotonic() - t0
        return out

    async def _generate_once(self, episode_id: str, prompt_ids: Sequence[int], sp: dict[str, Any]) -> TokenOutput:
        """One call with retries on other servers (no continuation)."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.retry_budget_s
        avoid: set[int] = set()
        attempt = 0
        dropped_once = False
        last_err: Exception | None = None
        while True:
            await self._wait_unpaused(deadline)
            idx = await self._acquire(episode_id, avoid, deadline, last_err)
            attempt += 1
            rid = uuid.uuid4().hex
            stamp = self.router.servers[idx].version
            data = self._request_body(prompt_ids, sp, rid, stamp)
            url = self.urls[idx]
            ts = time.monotonic()
            pauses = self._pauses
            try:
                self._stats["requests"] += 1
                raw = await self._post_generate(url, data, timeout=max(0.001, min(self.cfg.request_timeout_s,
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
                single = self._pauses == pauses or self._pause_mode == "abort"
                out = parse_generate_response(body, url, stamp=stamp, single_version=single)
            except asyncio.CancelledError:
                self._stats["cancelled_calls"] += 1
                self._spawn(self._abort_quietly(url, rid), name=f"abort-{rid}")
                raise
            except RetryableError as e:
                if isinstance(e, _Dropped) and not dropped_once:
                    # The server closed the connection without answering: on a pooled connection that is
                    # the keep-alive race (it closed the idle connection as we sent), not a failing
                    # server. Once per call it is retried at once, on the same server, uncounted; a dead
                    # server then refuses the new connection and is counted as usual.
                    dropped_once = True
                    self._stats["dropped_connections"] += 1
                    self._spawn(self._abort_quietly(url, rid), name=f"abort-{rid}")  # in case it did arrive
                    attempt -= 1
                    continue
                self._note_failure(idx)
                last_err = e
                avoid.add(idx)
                if isinstance(e, _Timeout):
                    self._stats["timeouts"] += 1
                    self._spawn(self._abort_quietly(url, rid), name=f"abort-{rid}")
                if attempt >= self.cfg.max_attempts or time.monotonic() >= deadline:
                    self._stats["errors"] += 1
                    raise RetryBudgetExhausted(
                        f"generate for episode {episode_id} failed after {attempt} attempt(s) in "
                        f"{time.monotonic() - t0:.1f}s; last error: {e}") from e
                self._stats["retries"] += 1
                await asyncio.sleep(min(5.0, self.cfg.retry_backoff_s * 2 ** (attempt - 1)))
                continue
            except FatalRequestError:
                self._stats["errors"] += 1
                raise
            finally:
                self.router.release(idx)
                self._changed.set()
            self.router.record_success(idx)
            self._answered_at[idx] = time.monotonic()
            latency = time.monotonic() - ts
            self._latencies.append(latency)
            self._stats["prompt_tokens"] += out.prompt_tokens or len(prompt_ids)
            self._stats["cached_tokens"] += out.cached_tokens
            self._stats["output_tokens"] += len(out.token_ids)
            out.latency_s = latency
            out.attempts = attempt
            return out

    def _request_body(self, prompt_ids: Sequence[int], sp: dict[str, Any], rid: str, stamp: int | None) -> bytes:
        """The /generate body. The ids list exists only while it is serialised, and the bytes are copied out of
        orjson's 64 KiB output buffer: a request in flight holds ~2 KB, not 64 KB plus a list of Python ints."""
        ids = prompt_ids.tolist() if isinstance(prompt_ids, array) else prompt_ids
        payload: dict[str, Any] = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                                   "logprob_start_len": -1, "rid": rid, "stream": False}
        if self.cache_salt and stamp is not None:
            payload["extra_key"] = f"agentloop-v{stamp}"
        return bytes(memoryview(orjson.dumps(payload)))

    def end_episode(self, episode_id: str) -> None:
        """Forget the episode's sticky server (the engine calls this when an episode ends)."""
        self.router.end_episode(episode_id)

    async def _acquire(self, episode_id: str, avoid: set[int], deadline: float,
                       last_err: Exception | None) -> int:
        while True:
            idx = self.router.acquire(episode_id, avoid)
            if idx is not None:
                self._down_since = None
                return idx
            now = time.monotonic()
            availability = self.router.availability()
            if availability is Availability.FULL and self.cfg.max_inflight_per_server is None \
                    and len(self._sized) < len(self.urls) and not self._sizing:
                self._sizing = True  # one ask at a time; waiters wake when caps change (_changed)
                self._spawn(self._size_then_clear(), name="size-servers")
            if availability is Availability.DOWN:
                if self._down_since is None:
                    self._down_since = now
                if now - self._down_since >= self.cfg.all_down_grace_s:
                    raise AllServersDownError(
                        f"all {len(self.urls)} server(s) are down ({', '.join(self.urls)}) for "
                        f"{now - self._down_since:.0f}s" + (f"; last error: {last_err}" if last_err else ""))
            if now >= deadline:
                raise RetryBudgetExhausted(f"no server could take episode {episode_id} within the retry budget"
                                           + (f"; last error: {last_err}" if last_err else ""))
            self._changed.clear()
            wait = min(deadline - now, self.cfg.health_interval_s)
            if self._down_since is not None:
                wait = min(wait, max(0.01, self._down_since + self.cfg.all_down_grace_s - now))
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=max(0.01, wait))
            except asyncio.TimeoutError:
                pass

    async def _wait_unpaused(self, deadline: float) -> None:
        if self._unpaused.is_set():
            return
        # A pause (weight sync) is not a failure: it does not consume the retry budget's attempts,
        # but it is bounded by admin_timeout_s so a forgotten resume cannot hang the run.
        try:
            await asyncio.wait_for(self._unpaused.wait(), timeout=self.cfg.admin_timeout_s)
        except asyncio.TimeoutError:
            raise ServerError(f"servers stayed paused for over {self.cfg.admin_timeout_s}s") from None

    def _note_failure(self, idx: int) -> None:
        if self.router.record_failure(idx):
            self._stats["ejections"] += 1
            self._say(f"server {self.urls[idx]} ejected after {self.router.servers[idx].consecutive_failures} "
                      f"failures ({self.router.healthy_count}/{len(self.urls)} healthy)")

    async def _post_generate(self, url: str, data: bytes, timeout: float) -> bytes:
        """POST /generate; the answer's body (HTTP 2xx). Failures classified for the retry policy (module doc)."""
        if url.startswith("https://"):
            status, raw = await self._post_aiohttp(url, data, timeout)
        else:
            try:
                status, raw = await self.http.post(url, "/generate", data, timeout=timeout,
                                                   connect_timeout=self.cfg.connect_timeout_s)
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
        to = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, self.cfg.connect_timeout_s))
        try:
            async with self.session.post(url + "/generate", data=data, headers=_JSON_HEADERS, timeout=to) as resp:
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
        try:
            await self._admin_post(url, "/abort_request", {"rid": rid}, timeout=self.cfg.health_timeout_s)
        except Exception:  # noqa: BLE001 - best effort: the server may be the reason we are here
            pass

    # ------------------------------------------------------------------ health

    async def _get_ok(self, url: str, path: str, timeout: float) -> Any:
        """GET url+path; the JSON body (or True for a non-JSON 200), None on any failure."""
        to = aiohttp.ClientTimeout(total=timeout)
        try:
            async with self.session.get(url + path, timeout=to) as resp:
                text = await resp.text()
                if resp.status != 200:
                    return None
                try:
                    return json.loads(text) if text.strip() else True
                except json.JSONDecodeError:
                    return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def check_health(self, idx: int) -> bool:
        """Liveness of an admitted server (GET /health)."""
        return await self._get_ok(self.urls[idx], "/health", self.cfg.health_timeout_s) is not None

    async def model_info(self, idx: int, timeout: float | None = None) -> dict[str, Any] | None:
        """What the server says it serves (GET /model_info: model_path, model_type, architectures,
        weight_version, ...), None when it does not answer with a JSON object."""
        info = await self._get_ok(self.urls[idx], "/model_info", timeout or self.cfg.health_timeout_s)
        return info if isinstance(info, dict) else None

    async def server_info(self, idx: int, timeout: float | None = None) -> dict[str, Any] | None:
        """The server's state and settings (GET /server_info, older SGLang /get_server_info: its arguments and
        each scheduler's internal state, max_total_num_tokens among them), None when it does not say."""
        for path in ("/server_info", "/get_server_info"):
            info = await self._get_ok(self.urls[idx], path, timeout or self.cfg.health_timeout_s)
            if isinstance(info, dict):
                return info
        return None

    async def reported_version(self, idx: int) -> int | None:
        """The weight version the server says it serves (GET /model_info), None when it does not say."""
        info = await self.model_info(idx)
        return parse_version(info.get("weight_version")) if info is not None else None

    async def _try_readmit(self, idx: int) -> None:
        """An ejected server: a probe through its scheduler, then its version; resync when stale."""
        url = self.urls[idx]
        if idx in self._needs_continue:  # it failed a pause or continue: it may still be paused
            await self._continue_quietly([idx])
        if await self._get_ok(url, "/health_generate", self.cfg.health_timeout_s + 20.0) is None:
            self.router.record_failure(idx)
            return
        version = await self.reported_version(idx)
        expected = self.router.expected_version
        if expected is not None and version != expected and self.resync is not None:
            try:
                await self.resync(url)
                self._stats["resyncs"] += 1
                version = await self.reported_version(idx)
            except Exception as e:  # noqa: BLE001 - it stays out; the next probe tries again
                self._say(f"server {url}: resync to version {expected} failed: {type(e).__name__}: {e}")
                return
        if expected is None and version is None:
            version = self.router.servers[idx].version
        if self.router.servers[idx].healthy:  # the resync's update already brought it back
            return
        was_stale = self.router.servers[idx].stale
        if self._readmit(idx, version):
            return
        if self.router.servers[idx].stale and not was_stale:
            self._stats["stale_servers"] += 1
            self._say(f"server {url} answers but serves version {version}, expected {expected}: kept out")

    async def probe_all(self) -> None:
        if not self._unpaused.is_set():
            # SGLang parks probes behind a pause and then marks itself unhealthy: never probe one.
            return

        async def one(i: int) -> None:
            s = self.router.servers[i]
            if s.healthy:
                if await self.check_health(i):
                    self.router.record_success(i)
                elif time.monotonic() - self._answered_at[i] < self.cfg.answered_grace_s:
                    # A server answering requests is alive, whatever its probe says: under heavy load
                    # SGLang's /health can miss its timeout, and ejecting the only server ends the run.
                    self.router.record_success(i)
                else:
                    self._note_failure(i)
            else:
                await self._try_readmit(i)

        await asyncio.gather(*(one(i) for i in range(len(self.urls))))
        self._changed.set()

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.cfg.health_interval_s)
            await self.probe_all()

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every server answers /health (used after connecting to external servers)."""
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.urls)))
        while pending:
            for i in list(pending):
                if await self.check_health(i):
                    pending.discard(i)
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise ServerError("server(s) not healthy within %.0fs: %s"
                                  % (timeout, ", ".join(self.urls[i] for i in sorted(pending))))
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ capacity

    async def size_from_servers(self) -> None:
        """Size each server's cap on concurrent requests from the capacity it reports (`reported_capacity`:
        its scheduler's max_running_requests), unless manager.max_inflight_per_server was set (then that
        number holds for every server). A fixed default of 256 split a 512-episode GPU rollout into two
        waves while the server's KV cache sat at 8%.

        Asked when it matters: the first time every admitted server is at its cap (`_acquire`), so a run
        that never fills the default cap never asks. A server that does not say keeps the default; it is
        asked again after `_RESIZE_AFTER_S` when the servers are full again."""
        if self.cfg.max_inflight_per_server is not None:
            return
        now = time.monotonic()
        todo = [i for i in range(len(self.urls))
                if i not in self._sized and now - self._asked.get(i, float("-inf")) >= _RESIZE_AFTER_S]
        for i in todo:
            self._asked[i] = now
        caps = await asyncio.gather(*(self._server_capacity(i) for i in todo))
        for i, cap in zip(todo, caps):
            if cap is not None:
                self._sized.add(i)
                self.router.set_capacity(i, cap)
                if self._http is not None and self.urls[i].startswith("http://"):
                    self._http.set_limit(self.urls[i], cap)
                self._say(f"server {self.urls[i]}: up to {cap} concurrent requests (its max_running_requests)")
        if any(c is not None for c in caps):
            self._changed.set()

    async def _size_then_clear(self) -> None:
        try:
            await self.size_from_servers()
        finally:
            self._sizing = False

    async def _server_capacity(self, idx: int) -> int | None:
        for path in ("/server_info", "/get_server_info"):
            info = await self._get_ok(self.urls[idx], path, self.cfg.health_timeout_s)
            cap = reported_capacity(info)
            if cap is not None:
                return cap
        return None

    # ------------------------------------------------------------------ admin broadcast

    async def _admin_post(self, url: str, path: str, payload: dict[str, Any] | None,
                          timeout: float | None = None) -> Any:
        to = aiohttp.ClientTimeout(total=timeout or self.cfg.admin_timeout_s)
        try:
            async with self.session.post(url + path, json=payload or {}, timeout=to) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise RequestError(f"{url}{path} answered HTTP {resp.status}: {text[:300]}", server=url,
                                       status=resp.status)
                try:
                    return json.loads(text) if text else None
                except json.JSONDecodeError:
                    return text
        except asyncio.TimeoutError:
            raise RequestError(f"{url}{path} timed out after {to.total}s", server=url) from None
        except aiohttp.ClientError as e:
            raise RequestError(f"{url}{path}: {type(e).__name__}: {e}", server=url) from None

    async def _broadcast(self, path: str, payload: dict[str, Any] | None = None, *,
                         idxs: list[int] | None = None) -> list[Any]:
        """POST an admin call to every admitted server (or `idxs`); the answers of those that took it.

        A server that fails it is ejected and the others go on: the health loop brings it back once it
        answers a probe through its scheduler and serves the expected weights (reloaded first when stale);
        one that failed a pause or a continue is sent a continue before that probe, since a paused SGLang
        parks probes. Only when every server fails is it an error (ServerError)."""
        if idxs is None:
            idxs = [i for i, s in enumerate(self.router.servers) if s.healthy]
        results = await asyncio.gather(*(self._admin_post(self.urls[i], path, payload) for i in idxs),
                                       return_exceptions=True)
        failed = [(i, r) for i, r in zip(idxs, results) if isinstance(r, BaseException)]
        if failed and len(failed) == len(idxs):
            raise ServerError(f"{path} failed on {len(failed)}/{len(idxs)} server(s): {failed[0][1]}")
        for i, err in failed:
            if path in ("/pause_generation", "/continue_generation"):
                self._needs_continue.add(i)
            if self.router.servers[i].healthy:
                self.router.eject(i)
                self._stats["ejections"] += 1
            self._stats["admin_failures"] += 1
            self._say(f"server {self.urls[i]} failed {path} ({err}); ejected until it answers again "
                      f"({self.router.healthy_count}/{len(self.urls)} healthy)")
        if failed:
            self._changed.set()
        return [r for r in results if not isinstance(r, BaseException)]

    async def _continue_quietly(self, idxs: list[int]) -> None:
        """Best effort, short timeout: servers we may have left paused go on generating."""
        async def one(i: int) -> None:
            try:
                await self._admin_post(self.urls[i], "/continue_generation", {}, timeout=self.cfg.health_timeout_s)
                self._needs_continue.discard(i)
            except Exception:  # noqa: BLE001 - best effort: the server may be gone, or the run ending
                pass

        await asyncio.gather(*(one(i) for i in idxs))

    async def pause(self, mode: str = "in_place") -> None:
        """Stop admitting new requests and pause generation on every admitted server.

        mode: "in_place" keeps in-flight requests (resumed by `resume`), "abort" aborts them (calls of
        `generate` continue themselves after `resume`), "retract" lets the server requeue them.
        A server that fails the pause is ejected (see `_broadcast`); when every one fails, none is left
        paused (each is sent a continue) and ServerError is raised.
        """
        self._unpaused.clear()
        self._pause_mode = mode
        self._pauses += 1
        targets = [i for i, s in enumerate(self.router.servers) if s.healthy]
        self._paused.update(targets)  # remembered until resumed: `close` continues them whatever happens
        try:
            if mode == "abort":
                self._interrupts += 1
            await self._tell_followers()  # their calls this pause cuts short continue, as ours do
            if mode == "abort":
                await self._abort_and_drain()
            await self._broadcast("/pause_generation", {"mode": mode}, idxs=targets)
        except BaseException:
            await self._continue_quietly(sorted(self._paused))
            self._paused.clear()
            self._unpaused.set()
            self._changed.set()
            await self._tell_followers()
            raise

    async def _abort_and_drain(self, rounds: int = 4, wait_s: float = 0.25) -> None:
        """Abort what runs and wait for those calls to come back, before an abort-mode pause.

        SGLang's abort-mode /pause_generation aborts everything, then polls for the requests' end in 1 s
        sleeps: with anything in flight it costs >= 1 s (measured: 1.06 s per weight sync under async load
        on an H100 vs 0.21 s with nothing in flight). Aborted calls answer within milliseconds, so we abort
        first and let the pause find nothing running. A call that reached a server after an abort gets the
        next round; whatever is left after the rounds, the pause itself aborts."""
        def busy() -> bool:
            return any(s.inflight for s in self.router.servers)

        for _ in range(rounds):
            if not busy():
                return
            try:
                await self._broadcast("/abort_request", {"rid": "", "abort_all": True})
            except ServerError:
                return  # only a shortcut: the pause itself aborts what runs, and says if it fails
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self._changed.clear()  # cleared before the check, so a release after it wakes us
                if not busy():
                    break
                try:  # set by every call's release; the short cap guards a wake-up taken by another waiter
                    await asyncio.wait_for(self._changed.wait(),
                                           timeout=min(0.02, max(0.001, deadline - time.monotonic())))
                except asyncio.TimeoutError:
                    pass

    async def resume(self) -> None:
        """Continue generation on every admitted server and on every one paused since the last resume.
        A server that fails it is ejected (see `_broadcast`); ServerError only when every one fails."""
        targets = sorted({i for i, s in enumerate(self.router.servers) if s.healthy} | self._paused)
        try:
            await self._broadcast("/continue_generation", {}, idxs=targets)
        finally:
            self._paused.clear()
            self._unpaused.set()
            self._changed.set()
            await self._tell_followers()

    async def finish_update(self, policy: InterruptPolicy, urls: list[str] | None = None) -> None:
        """After a weight update reached the servers (`urls`, default the push targets), before `resume`:
        flush their prefix caches where `policy.flush_after` says so (retract).

        A server that refuses the flush (SGLang 0.5.17 counts retracted requests waiting in its queue as
        busy; 0.5.23 does not) gets those requests aborted: they answer with their partial tokens, and since
        the abort counts as an interrupt their calls continue under the new weights once resumed, as in abort
        mode. It is flushed again once they have answered; one that still refuses is ejected, so it never
        serves KV of the old weights (it is resynced before it comes back)."""
        if policy.flush_after:
            await self.flush_prefix_cache(urls if urls is not None else self.push_targets())

    async def flush_prefix_cache(self, urls: list[str]) -> None:
        """Empty these servers' prefix caches (paused, or kept out of rotation), whatever waits in their queues (see
        `finish_update`: refused flushes abort the waiting requests, then flush; a server that still
        refuses is ejected)."""
        await asyncio.gather(*(self._flush_paused(self.urls.index(u.rstrip("/"))) for u in urls))

    async def _flush_paused(self, i: int) -> None:
        url = self.urls[i]
        try:
            if await self._flush_one(i, time.monotonic()):  # one try: retracted requests waiting make it refuse
                return
            first: Exception | str = "refused"
        except RequestError as e:
            first = e
        self._interrupts += 1  # the calls aborted below continue themselves after resume
        await self._tell_followers()  # and so do the followers' calls
        try:
            await self._admin_post(url, "/abort_request", {"rid": "", "abort_all": True})
            await self._drain(lambda: self.router.servers[i].inflight > 0, self.cfg.admin_timeout_s)
            if await self._flush_one(i, time.monotonic() + self.cfg.flush_timeout_s):
                return
            e2: Exception | str = f"still refused after {self.cfg.flush_timeout_s:g}s of retries"
        except (RequestError, ServerError) as e:
            e2 = e
        # Its prefix cache holds KV of the old weights: serving it would sample under no version at all.
        self.router.eject(i)
        self._stats["ejections"] += 1
        self._say(f"server {url} kept its prefix cache after the weight update ({first}; then {e2}); "
                  "ejected until resynced")
        self._changed.set()

    async def _flush_one(self, i: int, deadline: float) -> bool:
        """POST /flush_cache to server i; True once it flushed. A refusal (HTTP 400) is retried with back-off
        until `deadline` (then False), never counted as the server's failure: SGLang flushes only a fully idle
        scheduler, and one whose requests just ended is not idle for a moment (its last batch or its overlap
        queue still set: "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 0").
        Other failures (the server down, a timeout) raise RequestError."""
        delay = 0.05
        while True:
            try:
                await self._admin_post(self.urls[i], "/flush_cache", None)
                return True
            except RequestError as e:
                if e.status != 400:
                    raise
                self._stats["flushes_refused"] += 1
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(delay, left))  # back-off: the scheduler needs an iteration or two
            delay = min(1.0, delay * 2)

    async def _drain(self, busy: Callable[[], bool], timeout: float) -> None:
        """Wait until `busy()` is false (re-checked whenever a call releases its server); ServerError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self._changed.clear()  # cleared before the check, so a release after it wakes us
            if not busy():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerError(f"calls did not drain within {timeout}s")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(0.05, left))
            except asyncio.TimeoutError:
                pass

    async def abort_all(self) -> None:
        await self._broadcast("/abort_request", {"rid": "", "abort_all": True})

    async def flush_cache(self) -> list[str]:
        """Empty every admitted server's prefix cache (benches, before each side). A refusal is retried with back-off
        for `manager.flush_timeout_s` and never ejects the server (`_flush_one`); returns the urls of the servers that
        still refused at that deadline (their cache kept; said once each). A server that fails otherwise (down,
        timing out) is ejected as for any admin call; ServerError only when every server failed that way."""
        idxs = [i for i, s in enumerate(self.router.servers) if s.healthy]
        deadline = time.monotonic() + self.cfg.flush_timeout_s
        results = await asyncio.gather(*(self._flush_one(i, deadline) for i in idxs), return_exceptions=True)
        failed = [(i, r) for i, r in zip(idxs, results) if isinstance(r, BaseException)]
        if failed and len(failed) == len(idxs):
            raise ServerError(f"/flush_cache failed on {len(failed)}/{len(idxs)} server(s): {failed[0][1]}")
        for i, err in failed:
            self.router.eject(i)
            self._stats["ejections"] += 1
            self._stats["admin_failures"] += 1
            self._say(f"server {self.urls[i]} failed /flush_cache ({err}); ejected until it answers again "
                      f"({self.router.healthy_count}/{len(self.urls)} healthy)")
        if failed:
            self._changed.set()
        kept = [self.urls[i] for i, r in zip(idxs, results) if r is False]
        for url in kept:
            self._say(f"server {url} refused /flush_cache for {self.cfg.flush_timeout_s:g}s; its prefix cache is kept")
        return kept

    async def update_weights_from_disk(self, model_path: str | Mapping[str, str],
                                       weight_version: int | str | None = None, *, flush_cache: bool = True,
                                       urls: list[str] | None = None) -> list[Any]:
        """Load HF weights into the servers (`urls`, default: admitted ones and version-stale ones) from
        `model_path`: one directory every server reads, or one per server URL (servers on other nodes each read
        their own copy).

        A server that fails the update is ejected (it is resynced before it comes back) as long as one
        succeeded; with none succeeding it is an error."""
        def payload(i: int) -> dict[str, Any]:
            path = model_path if isinstance(model_path, str) else model_path[self.urls[i]]
            body: dict[str, Any] = {"model_path": path, "flush_cache": flush_cache}
            if weight_version is not None:
                body["weight_version"] = str(weight_version)
            return body

        if not isinstance(model_path, str):
            model_path = {u.rstrip("/"): p for u, p in model_path.items()}
        to = urls if urls is not None else await self.reachable_targets()
        targets = [self.urls.index(u.rstrip("/")) for u in to]
        results = await asyncio.gather(*(self._admin_post(self.urls[i], "/update_weights_from_disk", payload(i))
                                         for i in targets), return_exceptions=True)
        version = parse_version(weight_version)
        ok, failures = [], []
        for i, r in zip(targets, results):
            if isinstance(r, BaseException) or (isinstance(r, dict) and r.get("success") is False):
                failures.append((i, r.get("message") if isinstance(r, dict) else r))
            else:
                ok.append(r)
                if version is not None:
                    self.router.set_version(i, version)
                if self.router.servers[i].stale:
                    self._readmit(i)
        if failures and (not ok or urls is not None):
            i, why = failures[0]
            raise ServerError(f"{self.urls[i]} refused the weight update: {why}")
        for i, why in failures:
            self.router.eject(i)
            self._stats["ejections"] += 1
            self._say(f"server {self.urls[i]} failed the weight update ({why}); ejected until resynced")
        self._changed.set()
        return ok

    # ------------------------------------------------------------------ gauges

    def gauges(self) -> dict[str, float]:
        lat = list(self._latencies)
        g: dict[str, float] = {
            "server/healthy": float(self.router.healthy_count),
            "server/total": float(len(self.urls)),
            "server/inflight": float(sum(s.inflight for s in self.router.servers)),
            "server/latency_p50_s": _percentile(lat, 0.50),
            "server/latency_p99_s": _percentile(lat, 0.99),
            "server/prefix_cache_hit_rate": (self._stats["cached_tokens"] / self._stats["prompt_tokens"]
                                             if self._stats["prompt_tokens"] else 0.0),
        }
        for k, v in self._stats.items():
            g[f"server/{k}"] = float(v)
        if self._http is not None:  # connections: open, opened, connect retries, waits for one (p99, max)
            for k, v in self._http.stats().items():
                g[f"server/{k}"] = v
        for i, s in enumerate(self.router.servers):
            g[f"server/{i}/inflight"] = float(s.inflight)
            g[f"server/{i}/healthy"] = float(s.healthy)
            g[f"server/{i}/requests"] = float(s.requests)
            g[f"server/{i}/capacity"] = float(self.router.capacity(i))
        return g


class _Dropped(RetryableError):
    """The server closed the connection before answering (retryable; see `_generate_once`)."""


class _Timeout(RetryableError):
    """An attempt that hit its timeout (retryable; the request is aborted on its server)."""
