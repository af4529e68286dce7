"""The learner over two hosts without Ray, the user's path as the README gives it ("Beyond one machine", torchrun
across hosts), with one host standing in for two and the run dir as the shared filesystem: `agentloop train
learner.nnodes=2 learner.rdzv_endpoint=HOST:PORT` on the first "node", `agentloop learner-node --run-dir RUN_DIR`
on the second, against the session's real SGLang CPU server. Two training steps end to end, both commands exit 0,
and the learner trained them as one torch.distributed group of two ranks (one per "node").
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentloop.inference.launcher import pick_free_port
from agentloop.records import read_records
from agentloop.train.handle.mailbox import MailboxPaths
from tests.integration.test_train_real import _load

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _tail(p: Path, n: int = 4000) -> str:
    return p.read_text(errors="replace")[-n:] if p.is_file() else f"({p} missing)"


@pytest.mark.timeout(900)
def test_two_learner_nodes_through_the_cli_train_two_steps(sglang_server, tiny_model_path, tmp_path):
    run_dir, plugin = tmp_path / "run", tmp_path / "reward.py"
    plugin.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) > 0 and ord(solution_str[0]) % 2 == 0)\n")
    train_cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", sglang_server.url,
                 "--model", str(tiny_model_path), "--loop", "single_turn_agent_loop", "--run-dir", str(run_dir),
                 "train.steps=2", "train.prompts_per_step=2", "rollout.n_samples=2", "train.val_every=0",
                 "sampling.max_new_tokens=6", "learner.lr=0.001", "train.tensorboard=false",
                 "reward.custom=" + json.dumps(f"{plugin}:compute_score"),
                 "learner.nnodes=2", f"learner.rdzv_endpoint=127.0.0.1:{pick_free_port()}"]
    node_cmd = [sys.executable, "-m", "agentloop.cli", "learner-node", "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train_log, node_log = tmp_path / "train.log", tmp_path / "node2.log"
    procs: list[subprocess.Popen] = []
    try:
        with train_log.open("wb") as out:
            procs.append(subprocess.Popen(train_cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        # the first node writes what the others run into the (shared) run dir once it starts its ranks
        deadline = time.monotonic() + 300
        while not (run_dir / "learner_node.json").is_file():
            assert procs[0].poll() is None, f"agentloop train ended before starting its learner:\n{_tail(train_log)}"
            assert time.monotonic() < deadline, f"no learner_node.json after 300 s:\n{_tail(train_log)}"
            time.sleep(0.2)
        with node_log.open("wb") as out:
            procs.append(subprocess.Popen(node_cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        assert procs[0].wait(600) == 0, f"{_tail(train_log)}\n--- learner.log ---\n{_tail(run_dir / 'learner.log')}"
        assert procs[1].wait(120) == 0, _tail(node_log)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        asyncio.run(_load(sglang_server.url, str(tiny_model_path)))  # the shared server's own weights back
    out = train_log.read_text()
    print(out[-2000:])
    print(node_log.read_text()[-1000:])
    assert f"run `agentloop learner-node --run-dir {run_dir}` on each of the other 1" in out
    assert "--nnodes=2" in node_log.read_text()
    # one group of two ranks trained both steps, and the run finished as on one host
    assert json.loads(MailboxPaths(run_dir).learner_info.read_text())["world_size"] == 2
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0]
    assert all(r["learner/actor/optimizer_steps"] >= 1 for r in rows)
    for step in (1, 2):
        recs = list(read_records(run_dir / "rollouts" / f"step-{step:06d}.jsonl"))
        assert len(recs) == 4 and all(r.error is None for r in recs)
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["learner_exit"] == 0 and summary["last_weights"] == str(run_dir / "weights" / "step-000002")
