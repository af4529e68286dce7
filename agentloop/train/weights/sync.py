"""The learner half of the weight transport, what every path shares: `WeightSync` (publish a step's weights: save
or push), the registry of paths by `learner.weight_sync` name, buckets of parameters, the HTTP calls a push makes.

The paths (each registers itself under its name; the package imports them all):

    disk    (here) rank 0 writes HF safetensors to weights/step-N; the orchestrator calls
            /update_weights_from_disk. Works wherever learner and servers share a filesystem.
    tensor  (agentloop.train.weights.tensor) rank 0 hands CUDA IPC handles of each bucket to
            /update_weights_from_tensor; the servers run on the learner's host.
    nccl    (agentloop.train.weights.nccl) rank 0 broadcasts each bucket to every server TP rank over a NCCL
            group; servers may be on other GPUs/hosts.

For tensor and nccl the learner pushes the weights itself, while the orchestrator holds
the servers paused (see agentloop.train.handle.mailbox: sync.request / sync.go); no HF weights go to disk
while training, and a learner that resumes from checkpoint C writes weights/step-C before it reports
ready, so the orchestrator can reload its servers.

Map:
    ParamMeta, plan_buckets       pure: (name, shape, dtype) per tensor -> buckets under a byte budget
    param_metas, gather_bucket    a (FSDP2 or plain) model's tensors: metadata without a gather,
                                  full tensors per bucket (collective on every rank)
    flatten_bucket, bucket_metadata  one bucket as one flat uint8 tensor and what a server needs to cut it
    post_json                     one blocking HTTP call with a deadline (the learner has no event loop)
    begin_update, end_update      SGLang >= 0.5.23's weight-update session around tensor/distributed
                                  updates; a server without the endpoints (404, 0.5.17) needs none
    server_tp_size                a server's tensor-parallel size (one payload or group rank per TP rank)
    WeightSync, DiskSync, SYNCS, register_sync, get_sync, sync_from_config
                                  the learner half of each path (`publish`: save or push a step's weights),
                                  looked up by name; the server halves: agentloop.train.weights.servers

Who calls whom: agentloop.train.trainer.serve -> sync_from_config(cfg).publish(learner, ...) -> push(model, ...)
-> the helpers above; nothing here imports the learner, the mailbox or the orchestrator.

Sessions: SGLang 0.5.23 refuses /update_weights_from_tensor and /update_weights_from_distributed (400)
outside POST /begin_weight_update {"selector": "all"} ... POST /end_weight_update {}; 0.5.17 has neither
endpoint (404) and needs none. Each push opens a session on every server that has them, sends all its
buckets, and closes it (also when the push fails, best effort); which servers have them is remembered.

Simplified: only parameters are synced (HF decoder LMs keep no trainable persistent buffers; a tied
lm_head is the embedding parameter, so it is sent once, as the disk path saves it); buckets are sent
one after another (no overlap of the gather of bucket k+1 with the send of bucket k).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, Iterator, Sequence

from agentloop.errors import AgentLoopError
from agentloop.train.handle.protocol import PushOrder

# torch is imported inside functions so the pure helpers (and their tests) stay light.

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1,
               "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass
class Published:
    """What the learner half did with a step's weights (WeightSync.publish)."""

    weights_dir: Any
    """The HF directory written (disk), else None."""
    pushed: bool
    """The servers hold the weights already (tensor|nccl)."""
    metrics: dict[str, float]


class WeightSyncError(AgentLoopError):
    """A weight push to a server failed (HTTP error, `success: false`, rendezvous or timeout)."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status
        """The HTTP status when the server answered one (>= 400), else None."""


# ---------------------------------------------------------------------------- buckets (pure)


@dataclass(frozen=True)
class ParamMeta:
    name: str
    """HF parameter name, as the server's `load_weights` expects it."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    dtype: str
    """torch dtype name without the `torch.` prefix, as sent to the server (e.g. "bfloat16")."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def plan_buckets(metas: Sequence[ParamMeta], budget_bytes: int) -> list[list[ParamMeta]]:
    """Consecutive tensors packed greedily while their bytes stay within `budget_bytes`.

    Order is kept (every rank must gather in the same order); a tensor larger than the budget
    gets a bucket of its own; no bucket is empty.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    buckets: list[list[ParamMeta]] = []
    size = 0
    for m in metas:
        if buckets and buckets[-1] and size + m.nbytes <= budget_bytes:
            buckets[-1].append(m)
            size += m.nbytes
        else:
            buckets.append([m])
            size = m.nbytes
    return buckets


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- HTTP


