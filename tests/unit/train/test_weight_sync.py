"""Weight sync paths (agentloop.train.weights.sync) without a GPU: bucketing, payloads, the endpoint
call sequence against scripted fake servers, SGLang's restricted unpickler, the learner-side group
rendezvous against SGLang's own `init_custom_process_group` (gloo), and the mailbox handshake."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from agentloop.train.config import LearnerConfig
from agentloop.train.handle.mailbox import (
    LearnerMailbox,
    MailboxClient,
    SyncRequest,
    UpdateResult,
)
from agentloop.train.handle.protocol import PushOrder, WeightsOnDisk
from agentloop.train.weights import nccl as wn
from agentloop.train.weights import sync as ws
from agentloop.train.weights import tensor as wt
from agentloop.train.weights.sync import ParamMeta, WeightSyncError, plan_buckets
from tests.fakes.fake_sglang import FakeSGLang


def meta(name: str, n: int, dtype: str = "bfloat16") -> ParamMeta:
    return ParamMeta(name, (n,), dtype)


# ---------------------------------------------------------------------------- pure logic


def test_plan_buckets_by_byte_budget():
    ms = [meta("a", 10), meta("b", 20), meta("c", 5), meta("d", 100), meta("e", 1)]  # bytes 20, 40, 10, 200, 2
    got = [[m.name for m in b] for b in plan_buckets(ms, 64)]
    assert got == [["a", "b"], ["c"], ["d"], ["e"]]  # 20+40 fits 64; +10 would not; d alone (over budget)
    assert [[m.name for m in b] for b in plan_buckets(ms, 10**6)] == [["a", "b", "c", "d", "e"]]
    assert [len(b) for b in plan_buckets(ms, 1)] == [1, 1, 1, 1, 1]
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError):
        plan_buckets(ms, 0)


def test_param_meta_bytes_and_offsets():
    assert ParamMeta("w", (3, 4), "float32").nbytes == 48
    assert ParamMeta("w", (3, 4), "bfloat16").nbytes == 24
    assert wn.rank_offsets([1, 2, 1]) == ([1, 2, 4], 5)
    assert wn.rank_offsets([]) == ([], 1)
    assert wn.default_master_addr(["http://127.0.0.1:1", "http://localhost:2"]) == "127.0.0.1"


def test_payloads():
    b = [ParamMeta("x.weight", (2, 3), "bfloat16"), ParamMeta("y.bias", (3,), "float32")]
    mid = wn.distributed_payload(b, "g", last=False, version="7", flush_cache=True)
    assert mid == {"names": ["x.weight", "y.bias"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [3]],
                   "group_name": "g", "load_format": "flattened_bucket", "flush_cache": False,
                   "abort_all_requests": False}
    last = wn.distributed_payload(b, "g", last=True, version="7", flush_cache=True)
    assert last["flush_cache"] is True and last["weight_version"] == "7"
    t = wt.tensor_payload(["AAA", "BBB"], last=True, version="3", flush_cache=True)
    assert t["serialized_named_tensors"] == ["AAA", "BBB"] and t["load_format"] == "flattened_bucket"
    assert t["weight_version"] == "3" and t["flush_cache"] is True
    assert "weight_version" not in wt.tensor_payload(["A"], last=False, version="3")
    # no flush unless the interrupt mode allows one (agentloop.interrupt): the default is the safe side
    assert wt.tensor_payload(["A"], last=True, version="3")["flush_cache"] is False
    assert wn.distributed_payload(b, "g", last=True, version="7")["flush_cache"] is False
    assert wn.init_group_payload("10.0.0.1", 29500, 3, 5, "g") == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5,
        "group_name": "g", "backend": "nccl"}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)


def test_param_metas_gather_and_flatten_roundtrip():
    m = Tiny()
    metas = ws.param_metas(m, torch.bfloat16)
    assert [x.name for x in metas] == [n for n, _ in m.named_parameters()]
    assert metas[0] == ParamMeta("emb.weight", (50, 8), "bfloat16")
    bucket = metas[:3]
    ts = ws.gather_bucket(m, bucket, torch.bfloat16, torch.device("cpu"))
    flat = ws.flatten_bucket(ts)
    md = ws.bucket_metadata(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(x.nbytes for x in bucket) == md[-1].end_idx
    # read back the way SGLang's FlattenedTensorBucket.reconstruct_tensors does
    for x, t in zip(md, ts):
        back = flat[x.start_idx:x.end_idx].view(x.dtype).reshape(x.shape)
        assert torch.equal(back, t)


def test_sglang_restricted_unpickler_accepts_our_bucket():
    """Our metadata objects (types.SimpleNamespace with torch.Size / torch.dtype) pass SGLang's
    SafeUnpickler and its FlattenedTensorBucket rebuilds the tensors from them."""
    common = pytest.importorskip("sglang.srt.utils.common")
    bucket_mod = pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")
    ts = [torch.randn(3, 4).to(torch.bfloat16), torch.arange(5, dtype=torch.float32)]
    bucket = [ParamMeta("a", (3, 4), "bfloat16"), ParamMeta("b", (5,), "float32")]
    flat = ws.flatten_bucket(ts)
    payload = base64.b64encode(pickle.dumps({"flattened_tensor": flat, "metadata": ws.bucket_metadata(bucket)})).decode()
    data = common.MultiprocessingSerializer.deserialize(payload)
    rebuilt = bucket_mod.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                               metadata=data["metadata"]).reconstruct_tensors()
    assert [n for n, _ in rebuilt] == ["a", "b"]
    assert all(torch.equal(a, b) for (_, a), b in zip(rebuilt, ts))


def test_share_pickle_passes_sglang_deserializer():
    """The ForkingPickler with our tensor reducer (CUDA: device index -> GPU UUID) yields bytes that
    SGLang's MultiprocessingSerializer reads back (a CPU tensor here: shared memory instead of IPC)."""
    common = pytest.importorskip("sglang.srt.utils.common")
    flat = torch.arange(12, dtype=torch.uint8)
    md = ws.bucket_metadata([ParamMeta("a", (3, 2), "bfloat16")])
    data = common.MultiprocessingSerializer.deserialize(base64.b64encode(wt._share_pickle(
        {"flattened_tensor": flat, "metadata": md})).decode())
    assert torch.equal(data["flattened_tensor"], flat) and data["metadata"][0].name == "a"


