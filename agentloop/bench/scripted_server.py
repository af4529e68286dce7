"""A scripted SGLang server for benchmarks: SGLang's HTTP API, no model, fast enough never to be the bottleneck.

`agentloop bench rollout --scripted-server` and `agentloop bench cache --scripted-server` start these in their
own processes (`python -m agentloop.bench.scripted_server --port P --spec JSON`), so the engine under test
has its process to itself. Tests use it the same way.

    PrefixCache      SGLang's radix cache as a model: a radix tree of token ids with a capacity in tokens and
                     LRU eviction of unused leaves; a request's `cached_tokens` is its longest cached prefix,
                     and its prompt + output are inserted when it finishes (SGLang's cache_finished_req)
    ScriptedSpec     what the server answers: scripted turns (token ids chosen by how many `turn_marker` ids
                     the input holds: a tool loop's k-th turn sees k tool responses), a first-turn answer per
                     prompt (`answers`, keyed by `answer_key` of the input ids) or seeded filler tokens,
                     and how long each answer takes (latency model below)
    ScriptedServer   a minimal HTTP/1.1 server on asyncio (keep-alive, Content-Length bodies, orjson): the
                     aiohttp server costs ~4x more CPU per request, which on a 2-core box is CPU taken from
                     the engine being measured

Latency model: an answer is sent `base_s + per_token_s * new_tokens + per_prefill_token_s * uncached_tokens`
seconds after the request arrived, times a jitter factor in [1 - jitter, 1 + jitter] drawn from the request's
input ids (deterministic: the same request meets the same latency whoever sends it). Many requests wait at once
(timers, not work), so the server models a GPU batch that
answers thousands of requests concurrently.

Endpoints: POST /generate, /abort_request, /flush_cache, /pause_generation, /continue_generation;
GET /health, /health_generate, /model_info, /server_info and /get_server_info (max_total_num_tokens = the
cache capacity, internal_states[0].effective_max_running_requests_per_dp = `max_running_requests`), /stats
(requests, prompt and cached tokens, evictions; the same for later turns: inputs holding a `turn_marker`).

Simplification: no chunked request bodies, no pipelining beyond one request at a time per connection (aiohttp
sends neither); pause is accepted and ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import itertools
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

# ---------------------------------------------------------------------------------------------- prefix cache


class _Node:
    __slots__ = ("key", "children", "parent", "last", "refs")

    def __init__(self, key: tuple[int, ...], parent: "_Node | None"):
        self.key = key  # the edge label from the parent
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last = 0.0
        self.refs = 0  # requests running on this path: not evictable (SGLang locks them)


class PrefixCache:
    """A radix tree of token ids, `capacity` tokens at most, least recently used leaves evicted first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.root = _Node((), None)
        self.size = 0
        self.evicted = 0
        self._tick = itertools.count()

    def match(self, ids: list[int]) -> tuple[int, _Node]:
        """Length of the longest cached prefix of `ids`, and the deepest node on it (touched: recently used)."""
        node, i, n = self.root, 0, len(ids)
        now = next(self._tick)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            k = child.key
            m = 0
            while m < len(k) and i + m < n and k[m] == ids[i + m]:
                m += 1
            child.last = now
            if m < len(k):
                i += m
                break
            i += m
            node = child
        return i, node

    def lock(self, node: _Node, delta: int) -> None:
        while node is not None and node is not self.root:
            node.refs += delta
            node = node.parent  # type: ignore[assignment]

    def insert(self, ids: list[int]) -> None:
        if self.capacity <= 0:
            return
        node, i, n = self.root, 0, len(ids)
        now = next(self._tick)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                leaf = _Node(tuple(ids[i:]), node)
                leaf.last = now
                node.children[ids[i]] = leaf
                self.size += n - i
                break
            k = child.key
            m = 0
            while m < len(k) and i + m < n and k[m] == ids[i + m]:
                m += 1
            child.last = now
            if m < len(k):  # split the edge at m
                mid = _Node(k[:m], node)
                mid.last, mid.refs = now, child.refs
                node.children[k[0]] = mid
                child.key = k[m:]
                child.parent = mid
                mid.children[child.key[0]] = child
                child = mid
            i += m
            node = child
        self._evict()

    def _evict(self) -> None:
        if self.size <= self.capacity:
            return
        leaves = []
        stack = [self.root]
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            elif nd is not self.root and nd.refs == 0:
                leaves.append((nd.last, id(nd), nd))
        heapq.heapify(leaves)
        while self.size > self.capacity and leaves:
            _, _, nd = heapq.heappop(leaves)
            parent = nd.parent
            if parent is None or parent.children.get(nd.key[0]) is not nd:
                continue
            del parent.children[nd.key[0]]
            self.size -= len(nd.key)
            self.evicted += len(nd.key)
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(leaves, (parent.last, id(parent), parent))

    def flush(self) -> None:
        self.root = _Node((), None)
        self.size = 0


