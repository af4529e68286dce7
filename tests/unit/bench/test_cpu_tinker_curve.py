"""benchmarks/cpu_tinker_curve.py's matching, checked without running either arm: the `agentloop train` arm's data
file holds the cookbook's own problems with the prompt tokens its renderer makes, and its reward plugin gives what
the cookbook's ArithmeticEnv gives (and its flat -0.1 for an answer cut at max_tokens)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("cpu_tinker_curve", ROOT / "benchmarks" / "cpu_tinker_curve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plugin(mod, model: Path, tmp_path: Path):
    path = tmp_path / "cookbook_reward.py"
    path.write_text(mod.REWARD_PLUGIN.format(model=str(model), stop=mod.STOP))
    spec = importlib.util.spec_from_file_location("cookbook_reward_under_test", path)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    return plugin


def test_the_data_file_holds_the_cookbooks_batches_rendered_token_for_token(tiny_model_path, tmp_path):
    pytest.importorskip("tinker_cookbook")
    import asyncio

    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset
    from transformers import AutoTokenizer

    mod = _script()
    path = tmp_path / "rows.jsonl"
    mod.data_file(tiny_model_path, 3, 4, path)
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    renderer = renderers.get_renderer("role_colon", tokenizer=tok)
    ds = ArithmeticDataset(batch_size=4, renderer=renderer, group_size=1, n_batches=3)
    builders = [b for i in range(3) for b in ds.get_batch(i)]
    assert [(r["extra_info"]["x"], r["extra_info"]["y"]) for r in rows] == [
        tuple(int(v) for v in b.env_thunk.args) for b in builders]
    for r, b in zip(rows, builders):
        x, y = b.env_thunk.args
        ob, stop = asyncio.run(b.env_thunk().initial_observation())  # the cookbook's own env, as its loop makes it
        text = r["prompt"][0]["content"]
        assert tok.encode(text, add_special_tokens=False) == ob.to_ints()  # the cookbook's prompt tokens
        assert stop == [mod.STOP] and r["reward_model"]["ground_truth"] == str(x + y)


def test_the_reward_plugin_is_the_cookbooks_env(tiny_model_path, tmp_path):
    pytest.importorskip("tinker_cookbook")
    import asyncio

    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from transformers import AutoTokenizer

    plugin = _plugin(_script(), tiny_model_path, tmp_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    renderer = renderers.get_renderer("role_colon", tokenizer=tok)
    eos = tok.eos_token
    for text in (" 95\n\nUser:", " 94\n\nUser:", f" 95{eos}", f" 7{eos}", "95\n\nUser:"):
        env = ArithmeticEnv(40, 55, renderer=renderer, convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
        want = asyncio.run(env.step(tok.encode(text, add_special_tokens=False))).reward
        got = plugin.compute_score("cookbook_arithmetic", text, "95", {"x": 40, "y": 55})
        assert got["score"] == pytest.approx(want), text
    cut = plugin.compute_score("cookbook_arithmetic", " 95 95 95 9", "95", {"x": 40, "y": 55})
    assert cut["score"] == -0.1 and cut["cut"] == 1.0  # the cookbook's context_overflow_reward, nothing graded


def test_the_verdict_reads_the_spread():
    mod = _script()
    ours = [[0.0, 0.02, 0.04], [0.0, 0.04, 0.06], [0.0, 0.03, 0.05]]
    assert mod.verdict([[0.0, 0.03, 0.05], [0.0, 0.03, 0.05]], ours, 2)["within"]
    assert not mod.verdict([[0.0, 0.2, 0.3], [0.0, 0.21, 0.3]], ours, 2)["within"]


def test_matched_needs_both_the_reward_and_the_stop_share_within():
    mod = _script()
    reward = {"cookbook": [[0.0, 0.03, 0.05]] * 2, "agentloop": [[0.0, 0.02, 0.04], [0.0, 0.04, 0.06]]}
    close = {"cookbook": [[0.5, 0.9, 1.0]] * 2, "agentloop": [[0.5, 0.9, 0.98], [0.5, 0.95, 1.0]]}
    # the first comparison run: the train preset's KL to the reference kept the stop share at ~0.75
    apart = {"cookbook": [[0.5, 0.9, 1.0]] * 2, "agentloop": [[0.5, 0.8, 0.72], [0.5, 0.85, 0.76]]}
    arms = {arm: {"reward": reward[arm], "format": close[arm]} for arm in reward}
    assert mod.judge(arms, 2)["matched"]
    arms = {arm: {"reward": reward[arm], "format": apart[arm]} for arm in reward}
    got = mod.judge(arms, 2)
    assert got["reward"]["within"] and not got["format"]["within"] and not got["matched"]
