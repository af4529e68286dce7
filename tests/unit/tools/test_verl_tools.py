"""verl tool config files load as our tools; a plain class with verl's tool API runs inside tool_agent_loop."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from agentloop.config import SamplingParams
from agentloop.errors import ConfigError
from agentloop.records import Sample
from agentloop.tools import ToolsConfig, get_tool
from agentloop.tools.verl_tools import load_verl_tool_config

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


def test_verl_tool_config_registers_adapters(verl_config):
    path, name, own = verl_config
    assert load_verl_tool_config(path) == [name, own]
    assert load_verl_tool_config(path) == [name, own]  # once per file
    tool = get_tool(name)(ToolsConfig())
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
    assert get_tool(own).parameters["required"] == ["answer"]  # the class's own schema


def test_verl_tool_runs_in_tool_agent_loop_with_row_create_kwargs(verl_config):
    from tests.unit.loops.test_tool_loop import ScriptedServer, get_tokenizer, make_loop

    path, name, _ = verl_config
    load_verl_tool_config(path)
    tok = get_tokenizer("test")
    call = {"name": name, "arguments": {"answer": "84"}}
    server = ScriptedServer(tok, [(f"<tool_call>{json.dumps(call)}</tool_call>", "stop"), ("84", "stop")])
    loop = make_loop(tok, server)
    # verl's row shape: extra_info.tools_kwargs[name].create_kwargs
    sample = Sample(index=0, data_source="x", messages=[{"role": "user", "content": "12 * 7?"}],
                    extra_info={"tools_kwargs": {name: {"create_kwargs": {"ground_truth": "84"}}}})
    out = asyncio.run(loop.run(sample, SamplingParams(max_new_tokens=64)))
    assert out.extra["tool_trace"][0]["text"] == "checked: correct"
    assert out.metrics[f"tool/{name}/step_reward"] == 1.0
    assert get_tool(name).verl_tool.created[-1] == "84"


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
