"""The `nccl` path's learner half: a NCCL group of learner rank 0 and every server TP rank, one broadcast per bucket.

Rank 0 is rank 0 of a new NCCL group with every server TP rank (/init_weights_update_group, once; world = 1 + sum
of TP sizes, server i at rank_offset 1 + the TP sizes before it) and broadcasts each bucket while its
/update_weights_from_distributed call is in flight. Servers may be on other GPUs/hosts. On one host, give learner
and servers the same CUDA_VISIBLE_DEVICES (servers pick their GPU with --base-gpu-id): NCCL's P2P transport
between processes that see different device sets failed at comm init ("Cuda failure 'invalid argument'", H100).
The server half is agentloop.train.weights.servers.PushHalf.

Map:
    distributed_payload, init_group_payload   the JSON bodies of the two endpoints (pure)
    rank_offsets, default_master_addr         the group's ranks and rendezvous address (pure)
    UpdateGroup, create_update_group          learner side of SGLang's `init_custom_process_group` rendezvous
    NcclSync                                  the path (`push`), registered as "nccl"

Simplified: a change of the server set re-creates the group.
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

from agentloop.train.weights.sync import (
    ParamMeta,
    WeightSync,
    WeightSyncError,
    _gather_calls,
    param_metas,
    plan_buckets,
    post_json,
    register_sync,
    server_tp_size,
)

# torch is imported inside functions so the pure helpers (and their tests) stay light.


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


__all__ = ["NcclSync", "UpdateGroup", "create_update_group", "default_master_addr", "distributed_payload",
           "init_group_payload", "rank_offsets"]
