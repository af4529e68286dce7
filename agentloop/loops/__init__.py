"""Agent loops. To add one: subclass AgentLoopBase, write `async run(sample, sampling_params)`,
and register it with `register_agent_loop("name", Cls)` (or as a class decorator)."""

from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.loops.registry import get_agent_loop, list_agent_loops, load_plugin, register_agent_loop
from agentloop.loops import single_turn  # noqa: F401 - registers single_turn_agent_loop
from agentloop.loops import tool_agent  # noqa: F401 - registers tool_agent_loop

__all__ = ["AgentLoopBase", "TrajectoryBuilder", "get_agent_loop", "list_agent_loops", "load_plugin",
           "register_agent_loop"]
