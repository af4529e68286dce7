"""agentloop: an asyncio agent-loop engine for agentic RL of LLMs on SGLang, token-in/token-out.

Public API (`__all__`, kept true both ways by tests/unit/test_public_api.py):
    AgentLoopBase, AgentLoopOutput, TokenOutput, EpisodeRecord, Sample, SamplingParams,
    register_agent_loop, get_agent_loop, ServerManager, Config, load_config

Add a loop: subclass AgentLoopBase, write `async run(sample, sampling_params)`, register it.

Dependency rule (checked by tests/unit/test_layout.py, which reads the table below). Each line is a
layer, highest first. A module may import modules of its own layer and of the layers below it, never
of a layer above; function-local imports count too, and no import cycle is allowed. So `bench`,
`report` and `cli` are imported by nothing in the core below them, and the vocabulary imports only
itself. Nothing inside the package imports this file (the public API re-exports only).

    layer       where                                    role
    cli         cli.py                                   the command line
    bench       bench/                                   benchmarks (`agentloop bench ...`)
    tinker      tinker/                                  the Tinker-compatible service (`agentloop tinker serve`)
    cluster     cluster/                                 the Ray backend of `agentloop train`: server and learner actors
    train       train/                                   `agentloop train`, in rooms by process role (their own table: agentloop/train/__init__.py)
    rollout     rollout/                                 the engine, scoring, run summary, `agentloop rollout`
    report      report/                                  progress line, step log, curves, trace pages
    models      models/                                  tiny model, warm start, model and tokenizer loading
    loops       loops/                                   agent loops and their registry
    gateway     gateway/                                 the OpenAI/Anthropic-compatible HTTP gateway for your own agents
    data        data/                                    verl rows from files and built-in sets
    rewards     rewards/                                 reward functions by data_source
    tools       tools/                                   tools, tool-call parsers, the sandbox
    inference   inference/                               SGLang servers we launch (and the CPU op fallback)
    client      server_manager.py routing.py interrupt.py client/  the inference client (its parts in client/), interrupt modes
    journal     journal/                                 the episode journal: rollout state kept across a crash, replay
    util        util/                                    cache, run dirs, atomic writes, registries, event loop
    vocabulary  config.py records.py errors.py envs_config.py train/config.py tools/config.py tools/sandbox/limits.py rewards/config.py gateway/config.py journal/config.py
"""

from agentloop.config import Config, SamplingParams, load_config
from agentloop.loops import AgentLoopBase, get_agent_loop, register_agent_loop
from agentloop.records import AgentLoopOutput, EpisodeRecord, Sample, TokenOutput
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
