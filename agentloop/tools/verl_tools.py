"""verl's tool config files as our tools (`tools.verl_tool_config`, verl's
`actor_rollout_ref.rollout.multi_turn.tool_config_path`).

The file (verl's format):

    tools:
      - class_name: my_package.tools.Gsm8kTool     # dotted module path + class
        config: {type: native, ...}                # passed to __init__ as a dict
        tool_schema:                               # optional: else the class's get_openai_tool_schema()
          type: function
          function: {name: calc_gsm8k_reward, description: ..., parameters: {type: object, ...}}

`load_verl_tool_config(path)` imports each class, builds ONE instance as verl does
(`cls(config=dict, tool_schema=schema)`, the schema an object with verl's attribute shape:
`schema.function.name`, `.model_dump()`), and registers a `BaseTool` adapter under the schema's function
name. Rows select it like verl's: `extra_info.tools_kwargs[name].create_kwargs`.

The class is driven with verl's API (verl's BaseTool, subclassing it or not) the way verl's tool agent loop
does, per call: `create(create_kwargs=...)` (a str or an (id, response) tuple back), `execute(id, arguments
[, agent_data=None])` -> (response, step reward, metrics) with a response that is a str, has `.text`, or is
a {"text": ...} dict, then `release(id)` always. The step reward goes to the call's metrics
(`tool/<name>/step_reward`); `calc_reward` is not called (verl's agent loop does not add it to the reward).

Not supported: `type: mcp` entries (ConfigError naming the entry). The class must import without verl
unless verl is installed ("a plain Python class").
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from agentloop.errors import ConfigError
from agentloop.tools.base import BaseTool, ToolResponse
from agentloop.tools.registry import register_tool


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class VerlFunctionSchema(_Open):
    """verl's OpenAIFunctionSchema shape (attribute access for tool classes written against it)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}, "required": []})
    strict: bool = False


class VerlToolSchema(_Open):
    """verl's OpenAIFunctionToolSchema shape."""

    type: str = "function"
    function: VerlFunctionSchema


_LOADED: dict[str, list[str]] = {}


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _text_of(resp: Any) -> str:
    if resp is None:
        return ""
    if isinstance(resp, str):
        return resp
    if isinstance(resp, dict):
        return str(resp.get("text") or "")
    text = getattr(resp, "text", None)
    return "" if text is None else str(text)


def _schema_dict(schema: Any, where: str) -> dict[str, Any]:
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump()
    try:
        return VerlToolSchema.model_validate(schema).model_dump()
    except Exception as e:  # noqa: BLE001 - named and re-raised as a config error
        raise ConfigError(f"{where}: tool_schema is not an OpenAI function schema: {e}") from None


def make_adapter(instance: Any, schema: dict[str, Any]) -> type[BaseTool]:
    """A BaseTool class driving the verl-style tool `instance` (one shared instance, as verl has)."""
    fn = schema["function"]

    class VerlToolAdapter(BaseTool):
        name = fn["name"]
        description = fn.get("description", "")
        parameters = fn.get("parameters") or {"type": "object", "properties": {}}
        verl_tool = instance

        async def create(self, episode: Any, **kwargs: Any) -> Any:
            return dict(kwargs)  # the row's create_kwargs; verl creates an instance per call

        async def execute(self, create_kwargs: Any, arguments: dict[str, Any]) -> ToolResponse:
            tool = self.verl_tool
            created = await (tool.create(create_kwargs=create_kwargs) if _accepts(tool.create, "create_kwargs")
                             else tool.create())
            instance_id = created[0] if isinstance(created, tuple) else created
            try:
                extra = {"agent_data": None} if _accepts(tool.execute, "agent_data") else {}
                result = await tool.execute(instance_id, arguments, **extra)
            finally:
                await tool.release(instance_id)
            if not isinstance(result, tuple) or len(result) != 3:
                raise TypeError(f"{type(tool).__name__}.execute returned {type(result).__name__}; verl's API "
                                "returns (response, step reward, metrics)")
            resp, step_reward, metrics = result
            out = {"step_reward": float(step_reward or 0.0)}
            for k, v in (metrics or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[str(k)] = float(v)
            return ToolResponse(text=_text_of(resp), metrics=out)

    VerlToolAdapter.__qualname__ = f"VerlToolAdapter[{type(instance).__name__}:{fn['name']}]"
    return VerlToolAdapter


def _import_class(dotted: str, where: str) -> type:
    module_name, _, cls_name = dotted.rpartition(".")
    if not module_name:
        raise ConfigError(f"{where}: class_name {dotted!r} must be 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - named and re-raised as a config error
        raise ConfigError(f"{where}: cannot import {module_name!r} for class_name {dotted!r}: "
                          f"{type(e).__name__}: {e}") from None
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{where}: {module_name!r} has no class {cls_name!r}")
    return cls


def load_verl_tool_config(path: str | Path) -> list[str]:
    """Register every tool of a verl tool config file; returns their names (once per file per process)."""
    p = Path(path).resolve()
    if str(p) in _LOADED:
        return _LOADED[str(p)]
    if not p.is_file():
        raise ConfigError(f"verl tool config {str(path)!r} does not exist")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"verl tool config {str(path)!r} is not valid YAML: {e}") from None
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"verl tool config {str(path)!r} must hold a non-empty list under 'tools'")
    names = []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ConfigError(f"{where} needs a 'class_name'")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: 'config' must be a mapping")
        kind = config.get("type", "native")
        if kind != "native":
            raise ConfigError(f"{where}: tool type {kind!r} is not supported (only native tools; MCP is not)")
        cls = _import_class(entry["class_name"], where)
        given = entry.get("tool_schema")
        schema_obj = VerlToolSchema.model_validate(_schema_dict(given, where)) if given is not None else None
        try:
            instance = cls(config=dict(config), tool_schema=schema_obj)
        except Exception as e:  # noqa: BLE001 - named and re-raised as a config error
            raise ConfigError(f"{where}: {entry['class_name']}(config=..., tool_schema=...) failed: "
                              f"{type(e).__name__}: {e}") from None
        if schema_obj is None:
            getter = getattr(instance, "get_openai_tool_schema", None)
            if getter is None:
                raise ConfigError(f"{where}: no tool_schema given and {entry['class_name']} has no "
                                  "get_openai_tool_schema()")
            schema = _schema_dict(getter(), where)
        else:
            schema = schema_obj.model_dump()
        register_tool(schema["function"]["name"], make_adapter(instance, schema))
        names.append(schema["function"]["name"])
    _LOADED[str(p)] = names
    return names
