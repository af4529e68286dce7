"""The `tensor` path's learner half: CUDA IPC handles of each flattened bucket -> /update_weights_from_tensor.

Rank 0 gathers the full weights on its GPU and hands CUDA IPC handles of them to /update_weights_from_tensor
(`load_format: flattened_bucket`). The servers must run on the same host and see the learner's GPU (same GPU or a
peer); nothing is copied through the host. The server half is agentloop.train.weights.servers.PushHalf.

Map:
    tensor_payload         the JSON body of /update_weights_from_tensor (pure)
    serialize_cuda_bucket  one flattened bucket as SGLang's deserializer reads it
    TensorSync             the path (`push`), registered as "tensor"; with learner.lora `push_adapter`:
                           the adapter's tensors -> /load_lora_adapter_from_tensors as adapter agentloop-vN
    serialize_adapter      the adapter as that endpoint reads it: one flattened bucket in a shared-memory segment
    serialize_bucket       the same from a bucket already flat (Learner.adapter_bucket), into a given segment
    AdapterSegments        those segments by version, written again once no server holds that adapter

Checked against SGLang 0.5.17 / 0.5.23: request fields in `sglang/srt/managers/io_struct.py`; the
payload is unpickled by `MultiprocessingSerializer.deserialize` with a restricted unpickler
that admits torch, builtins and `types` (so metadata travels as `types.SimpleNamespace`, read by
attribute in `_update_weights_from_flattened_bucket`); one payload per server TP rank, since each
rank must open its own copy of the IPC handles.
"""

from __future__ import annotations

import base64
import io
import pickle
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Sequence

from agentloop.train.weights.sync import (
    ParamMeta,
    Published,
    WeightSync,
    WeightSyncError,
    _gather_calls,
    bucket_metadata,
    flatten_bucket,
    param_metas,
    plan_buckets,
    post_json,
    register_sync,
    server_tp_size,
)

# torch is imported inside functions so the pure helpers (and their tests) stay light.


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


@register_sync("tensor")
class TensorSync(WeightSync):
    """CUDA IPC handles of each flattened bucket -> /update_weights_from_tensor (same host)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._tp: dict[str, int] = {}
        self.segments = AdapterSegments()
        """LoRA: the shared-memory segments adapters were handed to the servers in, kept to be written again."""

    def close(self, urls: Sequence[str] = ()) -> None:
        self.segments.close()
        super().close(urls)

    def check(self, learner: Any) -> None:
        if getattr(learner, "lora", None) is not None:
            return  # an adapter goes through host shared memory from a GPU or CPU learner (serialize_adapter)
        super().check(learner)

    def publish(self, learner: Any, step: int, weights_dir: Any, ask: Any) -> Published:
        if getattr(learner, "lora", None) is None:
            return super().publish(learner, step, weights_dir, ask)
        order = ask(step, self.name)
        t = time.perf_counter()
        metrics = self.push_adapter(learner, urls=list(order.urls), version=step, released=order.released)
        metrics["time/sync_s"] = time.perf_counter() - t
        return Published(weights_dir=None, pushed=True, metrics=metrics)

    def push_adapter(self, learner: Any, *, urls: Sequence[str], version: int,
                     released: Sequence[int] = ()) -> dict[str, float]:
        """Collective (LoRA): gather the adapter on rank 0 and load it into `urls` as adapter `agentloop-v<version>`
        (/load_lora_adapter_from_tensors, no file written), then label them `version` (/update_weight_version). The
        orchestrator holds the servers paused and unloads the older adapters afterwards (LoraHalf); `released`: the
        versions it reports no server holds any more, whose host memory this push may write (AdapterSegments)."""
        from agentloop.train.lora import adapter_config, adapter_name, adapter_name_taken

        t0 = time.perf_counter()
        bucket = learner.adapter_bucket(on_device=learner.device_type == "cuda")
        gather_s = time.perf_counter() - t0
        if learner.rank != 0:
            return {"sync/total_s": time.perf_counter() - t0, "sync/gather_s": gather_s}
        flat, meta = bucket
        if learner.device_type == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # the server reads through IPC, unordered with our stream
        conf = adapter_config(learner.lora, str(learner.model_path))
        name = adapter_name(version)
        for u in urls:
            if u not in self._tp:
                self._tp[u] = server_tp_size(u, self.timeout_s)
        t = time.perf_counter()
        self.segments.release(released)
        segment = self.segments.take(flat.numel(), pin=flat.is_cuda)
        payloads, _alive = serialize_bucket(flat, meta, copies=sum(self._tp[u] for u in urls), segment=segment)
        t_ser = time.perf_counter() - t
        per_url, i = {}, 0
        for u in urls:
            per_url[u], i = payloads[i:i + self._tp[u]], i + self._tp[u]

        load_s: list[float] = []

        def load(u: str) -> None:
            body = {"lora_name": name, "config_dict": conf, "serialized_named_tensors": per_url[u],
                    "load_format": "flattened_bucket"}
            t_load = time.perf_counter()
            try:
                post_json(u, "/load_lora_adapter_from_tensors", body, self.timeout_s)
            except WeightSyncError as e:
                if not adapter_name_taken(e):
                    raise
                # a resumed run on the same servers: the name is taken by an older load of this version
                post_json(u, "/unload_lora_adapter", {"lora_name": name}, self.timeout_s)
                # fresh payloads: a server that opened the segment before refusing gave its reference back
                again, _keep = serialize_bucket(flat, meta, copies=self._tp[u])
                post_json(u, "/load_lora_adapter_from_tensors", {**body, "serialized_named_tensors": again},
                          self.timeout_s)
            load_s.append(time.perf_counter() - t_load)
            post_json(u, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False},
                      self.timeout_s)

        t = time.perf_counter()
        try:
            with ThreadPoolExecutor(max(1, len(urls))) as pool:
                _gather_calls(pool, [pool.submit(load, u) for u in urls], self.timeout_s)
        except BaseException:
            self.segments.forget(segment)  # a server may hold it with no unload to come: never written again
            raise
        if segment is not None:
            self.segments.hold(version, segment)  # the servers read it until they unload this version
        mb = flat.numel() / 2**20
        # the servers hold their own mapping of the segment (or copied the IPC bucket out) once they answered
        flat = payloads = per_url = _alive = None
        return {"sync/total_s": time.perf_counter() - t0, "sync/gather_s": gather_s, "sync/serialize_s": t_ser,
                "sync/send_s": time.perf_counter() - t, "sync/load_s": max(load_s, default=0.0),
                "sync/adapter_mb": mb}

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


SHM_DIR = "/dev/shm"
"""Where torch's `file_system` sharing strategy puts shared CPU tensors (Linux)."""


