"""`agentloop train` on a Ray cluster (cluster.backend=ray), on CPU: two simulated nodes of one local cluster,
each a raylet with its own custom resource and its own scratch dir (TMPDIR of its workers): the servers pinned to
node_a, the learner to node_b, the driver (the CLI) in a third place. Real SGLang CPU servers, the real learner.

  * three steps end to end with two server actors, one killed mid-rollout: no episode is lost (every step trains
    whole groups of every prompt, none aborted), records and metrics come back to the driver, and no file path
    crosses from one node's scratch dir to the other's (the learner's weights reach the servers through Ray);
  * the episodes on two rollout worker actors (their ServerManagers following the driver's), in each interrupt
    mode: no episode aborted, every token stamped with the version that sampled it; abort: the calls a weight
    update cuts short are continued under the new weights, and (the same run) a rollout worker killed mid-rollout
    with the episode journal on: its groups go on on the other worker from what it journaled, none cancelled;
  * the learner actor killed after a checkpoint: the run fails with an error naming the dead actor, and the same
    command resumes from that checkpoint on the learner's node and finishes;
  * a server actor killed with its restart allowed: Ray restarts it at its URL, and the run re-admits it only once
    it serves the current weights (reloaded from its node's copy, which was not fetched again);
  * learner ranks that Ray places on two nodes sharing no filesystem are refused before any rank starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.records import read_records
from agentloop.train.handle.mailbox import MailboxPaths
from agentloop.train.trainer.checkpoint import latest_checkpoint
from tests.conftest import RayNodes

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]  # real servers, restarts

REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")


Nodes = RayNodes
"""The session's cluster (tests/conftest.py, `ray_nodes`): node_a holds the servers (its scratch dir their TMPDIR),
node_b the learner, the driver its run dirs. Nothing here kills a node, so every test shares it (runs are named
after their run dirs; the handle's contract tests use it too)."""


@pytest.fixture
def nodes(ray_nodes: RayNodes) -> Nodes:
    return ray_nodes


def _cmd(nodes: Nodes, tiny_model_path: Path, run_dir: Path, plugin: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--model", str(tiny_model_path),
            "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir), "train.val_every=0",
            "rollout.n_samples=2", "train.prompts_per_step=2", "learner.lr=0.001", "train.tensorboard=false",
            "reward.custom=" + json.dumps(f"{plugin}:compute_score"), "cluster.backend=ray",
            f"cluster.address={nodes.address}", "cluster.server_resources={node_a: 1}",
            "cluster.learner_resources={node_b: 1}", f"cluster.learner_dir={nodes.b / 'learner' / run_dir.name}",
            "manager.retry_budget_s=120", *extra]


def _env(nodes: Nodes) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(nodes.driver)}


