"""`agentloop train --server-url` against the real SGLang CPU server (it serves the tiny model): without --model it
stops before anything starts; with another model it is refused naming both (the warm-started tiny model: the
same architecture and sizes, other weights; a copy of the tiny model with one more layer: other sizes); with
the right model on a server an earlier run left at another weight version, model.path is reloaded at version 0
and step 1 samples version 0."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from agentloop.records import read_records
from tests.integration.test_train_real import _load

pytestmark = pytest.mark.sglang

TINY_RUN = ["--loop", "single_turn_agent_loop", "train.steps=1", "train.prompts_per_step=2", "rollout.n_samples=2",
            "train.val_every=0", "sampling.max_new_tokens=6", "train.tensorboard=false",
            "tools.python.allow_unisolated=true"]


def _train(args: list[str], tmp_path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "agentloop.cli", "train", "--quiet", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=tmp_path)


async def _set_version(url: str, path: str, version: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/update_weights_from_disk", json={"model_path": path, "weight_version": version},
                          timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert (await r.json())["success"]


def test_train_with_a_server_url_needs_model_and_refuses_another_one(sglang_server, tiny_model_path, tmp_path):
    from agentloop.models.warmstart import ensure_warm_model

    url, run_dir = sglang_server.url, tmp_path / "run"
    asyncio.run(_load(url, str(tiny_model_path)))  # the tiny model as launched, whatever ran before
    p = _train(["--server-url", url, "--run-dir", str(run_dir), *TINY_RUN], tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "server.urls (--server-url) is set but model.path (--model) is not" in p.stderr
    assert not run_dir.exists()  # refused before the run dir, the learner or any request

    warm = ensure_warm_model()  # the tiny model's architecture and sizes, trained weights
    p = _train(["--server-url", url, "--model", str(warm), "--run-dir", str(run_dir), *TINY_RUN], tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"{url} serves {tiny_model_path} (weight_version 'orig')" in p.stderr, p.stderr[-2000:]
    assert f"the same architecture and sizes as model.path {warm}, but other weights" in p.stderr
    assert not (run_dir / "rollouts" / "step-000001.jsonl").exists()

    deeper = tmp_path / "tiny-one-more-layer"
    shutil.copytree(tiny_model_path, deeper)
    conf = json.loads((deeper / "config.json").read_text())
    conf["num_hidden_layers"] += 1
    if isinstance(conf.get("layer_types"), list):
        conf["layer_types"] = conf["layer_types"] + conf["layer_types"][-1:]
    (deeper / "config.json").write_text(json.dumps(conf))
    p = _train(["--server-url", url, "--model", str(deeper), "--run-dir", str(tmp_path / "run2"), *TINY_RUN],
               tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    layers = conf["num_hidden_layers"]
    assert f"a different model from model.path {deeper} (server vs model.path: num_hidden_layers {layers - 1} " \
           f"vs {layers}" in p.stderr, p.stderr[-2000:]


@pytest.mark.timeout(900)
def test_a_server_left_at_another_version_is_reloaded_before_step_1(sglang_server, tiny_model_path, tmp_path):
    url, run_dir = sglang_server.url, tmp_path / "run"
    asyncio.run(_set_version(url, str(tiny_model_path), "7"))  # as an earlier run would leave it
    try:
        p = _train(["--server-url", url, "--model", str(tiny_model_path), "--run-dir", str(run_dir), *TINY_RUN],
                   tmp_path)
    finally:
        asyncio.run(_load(url, str(tiny_model_path)))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"server {url} serves {tiny_model_path} at weight version '7'; a fresh run starts at version 0: " \
           f"reloading {tiny_model_path}" in p.stderr
    recs = list(read_records(run_dir / "rollouts" / "step-000001.jsonl"))
    assert len(recs) == 4 and all(r.error is None for r in recs)
    assert {v for r in recs for v in r.weight_versions} == {"0"}
    assert {v for r in recs for v in r.token_versions if v is not None} == {0}


@pytest.mark.timeout(900)
def test_a_server_on_another_host_with_other_weights_is_refused_by_its_logprobs(sglang_server, tiny_model_path,
                                                                               tmp_path):
    """What /model_info cannot tell: the server serves weights from a path this host cannot read (as on another
    host), of the same model type and architecture, but other weights. Its log-probs of the learner's probe differ:
    the run refuses before step 1, naming the server; the right weights pass (the test above)."""
    from agentloop.models.warmstart import ensure_warm_model

    url, run_dir = sglang_server.url, tmp_path / "run"
    elsewhere = tmp_path / "on-another-host"
    shutil.copytree(ensure_warm_model(), elsewhere)
    asyncio.run(_load(url, str(elsewhere)))
    shutil.rmtree(elsewhere)  # its model_path cannot be read here: only its type and architecture can be checked
    try:
        p = _train(["--server-url", url, "--model", str(tiny_model_path), "--run-dir", str(run_dir), *TINY_RUN],
                   tmp_path)
    finally:
        asyncio.run(_load(url, str(tiny_model_path)))
    assert p.returncode == 2, p.stderr[-3000:]
    assert "do not serve the model the learner trains" in p.stderr and f"{url}: mean |server - learner| log-prob" \
        in p.stderr, p.stderr[-3000:]
    assert not (run_dir / "rollouts" / "step-000001.jsonl").exists()
