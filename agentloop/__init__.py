"""agentloop: an asyncio agent-loop engine for agentic RL of LLMs on SGLang, token-in/token-out.

Public API (kept true by tests/test_public_api.py):
    AgentLoopBase, AgentLoopOutput, TokenOutput, EpisodeRecord, Sample, SamplingParams,
    register_agent_loop, get_agent_loop, ServerManager, Config, load_config
Add a loop: subclass AgentLoopBase, write `async run(sample, sampling_params)`, register it.
"""

from agentloop.config import Config, SamplingParams, load_config
from agentloop.loops import AgentLoopBase, get_agent_loop, register_agent_loop
from agentloop.records import AgentLoopOutput, EpisodeRecord, TokenOutput
from agentloop.sample import Sample
from agentloop.server_manager import ServerManager

__version__ = "0.1.0"

__all__ = [
    "AgentLoopBase",
    "AgentLoopOutput",
    "Config",
    "EpisodeRecord",
    "Sample",
    "SamplingParams",
    "ServerManager",
    "TokenOutput",
    "get_agent_loop",
    "load_config",
    "register_agent_loop",
]