def _wait(proc: subprocess.Popen, log: Path, cond, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _lines(f: Path) -> list[str]:
    return f.read_text().splitlines() if f.is_file() else []


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


@contextlib.contextmanager
def _connected(nodes: RayNodes) -> Iterator[Any]:
    """The `ray` module, connected to the test cluster for the block (a driver of its own beside the run's)."""
    import ray

    ray.init(address=nodes.address, namespace="agentloop", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_two_steps_across_two_nodes_survive_a_server_killed_mid_rollout(nodes, tiny_model_path, tmp_path):
    run_dir, plugin, log = nodes.driver / "run-two-nodes", nodes.driver / "reward.py", tmp_path / "run.log"
    plugin.write_text(REWARD)
    cmd = _cmd(nodes, tiny_model_path, run_dir, plugin, "train.steps=3", "server.num_local=2",
               "sampling.max_new_tokens=400", "learner.checkpoint_every=null")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(nodes))
    try:
        # step 2's batch is taken and step 3's groups were just admitted (async, η = 1), each generating up to
        # 400 tokens: kill a server's actor now, while they run
        _wait(proc, log, lambda: (run_dir / "rollouts" / "step-000002.jsonl").is_file(), "step 2's records")
        with _connected(nodes) as ray:
            victim = ray.get_actor(f"agentloop-{run_dir.name}-server1")
            killed_url = ray.get(victim.info.remote())["url"]
            ray.kill(victim)  # for good (no_restart): the run goes on with the other server
        assert proc.wait(600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    print(out[-3000:])
    # records and metrics came back to the driver
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["learner/actor/optimizer_steps"] == 1.0 for r in rows)
    # no episode lost: every step trained two whole groups of two episodes, none failed
    for step in (1, 2, 3):
        recs = list(read_records(run_dir / "rollouts" / f"step-{step:06d}.jsonl"))
        assert len(recs) == 4 and all(r.error is None and r.finish_reason != "abort" for r in recs), \
            (step, [(r.error, r.finish_reason) for r in recs])
        assert sorted({r.uid for r in recs}) == sorted(r.uid for r in recs[::2]) and len({r.uid for r in recs}) == 2
    # the killed server was ejected. Its calls went to the other one: retried when the kill cut a /generate,
    # or (a kill inside a weight push, while every call is paused) continued there after the push; either way
    # the records above are whole. The retry path itself: tests/unit/client (fault injection, counted retries).
    assert rows[-1]["server/ejections"] >= 1, rows[-1]
    assert any(killed_url in ln and "ejected" in ln for ln in out.splitlines()), out[-3000:]
    # no path crossed: the driver holds no weights or checkpoints, the learner's files are on node_b only, the
    # servers loaded copies on node_a
    learner_dir = nodes.b / "learner" / run_dir.name
    assert not (run_dir / "weights").exists() and not (run_dir / "checkpoints").exists()
    assert (learner_dir / "weights" / "step-000003").is_dir() and latest_checkpoint(learner_dir / "checkpoints")
    served = nodes.a / "agentloop-ray" / f"agentloop-{run_dir.name}"
    copies = [json.loads(ln) for ln in _lines(served / "server0" / "weights.jsonl")]  # each copy it loaded
    assert [Path(c["to"]).name for c in copies] == ["step-000001", "step-000002", "step-000003"], copies
    assert all(c["from"].startswith(str(learner_dir)) and c["to"].startswith(str(served)) for c in copies)
    # one copy per node, shared by its two servers: each step's weights crossed from node_b to node_a once
    fetches = [json.loads(ln) for ln in _lines(served / "weights" / "weights.jsonl")]
    assert [Path(f["to"]).name for f in fetches] == ["step-000001", "step-000002", "step-000003"], fetches
    assert not (nodes.a / "learner").exists() and not (nodes.b / "agentloop-ray").exists()
    assert not any(str(nodes.b) in p.read_text(errors="replace") for p in _files(served) if p.suffix == ".log")
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["last_weights"] == str(learner_dir / "weights" / "step-000003")
    assert summary["learner_exit"] == 0


def _both_journaled(run_dir: Path) -> bool:
    """Both rollout workers journaled, and at least two generate calls are in the journal."""
    from agentloop.journal.reader import read_journal

    jdir = run_dir / "journal"
    if not jdir.is_dir():
        return False
    writers = {p.stem.rpartition("-")[0] for p in jdir.glob("w*.jal")}
    return len(writers) >= 2 and sum(len(e.replay()) for e in read_journal(jdir).episodes.values()) >= 2


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_rollout_workers_continue_the_calls_a_weight_update_cuts_short(nodes, tiny_model_path, tmp_path, mode):
    """Two rollout workers, each interrupt mode. abort (the default mode) also kills rollout worker 0 once both
    workers have journaled generate calls (the episode journal on, the default): its groups are not cancelled,
    each goes on on worker 1 from what worker 0 journaled (the same attempt, so its seeds and episode ids), and
    every step still trains whole groups of every prompt (one training run for both scenarios: each run pays for
    its servers, learner and workers). retract trains a LoRA adapter (learner.lora): the server actors get the LoRA
    flags, each step's adapter crosses to their node and is loaded there, and every token names its version."""
    run_dir, plugin, log = nodes.driver / f"run-workers-{mode}", nodes.driver / "reward.py", tmp_path / "run.log"
    plugin.write_text(REWARD)
    lora = mode == "retract"
    cmd = _cmd(nodes, tiny_model_path, run_dir, plugin, "train.steps=3", "sampling.max_new_tokens=400",
               "learner.checkpoint_every=null", "cluster.rollout_workers=2", f"train.interrupt={mode}",
               "journal.write_interval_ms=1", *(["learner.lora.enabled=true", "learner.lora.rank=8"] if lora else []))
    with log.open("wb") as out_file:
        proc = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.STDOUT, env=_env(nodes))
    try:
        if mode == "abort":
            _wait(proc, log, lambda: _both_journaled(run_dir), "both workers' journaled calls")
            with _connected(nodes) as ray:
                ray.kill(ray.get_actor(f"agentloop-{run_dir.name}-rollout0"), no_restart=True)
        assert proc.wait(600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert "episodes run on 2 rollout worker(s)" in out
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    by_step = {s: list(read_records(run_dir / "rollouts" / f"step-{s:06d}.jsonl")) for s in (1, 2, 3)}
    recs = [r for s in (1, 2, 3) for r in by_step[s]]
    assert len(recs) == 12 and all(r.error is None and r.finish_reason != "abort" for r in recs)
    # every token stamped with the version that sampled it, in order, within the staleness bound (η = 1): a call
    # the push reached went on under the new weights (retract: requeued in the server; in_place: paused where it
    # was; abort: cut and continued by the worker)
    for s, step_recs in by_step.items():
        for r in step_recs:
            vs = [v for v, m in zip(r.token_versions, r.response_mask) if m]
            assert vs == sorted(vs) and s - 2 <= vs[0] and vs[-1] <= s - 1, (mode, s, sorted(set(vs)))
    if lora:  # each step's adapter (a PEFT directory, not the model) went from node_b to the servers' node
        learner_dir = nodes.b / "learner" / run_dir.name
        assert all((learner_dir / "weights" / f"step-{s:06d}" / "adapter_config.json").is_file() for s in (1, 2, 3))
        served = nodes.a / "agentloop-ray" / f"agentloop-{run_dir.name}"
        fetches = [json.loads(ln) for ln in _lines(served / "weights" / "weights.jsonl")]
        assert [Path(f["to"]).name for f in fetches] == ["step-000001", "step-000002", "step-000003"], fetches
        base = sum(p.stat().st_size for p in tiny_model_path.glob("*.safetensors"))
        assert all(f["files"] == 2 and f["bytes"] < base / 2 for f in fetches), (base, fetches)  # config + adapter
        assert any(max(r.token_versions[i] for i, m in enumerate(r.response_mask) if m) >= 1 for r in recs)
    if mode == "abort":
        # groups of the next step run on the workers while a step's weights are pushed (async, η = 1): the pause
        # cut some of their calls, which continued under the new weights, their tokens of both versions
        assert sum(r["async/episodes_continued"] for r in rows) >= 1, [r["async/episodes_continued"] for r in rows]
        both = [r for r in recs if r.metrics.get("interrupted_calls", 0) > 0]
        assert both and all(len(set(v for v, m in zip(r.token_versions, r.response_mask) if m)) == 2 for r in both)
        # the killed worker's groups went on on the other one from its journal, none given out again from scratch
        assert sum(r.get("journal/groups_moved_from_dead_worker", 0) for r in rows) >= 1
        assert sum(r.get("journal/groups_continued_after_worker_death", 0) for r in rows) >= 1
        assert sum(r.get("journal/calls_reused", 0) + r.get("journal/episodes_reused_finished", 0) for r in rows) >= 1
        assert sum(r["async/groups_cancelled"] for r in rows) == 0


def test_a_killed_learner_actor_fails_the_run_clearly_and_its_checkpoint_resumes(nodes, tiny_model_path, tmp_path):
    run_dir, plugin = nodes.driver / "run-learner-kill", nodes.driver / "reward.py"
    plugin.write_text(REWARD)
    logs = [tmp_path / "run1.log", tmp_path / "run2.log"]
    learner_dir = nodes.b / "learner" / run_dir.name
    cmd = _cmd(nodes, tiny_model_path, run_dir, plugin, "train.steps=4", "sampling.max_new_tokens=6",
               "learner.checkpoint_every=2")
    with logs[0].open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(nodes))
    try:
        # step 2's row logged: its checkpoint is complete (written before the step's update, CPU: synchronously)
        _wait(proc, logs[0], lambda: len(_lines(run_dir / "metrics.jsonl")) >= 2, "step 2's row")
        with _connected(nodes) as ray:
            ray.kill(ray.get_actor(f"agentloop-{run_dir.name}-learner-rank0"))
        rc = proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = logs[0].read_text()
    assert rc != 0, out[-3000:]
    assert f"learner rank 0 (agentloop-{run_dir.name}-learner-rank0, a Ray actor) its actor died" in out, out[-3000:]
    ck = latest_checkpoint(learner_dir / "checkpoints")
    assert ck is not None and ck.name == "step-000002"
    # the same command resumes from it, on the learner's node, and finishes
    with logs[1].open("wb") as out2:
        second = subprocess.run(cmd, stdout=out2, stderr=subprocess.STDOUT, env=_env(nodes), timeout=600)
    out = logs[1].read_text()
    assert second.returncode == 0, out[-4000:]
    assert "resumed at step 3 (data position" in out and "the learner resumed from checkpoint 2" in out, out[-3000:]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert (learner_dir / "weights" / "step-000004").is_dir()
    assert not MailboxPaths(run_dir).mailbox.exists() or not any(MailboxPaths(run_dir).mailbox.glob("step-*"))


