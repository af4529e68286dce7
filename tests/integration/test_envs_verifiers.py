"""verifiers environments through verifiers_loop, scored by their own rubric: parity with verifiers' own evaluation,
and every failure an error record with verifiers' message. The model is a scripted SGLang server (each prompt its
own completion), so this needs no real server; verifiers runs in its own virtualenv (agentloop.loops.verifiers_env:
`agentloop envs setup verifiers` builds it, cached in ~/.cache/agentloop/env-venvs or $AGENTLOOP_ENV_VENVS; the
first build takes a minute or two).

Parity: the same 1,000+ completions (right, wrong and malformed `####` answers) for the eval dataset of
examples/envs/verifiers_calculator.py (its SingleTurnEnv form) scored (a) by verifiers itself, `env.evaluate(...)`
against a fake OpenAI server answering those completions (tests/integration/verifiers_eval_driver.py, in the
virtualenv), (b) by agentloop: the rows `--env verifiers:` exports, each episode the environment's own rollout in
the worker, through the gateway, tokens from the scripted server. 0 disagreements.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop.bench.scripted_server import ScriptedProcess, ScriptedSpec, answer_key
from agentloop.config import load_config
from agentloop.data import load_file
from agentloop.envs_config import VerifiersEnvConfig
from agentloop.loops import get_agent_loop
from agentloop.loops.verifiers_env import export_rows, setup_venv
from agentloop.models.loading import load_tokenizer_for
from agentloop.rollout.engine import RolloutEngine
from agentloop.server_manager import ServerManager

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = ROOT / "examples" / "envs" / "verifiers_calculator.py"
DRIVER = ROOT / "tests" / "integration" / "verifiers_eval_driver.py"
N = 1000


@pytest.fixture(scope="module")
def vf_python() -> str:
    return str(setup_venv() / "bin" / "python")


def completion(i: int, answer: int) -> str:
    a = answer
    kinds = [f"#### {a}", f"#### {a + 1}", f"The answer is {a}.", f"####{a}", f"#### {a:,}", f"#### {a}\n#### {a + 7}",
             f"#### {a + 3}\n#### {a}", "", "#### ", f"{a} ####", f"#### {a}.0", f"#### -{a}", "I do not know ☃",
             f"####  {a}", f"Let me think. {a - 1}? No.\n#### {a}", f"**#### {a}**"]
    return kinds[i % len(kinds)]


def rollout(spec: ScriptedSpec, make_cfg, samples) -> list:
    """The samples through `make_cfg(url)`'s loop against a scripted server of `spec` (started and stopped here)."""
    async def main():
        proc = await ScriptedProcess(spec).start()
        try:
            cfg = make_cfg(proc.url)
            tok = load_tokenizer_for(cfg, Path(cfg.model.path))
            async with ServerManager(cfg.server.urls, cfg.manager) as sm:
                engine = RolloutEngine(cfg, sm, tok, get_agent_loop(cfg.rollout.loop), progress=False)
                return (await engine.run(samples, n_samples=1)).records
        finally:
            await proc.stop()

    return asyncio.run(asyncio.wait_for(main(), 900))


def config(url: str, model: Path, vf_python: str, env: str, args: dict, *extra: str):
    return load_config(None, [
        f"server.urls=[\"{url}\"]", f"model.path=\"{model}\"", "rollout.loop=verifiers_loop",
        f"envs.verifiers.env=\"{env}\"", "envs.verifiers.args=" + json.dumps(args), f"envs.verifiers.python=\"{vf_python}\"",
        "envs.verifiers.worker_concurrency=512", "rollout.max_concurrency=512", "sampling.max_new_tokens=64",
        "rollout.progress_interval_s=100", "agent.timeout_s=120", *extra])