# ---------------------------------------------------------------------------------------------- the server


@dataclass
class ScriptedSpec:
    """What a scripted server answers, and when."""

    script: list[list[int]] = field(default_factory=list)
    """Turn responses (token ids). The k-th entry answers an input holding k `turn_marker` ids (the last entry
    any later one); each is cut to the request's max_new_tokens. Empty: seeded filler tokens."""
    think_ids: list[int] = field(default_factory=list)
    """With `think_tokens`: each scripted turn starts with that many of these ids, drawn from the request's
    sampling seed and turn, so episodes (GRPO siblings included) diverge after their first turn as sampled ones do."""
    think_tokens: int = 0
    """Seeded tokens before each scripted turn (0: the script alone, the same for every episode)."""
    turn_marker: int | None = None
    """Token id that counts turns in the input (e.g. `<tool_response>`)."""
    stop_ids: list[int] = field(default_factory=list)
    """A scripted response ending in one of these finishes "stop"; otherwise "length"."""
    vocab: int = 2048
    """Filler tokens are drawn from [10, vocab)."""
    base_s: float = 0.0
    """Fixed part of every answer's latency."""
    per_token_s: float = 0.0
    """Latency per generated token."""
    per_prefill_token_s: float = 0.0
    """Latency per uncached prompt token."""
    jitter: float = 0.0
    """Each latency is scaled by a factor in [1 - jitter, 1 + jitter] drawn from the request's input ids."""
    cache_tokens: int = 0
    """Prefix cache capacity in tokens (0: no cache; every cached_tokens is 0)."""
    answers: dict[str, list[int]] = field(default_factory=dict)
    """First-turn answers by prompt: `answer_key(input_ids)` -> the answer's ids (before the script, which answers
    the prompts not here and every later turn), so each episode can get its own completion (parity tests)."""
    max_running_requests: int = 4096
    """What /server_info reports as the scheduler's concurrent request limit (not enforced)."""
    weight_version: str = "default"


def answer_key(input_ids: list[int]) -> str:
    """The key of a prompt in `ScriptedSpec.answers`."""
    return hashlib.blake2b(",".join(map(str, input_ids)).encode(), digest_size=16).hexdigest()


