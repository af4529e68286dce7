"""ServerManager: the only way agentloop talks to SGLang servers (token ids in, token ids out).

Map:
    ServerManager.generate     route (Router) -> POST /generate -> TokenOutput, typed retries
    _post_generate             one attempt; classifies failures as RetryableError / FatalRequestError
    _health_loop               probes /health; ejects dead servers and re-admits recovered ones
    pause/resume/abort_all/flush_cache/update_weights_from_disk
                               admin calls broadcast to every server
    gauges                     `server/...` numbers for progress lines and metrics

Retry policy: transport errors, HTTP 5xx and timeouts are retried on another server (the
one that failed is avoided) until `max_attempts` or `retry_budget_s` runs out; 4xx and
malformed responses are never retried. A request that timed out is aborted on its server
(best effort) so a hung request stops burning compute there. When no server is healthy for
`all_down_grace_s`, generate raises AllServersDownError, which the engine treats as fatal.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import deque
from typing import Any

import aiohttp

from agentloop.config import ManagerConfig, SamplingParams
from agentloop.errors import (
    AllServersDownError,
    FatalRequestError,
    RequestError,
    RetryableError,
    RetryBudgetExhausted,
    ServerError,
)
from agentloop.records import TokenOutput
from agentloop.routing import Availability, Router

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


def parse_generate_response(body: Any, server: str) -> TokenOutput:
    """Turn SGLang's /generate JSON into a TokenOutput; FatalRequestError if it is not usable."""
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
        ids = [int(e[1]) for e in entries]
        lps = [float(e[0]) if e[0] is not None else 0.0 for e in entries]
    except (TypeError, IndexError, ValueError) as e:
        raise FatalRequestError(f"malformed output_token_logprobs: {e}", server=server) from None
    out_ids = body.get("output_ids")
    if out_ids is not None and list(out_ids) != ids:
        raise FatalRequestError("output_ids and output_token_logprobs disagree", server=server)
    fr = meta.get("finish_reason")
    fr_type = fr.get("type") if isinstance(fr, dict) else fr
    finish = _FINISH.get(str(fr_type), "abort" if fr_type is not None else "length")
    wv = meta.get("weight_version")
    return TokenOutput(
        token_ids=ids,
        logprobs=lps,
        finish_reason=finish,
        weight_version=None if wv is None else str(wv),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        server=server,
    )


