"""Weights to servers on other nodes (cluster.backend=ray without a shared filesystem): one copy per node, shared
by its servers, fetched file by file in chunks (never one object the size of the model), complete or absent, the
newest KEEP_WEIGHTS kept. The server actor's fetch is driven here without a cluster: the holder's calls and
`ray.get` are stood in for, the file and lock logic is the actor's own."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

ray_servers = pytest.importorskip("agentloop.cluster.ray_servers", reason="needs Ray (the agentloop[ray] extra)")
ray_learner = pytest.importorskip("agentloop.cluster.ray_learner")


class _Remote:
    def __init__(self, fn, calls, name):
        self.fn, self.calls, self.name = fn, calls, name

    def remote(self, *args):
        self.calls.append((self.name, args))
        return self.fn(*args)


class Holder:
    """The learner rank-0 actor's two calls, on its real implementation, counted."""

    def __init__(self):
        self.calls: list = []
        impl = _find_rank_impl()
        self.manifest = _Remote(impl.manifest, self.calls, "manifest")
        self.read_chunk = _Remote(impl.read_chunk, self.calls, "read_chunk")


def _find_rank_impl():
    return ray_learner.LearnerRank.__new__(ray_learner.LearnerRank)  # its two calls use no state of the rank


def _actor(tmp: Path, index: int):
    a = ray_servers.ServerActor.__new__(ray_servers.ServerActor)
    a.index, a.dir, a.node_weights, a.weights = index, tmp / f"server{index}", tmp / "weights", {}
    a.dir.mkdir(parents=True, exist_ok=True)
    a.node_weights.mkdir(parents=True, exist_ok=True)
    return a


def _weights(root: Path, step: int, big: int) -> Path:
    d = root / f"step-{step:06d}"
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes((i * 7 + step) % 251 for i in range(big)))
    (d / "config.json").write_text(json.dumps({"step": step}))
    (d / "sub" / "empty.txt").write_bytes(b"")
    return d


def test_a_nodes_servers_share_one_copy_fetched_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_servers.ray, "get", lambda x, **kw: x)
    monkeypatch.setattr(ray_servers, "CHUNK_BYTES", 1000)
    learner = tmp_path / "learner"
    src = _weights(learner, 1, 4500)
    holder = Holder()
    node = tmp_path / "node_a"
    a, b = _actor(node, 0), _actor(node, 1)
    got = []
    threads = [threading.Thread(target=lambda x=x: got.append(x.fetch_weights(str(src), holder))) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1
    copy = Path(got[0])
    for f in ("model.safetensors", "config.json", "sub/empty.txt"):
        assert (copy / f).read_bytes() == (src / f).read_bytes(), f
    reads = [args for name, args in holder.calls if name == "read_chunk"]
    # once for the node: 5 chunks of the 4500-byte file, 1 of config.json, none of the empty file
    assert [r[1:] for r in reads if r[1] == "model.safetensors"] == [
        ("model.safetensors", o, min(1000, 4500 - o)) for o in range(0, 4500, 1000)]
    assert sum(name == "manifest" for name, _ in holder.calls) == 1
    fetches = [json.loads(ln) for ln in (node / "weights" / "weights.jsonl").read_text().splitlines()]
    assert len(fetches) == 1 and fetches[0]["bytes"] == 4500 + len((src / "config.json").read_bytes())
    for x in (a, b):  # each server's own record of the copy it was given
        assert [json.loads(ln)["to"] for ln in (x.dir / "weights.jsonl").read_text().splitlines()] == [str(copy)]


def test_a_partial_copy_is_never_served_and_the_newest_two_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_servers.ray, "get", lambda x, **kw: x)
    monkeypatch.setattr(ray_servers, "CHUNK_BYTES", 1000)
    learner, node = tmp_path / "learner", tmp_path / "node_a"
    holder = Holder()
    a = _actor(node, 0)
    src1 = _weights(learner, 1, 2500)
    # a copy cut short (a server killed mid-fetch left it, unmarked): fetched afresh, not served
    partial = node / "weights" / "step-000001"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"x" * 10)
    copy1 = Path(a.fetch_weights(str(src1), holder))
    assert (copy1 / "model.safetensors").read_bytes() == (src1 / "model.safetensors").read_bytes()
    # a server restarted on the node (its memory empty) finds the complete copy: no second fetch
    before = len(holder.calls)
    assert _actor(node, 1).fetch_weights(str(src1), holder) == str(copy1) and len(holder.calls) == before
    for step in (2, 3):
        a.fetch_weights(str(_weights(learner, step, 1500)), holder)
    kept = sorted(d.name for d in (node / "weights").iterdir() if d.is_dir())
    assert kept == ["step-000002", "step-000003"]


def test_a_chunk_is_read_only_from_under_the_weights_directory(tmp_path):
    impl = _find_rank_impl()
    d = _weights(tmp_path / "learner", 1, 10)
    (tmp_path / "secret").write_text("no")
    assert impl.read_chunk(str(d), "config.json", 0, 3) == b'{"s'
    with pytest.raises(ValueError, match="not a file under"):
        impl.read_chunk(str(d), "../../secret", 0, 2)
