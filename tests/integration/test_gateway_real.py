"""openai_agent_loop and the gateway against the real CPU SGLang server serving the warm-started calculator model
(loaded into the shared server for this module, the original weights restored after): agents on the real
OpenAI SDK (AsyncOpenAI and, in a command, OpenAI), the Anthropic route with a plain HTTP client, streaming.

Exactness is checked three ways: the records equal tool_agent_loop's token for token on the same episodes
(same seeds; the SDK agent does what the tool loop does), every model token's recorded logprob is what the
server gives that token when it re-reads the whole record (prompt_ids + response_ids, input logprobs), as
close as for the tool loop's own records, and decode(record) is the chat template of the conversation the
model saw. Then: two exact segments from a compacting agent, a command-mode harness, a weight update in
the middle of a gateway request, the README's example through the CLI, and one training step.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import aiohttp
import pytest

from agentloop.config import ManagerConfig, load_config
from agentloop.data import load_samples
from agentloop.loops import get_agent_loop
from agentloop.models.loading import load_tokenizer_for
from agentloop.records import EpisodeRecord, read_records
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager
from agentloop.tools import ToolsConfig, get_tool
from tests.integration.test_async_real import _scaled_copy
from tests.integration.test_train_real import _load

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "tests" / "integration" / "gateway_agents.py"
EXAMPLE = ROOT / "examples" / "calculator_agent.py"
TOL = 1e-3
"""Max |recorded - re-scored| logprob of a model token (the tool loop's own records: ~4e-6 on the 2-core box)."""


@pytest.fixture(scope="module")
def warm(sglang_server):
    from agentloop.models.warmstart import ensure_warm_model

    path = ensure_warm_model()
    asyncio.run(_load(sglang_server.url, str(path)))
    yield sglang_server.url, path
    asyncio.run(_load(sglang_server.url, str(sglang_server.model_path)))


def _cfg(url: str, model: Path, loop: str, entry: str | None = None, *extra: str):
    return load_config(None, [
        f"server.urls=[\"{url}\"]", f"model.path=\"{model}\"", f"rollout.loop={loop}", "data.builtin=calculator",
        "sampling.max_new_tokens=48", "tools.max_turns=3", "tools.max_response_tokens=4096",
        "rollout.progress_interval_s=100", *([f"agent.entry=\"{entry}\""] if entry else []), *extra])


def _rollout(url: str, model: Path, runs: dict[str, tuple[str, str | None]], prompts: int = 6, n: int = 2,
             *extra: str) -> dict[str, list[EpisodeRecord]]:
    """{name: (loop, entry)} -> {name: records}, all on one ServerManager, same samples and seeds."""
    async def main():
        out = {}
        async with ServerManager([url], ManagerConfig(health_interval_s=60)) as sm:
            for name, (loop, entry) in runs.items():
                cfg = _cfg(url, model, loop, entry, *extra)
                tok = load_tokenizer_for(cfg, model)
                engine = RolloutEngine(cfg, sm, tok, get_agent_loop(loop), progress=False)
                out[name] = (await engine.run(load_samples(cfg.data)[:prompts], n_samples=n)).records
        return out

    return asyncio.run(asyncio.wait_for(main(), 600))


async def _rescore(url: str, records: list[EpisodeRecord]) -> float:
    """Max over model tokens of |recorded logprob - the server's logprob re-reading prompt_ids + response_ids|."""
    worst = 0.0
    async with aiohttp.ClientSession() as http:
        for r in records:
            payload = {"input_ids": r.prompt_ids + r.response_ids, "return_logprob": True, "logprob_start_len": 0,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
            async with http.post(f"{url}/generate", json=payload, timeout=aiohttp.ClientTimeout(total=120)) as resp:
                body = await resp.json()
            lps = [e[0] for e in body["meta_info"]["input_token_logprobs"][1:]]  # lps[i]: token i + 1
            p = len(r.prompt_ids)
            worst = max([worst] + [abs(lps[p + k - 1] - lp) for k, (lp, m) in
                                   enumerate(zip(r.response_logprobs, r.response_mask)) if m])
    return worst


def rescore(url: str, records: list[EpisodeRecord]) -> float:
    return asyncio.run(_rescore(url, records))


def key(records: list[EpisodeRecord]) -> dict[tuple[str, int], tuple]:
    return {(r.episode_id, r.segment): (r.prompt_ids, r.response_ids, r.response_mask) for r in records}


def check_tokens(rec: EpisodeRecord, tok) -> None:
    """decode(prompt + response) is the template of the conversation the model saw (its turns as written), up to
    the end of its last turn the template adds; mask-1 tokens have logprobs <= 0, mask-0 tokens 0."""
    assert rec.error is None, rec.error
    schemas = [get_tool("calculator")(ToolsConfig()).schema]
    rendered = tok.apply_chat_template(rec.extra["messages"], tools=schemas, tokenize=False, add_generation_prompt=False)
    own_end = tok.decode(rec.response_ids[-1:]) == "<|im_end|>" and rec.response_mask[-1] == 1
    full = tok.decode(rec.prompt_ids + rec.response_ids, skip_special_tokens=False)
    assert rendered == full + ("\n" if own_end else "<|im_end|>\n")
    for m, lp in zip(rec.response_mask, rec.response_logprobs):
        assert (lp == 0.0) if m == 0 else (lp <= 0.0)
    assert rec.num_turns == len(rec.weight_versions)


def test_sdk_agent_records_equal_the_tool_loops_and_rescore_exactly(warm):
    url, model = warm
    recs = _rollout(url, model, {"tool": ("tool_agent_loop", None), "sdk": ("openai_agent_loop", f"{EXAMPLE}:run")})
    tool, sdk = recs["tool"], recs["sdk"]
    assert len(sdk) == 12 and all(r.error is None for r in tool + sdk)
    assert key(sdk) == key(tool), "the gateway's records differ from the tool loop's"
    assert any(r.num_turns >= 2 for r in sdk), "no episode called the calculator: nothing multi-turn was checked"
    tok = load_tokenizer_for(_cfg(url, model, "tool_agent_loop"), model)
    for r in sdk:
        check_tokens(r, tok)
        assert r.metrics["tool_calls"] == (r.num_turns - 1) and r.reward == next(
            t.reward for t in tool if t.episode_id == r.episode_id)
    d_sdk, d_tool = rescore(url, sdk), rescore(url, tool)
    print(f"max |recorded - re-scored| logprob: gateway {d_sdk:.2e}, tool loop {d_tool:.2e}")
    assert d_sdk < TOL and d_sdk <= max(10 * d_tool, 1e-4)


def test_streaming_the_anthropic_route_and_a_command_give_the_same_records(warm, tmp_path):
    url, model = warm
    harness = tmp_path / "harness.py"
    harness.write_text(
        "import json, sys\nfrom openai import OpenAI\n"
        f"sys.path.insert(0, {str(AGENTS.parent)!r})\nfrom gateway_agents import TOOLS, calculator\n"
        "sample = json.loads(sys.stdin.read())\nclient = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the env\n"
        "messages = list(sample['messages'])\nfor _ in range(3):\n"
        "    message = client.chat.completions.create(model='policy', messages=messages, tools=TOOLS).choices[0].message\n"
        "    messages.append(message.model_dump(exclude_none=True))\n    if not message.tool_calls:\n        break\n"
        "    for call in message.tool_calls:\n"
        "        messages.append({'role': 'tool', 'tool_call_id': call.id, 'content': calculator(call.function.arguments)})\n"
        "import os\nwith os.fdopen(int(os.environ['AGENTLOOP_RESULT_FD']), 'w') as out:  # the result channel\n"
        "    out.write(json.dumps({'reward': 0.5, 'turns': sum(m['role'] == 'assistant' for m in messages)}))\n")
    recs = _rollout(url, model, {"sdk": ("openai_agent_loop", f"{EXAMPLE}:run"),
                                 "stream": ("openai_agent_loop", f"{AGENTS}:streaming_agent"),
                                 "anthropic": ("openai_agent_loop", f"{AGENTS}:anthropic_agent")}, 4)
    cmd = _rollout(url, model, {"command": ("openai_agent_loop", None)}, 4, 2,
                   f"agent.command=\"{sys.executable} {harness}\"")["command"]
    for name, other in (("stream", recs["stream"]), ("anthropic", recs["anthropic"]), ("command", cmd)):
        assert all(r.error is None for r in other), (name, [r.error for r in other])
        assert key(other) == key(recs["sdk"]), f"{name} records differ from the SDK agent's"
    assert all(r.reward == 0.5 and r.extra["agent_result"]["turns"] == r.num_turns for r in cmd)
    assert rescore(url, recs["anthropic"] + cmd) < TOL


def test_a_compacting_agent_gives_two_exact_segments(warm):
    url, model = warm
    recs = _rollout(url, model, {"c": ("openai_agent_loop", f"{AGENTS}:compaction_agent")})["c"]
    two = [r for r in recs if r.metrics.get("segments") == 2 or r.segment == 1]
    assert two, "no episode called the calculator, so none compacted"
    tok = load_tokenizer_for(_cfg(url, model, "tool_agent_loop"), model)
    for r in (r for r in recs if r.segment == 1):
        first = next(f for f in recs if f.episode_id == r.episode_id and f.segment == 0)
        assert first.reward == r.reward == 1.0 and (first.uid, first.repeat) == (r.uid, r.repeat)
        check_tokens(first, tok)
        assert first.num_turns == r.num_turns == 1
        # the second segment's prompt is the template of the compacted history, its answer the model's
        assert "The calculator says:" in tok.decode(r.prompt_ids) and r.response_mask == [1] * len(r.response_ids)
    assert rescore(url, recs) < TOL


def test_a_weight_update_in_the_middle_of_a_gateway_request(warm, tmp_path):
    url, model = warm
    v1 = _scaled_copy(model, tmp_path / "v1", 1.02)
    cfg = _cfg(url, model, "openai_agent_loop", f"{AGENTS}:long_agent", "sampling.ignore_eos=true",
               "sampling.max_new_tokens=600")
    tok = load_tokenizer_for(cfg, model)

    async def main():
        async with ServerManager([url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
            called, cut = asyncio.Event(), asyncio.Queue()
            once = sm.data._generate_once

            async def spy(episode_id, *a, **kw):
                if episode_id == "probe":
                    return await once(episode_id, *a, **kw)
                called.set()
                out = await once(episode_id, *a, **kw)
                cut.put_nowait(len(out.token_ids))
                return out

            sm.data._generate_once = spy
            engine = RolloutEngine(cfg, sm, tok, get_agent_loop("openai_agent_loop"), progress=False)
            task = asyncio.create_task(engine.run(load_samples(cfg.data)[:1], n_samples=1))
            # Cut the request only once the server has sampled some of it: a probe sent after it is answered
            # only after a few decode steps of the running batch. Should the pause still land before its first
            # token (nothing of version 0 to keep), let it run again and cut it again.
            for _ in range(5):
                await called.wait()
                called.clear()
                await sm.generate("probe", prompt_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8})
                await sm.pause("abort")
                if await cut.get() > 0:
                    break
                await sm.resume()
            await sm.update_weights_from_disk(str(v1), weight_version=1)
            await sm.resume()
            sm.expect_version(1)
            return (await task).records

    try:
        [rec] = asyncio.run(asyncio.wait_for(main(), 600))
        assert rec.error is None and rec.reward == 600.0 and rec.num_model_tokens == 600  # one answer to the SDK
        vs = rec.token_versions
        assert vs == sorted(vs) and vs[0] == 0 and vs[-1] == 1, "the tokens must carry both versions"
        # the server now serves v1: the tokens v1 sampled re-score exactly
        assert rescore(url, [rec.model_copy(update={"response_mask": [int(v == 1) for v in vs]})]) < TOL
    finally:
        asyncio.run(_load(url, str(model)))


def test_the_readme_example_runs_as_written(warm, tmp_path):
    """The README's "Bring your own agent" code block, saved as a file, through `agentloop rollout` (the CLI)."""
    from agentloop.cli import main

    url, _ = warm
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Bring your own agent"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 10 <= len(code.strip().splitlines()) <= 25
    assert code in EXAMPLE.read_text(), "examples/calculator_agent.py is no longer the README's example"
    agent = tmp_path / "my_agent.py"
    agent.write_text(code)
    run_dir = tmp_path / "run"
    rc = main(["rollout", "--server-url", url, "--loop", "openai_agent_loop", f"agent.entry={agent}:run",
               "data.max_samples=4", "-n", "2", "--quiet", "--run-dir", str(run_dir)])
    recs = list(read_records(run_dir / "records.jsonl"))
    assert rc == 0 and len(recs) == 8 and all(r.error is None and r.reward is not None for r in recs)
    assert any(r.num_turns >= 2 for r in recs)


def test_one_training_step_on_segmented_episodes(warm, tmp_path):
    """`agentloop train` with openai_agent_loop: the compacting agent's two-segment episodes are trained."""
    from agentloop.train.orchestrator.loop import run_train

    url, model = warm
    try:
        run_dir, final = run_train(load_config(None, [
            f"server.urls=[\"{url}\"]", f"model.path=\"{model}\"", f"run_dir=\"{tmp_path / 'run'}\"",
            "rollout.loop=openai_agent_loop", f"agent.entry=\"{AGENTS}:compaction_agent\"",
            "data.builtin=calculator_train", "train.steps=1", "train.prompts_per_step=4", "rollout.n_samples=2",
            "train.val_every=0", "sampling.max_new_tokens=48", "train.tensorboard=false", "learner.lr=1e-4"]))
    finally:
        asyncio.run(_load(url, str(model)))
    recs = list(read_records(run_dir / "rollouts" / "step-000001.jsonl"))
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["train/episodes"] == 8 and len(recs) >= 8 and all(r.error is None for r in recs)
    assert row["learner/batch/records"] == len(recs)


FORGER = '''
import json, os, sys, urllib.request
sample = json.loads(sys.stdin.read())
open(os.path.join(os.environ["SEEN"], sample["episode_id"]), "w").write(json.dumps(sample))
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "m", "messages": sample["messages"], "max_tokens": 1}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=120).read()
print(json.dumps({"reward": 1.0}))  # what a harness printing the model's text would print last
'''


def test_through_the_cli_a_command_cannot_print_its_reward_nor_read_the_answer(warm, tmp_path):
    """The issue's run: a command agent asking the policy for one token, then printing {"reward": 1.0}."""
    from agentloop.cli import main

    url, _ = warm
    harness, seen = tmp_path / "forger.py", tmp_path / "seen"
    harness.write_text(FORGER)
    seen.mkdir()
    run_dir = tmp_path / "run"
    rc = main(["rollout", "--server-url", url, "--loop", "openai_agent_loop",
               f"agent.command=\"{sys.executable} {harness}\"", f"agent.env.SEEN={seen}", "data.max_samples=2", "-n",
               "2", "--quiet", "--run-dir", str(run_dir)])
    recs = list(read_records(run_dir / "records.jsonl"))
    assert rc == 0 and len(recs) == 4 and all(r.error is None for r in recs)
    assert all(r.reward != 1.0 for r in recs), [r.reward for r in recs]  # one token answers nothing
    stdins = [json.loads(p.read_text()) for p in seen.iterdir()]
    assert len(stdins) == 4 and not any("ground_truth" in s or "extra_info" in s for s in stdins)


def test_agentloop_rollout_fails_when_too_many_episodes_are_error_records(warm, tmp_path, capsys):
    from agentloop.cli import main

    url, _ = warm
    argv = ["rollout", "--server-url", url, "--loop", "openai_agent_loop", "agent.command=\"exit 3\"",
            "data.max_samples=2", "-n", "2", "--quiet"]
    assert main([*argv, "--run-dir", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "4 of 4 episodes are error records, above rollout.max_error_rate=0.5: AgentError x4" in err
    assert main([*argv, "--run-dir", str(tmp_path / "b"), "rollout.max_error_rate=1.0"]) == 0
