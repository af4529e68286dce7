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
`schema.function.name`, `.model_dump()`), and keeps a `BaseTool` adapter per schema function name for that
file (`verl_tool_classes(path)`), apart from the global tool registry: a verl tool named like one of ours
(verl's `search`) is the file's tool wherever the file is given, and our built-in keeps its name elsewhere.
verl's own example classes (`verl.tools.search_tool.SearchTool`, `verl.tools.gsm8k_tool.Gsm8kTool`) load
without verl installed: agentloop.tools.verl_ports implements them.

tool_agent_loop drives them as verl's tool agent loop does (agentloop.loops.tool_agent): every tool of the
file is offered to every row; a row's `extra_info.tools_kwargs[name].create_kwargs` (else {}) is what
`create` gets; arguments reach `execute` as the model wrote them (no schema check: verl has none); calls
beyond `tools.max_tool_calls_per_turn` are dropped without a message (verl's max_parallel_calls); each
call's step reward is listed in the reward's `extra_info["tool_rewards"]`.

Per call: `create(create_kwargs=...)` (a str or an (id, response) tuple back), `execute(id, arguments
[, agent_data=None])` -> (response, step reward, metrics) with a response that is a str, has `.text`, or is
a {"text": ...} dict, then `release(id)` always. The step reward also goes to the call's metrics
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


class VerlToolEntry(BaseModel):
    """One tool of a verl tool config file, as loaded."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    """The schema's function name: what the model calls and what rows' tools_kwargs name."""
    class_name: str
    """The file's class_name."""
    implementation: str
    """The class actually used: class_name itself, or agentloop's port of it (verl not installed)."""
    cls: Any
    """The BaseTool adapter class."""


_LOADED: dict[str, list[VerlToolEntry]] = {}


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
        verl_style = True

        def validate_arguments(self, arguments: Any) -> list[str]:
            return []  # verl hands the model's arguments to the tool as they are; the tool decides

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


def _import_class(dotted: str, where: str) -> tuple[type, str]:
    """(the class, the dotted name of the class used): verl's example classes fall back to our ports when
    verl is not installed."""
    from agentloop.tools.verl_ports import PORTS

    module_name, _, cls_name = dotted.rpartition(".")
    if not module_name:
        raise ConfigError(f"{where}: class_name {dotted!r} must be 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if dotted in PORTS and (e.name or "").split(".")[0] in ("verl", "ray"):
            port = PORTS[dotted]
            mod, _, name = port.rpartition(".")
            return getattr(importlib.import_module(mod), name), port
        raise ConfigError(f"{where}: cannot import {module_name!r} for class_name {dotted!r}: "
                          f"{type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 - named and re-raised as a config error
        raise ConfigError(f"{where}: cannot import {module_name!r} for class_name {dotted!r}: "
                          f"{type(e).__name__}: {e}") from None
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{where}: {module_name!r} has no class {cls_name!r}")
    return cls, dotted


def load_verl_tool_config(path: str | Path) -> list[str]:
    """Load every tool of a verl tool config file (once per file per process); returns their names."""
    return [e.name for e in verl_tool_entries(path)]


def verl_tool_classes(path: str | Path) -> dict[str, type[BaseTool]]:
    """The file's tools by name, in file order: BaseTool adapter classes (loaded once per file)."""
    return {e.name: e.cls for e in verl_tool_entries(path)}


def verl_tool_entries(path: str | Path) -> list[VerlToolEntry]:
    """The file's tools as loaded (name, class_name, the implementation used, the adapter)."""
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
    loaded: list[VerlToolEntry] = []
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
        cls, used = _import_class(entry["class_name"], where)
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
        name = schema["function"]["name"]
        if any(e.name == name for e in loaded):
            raise ConfigError(f"{where}: a second tool named {name!r} in {str(path)!r}")
        loaded.append(VerlToolEntry(name=name, class_name=entry["class_name"], implementation=used,
                                    cls=make_adapter(instance, schema)))
    _LOADED[str(p)] = loaded
    return loaded