def post_json(url: str, path: str, body: dict[str, Any] | None, timeout_s: float, *,
              method: str = "POST") -> Any:
    """One blocking call; WeightSyncError on transport errors, HTTP >= 400 or `success: false`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise WeightSyncError(f"{url}{path} answered HTTP {e.code}: {detail}", status=e.code) from None
    except (urllib.error.URLError, OSError) as e:  # includes socket timeouts
        raise WeightSyncError(f"{url}{path}: {type(e).__name__}: {e}") from None
    try:
        out = json.loads(text) if text else None
    except json.JSONDecodeError:
        return text
    if isinstance(out, dict) and out.get("success") is False:
        raise WeightSyncError(f"{url}{path} refused: {out.get('message')}")
    return out


def begin_update(url: str, timeout_s: float) -> bool:
    """Open a weight-update session (SGLang >= 0.5.23: tensor and distributed updates are refused outside
    `POST /begin_weight_update {"selector": "all"}` ... `POST /end_weight_update {}`).

    True: a session is open (end it with `end_update`). False: the server has no such endpoint (HTTP 404:
    an older SGLang, e.g. 0.5.17, which updates without one). A session left open by a push that died
    between begin and end is closed and opened afresh.
    """
    body = {"selector": "all"}
    try:
        post_json(url, "/begin_weight_update", body, timeout_s)
    except WeightSyncError as e:
        if e.status == 404:
            return False
        if e.status == 400 and "already open" in str(e):
            post_json(url, "/end_weight_update", {}, timeout_s)
            post_json(url, "/begin_weight_update", body, timeout_s)
            return True
        raise
    return True


def end_update(url: str, timeout_s: float) -> None:
    """Close the session `begin_update` opened (the server finalizes the loaded weights)."""
    post_json(url, "/end_weight_update", {}, timeout_s)


def server_tp_size(url: str, timeout_s: float) -> int:
    """The server's tensor-parallel size from /server_info (older SGLang: /get_server_info)."""
    last: Exception | None = None
    for path in ("/server_info", "/get_server_info"):
        try:
            info = post_json(url, path, None, timeout_s, method="GET")
        except WeightSyncError as e:
            last = e
            continue
        if isinstance(info, dict):
            return int(info.get("tp_size") or 1)
    raise WeightSyncError(f"cannot read the TP size of {url}: {last}")


def _gather_calls(pool: ThreadPoolExecutor, futures: list, timeout_s: float) -> list[Any]:
    """Results of all futures; the first error is raised after every call has ended or timed out."""
    deadline = time.monotonic() + timeout_s
    results, errors = [], []
    for f in futures:
        try:
            results.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
        except Exception as e:  # noqa: BLE001 - collected, re-raised below with the others counted
            errors.append(e)
    if errors:
        raise WeightSyncError(f"{len(errors)}/{len(futures)} server call(s) failed: {errors[0]}") from errors[0]
    return results


# ---------------------------------------------------------------------------- model tensors


def param_metas(model: Any, dtype: Any) -> list[ParamMeta]:
    """Names and full shapes of the model's parameters (no communication: a DTensor knows its
    global shape), in `named_parameters()` order, with the dtype they will be sent in."""
    name = _dtype_name(dtype)
    return [ParamMeta(n, tuple(int(s) for s in p.shape), name) for n, p in model.named_parameters()]


def gather_bucket(model: Any, bucket: Sequence[ParamMeta], dtype: Any, device: Any) -> list[Any]:
    """Full tensors of the bucket, cast to `dtype`, on `device`, in bucket order.

    Collective for FSDP2 (DTensor) parameters: every rank must call it with the same bucket.
    """
    params = dict(model.named_parameters())
    out = []
    for m in bucket:
        p = params[m.name].detach()
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.to(device=device, dtype=dtype).contiguous())
    return out


def flatten_bucket(tensors: Sequence[Any]) -> Any:
    """The tensors' bytes back to back in one uint8 tensor (SGLang's flattened-bucket layout)."""
    import torch

    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


def bucket_metadata(bucket: Sequence[ParamMeta]) -> list[SimpleNamespace]:
    """Per-tensor byte ranges of a flattened bucket, as SGLang reads them (by attribute)."""
    import torch

    out, start = [], 0
    for m in bucket:
        out.append(SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=getattr(torch, m.dtype),
                                   start_idx=start, end_idx=start + m.nbytes, numel=m.nbytes))
        start += m.nbytes
    return out