def serialize_adapter(tensors: dict[str, Any], copies: int = 1) -> tuple[list[str], Any]:
    """{PEFT name: tensor} as /load_lora_adapter_from_tensors reads it with `load_format: flattened_bucket`:
    serialize_bucket of its adapter_bucket."""
    flat, meta = adapter_bucket(tensors)
    return serialize_bucket(flat, meta, copies)


def serialize_bucket(flat: Any, meta: list[SimpleNamespace], copies: int = 1, *,
                     segment: Any = None) -> tuple[list[str], Any]:
    """A flattened adapter bucket (uint8, with its byte ranges) as /load_lora_adapter_from_tensors reads it with
    `load_format: flattened_bucket` (SGLang's MultiprocessingSerializer, base64), `copies` payloads (one per server
    TP rank). Returns (payloads, the tensor they name): keep it alive until the servers answered.

    The bucket goes to the server's host memory, where SGLang's LoRAAdapter keeps adapters, as one shared-memory
    segment by name (torch's `file_system` strategy; SGLang's restricted unpickler admits its rebuild): one copy
    from the learner's device, and the server's per-tensor `.cpu()` finds its tensors there already. `segment`: a
    shared segment of the bucket's size to write it into (AdapterSegments: one no server reads any more), else a
    fresh one. Handing the server a CUDA IPC handle instead cost a device-to-host copy per tensor on the server (336
    at rank 32 on the 0.5B shape: 57 ms of a 91 ms push on an H200, GPU acceptance call 13), and a CPU learner's
    bucket by value a pickle of the whole adapter in the request. Where /dev/shm cannot hold it twice over (a
    container's small default), a GPU bucket falls back to its CUDA IPC handle and a CPU one to going by value."""
    if segment is None and _shm_room(flat.numel()):
        segment = _new_segment(flat.numel())
    if segment is not None:
        segment.copy_(flat)
        # each dump takes one reference the server's rebuild gives back: one per TP rank that opens it
        return [_share_pickle_by_name({"flattened_tensor": segment, "metadata": meta}) for _ in range(copies)], segment
    if flat.is_cuda:
        return [serialize_cuda_bucket(flat, meta)] * copies, flat
    return [base64.b64encode(pickle.dumps({"flattened_tensor": flat, "metadata": meta})).decode()] * copies, flat