class ServerManager:
    """Routes token-in/token-out generate calls over N SGLang servers.

    Use as `async with ServerManager(urls, cfg) as sm:`; all methods must run on one event loop.
    """

    def __init__(self, urls: list[str], config: ManagerConfig | None = None, *, vocab_size: int | None = None):
        """`vocab_size`: when known, prompts with ids outside [0, vocab_size) are rejected client-side
        (SGLang 0.5.23 crashes its scheduler on such ids instead of answering 400)."""
        if not urls:
            raise ServerError("ServerManager needs at least one server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = config or ManagerConfig()
        self.vocab_size = vocab_size
        self.router = Router(self.urls, self.cfg.max_inflight_per_server, self.cfg.eject_after_failures,
                             sticky=self.cfg.sticky)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._changed = asyncio.Event()  # set whenever capacity or health may have changed
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._rid = itertools.count()
        self._latencies: deque[float] = deque(maxlen=4096)
        self._stats = {"requests": 0, "retries": 0, "errors": 0, "timeouts": 0, "ejections": 0,
                       "readmissions": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
        self._down_since: float | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "ServerManager":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="server-health")

    async def close(self) -> None:
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ServerError("ServerManager is not started (use `async with ServerManager(...)`)")
        return self._session

    # ------------------------------------------------------------------ generate

    async def generate(self, episode_id: str, *, prompt_ids: list[int],
                       sampling_params: SamplingParams | dict[str, Any]) -> TokenOutput:
        """Generate from `prompt_ids` on some server; the episode sticks to one server when it can."""
        if not prompt_ids:
            raise FatalRequestError("prompt_ids is empty")
        if self.vocab_size is not None:
            lo, hi = min(prompt_ids), max(prompt_ids)
            if lo < 0 or hi >= self.vocab_size:
                raise FatalRequestError(f"prompt_ids hold token id {lo if lo < 0 else hi} outside the "
                                        f"vocabulary [0, {self.vocab_size})")
        if isinstance(sampling_params, SamplingParams):
            sp = sampling_params.to_sglang()
        else:
            sp = dict(sampling_params)
        t0 = time.monotonic()
        deadline = t0 + self.cfg.retry_budget_s
        avoid: set[int] = set()
        attempt = 0
        last_err: Exception | None = None
        while True:
            await self._wait_unpaused(deadline)
            idx = await self._acquire(episode_id, avoid, deadline, last_err)
            attempt += 1
            rid = f"{episode_id}-{next(self._rid)}"
            payload = {"input_ids": prompt_ids, "sampling_params": sp, "return_logprob": True,
                       "logprob_start_len": -1, "rid": rid, "stream": False}
            url = self.urls[idx]
            ts = time.monotonic()
            try:
                self._stats["requests"] += 1
                out = await self._post_generate(url, payload, timeout=max(0.001, min(self.cfg.request_timeout_s,
                                                                                     deadline - ts)))
            except RetryableError as e:
                self._note_failure(idx)
                last_err = e
                avoid.add(idx)
                if isinstance(e, _Timeout):
                    self._stats["timeouts"] += 1
                    asyncio.create_task(self._abort_quietly(url, rid))
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
            latency = time.monotonic() - ts
            self._latencies.append(latency)
            self._stats["prompt_tokens"] += out.prompt_tokens or len(prompt_ids)
            self._stats["cached_tokens"] += out.cached_tokens
            self._stats["output_tokens"] += len(out.token_ids)
            out.latency_s = latency
            out.attempts = attempt
            return out

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
            if self.router.availability() is Availability.DOWN:
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

    async def _post_generate(self, url: str, payload: dict[str, Any], timeout: float) -> TokenOutput:
        to = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, self.cfg.connect_timeout_s))
        try:
            async with self.session.post(url + "/generate", json=payload, timeout=to) as resp:
                if resp.status >= 500:
                    text = await resp.text()
                    raise RetryableError(f"{url} answered HTTP {resp.status}: {text[:300]}", server=url,
                                         status=resp.status)
                if resp.status >= 400:
                    text = await resp.text()
                    raise FatalRequestError(f"{url} rejected the request (HTTP {resp.status}): {text[:500]}",
                                            server=url, status=resp.status)
                try:
                    body = await resp.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError, UnicodeDecodeError) as e:
                    raise FatalRequestError(f"{url} sent a non-JSON body: {e}", server=url) from None
        except asyncio.TimeoutError:
            raise _Timeout(f"{url} did not answer within {timeout:.1f}s", server=url) from None
        except aiohttp.ClientError as e:
            raise RetryableError(f"{url}: {type(e).__name__}: {e}", server=url) from None
        except OSError as e:
            raise RetryableError(f"{url}: {type(e).__name__}: {e}", server=url) from None
        return parse_generate_response(body, url)

    async def _abort_quietly(self, url: str, rid: str) -> None:
        try:
            await self._admin_post(url, "/abort_request", {"rid": rid}, timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort: the server may be the reason we are here
            pass

    # ------------------------------------------------------------------ health

    async def check_health(self, idx: int) -> bool:
        url = self.urls[idx]
        to = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        try:
            async with self.session.get(url + "/health", timeout=to) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def probe_all(self) -> None:
        results = await asyncio.gather(*(self.check_health(i) for i in range(len(self.urls))))
        for i, ok in enumerate(results):
            if ok:
                if self.router.readmit(i):
                    self._stats["readmissions"] += 1
            elif self.router.record_failure(i):
                self._stats["ejections"] += 1
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

    async def _broadcast(self, path: str, payload: dict[str, Any] | None = None,
                         only_healthy: bool = True) -> list[Any]:
        idxs = [i for i, s in enumerate(self.router.servers) if s.healthy or not only_healthy]
        results = await asyncio.gather(*(self._admin_post(self.urls[i], path, payload) for i in idxs),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise ServerError(f"{path} failed on {len(errors)}/{len(idxs)} server(s): {errors[0]}")
        return list(results)

    async def pause(self, mode: str = "in_place") -> None:
        """Stop admitting new requests and pause generation on every server.

        mode: "in_place" keeps in-flight requests (resumed by `resume`), "abort" aborts them
        (their callers get finish_reason "abort"), "retract" lets the server requeue them.
        """
        self._unpaused.clear()
        await self._broadcast("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        try:
            await self._broadcast("/continue_generation", {})
        finally:
            self._unpaused.set()

    async def abort_all(self) -> None:
        await self._broadcast("/abort_request", {"rid": "", "abort_all": True})

    async def flush_cache(self) -> None:
        await self._broadcast("/flush_cache", None)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> list[Any]:
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        results = await self._broadcast("/update_weights_from_disk", payload)
        for url, r in zip(self.urls, results):
            if isinstance(r, dict) and r.get("success") is False:
                raise ServerError(f"{url} refused the weight update: {r.get('message')}")
        return results

    # ------------------------------------------------------------------ gauges

    def gauges(self) -> dict[str, float]:
        lat = list(self._latencies)
        g: dict[str, float] = {
            "server/healthy": float(self.router.healthy_count),
            "server/inflight": float(sum(s.inflight for s in self.router.servers)),
            "server/latency_p50_s": _percentile(lat, 0.50),
            "server/latency_p99_s": _percentile(lat, 0.99),
            "server/prefix_cache_hit_rate": (self._stats["cached_tokens"] / self._stats["prompt_tokens"]
                                             if self._stats["prompt_tokens"] else 0.0),
        }
        for k, v in self._stats.items():
            g[f"server/{k}"] = float(v)
        for i, s in enumerate(self.router.servers):
            g[f"server/{i}/inflight"] = float(s.inflight)
            g[f"server/{i}/healthy"] = float(s.healthy)
            g[f"server/{i}/requests"] = float(s.requests)
        return g


class _Timeout(RetryableError):
    """An attempt that hit its timeout (retryable; the request is aborted on its server)."""
