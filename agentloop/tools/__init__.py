"""Tools for tool_agent_loop.

To add a tool: subclass BaseTool (set `name`, `description`, `parameters`; write `async execute`;
optionally `create`, `reward`, `release`) and register it with `register_tool("name", Cls)` (or as a
class decorator) in a module listed in `plugins`. Name it in `tools.names`, or in a row's `tools_kwargs`.

Built-ins: python (sandboxed subprocess), calculator (AST arithmetic), search (BM25 over a JSONL corpus).
Tool-call parsers (hermes, llama3_json, qwen3_coder) live in `agentloop.tools.parsers`; the sandbox
that runs model-written code in `agentloop.tools.sandbox`.

May import: the vocabulary and util only (loops, rewards and models build on tools, never the reverse).
"""

from agentloop.tools import calculator, python_tool, search  # noqa: F401 - register the built-ins
from agentloop.tools.base import BaseTool, ToolResponse
from agentloop.tools.config import PythonToolConfig, SearchToolConfig, ToolsConfig
from agentloop.tools.parsers import (
           ParseResult,
           ToolCall,
           get_parser,
           list_parsers,
           register_parser,
)
from agentloop.tools.registry import get_tool, list_tools, register_tool
from agentloop.tools.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = ["BaseTool", "ParseResult", "PythonToolConfig", "SandboxLimits", "SandboxResult", "SearchToolConfig",
           "ToolCall", "ToolResponse", "ToolsConfig", "get_parser", "get_tool", "list_parsers", "list_tools",
           "register_parser", "register_tool", "run_python"]