class AdapterSegments:
    """The host shared-memory segments rank 0 handed the servers adapters in, by version, each written again once
    the orchestrator reports that version released (no server holds it: PushOrder.released). A fresh segment costs
    the kernel's page faults, most of its copy (19 of 27 ms for 33.6 MB on an H200's host, GPU acceptance s5); a GPU
    learner's segments are also pinned (cudaHostRegister) once, so the device copy into them runs at DMA speed.
    A version never reported released stays held: a server may still read its segment (SGLang keeps an adapter's
    tensors where they arrived, the ones it does not restack, until it unloads it)."""

    keep_free = 2
    """Released segments kept for the next pushes; more are let go."""

    def __init__(self) -> None:
        self.held: dict[int, Any] = {}
        """version -> the segment the servers read that adapter from."""
        self.free: list[Any] = []
        """Released segments, to be written again."""
        self._pinned: set[int] = set()
        """data_ptr of the segments registered with CUDA (unregistered before they are let go)."""

    def release(self, versions: Sequence[int]) -> None:
        for v in versions:
            seg = self.held.pop(int(v), None)
            if seg is not None:
                self.free.append(seg)
        while len(self.free) > self.keep_free:
            self._let_go(self.free.pop(0))

    def take(self, nbytes: int, *, pin: bool) -> Any:
        """A segment of `nbytes` to write the next adapter into (a released one, else a fresh one; pinned with
        `pin`), None where /dev/shm has no room for one (serialize_bucket falls back)."""
        for i, seg in enumerate(self.free):
            if seg.numel() == nbytes:
                return self.free.pop(i)
        if not _shm_room(nbytes):
            return None
        seg = _new_segment(nbytes)
        if pin and nbytes:
            import torch

            if int(torch.cuda.cudart().cudaHostRegister(seg.data_ptr(), nbytes, 0)) == 0:  # else unpinned, still right
                self._pinned.add(seg.data_ptr())
        return seg

    def hold(self, version: int, segment: Any) -> None:
        old = self.held.pop(int(version), None)
        if old is not None and old is not segment:  # the same version pushed again: its old segment goes
            self._let_go(old)
        self.held[int(version)] = segment

    def forget(self, segment: Any) -> None:
        """A segment whose push failed: our reference goes (a server that mapped it keeps its own), never reused."""
        if segment is not None:
            self._let_go(segment)

    def close(self) -> None:
        for seg in [*self.held.values(), *self.free]:
            self._let_go(seg)
        self.held, self.free = {}, []

    def _let_go(self, seg: Any) -> None:
        if seg.data_ptr() in self._pinned:
            import torch

            self._pinned.discard(seg.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(seg.data_ptr())


def adapter_bucket(tensors: dict[str, Any]) -> tuple[Any, list[SimpleNamespace]]:
    """{name: tensor} as one flattened bucket (uint8) and its per-tensor byte ranges, in the dict's order: the
    learner's one cast tensor itself where the tensors are its views back to back, else a concatenation."""
    names = list(tensors)
    metas = [ParamMeta(n, tuple(int(x) for x in tensors[n].shape), str(tensors[n].dtype).removeprefix("torch."))
             for n in names]
    flat = _whole_base([tensors[n] for n in names])
    if flat is None:
        flat = flatten_bucket([tensors[n].contiguous() for n in names])
    return flat, bucket_metadata(metas)


def _whole_base(tensors: Sequence[Any]) -> Any:
    """The uint8 view of the one tensor `tensors` tile in order, back to back (Learner.adapter_tensors's views of its
    one cast), else None: the flattened bucket already, no second copy of the adapter."""
    import torch

    base = getattr(tensors[0], "_base", None) if tensors else None
    if base is None or not base.is_contiguous():
        return None
    at, size = base.data_ptr(), base.element_size()
    for t in tensors:
        if t._base is not base or not t.is_contiguous() or t.data_ptr() != at:
            return None
        at += t.numel() * size
    if at != base.data_ptr() + base.numel() * size:
        return None
    return base.reshape(-1).view(torch.uint8)


def _shm_room(nbytes: int) -> bool:
    """Whether /dev/shm has room for `nbytes` twice over (a write past a full tmpfs is a SIGBUS, not an error)."""
    import os

    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes


@contextmanager
def _by_name() -> Iterator[None]:
    """torch's `file_system` sharing strategy for the block (CPU tensors shared as named segments in /dev/shm, which
    an unrelated process can open), the process's own strategy back after it."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def _new_segment(nbytes: int) -> Any:
    """A uint8 tensor of `nbytes` in a shared-memory segment torch names in /dev/shm (its pages are faulted in by
    the first write: most of a fresh segment's cost; a segment made shared at birth, UntypedStorage._new_shared,
    faulted inside the device copy instead, slower: 37 against 27 ms, GPU acceptance s5 calls 2-3)."""
    import torch

    with _by_name():
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def _share_pickle_by_name(obj: Any) -> str:
    """base64 ForkingPickler bytes of `obj`, its CPU tensors by their shared-memory segment's name."""
    with _by_name():
        return base64.b64encode(_share_pickle(obj)).decode()


__all__ = ["AdapterSegments", "TensorSync", "adapter_bucket", "serialize_adapter", "serialize_bucket",
           "serialize_cuda_bucket", "tensor_payload"]
