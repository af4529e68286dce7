"""verl tool config files load as our tools and run as verl runs them inside tool_agent_loop: every tool offered
to every row, create_kwargs from tools_kwargs, arguments unchecked, excess calls dropped silently, step rewards
kept; verl's own example configs (search, gsm8k) load without verl."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from agentloop.config import SamplingParams
from agentloop.errors import ConfigError
from agentloop.records import Sample
from agentloop.tools import ToolsConfig, get_tool
from agentloop.tools.verl_tools import load_verl_tool_config, verl_tool_classes

# A tool written against verl's BaseTool API (the shape of verl's Gsm8kTool), without importing verl.
TOOL_MODULE = '''
from uuid import uuid4


class Response:
    def __init__(self, text=None):
        self.text = text


class AnswerChecker:
    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        self.live = {}
        self.created = []

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self.live[instance_id] = ground_truth
        self.created.append(ground_truth)
        return instance_id, Response()

    async def execute(self, instance_id, parameters, **kwargs):
        right = str(parameters.get("answer")) == str(self.live[instance_id])
        return Response(text=f"{self.config['prefix']} {'correct' if right else 'wrong'}"), (1.0 if right else -0.05), \\
            {"checked": 1}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        del self.live[instance_id]


class OwnSchema(AnswerChecker):
    def __init__(self, config, tool_schema):
        from types import SimpleNamespace
        schema = SimpleNamespace(model_dump=lambda: {"type": "function", "function": {
            "name": config["tool_name"], "description": "d",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}})
        schema.function = SimpleNamespace(name=config["tool_name"])
        super().__init__(config, schema)
'''

CONFIG = """
tools:
  - class_name: "{module}.AnswerChecker"
    config:
      type: native
      prefix: "checked:"
    tool_schema:
      type: "function"
      function:
        name: "check_answer_{tag}"
        description: "Check an answer"
        parameters:
          type: "object"
          properties:
            answer: {{type: "string", description: "the answer"}}
          required: ["answer"]
  - class_name: "{module}.OwnSchema"
    config: {{type: native, prefix: "own", tool_name: "own_schema_{tag}"}}