def test_serialize_refuses_cpu_tensors():
    with pytest.raises(WeightSyncError, match="CUDA"):
        wt.serialize_cuda_bucket(torch.zeros(4, dtype=torch.uint8), [])


def test_config_fields():
    c = LearnerConfig()
    assert c.weight_sync == "disk" and c.weight_sync_bucket_mb == 512.0
    LearnerConfig(weight_sync="nccl", weight_sync_bucket_mb=64, weight_sync_master_port=29600)
    with pytest.raises(ValueError, match="GPU learner"):
        LearnerConfig(weight_sync="tensor", device="cpu")
    with pytest.raises(ValueError):
        LearnerConfig(weight_sync="rdma")
    s = ws.sync_from_config(LearnerConfig(weight_sync="nccl", weight_sync_bucket_mb=2, weight_sync_timeout_s=9))
    assert isinstance(s, wn.NcclSync) and s.bucket_bytes == 2 * 2**20 and s.timeout_s == 9
    assert set(ws.SYNCS) == {"disk", "tensor", "nccl"} and ws.get_sync("disk").learner_pushes is False


# ---------------------------------------------------------------------------- against fake servers


@pytest.fixture(params=[False], ids=["sglang-0.5.17"])
def fakes(request):
    """Two fake servers on an event loop in a thread (the sync code is blocking, like the learner);
    parametrized with `weight_sessions` (0.5.23's begin/end protocol) where a test asks for both."""
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    servers = [asyncio.run_coroutine_threadsafe(FakeSGLang(tp_size=tp, weight_sessions=request.param).start(),
                                                loop).result(10) for tp in (1, 2)]
    yield servers
    for s in servers:
        asyncio.run_coroutine_threadsafe(s.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    th.join(10)
    loop.close()


def _paths(server: FakeSGLang) -> list[str]:
    return [p for p, _ in server.admin]


def test_tensor_sync_call_sequence(fakes, monkeypatch):
    serialized: list[int] = []

    def fake_serialize(flat, metadata):  # the CUDA IPC pickling needs a GPU; the rest runs as is
        serialized.append(flat.numel())
        return f"payload-{len(serialized)}"

    monkeypatch.setattr(wt, "serialize_cuda_bucket", fake_serialize)
    m = Tiny()
    budget = 50 * 8 * 2  # the embedding alone fills one bucket
    sync = wt.TensorSync(bucket_bytes=budget, timeout_s=10)
    out = sync.push(m, dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=[f.url for f in fakes],
                    version="4", flush_cache=True)
    nb = len(plan_buckets(ws.param_metas(m, torch.bfloat16), budget))
    assert nb >= 2 and out["sync/buckets"] == nb
    for f in fakes:
        assert _paths(f) == ["/server_info"] + ["/update_weights_from_tensor"] * nb
        bodies = [b for p, b in f.admin if p == "/update_weights_from_tensor"]
        assert all(len(b["serialized_named_tensors"]) == f.tp_size for b in bodies)  # one pickle per TP rank
        assert [b["flush_cache"] for b in bodies] == [False] * (nb - 1) + [True]
        assert [b.get("weight_version") for b in bodies] == [None] * (nb - 1) + ["4"]
        assert f.weight_version == "4"
    assert len(serialized) == nb * 3  # tp 1 + tp 2
    # TP sizes are cached: a second push asks no /server_info
    sync.push(m, dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=[fakes[0].url], version="5")
    assert _paths(fakes[0]).count("/server_info") == 1 and fakes[0].weight_version == "5"


class FakeGroup:
    def __init__(self, log, addr, port, world, name, backend, timeout_s, before_connect):
        self.name, self.world_size = name, world
        self.sent: list[bytes] = []
        self.closed = False
        log.append(("create", addr, port, world, name, backend))
        before_connect(41000 + len(log))

        self.block = False
        self.aborted = threading.Event()

    def broadcast(self, t):
        if self.block:  # like NCCL whose peer never joins: only an abort ends it
            assert self.aborted.wait(30), "broadcast was never aborted"
            raise RuntimeError("aborted")
        self.sent.append(t.numpy().tobytes())

    def abort(self):
        self.aborted.set()

    def close(self):
        self.closed = True


def test_nccl_sync_call_sequence(fakes):
    log: list = []
    groups: list[FakeGroup] = []

    def factory(addr, port, world, name, *, backend, timeout_s, before_connect):
        g = FakeGroup(log, addr, port, world, name, backend, timeout_s, before_connect)
        groups.append(g)
        return g

    m = Tiny()
    sync = wn.NcclSync(group_factory=factory, bucket_bytes=1000, timeout_s=10)
    urls = [f.url for f in fakes]
    out = sync.push(m, dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=urls, version="1")
    assert "sync/init_group_s" in out
    assert log == [("create", "127.0.0.1", 0, 4, groups[0].name, "nccl")]  # world = 1 + 1 + 2
    buckets = plan_buckets(ws.param_metas(m, torch.bfloat16), 1000)
    for f, offset in zip(fakes, (1, 2)):
        paths = _paths(f)
        assert paths[0] == "/server_info" and paths[1] == "/init_weights_update_group"
        assert paths[2:] == ["/update_weights_from_distributed"] * len(buckets)
        init = f.admin[1][1]
        assert init == {"master_address": "127.0.0.1", "master_port": 41001, "rank_offset": offset,
                        "world_size": 4, "group_name": groups[0].name, "backend": "nccl"}
        bodies = [b for p, b in f.admin if p == "/update_weights_from_distributed"]
        assert [b["names"] for b in bodies] == [[x.name for x in b] for b in buckets]
        assert bodies[-1]["weight_version"] == "1" and f.weight_version == "1"
    # each bucket went out as one broadcast of its tensors' bytes, in order
    params = dict(m.named_parameters())
    want = [b"".join(params[x.name].detach().to(torch.bfloat16).view(torch.uint8).numpy().tobytes() for x in b)
            for b in buckets]
    assert groups[0].sent == want
    # same servers: the group is reused; a different set: destroyed on the old servers, then re-created
    sync.push(m, dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=urls, version="2")
    assert len(groups) == 1
    sync.push(m, dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=urls[:1], version="3")
    assert len(groups) == 2 and groups[0].closed and groups[1].world_size == 2
    assert "/destroy_weights_update_group" in _paths(fakes[1])
    sync.close()
    assert groups[1].closed and _paths(fakes[0])[-1] == "/destroy_weights_update_group"


def test_nccl_sync_fails_instead_of_hanging_when_a_server_refuses(fakes):
    groups: list[FakeGroup] = []

    def factory(addr, port, world, name, *, backend, timeout_s, before_connect):
        groups.append(FakeGroup([], addr, port, world, name, backend, timeout_s, before_connect))
        groups[-1].block = True
        return groups[-1]

    fakes[1].refuse.add("/update_weights_from_distributed")
    sync = wn.NcclSync(group_factory=factory, timeout_s=20)
    with pytest.raises(WeightSyncError, match="refused"):
        sync.push(Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=[f.url for f in fakes],
                  version="1")
    assert groups[0].aborted.is_set() and sync.group is None  # the next push builds a new group


def test_nonzero_rank_only_gathers(fakes):
    sync = wn.NcclSync(group_factory=lambda *a, **k: pytest.fail("rank 1 must not create the group"), timeout_s=5)
    sync.push(Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=1, urls=[fakes[0].url], version="1")
    assert fakes[0].admin == []


def test_refused_update_raises(fakes, monkeypatch):
    monkeypatch.setattr(wt, "serialize_cuda_bucket", lambda flat, md: "x")
    fakes[1].refuse.add("/update_weights_from_tensor")
    with pytest.raises(WeightSyncError, match="refused"):
        wt.TensorSync(timeout_s=5).push(Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=0,
                                        urls=[f.url for f in fakes], version="1")


def test_disk_sync_load(fakes):
    ws.DiskSync(timeout_s=5).load("/tmp/w", [f.url for f in fakes], "9")
    assert all(f.admin[-1] == ("/update_weights_from_disk", {"model_path": "/tmp/w", "weight_version": "9"})
               for f in fakes)


# ---------------------------------------------------------------------------- rendezvous with SGLang's own code

_SGLANG_SIDE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group
    port, offset, world, name = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world,
                                   rank=offset, group_name=name)
    t = torch.zeros(6, dtype=torch.uint8)
    dist.broadcast(t, src=0, group=pg)
    print("GOT", t.tolist(), flush=True)