def test_a_server_actor_ray_restarts_is_readmitted_only_once_it_serves_the_current_weights(nodes, tiny_model_path):
    run_dir, plugin, stall, calls = (nodes.driver / "run-restart", nodes.driver / "reward_stall.py",
                                     nodes.driver / "stall", nodes.driver / "calls")
    log = nodes.driver / "run-restart.log"
    # while `stall` exists, the reward holds every episode after step 1's four (schedule sync: step 2's come after
    # them): the run stays at version 1 (step 1's weights) for as long as the restarted server takes to come back. The count is in a locked file: rewards run
    # in worker processes.
    plugin.write_text(
        "import fcntl, os, time\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(calls)!r}, 'a+') as fh:\n"
        "        fcntl.flock(fh, fcntl.LOCK_EX)\n"
        "        fh.seek(0)\n"
        "        n = int(fh.read() or 0) + 1\n"
        "        fh.seek(0)\n"
        "        fh.truncate()\n"
        "        fh.write(str(n))\n"
        f"    while n > 4 and os.path.exists({str(stall)!r}):\n"
        "        time.sleep(0.2)\n"
        "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    stall.touch()
    cmd = _cmd(nodes, tiny_model_path, run_dir, plugin, "train.steps=3", "server.num_local=2",
               "sampling.max_new_tokens=6", "learner.checkpoint_every=null", "reward.timeout_s=900",
               "cluster.server_restarts=1", "train.schedule=sync")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(nodes))
    try:
        _wait(proc, log, lambda: len(_lines(run_dir / "metrics.jsonl")) >= 1, "step 1's row")
        with _connected(nodes) as ray:
            name = f"agentloop-{run_dir.name}-server1"
            before = ray.get(ray.get_actor(name).info.remote())
            ray.kill(ray.get_actor(name), no_restart=False)  # Ray restarts it (cluster.server_restarts=1)
            url = before["url"]
            _wait(proc, log, lambda: f"server {url} re-admitted at version 1" in log.read_text(),
                  "the restarted server's re-admission")
            after = ray.get(ray.get_actor(name).info.remote(), timeout=60)
        stall.unlink()
        assert proc.wait(600) == 0, log.read_text()[-4000:]
    finally:
        stall.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    print(out[-3000:])
    # the same URL served by a new process, ejected first, back only at version 1
    assert after["url"] == url and after["pid"] != before["pid"]
    lines = out.splitlines()
    ejected = next(i for i, ln in enumerate(lines) if url in ln and "ejected" in ln)
    readmitted = next(i for i, ln in enumerate(lines) if f"server {url} re-admitted at version 1" in ln)
    assert ejected < readmitted and not any(f"server {url} re-admitted at version 0" in ln for ln in lines)
    # the new process was given step 1's weights again (before its re-admission), then steps 2 and 3; its node
    # already held step 1's copy, so only steps 2 and 3 crossed again
    copies = [Path(json.loads(ln)["to"]).name for ln in _lines(Path(before["dir"]) / "weights.jsonl")]
    assert copies == ["step-000001", "step-000001", "step-000002", "step-000003"], copies
    fetches = [Path(json.loads(ln)["to"]).name for ln in _lines(Path(before["dir"]).parent / "weights" / "weights.jsonl")]
    assert fetches == ["step-000001", "step-000002", "step-000003"], fetches
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0] and rows[-1]["server/readmissions"] >= 1
    assert rows[-1]["server/healthy"] == 2.0