class ScriptedServer:
    """The HTTP server (see the module docstring); `await start()`, `.port`, `await stop()`."""

    def __init__(self, spec: ScriptedSpec, host: str = "127.0.0.1", port: int = 0):
        self.spec = spec
        self.host, self.port = host, port
        self.cache = PrefixCache(spec.cache_tokens)
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "aborted": 0,
                      "later_turn_requests": 0, "later_turn_prompt_tokens": 0, "later_turn_cached_tokens": 0}
        self._pending: dict[str, tuple[asyncio.TimerHandle, Any]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> "ScriptedServer":
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Http(self), self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -------------------------------------------------------------------- endpoints

    def handle(self, method: str, path: str, body: bytes, reply: Any) -> None:
        """Answer one request: `reply(status, payload_bytes)` now or later."""
        if method == "POST" and path == "/generate":
            try:
                req = orjson.loads(body)
            except orjson.JSONDecodeError as e:
                reply(400, orjson.dumps({"error": f"body is not JSON: {e}"}))
                return
            self._generate(req, reply)
            return
        if method == "GET" and path in ("/health", "/health_generate"):
            reply(200, b"")
        elif method == "GET" and path == "/model_info":
            reply(200, orjson.dumps({"model_path": "scripted", "weight_version": self.spec.weight_version,
                                     "model_type": "scripted", "architectures": ["Scripted"]}))
        elif method == "GET" and path in ("/server_info", "/get_server_info"):
            reply(200, orjson.dumps({
                "tp_size": 1, "dp_size": 1, "max_total_num_tokens": self.spec.cache_tokens or 10 ** 9,
                "max_running_requests": None,
                "internal_states": [{"effective_max_running_requests_per_dp": self.spec.max_running_requests}]}))
        elif method == "GET" and path == "/stats":
            reply(200, orjson.dumps({**self.stats, "cache_size": self.cache.size, "evicted": self.cache.evicted,
                                     "pending": len(self._pending)}))
        elif method == "POST" and path == "/flush_cache":
            self.cache.flush()
            reply(200, b"")
        elif method == "POST" and path == "/abort_request":
            req = orjson.loads(body) if body else {}
            rids = list(self._pending) if req.get("abort_all") else [req.get("rid", "")]
            for rid in rids:
                entry = self._pending.pop(rid, None)
                if entry is not None:
                    entry[0].cancel()
                    entry[1]()
            reply(200, orjson.dumps({"success": True}))
        elif method == "POST" and path in ("/pause_generation", "/continue_generation"):
            reply(200, orjson.dumps({"success": True}))
        else:
            reply(404, orjson.dumps({"error": f"no route {method} {path}"}))

    def _generate(self, req: dict[str, Any], reply: Any) -> None:
        spec = self.spec
        ids = req.get("input_ids")
        if not isinstance(ids, list) or not ids:
            reply(400, orjson.dumps({"error": "input_ids must be a non-empty list"}))
            return
        sp = req.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        seed = int(sp.get("sampling_seed") or 0)
        k = ids.count(spec.turn_marker) if spec.turn_marker is not None else 0
        keyed = spec.answers.get(answer_key(ids)) if spec.answers and k == 0 else None
        if keyed is not None:
            out = keyed[:max_new]
            finish = "stop" if len(out) == len(keyed) and out and out[-1] in spec.stop_ids else "length"
        elif spec.script:
            turn = spec.script[min(k, len(spec.script) - 1)]
            if spec.think_tokens and spec.think_ids:
                h = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=32).digest()
                think = [spec.think_ids[h[i % 32] * (i + 1) % len(spec.think_ids)] for i in range(spec.think_tokens)]
                turn = think + turn
            out = turn[:max_new]
            finish = "stop" if len(out) == len(turn) and out and out[-1] in spec.stop_ids else "length"
        else:
            h = int.from_bytes(hashlib.blake2b(f"{seed}:{len(ids)}:{ids[-1]}".encode(), digest_size=8).digest(),
                               "little")
            span = max(1, spec.vocab - 10)
            out = [10 + (h >> (i % 48)) % span for i in range(max_new)]
            finish = "length"
        cached, node = self.cache.match(ids) if spec.cache_tokens else (0, None)
        if node is not None:
            self.cache.lock(node, 1)
        st = self.stats
        st["requests"] += 1
        st["prompt_tokens"] += len(ids)
        st["cached_tokens"] += cached
        if k:  # a later turn of an episode (its input holds k tool responses): what sticky routing can reuse
            st["later_turn_requests"] += 1
            st["later_turn_prompt_tokens"] += len(ids)
            st["later_turn_cached_tokens"] += cached
        latency = spec.base_s + spec.per_token_s * len(out) + spec.per_prefill_token_s * (len(ids) - cached)
        rid = str(req.get("rid") or f"anon-{st['requests']}")
        if spec.jitter:
            # drawn from the input alone, so two clients sending the same requests (the engine and the bare
            # client of `agentloop bench rollout`) meet the same latencies
            u = int.from_bytes(hashlib.blake2b(f"{len(ids)}:{ids[:8]}:{ids[-8:]}".encode(), digest_size=4).digest(),
                               "little") / 2**32
            latency *= 1.0 - spec.jitter + 2 * spec.jitter * u
        lp = [-0.5] * len(out)

        def answer(aborted: bool = False) -> None:
            self._pending.pop(rid, None)
            toks = [] if aborted else out
            if node is not None:
                self.cache.lock(node, -1)
            if spec.cache_tokens and not aborted:
                self.cache.insert(ids + toks)
            st["output_tokens"] += len(toks)
            st["aborted"] += aborted
            meta = {"id": rid, "finish_reason": {"type": "abort" if aborted else finish},
                    "prompt_tokens": len(ids), "completion_tokens": len(toks), "cached_tokens": cached,
                    "weight_version": spec.weight_version,
                    "output_token_logprobs": [[lp[i], t, None] for i, t in enumerate(toks)]}
            reply(200, orjson.dumps({"output_ids": toks, "meta_info": meta}))

        handle = asyncio.get_running_loop().call_later(max(0.0, latency), answer)
        self._pending[rid] = (handle, lambda: answer(aborted=True))