def test_thousand_completions_score_as_verifiers_own_evaluation(tiny_model_path, vf_python, tmp_path):
    args = {"tools": False, "num_train_examples": 1, "num_eval_examples": N}
    rows = export_rows(VerifiersEnvConfig(env=str(ENV), args=args, python=vf_python), "eval", tmp_path / "rows.jsonl")
    samples = load_file(rows)
    assert len(samples) == N
    cfg0 = config("http://127.0.0.1:1", tiny_model_path, vf_python, str(ENV), args)
    tok = load_tokenizer_for(cfg0, tiny_model_path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    by_question: dict[str, str] = {}
    answers: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        q = s.messages[-1]["content"]
        text = by_question.setdefault(q, completion(i, int(s.ground_truth)))
        ids = tok.encode(tok.apply_chat_template(s.messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        answers[answer_key(ids)] = list(tok.encode(text, add_special_tokens=False)) + [eos]
    assert all(tok.decode(ids[:-1]) == t for t, ids in zip(by_question.values(), answers.values()))

    # (a) verifiers' own evaluation
    table = tmp_path / "completions.json"
    table.write_text(json.dumps(by_question))
    theirs_file = tmp_path / "theirs.json"
    subprocess.run([vf_python, str(DRIVER), str(ENV), json.dumps(args), str(table), str(theirs_file)], check=True,
                   timeout=600, capture_output=True)
    theirs = json.loads(theirs_file.read_text())
    assert len(theirs) == N

    # (b) agentloop: verifiers_loop through the gateway, the scripted server answering each prompt's completion
    records = rollout(ScriptedSpec(answers=answers, stop_ids=[eos], script=[[eos]]),
                      lambda url: config(url, tiny_model_path, vf_python, str(ENV), args), samples)
    assert [r.error for r in records if r.error] == []
    ours = {str(json.loads(s.extra_info["verifiers"])["example_id"]): r.reward
            for s, r in zip(sorted(samples, key=lambda s: s.index), sorted(records, key=lambda r: r.index))}
    disagreements = {k: (theirs[k], ours[k]) for k in theirs if theirs[k] != ours[k]}
    assert disagreements == {}
    assert 200 < sum(v == 1.0 for v in ours.values()) < 800  # right and wrong answers both scored
    # the gateway recorded what the scripted server sampled (mask 1) after the prompt verifiers sent
    r = records[0]
    assert r.response_ids and all(r.response_mask) and r.response_ids[-1] == eos


BROKEN = '''
import verifiers as vf
from datasets import Dataset

def load_environment(mode="ok"):
    if mode == "load_fails":
        raise RuntimeError("this environment cannot load")
    ds = Dataset.from_list([{"question": "What is 1 + 1?", "answer": "2"}] * 4)

    def nothing(completion, answer):
        return None

    def right(completion, answer):
        return 1.0

    class Exploding(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            raise RuntimeError("the environment exploded")

    if mode == "raises":
        return Exploding(dataset=ds, eval_dataset=ds, max_turns=3, rubric=vf.Rubric(funcs=[right]))
    return vf.SingleTurnEnv(dataset=ds, eval_dataset=ds, rubric=vf.Rubric(funcs=[nothing if mode == "no_reward" else right]))
'''


@pytest.mark.parametrize("mode,message", [
    ("raises", "the environment exploded"),
    ("no_reward", "verifiers rubric: Error calling reward function nothing"),
])
def test_failures_are_error_records_with_verifiers_message(tiny_model_path, vf_python, tmp_path, mode, message):
    env = tmp_path / "broken_env.py"
    env.write_text(BROKEN)
    args = {"mode": mode}
    rows = export_rows(VerifiersEnvConfig(env=str(env), args=args, python=vf_python), "eval", tmp_path / "rows.jsonl")
    samples = load_file(rows)
    cfg0 = config("http://127.0.0.1:1", tiny_model_path, vf_python, str(env), args)
    tok = load_tokenizer_for(cfg0, tiny_model_path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    script = [list(tok.encode("#### 2", add_special_tokens=False)) + [eos]]

    records = rollout(ScriptedSpec(script=script, stop_ids=[eos]),
                      lambda url: config(url, tiny_model_path, vf_python, str(env), args), samples)
    assert len(records) == 4 and all(r.error and r.error.startswith("AgentError") for r in records)
    assert all(message in r.error for r in records), records[0].error


def test_an_environment_that_cannot_load_is_named(vf_python, tmp_path):
    env = tmp_path / "broken_env.py"
    env.write_text(BROKEN)
    from agentloop.errors import EnvError

    with pytest.raises(EnvError, match="this environment cannot load"):
        export_rows(VerifiersEnvConfig(env=str(env), args={"mode": "load_fails"}, python=vf_python), "eval",
                    tmp_path / "rows.jsonl")
    with pytest.raises(EnvError, match="does not exist"):
        export_rows(VerifiersEnvConfig(env=str(tmp_path / "nope.py"), python=vf_python), "eval", tmp_path / "r.jsonl")


def test_worker_needs_no_agentloop():
    """The worker runs in verifiers' virtualenv: it imports nothing of agentloop (that env has no agentloop)."""
    src = (ROOT / "agentloop" / "loops" / "verifiers_worker.py").read_text()
    assert "agentloop" not in "".join(line for line in src.splitlines() if line.startswith(("import", "from")))
    assert sys.executable  # the test itself runs in the main venv