"""


@pytest.fixture
def verl_config(tmp_path, monkeypatch):
    module = f"verl_style_tools_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "tool_config.yaml"
    path.write_text(CONFIG.format(module=module, tag=tmp_path.name.replace("-", "_")))
    tag = tmp_path.name.replace("-", "_")
    yield path, f"check_answer_{tag}", f"own_schema_{tag}"
    sys.modules.pop(module, None)


def test_verl_tool_config_loads_apart_from_the_tool_registry(verl_config):
    path, name, own = verl_config
    assert load_verl_tool_config(path) == [name, own]
    assert load_verl_tool_config(path) == [name, own]  # once per file
    classes = verl_tool_classes(path)
    assert list(classes) == [name, own]
    with pytest.raises(ConfigError, match="unknown tool"):
        get_tool(name)  # the file's tools are the file's: a verl `search` never replaces our built-in
    tool = classes[name](ToolsConfig())
    assert tool.schema["function"]["parameters"]["required"] == ["answer"]

    async def go():
        inst = await tool.create(None, ground_truth="72")
        right = await tool.execute(inst, {"answer": "72"})
        wrong = await tool.execute(inst, {"answer": "71"})
        await tool.release(inst)
        return right, wrong

    right, wrong = asyncio.run(go())
    assert right.text == "checked: correct" and right.metrics == {"step_reward": 1.0, "checked": 1.0}
    assert wrong.text == "checked: wrong" and wrong.metrics["step_reward"] == -0.05
    assert tool.verl_tool.live == {}  # verl's per-call create/release
    assert classes[own].parameters["required"] == ["answer"]  # the class's own schema


def _loop(path, server, tok, **cfg):
    from tests.unit.loops.test_tool_loop import make_loop

    return make_loop(tok, server, verl_tool_config=str(path), **cfg)


def _run(loop, sample):
    return asyncio.run(loop.run(sample, SamplingParams(max_new_tokens=64)))


def test_verl_tool_runs_in_tool_agent_loop_with_row_create_kwargs(verl_config):
    from tests.unit.loops.test_tool_loop import ScriptedServer, get_tokenizer

    path, name, _ = verl_config
    tok = get_tokenizer("test")
    call = {"name": name, "arguments": {"answer": "84"}}
    server = ScriptedServer(tok, [(f"<tool_call>{json.dumps(call)}</tool_call>", "stop"), ("84", "stop")])
    # verl's row shape: extra_info.tools_kwargs[name].create_kwargs
    sample = Sample(index=0, data_source="x", messages=[{"role": "user", "content": "12 * 7?"}],
                    extra_info={"tools_kwargs": {name: {"create_kwargs": {"ground_truth": "84"}}}})
    out = _run(_loop(path, server, tok), sample)
    assert out.extra["tool_trace"][0]["text"] == "checked: correct"
    assert out.extra["tool_trace"][0]["step_reward"] == 1.0
    assert out.metrics[f"tool/{name}/step_reward"] == 1.0
    assert verl_tool_classes(path)[name].verl_tool.created[-1] == "84"


def test_every_verl_tool_is_offered_to_every_row_and_gets_arguments_unchecked(verl_config):
    """verl offers every configured tool to every row (a row without tools_kwargs too: its create_kwargs are
    {}) and hands the model's arguments to the tool as they are: {"answer": 84} (an int where the schema says
    string) reaches the tool, which decides (here str(84) == "84": correct)."""
    from tests.unit.loops.test_tool_loop import ScriptedServer, get_tokenizer

    path, name, own = verl_config
    tok = get_tokenizer("test")
    call = {"name": name, "arguments": {"answer": 84}}
    server = ScriptedServer(tok, [(f"<tool_call>{json.dumps(call)}</tool_call>", "stop"), ("84", "stop")])
    plain = Sample(index=0, data_source="x", messages=[{"role": "user", "content": "12 * 7?"}])
    loop = _loop(path, server, tok)
    out = _run(loop, plain)
    prompt = tok.decode(out.prompt_ids)
    assert f'"name": "{name}"' in prompt and f'"name": "{own}"' in prompt
    trace = out.extra["tool_trace"]
    assert trace[0]["status"] == "ok" and out.metrics["invalid_arguments"] == 0
    assert verl_tool_classes(path)[name].verl_tool.created[-1] is None  # no tools_kwargs: create_kwargs {}
    right = Sample(index=1, data_source="x", messages=[{"role": "user", "content": "12 * 7?"}],
                   extra_info={"tools_kwargs": {name: {"create_kwargs": {"ground_truth": "84"}}}})
    server = ScriptedServer(tok, [(f"<tool_call>{json.dumps(call)}</tool_call>", "stop"), ("84", "stop")])
    out = _run(_loop(path, server, tok), right)
    assert out.extra["tool_trace"][0]["text"] == "checked: correct"


def test_calls_beyond_verls_max_parallel_calls_are_dropped_without_a_message(verl_config):
    """verl runs a turn's first max_parallel_calls calls and drops the rest silently: here
    tools.max_tool_calls_per_turn; with tools.excess_calls=message each dropped call is answered instead."""
    from tests.unit.loops.test_tool_loop import ScriptedServer, get_tokenizer

    path, name, _ = verl_config
    tok = get_tokenizer("test")
    calls = "".join(f"<tool_call>{json.dumps({'name': name, 'arguments': {'answer': str(a)}})}</tool_call>"
                    for a in (84, 1, 2))
    row = Sample(index=0, data_source="x", messages=[{"role": "user", "content": "12 * 7?"}],
                 extra_info={"tools_kwargs": {name: {"create_kwargs": {"ground_truth": "84"}}}})
    for excess, n_tool_msgs in ((None, 1), ("message", 3)):
        server = ScriptedServer(tok, [(calls, "stop"), ("84", "stop")])
        out = _run(_loop(path, server, tok, max_tool_calls_per_turn=1, excess_calls=excess), row)
        tool_msgs = [m for m in out.extra["messages"] if m["role"] == "tool"]
        assert len(tool_msgs) == n_tool_msgs and tool_msgs[0]["content"] == "checked: correct"
        assert [t["status"] for t in out.extra["tool_trace"]] == ["ok", "dropped", "dropped"]
        assert out.metrics["tool_calls"] == 1 and out.metrics["dropped_calls"] == 2


GSM8K_TOOL_CONFIG = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_verls_gsm8k_tool_config_loads_without_verl_and_scores_an_int_answer(tmp_path):
    """verl's gsm8k_tool_config.yaml (verl.tools.gsm8k_tool.Gsm8kTool) loads through our port of the class
    (verl is not installed here); {"answer": 72} scores 1.0 as in verl, a wrong one costs -0.05."""
    from agentloop.rewards.verl_gsm8k import extract_solution
    from agentloop.tools.verl_ports import flexible_answer
    from agentloop.tools.verl_tools import verl_tool_entries

    p = tmp_path / "gsm8k_tool_config.yaml"
    p.write_text(GSM8K_TOOL_CONFIG)
    entry = verl_tool_entries(p)[0]
    assert (entry.name, entry.implementation) == ("calc_gsm8k_reward", "agentloop.tools.verl_ports.Gsm8kTool")
    tool = entry.cls(ToolsConfig())

    async def go():
        inst = await tool.create(None, ground_truth="72")
        return [await tool.execute(inst, {"answer": a}) for a in (72, 72, "#### 71", "nothing")]

    first, again, wrong, none = asyncio.run(go())
    assert first.text == "Current parsed answer='72' reward=1.0" and first.metrics["step_reward"] == 0.0
    # verl's loop creates an instance per call, so "improved" compares with 0.0: right 0.0, wrong -0.05
    assert again.metrics["step_reward"] == 0.0
    assert wrong.text == "Current parsed answer='#### 71' reward=0.0" and wrong.metrics["step_reward"] == -0.05
    assert none.text == "Current parsed answer='nothing' reward=0"  # verl's int 0 when nothing parses
    for text in ("#### 72", "x 1,234.5 y", "a . b", "no digits", "-3 then 4.", "...", "12" * 200):
        assert flexible_answer(text) == extract_solution(text, "flexible"), text


SEARCH_TOOL_CONFIG = """tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries. The tool will return search results for each query.
          required:
            - query_list
