"""`agentloop tinker serve` driven by code nobody here wrote: the tinker SDK's own client calls
(tinker_sdk_driver.py, run as a child process like a user's script), against the service on a real CPU SGLang
server with the tiny model; and the service's auth, in process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_sglang

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".tinker-site"
"""Where a worktree without the tinker extra in its venv keeps the SDK (pip install --target); put on PYTHONPATH."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(SITE)] if SITE.is_dir() else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["TINKER_API_KEY"] = "tml-local"
    env["TINKER_TELEMETRY"] = "0"
    return env


def _require_tinker() -> None:
    probe = subprocess.run([sys.executable, "-c", "import tinker, tinker_cookbook"], env=_env(), capture_output=True)
    if probe.returncode != 0:
        pytest.skip("the tinker SDK / tinker-cookbook are not installed (pip install 'agentloop[tinker]'; "
                    "scripts/setup.sh does)")


@pytest.fixture(scope="module")
def tinker_service(tmp_path_factory):
    require_sglang()
    _require_tinker()
    run = tmp_path_factory.mktemp("tinker")
    err = open(run / "serve.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "agentloop.cli", "tinker", "serve", "--port", "0",
                             "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=err, env=_env(), text=True)
    try:
        line = proc.stdout.readline()  # the service prints its URL once it and its SGLang server are up
        if "serving" not in line:
            proc.wait(timeout=30)
            pytest.fail(f"agentloop tinker serve did not come up: {line!r}\n{(run / 'serve.err').read_text()[-3000:]}")
        yield line.split(" on ", 1)[1].split()[0], run
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # an unclosed pipe is a ResourceWarning, an error under filterwarnings=error
        err.close()


def _run(script: list[str], timeout: int = 240) -> str:
    p = subprocess.run([sys.executable, *script], env=_env(), capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


@pytest.mark.sglang
def test_the_sdks_own_calls_end_to_end(tinker_service):
    url, run = tinker_service
    out = _run([str(ROOT / "tests/integration/tinker_sdk_driver.py"), url])
    r = json.loads(out.split("RESULT ", 1)[1])
    ce = r["ce_losses"]
    assert ce[-1] < ce[0] * 0.9, ce  # loss goes down on the fixed batch
    assert r["sampler_path"].startswith("tinker://") and "/sampler_weights/s1" in r["sampler_path"]
    assert all(n > 0 for n in r["sample_lens"])
    assert r["sample_logprob_diff"] < 1e-3, r  # the server's sampled logprobs = the learner's forward
    assert r["prompt_logprob_diff"] < 1e-3 and r["prompt_logprobs_first"] is None, r
    assert r["is_server"] == pytest.approx(r["is_hand"], rel=1e-4, abs=1e-4)
    assert r["ppo_server"] == pytest.approx(r["ppo_hand"], rel=1e-4, abs=1e-4)
    assert r["custom_loss"] == pytest.approx(r["custom_hand"], rel=1e-4, abs=1e-4) and r["custom_metric"] == 1.0
    assert r["state_moved"] > 1e-3 and r["state_back"] < 1e-5 and r["state_fresh"] < 1e-5, r
    assert r["unsupported"] and "cispo" in r["unsupported"] and "not supported" in r["unsupported"]
    assert list((run / "checkpoints").rglob("adapter_config.json"))  # a PEFT adapter SGLang loaded by name
    # the full-weights extension: every weight trains, its sampler serves the trained model's logprobs, and the
    # LoRA sampler afterwards samples as before (the base weights switched back under it)
    fl = r["full_ce_losses"]
    assert fl[-1] < fl[0], fl
    assert r["full_sample_logprob_diff"] < 1e-3, r
    assert r["lora_again_same_as_before"], r


def _metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _cookbook(*args: str) -> list[str]:
    return [str(ROOT / "tests/integration/tinker_cookbook_driver.py"), *args]


@pytest.mark.sglang
def test_the_cookbooks_sft_loop_runs_unchanged(tinker_service, tiny_model_path, tmp_path):
    """tinker_cookbook.supervised.train.main (sl_basic's loop) on 4 conversations, 4 epochs of one batch: its
    NLL falls, its held-out NLL is evaluated and falls, its checkpoints are the service's."""
    url, run = tinker_service
    log = tmp_path / "sft"
    _run(_cookbook("sft", url, str(tiny_model_path), str(log), str(tmp_path / "conversations.jsonl")))
    m = _metrics(log)
    nll = [r["train_mean_nll"] for r in m if "train_mean_nll" in r]
    assert len(nll) == 4 and nll[-1] < nll[0] * 0.95 and nll == sorted(nll, reverse=True), nll
    test_nll = [r["test/nll"] for r in m if "test/nll" in r]
    assert len(test_nll) == 2 and test_nll[-1] < test_nll[0], test_nll
    saved = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
    assert [c["name"] for c in saved] == ["000002", "final"], saved
    for c in saved:  # tinker:// paths of this service, their files in its run dir
        for key, kind in (("state_path", "weights"), ("sampler_path", "sampler_weights")):
            model_id, name = c[key].removeprefix("tinker://").split(f"/{kind}/")
            assert (run / "checkpoints" / model_id.replace(":", "_") / kind / name).is_dir(), c[key]


@pytest.mark.sglang
def test_the_cookbooks_math_rl_recipe_runs_unchanged(tinker_service, tiny_model_path, tmp_path):
    """The math_rl recipe's own CLI (rl/train.py's loop) on its arithmetic env, 3 steps of 2 groups x 4 samples:
    each step samples through our SamplingClient from that step's saved sampler weights, trains with
    importance_sampling, and the cookbook's own sampler-vs-trainer check (kl_sample_train_v1, what its
    rl_numerics_check recipe watches) is ~0: the tokens and logprobs the server sampled are the learner's."""
    url, _ = tinker_service
    log = tmp_path / "rl"
    _run(["-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={tiny_model_path}", "renderer_name=role_colon",
          "env=arithmetic", "group_size=4", "groups_per_batch=2", "max_tokens=8", "lora_rank=8", "learning_rate=1e-3",
          "max_steps=3", "eval_every=0", "save_every=0", "loss_fn=importance_sampling", f"base_url={url}",
          f"log_path={log}", "behavior_if_log_dir_exists=delete"])
    m = [r for r in _metrics(log) if "env/all/reward/total" in r]
    assert [r["step"] for r in m] == [1.0, 2.0, 3.0], m
    for r in m:
        assert r["env/all/ac_tokens_per_turn"] > 0 and -0.1 - 1e-6 <= r["env/all/reward/total"] <= 1.0
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-3 and r["optim/kl_sample_train_v2"] < 1e-3, r
    assert sorted(p.name for p in log.glob("iteration_*")) == [f"iteration_{i:06d}" for i in range(3)]


@pytest.mark.sglang
def test_the_cookbooks_rollout_semantics_with_our_sampler(tinker_service, tiny_model_path):
    """The cookbook's rollout-semantics regression case 1 with our sampler instead of a scripted one: a sample
    cut at max_tokens comes back with stop_reason `length`, which ends the episode with the overflow reward
    before the env's step (no grading)."""
    url, _ = tinker_service
    r = json.loads(_run(_cookbook("rollout", url, str(tiny_model_path))).split("RESULT ", 1)[1])
    assert r == {"transitions": 1, "reward": -0.1, "done": True, "max_tokens_reached": 1.0, "ac_len": 3,
                 "logprobs": 3, "graded": 0}


def test_auth_refuses_a_request_without_the_key_on_a_non_local_bind(tiny_model_path):
    pytest.importorskip("tinker")
    import asyncio

    import aiohttp
    from aiohttp import web

    from agentloop.errors import ConfigError
    from agentloop.tinker.config import TinkerServiceConfig
    from agentloop.tinker.server import TinkerService, serve

    with pytest.raises(ConfigError, match="AGENTLOOP_TINKER_KEY"):
        asyncio.run(serve(TinkerServiceConfig(host="0.0.0.0")))

    async def go() -> tuple[int, int, dict]:
        svc = TinkerService(TinkerServiceConfig(host="0.0.0.0"), sampler=None, model_path=tiny_model_path,
                            key="tml-secret")
        runner = web.AppRunner(svc.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                url = f"http://127.0.0.1:{port}/api/v1/get_server_capabilities"
                async with s.get(url) as r:
                    refused, body = r.status, await r.json()
                async with s.get(url, headers={"X-API-Key": "tml-secret"}) as r:
                    ok = r.status
        finally:
            await svc.close()
            await runner.cleanup()
        return refused, ok, body

    refused, ok, body = asyncio.run(go())
    assert refused == 401 and ok == 200
    assert body["category"] == "user" and "unauthorized" in body["error"]