def test_learner_ranks_on_two_nodes_without_a_shared_filesystem_are_refused(nodes, tmp_path):
    """Each rank writes its shard of a checkpoint into cluster.learner_dir: spread over node_a and node_b, whose
    scratch dirs are their own, no checkpoint could be whole. Refused once the placement group is placed, before
    any rank actor starts, and the group's resources are given back."""
    import asyncio

    from agentloop.cluster.ray_learner import RayLearner
    from agentloop.config import load_config
    from agentloop.errors import ConfigError

    cfg = load_config(None, ["cluster.backend=ray", f"cluster.address={nodes.address}", "learner.ranks=2",
                             "cluster.placement=spread", "learner.device=cpu"])
    with _connected(nodes):
        learner = RayLearner(cfg, tmp_path, tmp_path / "model", run="agentloop-spread", gpus=0)

        async def start_and_close() -> None:
            try:
                await learner.start()
            finally:
                await learner.close()

        with pytest.raises(ConfigError, match="ranks were placed on 2 nodes and cluster.shared_fs is false"):
            asyncio.run(start_and_close())
        assert not learner.ranks
        from ray.util.placement_group import placement_group_table

        assert all(g["state"] == "REMOVED" for g in placement_group_table().values()
                   if g["name"] == "agentloop-spread-learner")