# ---------------------------------------------------------------------------- the paths


class WeightSync:
    """One way of getting the learner's weights into running servers.

    `push` is collective over the learner's ranks (it gathers FSDP2 shards); only rank 0 talks to
    the servers. It returns timing metrics (`sync/...`).
    """

    name: ClassVar[str] = ""
    learner_pushes: ClassVar[bool] = True
    """False: the learner only writes files and the orchestrator loads them (disk)."""

    def __init__(self, *, bucket_bytes: int = 512 * 2**20, timeout_s: float = 600.0,
                 master_addr: str | None = None, master_port: int = 0, backend: str = "nccl"):
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = backend
        self._sessions: dict[str, bool] = {}
        """Per server URL: whether it has weight-update sessions (begin/end), once known."""

    @classmethod
    def from_config(cls, cfg: Any) -> "WeightSync":
        """From a LearnerConfig's weight_sync_* fields."""
        return cls(bucket_bytes=int(cfg.weight_sync_bucket_mb * 2**20), timeout_s=cfg.weight_sync_timeout_s,
                   master_addr=cfg.weight_sync_master_addr, master_port=cfg.weight_sync_master_port)

    def push(self, model: Any, *, dtype: Any, device: Any, rank: int, urls: Sequence[str],
             version: str | None, flush_cache: bool = False) -> dict[str, float]:
        """Send the model's weights to `urls` as weight version `version`; `flush_cache`: the last call also
        flushes the servers' prefix caches (only where the interrupt mode allows it, agentloop.interrupt)."""
        raise NotImplementedError

    def publish(self, learner: Any, step: int, weights_dir: Any,
                ask: Callable[[int, str], PushOrder]) -> Published:
        """Collective, after `learner` (agentloop.train.trainer.learner.Learner) trained `step`: the learner half of the
        transport. Pushing paths ask the orchestrator for paused servers (`ask(step, self.name)` returns the
        PushOrder on every rank) and push to its URLs with its flush; `DiskSync` writes `weights_dir` instead."""
        order = ask(step, self.name)
        t = time.perf_counter()
        metrics = self.push(learner.model, dtype=learner.compute_dtype, device=learner.device, rank=learner.rank,
                            urls=list(order.urls), version=str(step), flush_cache=order.flush_cache)
        metrics["time/sync_s"] = time.perf_counter() - t
        return Published(weights_dir=None, pushed=True, metrics=metrics)

    def check(self, learner: Any) -> None:
        """Refuse a learner this path cannot serve (ValueError naming why); called once, before any step."""
        if self.learner_pushes and learner.device_type != "cuda":
            raise ValueError(f"learner.weight_sync={self.name!r} needs a GPU learner")

    def publish_replayed(self, learner: Any, step: int, weights_dir: Any, *, last: bool) -> Published:
        """Collective, after `learner` trained `step` again from a batch submitted before the run stopped (a resume):
        no server waits for these weights. The orchestrator is not running its step loop yet (it waits for the
        learner to catch up, `wait_caught_up`), so nothing is pushed and no push is asked for; it then loads the
        last replayed step's HF weights into the servers from disk, so `last` writes them (`weights_dir`)."""
        if not last:
            return Published(weights_dir=None, pushed=False, metrics={})
        t = time.perf_counter()
        out = learner.save_served(weights_dir)
        return Published(weights_dir=out, pushed=False, metrics={"time/save_hf_s": time.perf_counter() - t})

    def close(self, urls: Sequence[str] = ()) -> None:
        """Release what the path holds (a process group); best effort."""

    def _begin(self, pool: ThreadPoolExecutor, urls: Sequence[str]) -> list[str]:
        """Open an update session on every server that has them (in parallel); the URLs where one opened.
        Whether a server has sessions is remembered (a 404 is asked once per server)."""
        ask = [u for u in urls if self._sessions.get(u, True)]
        opened = _gather_calls(pool, [pool.submit(begin_update, u, self.timeout_s) for u in ask], self.timeout_s)
        for u, ok in zip(ask, opened):
            self._sessions[u] = ok
        return [u for u, ok in zip(ask, opened) if ok]

    @contextmanager
    def _session(self, pool: ThreadPoolExecutor, urls: Sequence[str], rank: int) -> Iterator[None]:
        """Rank 0 holds an update session open on the servers that have them for the body of the `with`,
        closed also when the push fails (then best effort: the push's error is the one raised)."""
        sessions = self._begin(pool, urls) if rank == 0 else []
        ok = False
        try:
            yield
            ok = True
        finally:
            self._end(pool, sessions, failing=not ok)

    def _end(self, pool: ThreadPoolExecutor, urls: Sequence[str], *, failing: bool) -> None:
        """Close the sessions `_begin` opened. While a push is already failing, best effort (the first
        error is the one reported)."""
        if not urls:
            return
        try:
            _gather_calls(pool, [pool.submit(end_update, u, self.timeout_s) for u in urls], self.timeout_s)
        except WeightSyncError:
            if not failing:
                raise

    @staticmethod
    def _flat_buckets(model: Any, buckets: list[list[ParamMeta]], dtype: Any, device: Any, rank: int,
                      gather_s: list[float], *, sync_cuda: bool = False) -> Iterator[tuple[int, Any]]:
        """Gather every bucket on every rank (collective); on rank 0 yield (index, flattened bucket).

        The time spent gathering and flattening is added to `gather_s[0]`. The generator drops its
        reference when resumed; the caller drops its own before asking for the next bucket, so only
        one bucket is alive at a time. `sync_cuda`: wait for the
        gather and the concatenation before yielding (a reader through CUDA IPC does not order
        against our stream).
        """
        import torch

        for i, bucket in enumerate(buckets):
            t = time.perf_counter()
            tensors = gather_bucket(model, bucket, dtype, device)
            if rank != 0:
                del tensors
                gather_s[0] += time.perf_counter() - t
                continue
            flat = flatten_bucket(tensors)
            del tensors
            if sync_cuda and flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()
            gather_s[0] += time.perf_counter() - t
            yield i, flat
            del flat


