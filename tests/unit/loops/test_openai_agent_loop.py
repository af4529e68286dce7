"""openai_agent_loop through the engine, the real gateway and a real ServerManager over the scripted fake server:
rewards, segments as records, error records for agents that crash, hang, answer badly or never call; command
mode with its process group; a weight update in the middle of a gateway request."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest

from agentloop.config import ManagerConfig, load_config
from agentloop.errors import AgentError, failure_kind
from agentloop.loops import chat_session
from agentloop.loops.openai_agent import OpenAIAgentLoop, agent_reward
from agentloop.records import EpisodeRecord, Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.rollout.summary import summarize
from agentloop.server_manager import ServerManager
from agentloop.tools.parsers import ParseResult
from agentloop.tools.parsers import ToolCall as ParsedCall
from tests.fakes.fake_sglang import FakeSGLang
from tests.unit.loops.test_tool_loop import get_tokenizer

HERE = "tests.unit.loops.test_openai_agent_loop"
SYSTEM = {"role": "system", "content": "Be brief."}


async def chat(base_url: str, api_key: str, messages: list, **extra) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/chat/completions", json={"model": "m", "messages": messages, **extra},
                             headers={"Authorization": f"Bearer {api_key}"}) as r:
            body = await r.json()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {body['error']['message']}")
            return body


# ---------------------------------------------------------------- agents (agent.entry=tests.unit...:NAME)

async def two_turns(sample, base_url, api_key):
    messages = list(sample.messages)
    first = await chat(base_url, api_key, messages)
    messages += [first["choices"][0]["message"], {"role": "user", "content": "go on"}]
    await chat(base_url, api_key, messages)
    return 0.5


async def compacting(sample, base_url, api_key):
    await chat(base_url, api_key, list(sample.messages))
    await chat(base_url, api_key, [SYSTEM, {"role": "user", "content": "summary of the work so far"}])
    return {"reward": 1.0, "note": "compacted"}


async def unrewarded(sample, base_url, api_key):
    await chat(base_url, api_key, list(sample.messages))


async def raises(sample, base_url, api_key):
    await chat(base_url, api_key, list(sample.messages))
    raise ValueError("harness bug")


async def hangs(sample, base_url, api_key):
    await chat(base_url, api_key, list(sample.messages))
    await asyncio.Event().wait()


async def silent(sample, base_url, api_key):
    return 1.0


async def malformed(sample, base_url, api_key):
    await chat(base_url, api_key, [])


async def long_call(sample, base_url, api_key):
    return (await chat(base_url, api_key, list(sample.messages), max_tokens=40))["usage"]["completion_tokens"]


def score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.25, "seen": solution_str}


# ---------------------------------------------------------------- running them

def samples(n: int = 2) -> list[Sample]:
    return [Sample(index=i, uid=10 + i, data_source="t", messages=[SYSTEM, {"role": "user", "content": f"q{i}"}],
                   ground_truth=f"answer-{i}", extra_info={"answer": f"answer-{i}"},
                   tools_kwargs={"calc": {"create_kwargs": {"ground_truth": f"answer-{i}"}}})
            for i in range(n)]


def run_engine(entry: str | None = None, *extra: str, n: int = 2, command: str | None = None, fake_kw=None,
               during=None, prompts: int = 2) -> tuple[list[EpisodeRecord], FakeSGLang]:
    async def main():
        fake = await FakeSGLang(vocab=500, **(fake_kw or {})).start()
        try:
            agent = [f"agent.entry={entry}"] if entry else [f"agent.command={json.dumps(command)}"]
            cfg = load_config(None, [f"server.urls=[\"{fake.url}\"]", "rollout.loop=openai_agent_loop",
                                     "sampling.max_new_tokens=6", *agent, *extra])
            async with ServerManager([fake.url], ManagerConfig(health_interval_s=60), initial_version=0) as sm:
                engine = RolloutEngine(cfg, sm, get_tokenizer("modelzoo"), OpenAIAgentLoop, progress=False)
                task = asyncio.create_task(engine.run(samples(prompts), n_samples=n))
                if during is not None:
                    await during(sm, fake)
                return (await task).records, fake
        finally:
            await fake.stop()

    return asyncio.run(asyncio.wait_for(main(), 120))


def by_error(records):
    return sorted((r.error or "").split(":")[0] for r in records)


def test_reward_turns_and_tokens_of_an_in_process_agent():
    recs, fake = run_engine(f"{HERE}:two_turns")
    assert len(recs) == 4 and all(r.error is None and r.reward == 0.5 and r.num_turns == 2 for r in recs)
    for r in recs:
        assert r.loop == "openai_agent_loop" and r.segment == 0 and r.metrics["requests"] == 2
        runs = [r.response_mask[0]] + [b for a, b in zip(r.response_mask, r.response_mask[1:]) if a != b]
        assert runs == [1, 0, 1] and set(r.token_versions[i] for i, m in enumerate(r.response_mask) if m) == {0}
        # the second generate call read the first turn's ids as the fake sampled them
        second = [q["input_ids"] for q in fake.requests if q["input_ids"][:len(r.prompt_ids)] == r.prompt_ids
                  and len(q["input_ids"]) > len(r.prompt_ids)]
        assert any(ids == (r.prompt_ids + r.response_ids)[:len(ids)] for ids in second)


def test_segments_become_records_of_one_episode():
    recs, _ = run_engine(f"{HERE}:compacting")
    assert len(recs) == 8
    for ep in {r.episode_id for r in recs}:
        first, second = sorted((r for r in recs if r.episode_id == ep), key=lambda r: r.segment)
        assert (first.segment, second.segment) == (0, 1) and first.reward == second.reward == 1.0
        assert (first.uid, first.repeat) == (second.uid, second.repeat) and first.prompt_ids != second.prompt_ids
        assert first.metrics["segments"] == 2 and first.extra["agent_result"] == {"note": "compacted"}
        assert "summary of the work so far" in get_tokenizer("modelzoo").decode(second.prompt_ids)
    s = summarize(recs, 2, 1.0)
    assert (s["episodes"], s["records"], s["mean_reward"]) == (4, 8, 1.0)


def test_without_a_reward_the_last_assistant_message_is_scored(tmp_path):
    recs, _ = run_engine(f"{HERE}:unrewarded", f"reward.custom=\"{Path(__file__)}:score\"")
    tok = get_tokenizer("modelzoo")
    for r in recs:
        assert r.reward == 0.25
        text = tok.decode(r.response_ids)
        assert r.reward_info["seen"] == r.extra["solution_str"] and text.startswith(r.extra["solution_str"])


@pytest.mark.parametrize("agent,error,text", [
    ("raises", "AgentError", "raised ValueError: harness bug"),
    ("silent", "AgentError", "made no model request"),
    ("malformed", "AgentError", "HTTP 400: 'messages' must be a non-empty list"),
])
def test_failing_agents_become_error_records(agent, error, text):
    # turns the model ended itself: no policy fault, so a failing harness is the infrastructure's failure
    recs, _ = run_engine(f"{HERE}:{agent}", "agent.timeout_s=0.5", fake_kw={"finish": "stop"})
    assert len(recs) == 4 and by_error(recs) == [error] * 4
    assert all(text in r.error and r.finish_reason == "error" and r.reward is None for r in recs)
    assert all(failure_kind(r.error, r.finish_reason) == "infra" for r in recs)


def test_a_timed_out_agent_is_the_policys_failure_with_its_tokens():
    recs, _ = run_engine(f"{HERE}:hangs", "agent.timeout_s=0.5")
    assert len(recs) == 4 and by_error(recs) == ["AgentTimeoutError"] * 4
    for r in recs:  # the turn it made before hanging is kept: trained at reward.failure_score
        assert "agent.timeout_s=0.5" in r.error and r.finish_reason == "timeout" and r.reward is None
        assert r.num_model_tokens > 0 and r.num_turns == 1 and failure_kind(r.error, r.finish_reason) == "policy"


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "harness.py"
    path.write_text("import json, os, sys, subprocess, urllib.request\n"
                    "sample = json.loads(sys.stdin.read())\n"
                    "def chat(messages):\n"
                    "    req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions',\n"
                    "        data=json.dumps({'model': 'm', 'messages': messages}).encode(),\n"
                    "        headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'],\n"
                    "                 'Content-Type': 'application/json'})\n"
                    "    return json.loads(urllib.request.urlopen(req, timeout=60).read())\n"
                    "def result(obj):\n"
                    "    with os.fdopen(int(os.environ['AGENTLOOP_RESULT_FD']), 'w') as f:\n"
                    "        f.write(obj if isinstance(obj, str) else json.dumps(obj))\n" + body)
    return f"{sys.executable} {path}"


BWRAP = "bwrap --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp --unshare-pid --die-with-parent "
"""The README's example of wrapping a command (read-only filesystem, own pid namespace, network shared)."""


