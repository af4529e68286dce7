"""Weight sync from the learner to SGLang servers: `disk`, `tensor` (CUDA IPC) and `nccl` (broadcast).

Selected by `learner.weight_sync`:

    disk    rank 0 writes HF safetensors to weights/step-N; the orchestrator calls
            /update_weights_from_disk. Works wherever learner and servers share a filesystem.
    tensor  rank 0 gathers the full weights on its GPU and hands CUDA IPC handles of them to
            /update_weights_from_tensor (`load_format: flattened_bucket`). The servers must run on
            the same host and see the learner's GPU (same GPU or a peer); nothing is copied
            through the host.
    nccl    rank 0 is rank 0 of a new NCCL group with every server TP rank
            (/init_weights_update_group, once; world = 1 + sum of TP sizes, server i at
            rank_offset 1 + the TP sizes before it) and broadcasts each bucket while its
            /update_weights_from_distributed call is in flight. Servers may be on other GPUs/hosts.
            On one host, give learner and servers the same CUDA_VISIBLE_DEVICES (servers pick
            their GPU with --base-gpu-id): NCCL's P2P transport between processes that see
            different device sets failed at comm init ("Cuda failure 'invalid argument'", H100).

For tensor and nccl the mailbox learner pushes the weights itself, while the orchestrator holds
the servers paused (see agentloop.train.mailbox: sync.request / sync.go); no HF weights go to disk
while training, and a learner that resumes from checkpoint C writes weights/step-C before it reports
ready, so the orchestrator can reload its servers.

Map:
    ParamMeta, plan_buckets       pure: (name, shape, dtype) per tensor -> buckets under a byte budget
    param_metas, gather_bucket    a (FSDP2 or plain) model's tensors: metadata without a gather,
                                  full tensors per bucket (collective on every rank)
    tensor_payload, distributed_payload, init_group_payload
                                  the JSON bodies of the three endpoints (pure)
    serialize_cuda_bucket         one flattened bucket as SGLang's deserializer reads it
    create_update_group           learner side of SGLang's `init_custom_process_group` rendezvous
    post_json                     one blocking HTTP call with a deadline (the learner has no event loop)
    begin_update, end_update      SGLang >= 0.5.23's weight-update session around tensor/distributed
                                  updates; a server without the endpoints (404, 0.5.17) needs none
    PushOrder                     the server half's answer to a push request: URLs and the interrupt mode
    WeightSync, DiskSync, TensorSync, NcclSync, SYNCS, register_sync, get_sync
                                  the learner half of each path (`publish`: save or push a step's weights),
                                  looked up by name; the server halves: agentloop.train.weight_transport

Who calls whom: agentloop.train.learner.serve -> sync_from_config(cfg).publish(learner, ...) -> push(model, ...)
-> the helpers above; nothing here imports the learner, the mailbox or the orchestrator.

Sessions: SGLang 0.5.23 refuses /update_weights_from_tensor and /update_weights_from_distributed (400)
outside POST /begin_weight_update {"selector": "all"} ... POST /end_weight_update {}; 0.5.17 has neither
endpoint (404) and needs none. Each push opens a session on every server that has them, sends all its
buckets, and closes it (also when the push fails, best effort); which servers have them is remembered.

Checked against SGLang 0.5.17 / 0.5.23: request fields in `sglang/srt/managers/io_struct.py`; the
tensor payload is unpickled by `MultiprocessingSerializer.deserialize` with a restricted unpickler
that admits torch, builtins and `types` (so metadata travels as `types.SimpleNamespace`, read by
attribute in `_update_weights_from_flattened_bucket`); one payload per server TP rank, since each
rank must open its own copy of the IPC handles.

Simplified: only parameters are synced (HF decoder LMs keep no trainable persistent buffers; a tied
lm_head is the embedding parameter, so it is sent once, as the disk path saves it); buckets are sent
one after another (no overlap of the gather of bucket k+1 with the send of bucket k); a change of the
server set re-creates the NCCL group.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, Iterator, Sequence
from urllib.parse import urlparse

from agentloop.errors import AgentLoopError

# torch is imported inside functions so the pure helpers (and their tests) stay light.

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1,
               "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class PushOrder:
    """The server half's answer to a learner that asked for paused servers: push step's weights to `urls`; the
    servers were paused in `interrupt` mode, and the push flushes their prefix caches only where that mode allows
    it (its policy's `flush_in_update`, agentloop.interrupt). Travels as JSON (the mailbox's sync.go, Ray)."""

    step: int
    urls: tuple[str, ...]
    interrupt: str | None = None
    """abort | retract | in_place; None (an order without a mode, an older orchestrator's): no flush, the safe
    side (a refused flush inside an update kills SGLang 0.5.17's scheduler, a missing one only keeps stale KV)."""

    @property
    def flush_cache(self) -> bool:
        """Whether the push's last call flushes the prefix cache; ValueError for an unknown mode."""
        from agentloop.interrupt import interrupt_policy

        return interrupt_policy(self.interrupt).flush_in_update if self.interrupt else False

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "urls": list(self.urls), "interrupt": self.interrupt}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PushOrder:
        return cls(step=int(d.get("step", 0)), urls=tuple(d.get("urls") or ()), interrupt=d.get("interrupt"))


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


# ---------------------------------------------------------------------------- payloads (pure)


def tensor_payload(serialized_per_rank: Sequence[str], *, last: bool, version: str | None,
                   flush_cache: bool = False) -> dict[str, Any]:
    """Body of /update_weights_from_tensor for one flattened bucket (base64 pickles, one per TP rank).

    The version is set, and the prefix cache flushed when `flush_cache` (the interrupt mode's
    `flush_in_update`, agentloop.interrupt), only with the last bucket: the servers are paused, so nothing
    samples from half-updated weights, and the version flips once. A flush the server cannot do (requests
    kept in place or retracted into its queue) would fail the update, and kill SGLang 0.5.17's scheduler.
    """
    body: dict[str, Any] = {"serialized_named_tensors": list(serialized_per_rank), "load_format": "flattened_bucket",
                            "flush_cache": last and flush_cache, "abort_all_requests": False}
    if last and version is not None:
        body["weight_version"] = version
    return body


def distributed_payload(bucket: Sequence[ParamMeta], group_name: str, *, last: bool,
                        version: str | None, flush_cache: bool = False) -> dict[str, Any]:
    """Body of /update_weights_from_distributed: the server allocates the bucket from these
    names/dtypes/shapes and receives it as one flattened uint8 broadcast from rank 0. Version and
    flush as in `tensor_payload`."""
    body: dict[str, Any] = {"names": [m.name for m in bucket], "dtypes": [m.dtype for m in bucket],
                            "shapes": [list(m.shape) for m in bucket], "group_name": group_name,
                            "load_format": "flattened_bucket", "flush_cache": last and flush_cache,
                            "abort_all_requests": False}
    if last and version is not None:
        body["weight_version"] = version
    return body


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """(rank_offset of each server, world_size): the learner is rank 0, servers follow in order."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        offsets.append(nxt)
        nxt += tp
    return offsets, nxt


def init_group_payload(master_addr: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str = "nccl") -> dict[str, Any]:
    return {"master_address": master_addr, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def default_master_addr(urls: Sequence[str]) -> str:
    """127.0.0.1 when every server is on this host's loopback, else this host's address."""
    hosts = {urlparse(u).hostname or "" for u in urls}
    if hosts <= {"127.0.0.1", "localhost", "::1"}:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


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


# ---------------------------------------------------------------------------- CUDA IPC serialization


def _device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def serialize_cuda_bucket(flat: Any, metadata: list[SimpleNamespace]) -> str:
    """Pickle {"flattened_tensor", "metadata"} the way SGLang's MultiprocessingSerializer expects,
    base64-encoded for JSON.

    A CUDA tensor pickles to its IPC handle (torch's multiprocessing reductions); the device index
    in it is replaced by the GPU's UUID, which SGLang's patched rebuild maps back to its own index,
    so the server may number its visible GPUs differently. CPU tensors would pickle to file
    descriptors that the server cannot open (its scheduler dies), so they are refused here.
    """
    if not flat.is_cuda:
        raise WeightSyncError("the tensor path needs CUDA tensors (a learner on the GPU)")
    return base64.b64encode(_share_pickle({"flattened_tensor": flat, "metadata": metadata})).decode()


def _share_pickle(obj: Any) -> bytes:
    """ForkingPickler bytes of `obj` (tensors as shared handles), CUDA device indices as GPU UUIDs."""
    import copyreg
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    reductions.init_reductions()  # registers torch's reducers with ForkingPickler

    def reduce_with_uuid(t: Any) -> Any:
        fn, args = reductions.reduce_tensor(t)
        if fn is reductions.rebuild_cuda_tensor and isinstance(args[6], int):  # args[6]: the storage's device
            args = (*args[:6], _device_uuid(args[6]), *args[7:])
        return fn, args

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)  # its __init__ takes no protocol keyword (Python 3.12)
    table = dict(copyreg.dispatch_table)
    table.update(ForkingPickler._extra_reducers)
    table[torch.Tensor] = reduce_with_uuid
    pickler.dispatch_table = table
    pickler.dump(obj)
    return buf.getvalue()


# ---------------------------------------------------------------------------- NCCL group


@dataclass
class UpdateGroup:
    """The learner's end of a weight-update group: a bare c10d backend (rank 0), outside
    torch.distributed's group registry, so the learner's default FSDP group is untouched."""

    backend: Any
    store: Any
    name: str
    world_size: int
    port: int

    def broadcast(self, tensor: Any) -> None:
        """Send `tensor` from rank 0 to every other rank; returns once it is queued on the GPU
        stream (NCCL) or done (gloo). The backend keeps the tensor alive until the collective ends."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.backend.broadcast([tensor], opts).wait()

    def abort(self) -> None:
        """Unblock a collective whose peers gave up (the group is unusable afterwards)."""
        abort = getattr(self.backend, "abort", None) or getattr(self.backend, "_abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - best effort: we are already failing
                pass

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown; the process may be exiting
                pass
        self.backend = None
        self.store = None


def create_update_group(master_addr: str, master_port: int, world_size: int, group_name: str, *,
                        backend: str = "nccl", timeout_s: float = 600.0,
                        before_connect: Callable[[int], None] | None = None) -> UpdateGroup:
    """Rank 0 of a group that SGLang's server ranks join through `init_custom_process_group`.

    The protocol SGLang follows (0.5.x, over torch 2.x): `tcp://addr:port` rendezvous, i.e. a TCPStore
    whose master is rank 0; keys under PrefixStore(group_name); then torch's group helper adds
    `"{group_name}/"` and the device type of the backend (`"cuda/"` for nccl, `"cpu/"` for gloo)
    before building the backend on that store. We build the same key space by hand and the
    backend object directly, so no process group is registered in this process.

    `master_port` 0 picks a free port. `before_connect(port)` is called once the store listens and
    before the backend is built; a gloo backend connects to every rank at construction, so the
    caller must have asked the servers to join by then (NCCL connects at the first broadcast).
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    port = int(store.port)
    if before_connect is not None:
        before_connect(port)
    device = "cuda" if backend == "nccl" else "cpu"
    keyspace = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "nccl":
        be = dist.ProcessGroupNCCL(keyspace, 0, world_size, timeout)
    elif backend == "gloo":
        be = dist.ProcessGroupGloo(keyspace, 0, world_size, timeout)
    else:
        raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
    return UpdateGroup(be, store, group_name, world_size, port)


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
        """Collective, after `learner` (agentloop.train.learner.Learner) trained `step`: the learner half of the
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
        out = learner.save_hf(weights_dir)
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
        out = learner.save_hf(weights_dir)
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


@register_sync("tensor")
class TensorSync(WeightSync):
    """CUDA IPC handles of each flattened bucket -> /update_weights_from_tensor (same host)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._tp: dict[str, int] = {}

    def push(self, model: Any, *, dtype: Any, device: Any, rank: int, urls: Sequence[str],
             version: str | None, flush_cache: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        buckets = plan_buckets(param_metas(model, dtype), self.bucket_bytes)
        if rank == 0:
            for u in urls:
                if u not in self._tp:
                    self._tp[u] = server_tp_size(u, self.timeout_s)
        gather_s, t_send = [0.0], 0.0
        with ThreadPoolExecutor(max(1, len(urls))) as pool:
            with self._session(pool, urls, rank):
                # The server reads the memory through the IPC handle with no ordering against our
                # stream beyond torch's sharing event: the gather and the concatenation finish first.
                for i, flat in self._flat_buckets(model, buckets, dtype, device, rank, gather_s, sync_cuda=True):
                    t = time.perf_counter()
                    meta = bucket_metadata(buckets[i])
                    last = i == len(buckets) - 1
                    futures = [pool.submit(post_json, u, "/update_weights_from_tensor",
                                           tensor_payload([serialize_cuda_bucket(flat, meta)
                                                           for _ in range(self._tp[u])], last=last, version=version,
                                                          flush_cache=flush_cache),
                                           self.timeout_s)
                               for u in urls]
                    _gather_calls(pool, futures, self.timeout_s)
                    # `flat` must outlive the calls: the servers copy out of it through the IPC handles.
                    del flat  # before the next bucket is gathered (the generator drops its own reference)
                    t_send += time.perf_counter() - t
        return {"sync/total_s": time.perf_counter() - t0, "sync/gather_s": gather_s[0], "sync/send_s": t_send,
                "sync/buckets": float(len(buckets))}


@register_sync("nccl")
class NcclSync(WeightSync):
    """A NCCL group learner(rank 0) + server ranks; each bucket is one flattened broadcast."""

    def __init__(self, *, group_factory: Callable[..., UpdateGroup] = create_update_group, **kw: Any):
        super().__init__(**kw)
        self.group_factory = group_factory
        self.group: UpdateGroup | None = None
        self._urls: tuple[str, ...] = ()
        self._generation = 0

    def _init_group(self, urls: Sequence[str]) -> float:
        t0 = time.perf_counter()
        if self.group is not None:
            self.close(self._urls)
        tp = [server_tp_size(u, self.timeout_s) for u in urls]
        offsets, world = rank_offsets(tp)
        addr = self.master_addr or default_master_addr(urls)
        # Unique per learner process and generation: a server refuses a second group of a name it holds.
        name = f"agentloop-ws-{os.getpid()}-{self._generation}"
        self._generation += 1
        with ThreadPoolExecutor(max(1, len(urls))) as pool:
            futures: list = []

            def ask_servers(port: int) -> None:
                futures.extend(pool.submit(post_json, u, "/init_weights_update_group",
                                           init_group_payload(addr, port, off, world, name, self.backend),
                                           self.timeout_s)
                               for u, off in zip(urls, offsets))

            try:
                group = self.group_factory(addr, self.master_port, world, name, backend=self.backend,
                                           timeout_s=self.timeout_s, before_connect=ask_servers)
            finally:
                # A failed rendezvous still waits for (and reports) the servers' answers.
                _gather_calls(pool, futures, self.timeout_s)
        self.group = group
        self._urls = tuple(urls)
        return time.perf_counter() - t0

    def push(self, model: Any, *, dtype: Any, device: Any, rank: int, urls: Sequence[str],
             version: str | None, flush_cache: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        buckets = plan_buckets(param_metas(model, dtype), self.bucket_bytes)
        if rank == 0 and (self.group is None or tuple(urls) != self._urls):
            metrics["sync/init_group_s"] = self._init_group(urls)
        gather_s, t_send = [0.0], 0.0
        with ThreadPoolExecutor(max(1, len(urls))) as pool:
            with self._session(pool, urls, rank):
                for i, flat in self._flat_buckets(model, buckets, dtype, device, rank, gather_s):
                    t = time.perf_counter()
                    assert self.group is not None
                    body = distributed_payload(buckets[i], self.group.name, last=i == len(buckets) - 1,
                                               version=version, flush_cache=flush_cache)
                    # The servers join the broadcast from inside the HTTP handler, so the calls go first
                    # and stay in flight while rank 0 sends.
                    futures = [pool.submit(post_json, u, "/update_weights_from_distributed", body, self.timeout_s)
                               for u in urls]
                    self._broadcast_while(flat, pool, futures)
                    del flat  # before the next bucket is gathered (the generator drops its own reference)
                    t_send += time.perf_counter() - t
        metrics.update({"sync/total_s": time.perf_counter() - t0, "sync/gather_s": gather_s[0],
                        "sync/send_s": t_send, "sync/buckets": float(len(buckets))})
        return metrics

    def _broadcast_while(self, flat: Any, pool: ThreadPoolExecutor, futures: list) -> None:
        """Broadcast `flat` while the servers' calls are in flight; fail (never hang) if a call fails.

        NCCL's first collective blocks the calling thread until every rank has joined, with no
        timeout; a server that answers 400 instead of joining (e.g. its NCCL init failed) would leave
        it there for good. So the broadcast runs in a daemon thread, the calls are watched here, and
        a failed call aborts the group, which ends the broadcast.
        """
        import threading

        assert self.group is not None
        group = self.group
        err: list[BaseException] = []

        def send() -> None:
            try:
                if getattr(flat, "is_cuda", False):
                    import torch

                    torch.cuda.set_device(flat.device)  # the current device is per thread
                group.broadcast(flat)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                err.append(e)

        th = threading.Thread(target=send, name="weight-sync-broadcast", daemon=True)
        th.start()
        try:
            _gather_calls(pool, futures, self.timeout_s)
        except WeightSyncError:
            group.abort()
            self.group, self._urls = None, ()  # unusable now: the next push builds a new group
            raise
        th.join(self.timeout_s)
        if th.is_alive() or err:
            group.abort()
            self.group, self._urls = None, ()
            raise WeightSyncError(f"broadcast to the servers failed: {err[0] if err else 'timed out'}")

    def close(self, urls: Sequence[str] = ()) -> None:
        if self.group is None:
            return
        for u in urls or self._urls:
            try:
                post_json(u, "/destroy_weights_update_group", {"group_name": self.group.name},
                          min(self.timeout_s, 30.0))
            except WeightSyncError:
                pass  # best effort: the server may be gone already
        self.group.close()
        self.group = None
        self._urls = ()


def sync_from_config(cfg: Any) -> WeightSync:
    """The configured path (`cfg.weight_sync`) built from a LearnerConfig."""
    return get_sync(cfg.weight_sync).from_config(cfg)


__all__ = [
    "DiskSync",
    "NcclSync",
    "ParamMeta",
    "Published",
    "PushOrder",
    "SYNCS",
    "TensorSync",
    "UpdateGroup",
    "WeightSync",
    "WeightSyncError",
    "begin_update",
    "bucket_metadata",
    "create_update_group",
    "default_master_addr",
    "distributed_payload",
    "end_update",
    "flatten_bucket",
    "gather_bucket",
    "get_sync",
    "init_group_payload",
    "param_metas",
    "plan_buckets",
    "post_json",
    "rank_offsets",
    "register_sync",
    "serialize_cuda_bucket",
    "server_tp_size",
    "sync_from_config",
    "tensor_payload",
]