""")


@pytest.mark.timeout(180)
def test_group_rendezvous_with_sglang_init_custom_process_group(tmp_path: Path):
    """Our create_update_group (rank 0) and SGLang's init_custom_process_group (ranks 1, 2) form one
    group and a broadcast arrives: the store/prefix protocol matches (gloo stands in for NCCL on CPU;
    only the device prefix differs, cpu/ vs cuda/)."""
    pytest.importorskip("sglang.srt.utils.common")
    script = tmp_path / "side.py"
    script.write_text(_SGLANG_SIDE)
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def start(port: int) -> None:
        for rank in (1, 2):
            procs.append(subprocess.Popen([sys.executable, str(script), str(port), str(rank), "3", "agentloop-test"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))

    try:
        g = wn.create_update_group("127.0.0.1", 0, 3, "agentloop-test", backend="gloo", timeout_s=120,
                                   before_connect=start)
        g.broadcast(torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.uint8))
        outs = [p.communicate(timeout=120)[0] for p in procs]
        g.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for out in outs:
        assert "GOT [1, 2, 3, 4, 5, 6]" in out, out[-2000:]


# ---------------------------------------------------------------------------- mailbox handshake


def test_mailbox_sync_handshake(tmp_path: Path):
    client = MailboxClient(tmp_path, poll_s=0.01)
    box = LearnerMailbox(tmp_path)
    box.request_sync(1, "nccl")
    ev = client.wait_update_or_sync(1, 5)
    assert ev == SyncRequest(step=1, method="nccl")
    client.allow_sync(PushOrder(1, ("http://a", "http://b"), "abort"))
    assert box.wait_sync_go(1, 5)["urls"] == ["http://a", "http://b"]
    box.write_done(1, None, {"sync/total_s": 0.1}, pushed=True)
    upd = client.wait_update_or_sync(1, 5)  # sync.go is there: only update.done ends the wait now
    assert isinstance(upd, UpdateResult) and upd.pushed and upd.weights_dir is None
    assert client.wait_update(1, 5).metrics == {"sync/total_s": 0.1}
    # disk path unchanged: a weights dir and pushed False
    box.write_done(2, tmp_path / "w2", {})
    assert client.wait_update(2, 5) == UpdateResult(step=2, weights=WeightsOnDisk(str(tmp_path / "w2")), metrics={},
                                                    pushed=False)
    # a resume past step 0 forgets the handshake files of later steps
    box.forget_after(0)
    assert not client.paths.sync_request(1).exists() and not client.paths.sync_go(1).exists()
    from agentloop.train.handle.mailbox import MailboxTimeout

    with pytest.raises(MailboxTimeout):
        box.wait_sync_go(3, 0.05)


def test_orchestrator_learner_update_pauses_around_the_push(fakes, tmp_path: Path):
    """tensor/nccl: pause -> (learner pushes) -> resume; disk: pause -> update_weights_from_disk -> resume."""
    from agentloop.config import Config, ManagerConfig, load_config
    from agentloop.server_manager import ServerManager
    from agentloop.train.orchestrator.learner_process import FileLearner
    from agentloop.train.orchestrator.loop import Trainer

    push_cfg, disk_cfg = load_config(None, ["learner.weight_sync=tensor"]), Config()
    box = LearnerMailbox(tmp_path)
    urls = [f.url for f in fakes]

    def learner_side() -> None:  # what serve() does for step 1 (tensor) and step 2 (disk)
        box.request_sync(1, "tensor")
        go = box.wait_sync_go(1, 10)
        for u in go["urls"]:
            ws.post_json(u, "/update_weights_from_tensor", {"serialized_named_tensors": [], "weight_version": "1"}, 5)
        box.write_done(1, None, {}, pushed=True)

    async def main():
        async with ServerManager(urls, ManagerConfig(health_interval_s=60), initial_version=0) as sm:
            learner = FileLearner(tmp_path, poll_s=0.01)
            trainer = Trainer(push_cfg, tmp_path, sm, None, learner, None, None, [])
            th = threading.Thread(target=learner_side)
            th.start()
            upd, _, _ = await trainer.learner_update(1)
            th.join(10)
            assert upd.pushed and sm.server_versions() == {u: 1 for u in urls} and sm.expected_version == 1
            box.write_done(2, tmp_path / "w2", {})
            upd2, _, _ = await Trainer(disk_cfg, tmp_path, sm, None, learner, None, None, []).learner_update(2)
            assert upd2.weights_dir == str(tmp_path / "w2") and not upd2.pushed
            assert sm.server_versions() == {u: 2 for u in urls} and sm.expected_version == 2

    asyncio.run(main())
    for f in fakes:
        assert _paths(f) == ["/pause_generation", "/update_weights_from_tensor", "/continue_generation",
                             "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert f.weight_version == "2"


# ---------------------------------------------------------------------------- SGLang 0.5.23 update sessions

BOTH = pytest.mark.parametrize("fakes", [False, True], ids=["sglang-0.5.17", "sglang-0.5.23"], indirect=True)


@BOTH
def test_tensor_sync_opens_a_session_where_the_server_has_them(fakes, monkeypatch):
    """0.5.23 (weight_sessions): begin -> every bucket -> end, on every push. 0.5.17: the begin is a 404,
    remembered, and the buckets go without a session (as before)."""
    monkeypatch.setattr(wt, "serialize_cuda_bucket", lambda flat, md: "x")
    sessions = fakes[0].weight_sessions
    sync = wt.TensorSync(bucket_bytes=50 * 8 * 2, timeout_s=10)
    nb = len(plan_buckets(ws.param_metas(Tiny(), torch.bfloat16), 50 * 8 * 2))
    for version in ("1", "2"):
        sync.push(Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=[f.url for f in fakes],
                  version=version)
    for f in fakes:
        push = ["/update_weights_from_tensor"] * nb
        if sessions:
            push = ["/begin_weight_update"] + push + ["/end_weight_update"]
        assert _paths(f) == ["/server_info"] + push + push, f.url
        assert f.weight_version == "2" and not f.session_open
        if sessions:
            assert f.admin[1][1] == {"selector": "all"} and f.admin[nb + 2][1] == {}
    assert sync._sessions == {f.url: sessions for f in fakes}


@pytest.mark.parametrize("fakes", [True], ids=["sglang-0.5.23"], indirect=True)
def test_without_a_session_0523_refuses_and_a_stale_session_is_recovered(fakes, monkeypatch):
    monkeypatch.setattr(wt, "serialize_cuda_bucket", lambda flat, md: "x")
    # what the old code did (no begin): the server refuses, naming the protocol
    with pytest.raises(WeightSyncError, match="begin_weight_update"):
        ws.post_json(fakes[0].url, "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, 5)
    # a session left open by a push that died between begin and end: closed, then opened afresh
    fakes[0].session_open = True
    wt.TensorSync(timeout_s=5).push(Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=0,
                                    urls=[fakes[0].url], version="3")
    assert fakes[0].weight_version == "3" and not fakes[0].session_open
    # a push that fails mid-way still closes its sessions, and reports the failure, not the close
    fakes[1].refuse.add("/update_weights_from_tensor")
    with pytest.raises(WeightSyncError, match="refused"):
        wt.TensorSync(timeout_s=5).push(Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=0,
                                        urls=[f.url for f in fakes], version="4")
    assert [f.session_open for f in fakes] == [False, False]
    assert _paths(fakes[1])[-1] == "/end_weight_update"


@BOTH
def test_nccl_sync_sessions(fakes):
    groups: list[FakeGroup] = []

    def factory(addr, port, world, name, *, backend, timeout_s, before_connect):
        groups.append(FakeGroup([], addr, port, world, name, backend, timeout_s, before_connect))
        return groups[-1]

    sync = wn.NcclSync(group_factory=factory, bucket_bytes=1000, timeout_s=10)
    sync.push(Tiny(), dtype=torch.bfloat16, device=torch.device("cpu"), rank=0, urls=[f.url for f in fakes],
              version="1")
    nb = len(plan_buckets(ws.param_metas(Tiny(), torch.bfloat16), 1000))
    for f in fakes:
        push = ["/update_weights_from_distributed"] * nb
        if f.weight_sessions:
            push = ["/begin_weight_update"] + push + ["/end_weight_update"]
        assert _paths(f) == ["/server_info", "/init_weights_update_group"] + push
        assert f.weight_version == "1"