@pytest.mark.parametrize("wrap", ["", "bwrap"])
def test_command_harness_reward_from_its_last_stdout_line(tmp_path, wrap):
    if wrap and not shutil.which("bwrap"):
        pytest.skip("bwrap is not installed")
    # the interpreter's environment bound too: a checkout under /tmp is hidden by the wrapper's tmpfs; the run
    # directory (answers in its rollouts) hidden behind a tmpfs of its own, as the README's example hides it
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "rollouts.jsonl").write_text('{"ground_truth": "42"}\n')
    wrapper = (f"{BWRAP}--ro-bind {sys.prefix} {sys.prefix} --ro-bind {tmp_path} {tmp_path} --tmpfs {runs} "
               if wrap else "")
    cmd = wrapper + _script(tmp_path, f"assert os.path.exists({str(runs / 'rollouts.jsonl')!r}) == {not wrap}\n"
                            "answer = chat(sample['messages'])\n"
                            "assert os.environ['ANTHROPIC_BASE_URL'] + '/v1' == os.environ['OPENAI_BASE_URL']\n"
                            "assert os.environ['AGENTLOOP_EPISODE_ID'] == sample['episode_id']\n"
                            "print('working...')\n"
                            "result({'reward': 0.75, 'turns': 1})\n")
    recs, _ = run_engine(None, command=cmd)
    assert all(r.error is None and r.reward == 0.75 and r.extra["agent_result"] == {"turns": 1} for r in recs)