class _Http(asyncio.Protocol):
    """One connection: requests parsed from the byte stream one at a time, answers written in order."""

    def __init__(self, server: ScriptedServer):
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.close_after = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy or self.transport is None:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        method, path, _ = head[0].split(" ", 2)
        length, close = 0, False
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        self.busy, self.close_after = True, close
        self.server.handle(method, path.split("?", 1)[0], body, self._reply)

    def _reply(self, status: int, payload: bytes) -> None:
        t = self.transport
        if t is None:
            return
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
        t.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
                % (status, reason.encode(), len(payload), b"Connection: close\r\n" if self.close_after else b"")
                + payload)
        self.busy = False
        if self.close_after:
            t.close()
            return
        if self.buf:
            self._next()


# ---------------------------------------------------------------------------------------------- process


def spec_json(spec: ScriptedSpec) -> str:
    return orjson.dumps(asdict(spec)).decode()


async def _main(args: argparse.Namespace) -> None:
    spec = ScriptedSpec(**orjson.loads(args.spec)) if args.spec else ScriptedSpec()
    server = await ScriptedServer(spec, args.host, args.port).start()
    print(f"READY {server.port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="scripted SGLang server for benchmarks")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--spec", help="ScriptedSpec as JSON")
    args = p.parse_args(argv)
    from agentloop.util.runtime import run_async

    try:
        run_async(_main(args))
    except KeyboardInterrupt:
        pass


class ScriptedProcess:
    """A scripted server in a child process (started by `start`, stopped by `stop`, both bounded)."""

    def __init__(self, spec: ScriptedSpec, host: str = "127.0.0.1"):
        self.spec, self.host = spec, host
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout: float = 60.0) -> "ScriptedProcess":
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentloop.bench.scripted_server", "--host", self.host, "--spec",
            spec_json(self.spec), stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self.stop()
                raise RuntimeError(f"the scripted server did not start within {timeout:g}s") from None
            if not line:
                await self.stop()
                raise RuntimeError("the scripted server exited before it was ready")
            if line.startswith(b"READY "):
                self.port = int(line.split()[1])
                return self

    async def stop(self, timeout: float = 10.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.returncode is not None:
            return
        p.terminate()
        try:
            await asyncio.wait_for(p.wait(), timeout)
        except asyncio.TimeoutError:
            p.kill()
            await p.wait()


if __name__ == "__main__":
    main()