SYNCS: dict[str, type[WeightSync]] = {}


def register_sync(name: str) -> Callable[[type[WeightSync]], type[WeightSync]]:
    def deco(cls: type[WeightSync]) -> type[WeightSync]:
        if name in SYNCS:
            raise ValueError(f"weight sync {name!r} is already registered")
        cls.name = name
        SYNCS[name] = cls
        return cls

    return deco


def get_sync(name: str) -> type[WeightSync]:
    try:
        return SYNCS[name]
    except KeyError:
        raise ValueError(f"unknown weight sync {name!r}; known: {sorted(SYNCS)}") from None


@register_sync("disk")
class DiskSync(WeightSync):
    """HF directory -> /update_weights_from_disk. The mailbox learner only saves the directory
    (Learner.save_hf) and the orchestrator makes the call; `load` is that call, for in-process use
    and benchmarks."""

    learner_pushes = False

    def publish(self, learner: Any, step: int, weights_dir: Any,
                ask: Callable[[int, str], PushOrder]) -> Published:
        """Collective: the learner saves step's HF weights to `weights_dir`; the orchestrator loads them."""
        t = time.perf_counter()
        out = learner.save_served(weights_dir)
        return Published(weights_dir=out, pushed=False, metrics={"time/save_hf_s": time.perf_counter() - t})

    def publish_replayed(self, learner: Any, step: int, weights_dir: Any, *, last: bool) -> Published:
        """Every step's weights, as in training (keep_weights prunes them as it does then)."""
        return self.publish(learner, step, weights_dir, ask=lambda s, m: PushOrder(step=s, urls=()))

    def load(self, weights_dir: str, urls: Sequence[str], version: str | None) -> dict[str, float]:
        t0 = time.perf_counter()
        body: dict[str, Any] = {"model_path": str(weights_dir)}
        if version is not None:
            body["weight_version"] = version
        with ThreadPoolExecutor(max(1, len(urls))) as pool:
            _gather_calls(pool, [pool.submit(post_json, u, "/update_weights_from_disk", body, self.timeout_s)
                                 for u in urls], self.timeout_s)
        return {"sync/load_s": time.perf_counter() - t0}


def sync_from_config(cfg: Any) -> WeightSync:
    """The configured path (`cfg.weight_sync`) built from a LearnerConfig."""
    return get_sync(cfg.weight_sync).from_config(cfg)


__all__ = [
    "DiskSync",
    "ParamMeta",
    "Published",
    "SYNCS",
    "WeightSync",
    "WeightSyncError",
    "begin_update",
    "bucket_metadata",
    "end_update",
    "flatten_bucket",
    "gather_bucket",
    "get_sync",
    "param_metas",
    "plan_buckets",
    "post_json",
    "register_sync",
    "server_tp_size",
    "sync_from_config",
]