@pytest.mark.parametrize("body,error,text", [
    ("chat(sample['messages'])\nsys.stderr.write('boom')\nsys.exit(3)\n", "AgentError", "exited with code 3; stderr tail: 'boom'"),
    ("chat(sample['messages'])\nresult('{oops')\n", "AgentError", "($AGENTLOOP_RESULT_FD) is not JSON"),
    ("chat(sample['messages'])\nresult({'reward': 'high'})\n", "AgentError", "must be a finite number"),
])
def test_command_harness_that_crashes_or_answers_badly(tmp_path, body, error, text):
    recs, _ = run_engine(None, command=_script(tmp_path, body), fake_kw={"finish": "stop"})
    assert by_error(recs) == [error] * 4 and all(text in r.error for r in recs)


def test_hanging_command_is_killed_with_its_process_group(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = _script(tmp_path, "chat(sample['messages'])\n"
                            "child = subprocess.Popen(['sleep', '600'])\n"
                            f"open({str(pids)!r} + '/' + str(child.pid), 'w').close()\n"
                            "child.wait()\n")
    recs, _ = run_engine(None, "agent.timeout_s=1.5", command=cmd)
    assert by_error(recs) == ["AgentTimeoutError"] * 4
    children = [int(p.name) for p in pids.iterdir()]
    assert len(children) == 4
    for pid in children:  # killed with the group: gone, or a zombie waiting for init to reap it
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(") ")[1][0] in "ZX", pid


def test_a_weight_update_in_the_middle_of_a_gateway_request():
    async def update_midway(sm, fake):
        await fake.started.wait()
        await sm.pause(mode="abort")
        await sm.update_weights_from_disk("/w", weight_version=1)
        await sm.resume()
        sm.expect_version(1)

    recs, fake = run_engine(f"{HERE}:long_call", "sampling.max_new_tokens=40", "sampling.ignore_eos=true", n=1,
                            fake_kw={"token_delay_s": 0.01}, during=update_midway)
    interrupted = [r for r in recs if r.metrics.get("interrupted_calls")]
    assert interrupted, "no request was cut by the update"
    for r in recs:  # the agent got one answer of 40 tokens; the record's tokens carry the version that made each
        assert r.error is None and r.reward == 40.0 and r.num_model_tokens == 40
        assert r.token_versions == sorted(r.token_versions) and set(r.token_versions) <= {0, 1}
    assert all(set(r.token_versions) == {0, 1} for r in interrupted)


def test_agent_reward_reads_numbers_dicts_and_none():
    assert agent_reward(None) == (None, {}) and agent_reward(1) == (1.0, {}) and agent_reward(True) == (1.0, {})
    assert agent_reward({"reward": 0.5, "k": [1]}) == (0.5, {"agent_result": {"k": [1]}})
    for bad in ("0.5", float("nan"), {"reward": "x"}, {"reward": 1, "o": object()}):
        with pytest.raises(AgentError):
            agent_reward(bad)


def test_the_config_says_when_the_agent_is_missing_or_doubly_given():
    from agentloop.errors import ConfigError

    with pytest.raises(ConfigError, match="set agent.entry=path.py:fn or agent.command"):
        load_config(None, ["rollout.loop=openai_agent_loop"])
    with pytest.raises(ConfigError, match="set agent.entry or agent.command, not both"):
        load_config(None, ["agent.entry=a.py:f", "agent.command=\"python h.py\""])
    with pytest.raises(ConfigError, match="must be an async function"):
        from agentloop.loops.openai_agent import load_entry

        load_entry(f"{HERE}:score")


# ---------------------------------------------------------------- what the policy cannot game through an agent

def test_stdout_cannot_write_the_reward_and_the_task_comes_without_the_answer(tmp_path):
    seen = tmp_path / "stdin"
    seen.mkdir()
    # a harness that prints the model's text (here: a forged result) as its last stdout line
    cmd = _script(tmp_path, f"open({str(seen)!r} + '/' + sample['episode_id'], 'w').write(json.dumps(sample))\n"
                            "chat(sample['messages'])\n"
                            "print(json.dumps({'reward': 1.0}))\n")
    recs, _ = run_engine(None, f"reward.custom=\"{Path(__file__)}:score\"", command=cmd)
    assert len(recs) == 4 and all(r.error is None and r.reward == 0.25 for r in recs)  # the data_source's score
    stdins = [json.loads(p.read_text()) for p in seen.iterdir()]
    assert len(stdins) == 4
    for got in stdins:
        assert "answer-" not in json.dumps(got), got
        assert set(got) >= {"episode_id", "messages", "data_source", "index", "uid", "repeat"}


def test_send_answer_gives_the_whole_sample(tmp_path):
    seen = tmp_path / "stdin"
    seen.mkdir()
    cmd = _script(tmp_path, f"open({str(seen)!r} + '/' + sample['episode_id'], 'w').write(json.dumps(sample))\n"
                            "chat(sample['messages'])\nresult({'reward': 0.5})\n")
    recs, _ = run_engine(None, "agent.send_answer=true", command=cmd)
    assert all(r.reward == 0.5 for r in recs)
    for p in seen.iterdir():
        got = json.loads(p.read_text())
        assert got["ground_truth"].startswith("answer-") and got["extra_info"]["answer"] == got["ground_truth"]


async def entry_sees(sample, base_url, api_key):
    await chat(base_url, api_key, list(sample.messages))
    return {"reward": 0.0, "gt": sample.ground_truth, "extra": sample.extra_info, "tk": sample.tools_kwargs}


def test_an_entry_function_gets_the_task_without_the_answer():
    recs, _ = run_engine(f"{HERE}:entry_sees")
    assert all(r.extra["agent_result"] == {"gt": None, "extra": {}, "tk": {}} for r in recs)


async def overflows(sample, base_url, api_key):
    first = await chat(base_url, api_key, list(sample.messages))
    await chat(base_url, api_key, list(sample.messages) + [first["choices"][0]["message"],
                                                          {"role": "user", "content": "x " * 400}])


async def bad_tool_call(sample, base_url, api_key):
    body = await chat(base_url, api_key, list(sample.messages), tools=[CALC])
    raise ValueError(f"the SDK could not use {body['choices'][0]['message']}")


CALC = {"type": "function", "function": {"name": "calc", "description": "d", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.mark.parametrize("agent,fault,parsed", [
    ("raises", "a turn cut at its token cap (6 tokens)", None),
    ("overflows", "overflowed the context", None),
    ("bad_tool_call", "could not be parsed", ParseResult(errors=["malformed JSON in tool call"])),
    ("bad_tool_call", "without its required argument(s) ['expression']",
     ParseResult(calls=[ParsedCall("calc", {})])),
    ("bad_tool_call", "which the request did not offer", ParseResult(calls=[ParsedCall("shell", {"cmd": "ls"})])),
])
def test_an_agent_failing_on_the_policys_output_is_the_policys_failure(agent, fault, parsed, monkeypatch):
    if parsed is not None:  # the fake server's tokens are no tool call: the parser reads what the case needs
        monkeypatch.setattr(chat_session, "get_parser", lambda name: lambda text: parsed)
    # the fake's turns end at the token cap unless told otherwise: only the "raises" case keeps that fault
    recs, _ = run_engine(f"{HERE}:{agent}", "model.context_length=256",
                         fake_kw=None if agent == "raises" else {"finish": "stop"})
    assert len(recs) == 4 and by_error(recs) == ["AgentPolicyError"] * 4
    for r in recs:  # kept with the tokens the policy made, trained at reward.failure_score
        assert fault in r.error and r.num_model_tokens > 0 and r.metrics["policy_faults"] >= 1
        assert failure_kind(r.error, r.finish_reason) == "policy"


# ---------------------------------------------------------------- one episode's tokens are its own

async def one_turn_then_hangs(sample, base_url, api_key):
    await chat(base_url, api_key, list(sample.messages))
    await asyncio.Event().wait()


@pytest.mark.parametrize("prompts", [1, 100])
def test_gateway_episodes_cut_by_their_deadline_keep_their_own_turns(prompts):
    """2 and 200 gateway episodes, each timed out by rollout.episode_timeout_s after one turn: each record keeps
    its own turn (the gateway started in the first episode's context used to file every builder under it). The
    deadline is a margin, not a verdict on the box: 200 first turns took up to ~2 s on the 2-core box under a
    full test run beside this one (one episode, 97-0, was cut before its turn at a 2 s deadline), so 200 get 15 s."""
    deadline = 2 if prompts == 1 else 15
    recs, _ = run_engine(f"{HERE}:one_turn_then_hangs", f"rollout.episode_timeout_s={deadline}",
                         "agent.timeout_s=600", prompts=prompts)
    assert len(recs) == 2 * prompts and by_error(recs) == ["EpisodeTimeout"] * (2 * prompts)
    tok = get_tokenizer("modelzoo")
    for r in recs:
        assert r.finish_reason == "timeout" and r.num_turns == 1 and r.num_model_tokens > 0, r.episode_id
        assert tok.decode(r.prompt_ids).rstrip().endswith(f"q{r.index}<|im_end|>\n<|im_start|>assistant"), r.episode_id


def test_agent_env_values_may_be_numbers_and_booleans():
    cfg = load_config(None, ["agent.command=\"python h.py\"", "agent.env.WORKERS=4", "agent.env.OPENAI_AGENTS_DISABLE_TRACING=true",
                             "agent.env.RATIO=0.5", "agent.env.NAME=x"])
    assert cfg.agent.env == {"WORKERS": "4", "OPENAI_AGENTS_DISABLE_TRACING": "true", "RATIO": "0.5", "NAME": "x"}


# ---------------------------------------------------------------- long-lived harness workers (agent.workers)

WORKER = r'''
import json, os, sys, threading, urllib.request
out = os.fdopen(int(os.environ["AGENTLOOP_RESULT_FD"]), "w")
lock = threading.Lock()
mode = os.environ.get("MODE", "ok")
state = {"inflight": 0, "peak": 0, "done": 0}
def chat(msg, messages):
    req = urllib.request.Request(msg["openai_base_url"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": messages}).encode(),
        headers={"Authorization": "Bearer " + msg["api_key"], "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())
def episode(msg):
    with lock:
        state["inflight"] += 1
        state["peak"] = max(state["peak"], state["inflight"])
    chat(msg, msg["task"]["messages"])
    if mode == "hang":
        threading.Event().wait()
    if mode == "crash":
        os._exit(7)
    with lock:
        state["inflight"] -= 1
        state["done"] += 1
        # the model's text on stdout cannot be a result: only this descriptor is read
        print(json.dumps({"id": msg["id"], "result": {"reward": 1.0}}), flush=True)
        out.write(json.dumps({"id": msg["id"], "result": {"reward": 0.5, "pid": os.getpid(), "peak": state["peak"],
                                                          "task": msg["task"]}}) + "\n")
        out.flush()
for line in sys.stdin:
    msg = json.loads(line)
    if msg["type"] == "episode":
        threading.Thread(target=episode, args=(msg,), daemon=True).start()
'''


def _worker(tmp_path: Path) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return f"{sys.executable} {path}"


def test_a_long_lived_worker_takes_episodes_several_at_once(tmp_path):
    recs, _ = run_engine(None, "agent.workers=1", "agent.worker_concurrency=4", command=_worker(tmp_path), n=4,
                         fake_kw={"finish": "stop", "delay_s": 0.05})
    assert len(recs) == 8 and all(r.error is None and r.reward == 0.5 for r in recs)
    results = [r.extra["agent_result"] for r in recs]
    assert len({x["pid"] for x in results}) == 1, "one worker process took every episode"
    assert max(x["peak"] for x in results) > 1, "the worker never had two episodes at once"
    assert all("answer-" not in json.dumps(x["task"]) for x in results)  # the task, without its answer


def test_a_worker_that_exits_fails_its_episodes_and_is_started_again(tmp_path):
    recs, _ = run_engine(None, "agent.workers=1", "agent.worker_concurrency=1", "agent.env.MODE=crash",
                         command=_worker(tmp_path), fake_kw={"finish": "stop"})
    assert len(recs) == 4 and by_error(recs) == ["AgentError"] * 4
    assert all("the agent worker exited (code 7)" in r.error for r in recs)  # each episode met a fresh worker


def test_a_worker_past_the_agent_timeout_is_the_policys_timeout_with_its_tokens(tmp_path):
    recs, _ = run_engine(None, "agent.workers=2", "agent.timeout_s=1", "agent.env.MODE=hang",
                         command=_worker(tmp_path), fake_kw={"finish": "stop"})
    assert len(recs) == 4 and by_error(recs) == ["AgentTimeoutError"] * 4
    assert all(r.num_model_tokens > 0 and failure_kind(r.error, r.finish_reason) == "policy" for r in recs)


# ---------------------------------------------------------------- the Responses API through the engine

async def responses_agent(sample, base_url, api_key):
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        system = sample.messages[0]["content"]
        items = [{"role": "user", "content": sample.messages[1]["content"]}]
        tools = [{"type": "function", "name": "calc", "description": "d", "strict": True,
                  "parameters": CALC["function"]["parameters"]}]
        first = await client.responses.create(model="m", instructions=system, input=items, tools=tools)
        calls = [o for o in first.output if o.type == "function_call"]
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "42"} for c in calls]
        second = await client.responses.create(model="m", instructions=system, input=items, tools=tools, stream=True)
        async for _ in second:
            pass
    return {"reward": 0.5, "calls": len(calls)}


def test_a_responses_api_agent_extends_one_exact_segment(monkeypatch):
    parsed = ParseResult(calls=[ParsedCall("calc", {"expression": "6 * 7"})], content="let me see")

    def parser(name):  # per session: its first turn is a calculator call, its second an answer
        turns = iter([parsed])
        return lambda text: next(turns, ParseResult())

    monkeypatch.setattr(chat_session, "get_parser", parser)
    recs, fake = run_engine(f"{HERE}:responses_agent", fake_kw={"finish": "stop"})
    assert len(recs) == 4 and all(r.error is None and r.reward == 0.5 for r in recs), [r.error for r in recs]
    for r in recs:  # the harness sent the output items back: the second request extended the first's segment
        assert r.segment == 0 and r.metrics["segments"] == 1 and r.num_turns == 2
        assert r.extra["agent_result"] == {"calls": 1} and r.metrics["tool_calls"] == 1
        runs = [r.response_mask[0]] + [b for a, b in zip(r.response_mask, r.response_mask[1:]) if a != b]
        assert runs == [1, 0, 1]