"""
"""verl's examples/sglang_multiturn/config/tool_config/search_tool_config.yaml, the URL aside."""


def test_verls_search_tool_config_loads_and_search_r1_rows_bind_to_it(tmp_path):
    """verl's own search tool config: `search` does not collide with our built-in, and a searchR1_nq row (verl's
    preprocess_search_r1_dataset shape) calls it with query_list against a real retrieval service (our BM25
    server over a socket), getting verl's result text; the built-in `search` would refuse query_list."""
    from agentloop.tools.retriever_server import serve
    from agentloop.tools.search import DEMO_CORPUS
    from tests.unit.loops.test_tool_loop import ScriptedServer, get_tokenizer

    tok = get_tokenizer("test")
    row = Sample(index=0, data_source="searchR1_nq", messages=[
        {"role": "system", "content": "You are a helpful and harmless assistant."},
        {"role": "user", "content": "Answer the given question. Question: what is the capital of australia?"}],
        extra_info={"need_tools_kwargs": True, "tools_kwargs": {"search": {"create_kwargs": {
            "ground_truth": {"target": ["Canberra"]}, "question": "capital of australia",
            "data_source": "searchR1_nq"}}}})
    call = {"name": "search", "arguments": {"query_list": ["capital of Australia", "river of Paris"]}}

    async def go():
        started = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(DEMO_CORPUS, port=0, topk=3,
                                         ready=lambda url, n: started.set_result(url)))
        try:
            url = await asyncio.wait_for(started, 30)
            p = tmp_path / "search_tool_config.yaml"
            p.write_text(SEARCH_TOOL_CONFIG.format(url=url))
            entry = verl_tool_entries(p)[0]
            server = ScriptedServer(tok, [(f"<tool_call>{json.dumps(call)}</tool_call>", "stop"),
                                          ("<answer>Canberra</answer>", "stop")])
            loop = _loop(p, server, tok, max_response_tokens=4000, max_tool_response_tokens=2000)
            return entry, await loop.run(row, SamplingParams(max_new_tokens=64))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    from agentloop.tools.verl_tools import verl_tool_entries

    entry, out = asyncio.run(go())
    assert (entry.name, entry.implementation) == ("search", "agentloop.tools.verl_ports.SearchTool")
    assert get_tool("search").__module__ == "agentloop.tools.search"  # our built-in is untouched
    trace = out.extra["tool_trace"]
    assert trace[0]["status"] == "ok" and trace[0]["name"] == "search"
    result = json.loads(next(m for m in out.extra["messages"] if m["role"] == "tool")["content"])["result"]
    first, second = result.split("\n---\n")
    assert first.startswith('Doc 1 (Title: "Canberra")\n') and "Doc 3 (Title:" in first
    assert "Seine" in second
    builtin = get_tool("search")(ToolsConfig())
    assert builtin.validate_arguments(call["arguments"])  # ours would have refused verl's arguments


def test_bad_verl_tool_configs_are_named(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("tools:\n  - class_name: nope_module_xyz.Tool\n    config: {type: native}\n")
    with pytest.raises(ConfigError, match=r"tools\[0\]: cannot import 'nope_module_xyz'"):
        load_verl_tool_config(p)
    p.write_text("tools:\n  - class_name: json.JSONDecoder\n    config: {type: mcp}\n")
    with pytest.raises(ConfigError, match="tool type 'mcp' is not supported"):
        load_verl_tool_config(p)
    p.write_text("tools: []\n")
    with pytest.raises(ConfigError, match="non-empty list under 'tools'"):
        load_verl_tool_config(p)
