"""Agent loops. To add one: subclass AgentLoopBase, write `async run(sample, sampling_params)`,
and register it with `register_agent_loop("name", Cls)` (or as a class decorator).

    registry.py     register/get/list, plugin files and modules, the `agentloop.loops` entry points
    base.py         AgentLoopBase (generate, chat template) and TrajectoryBuilder (ids, mask, logprobs)
    single_turn.py  single_turn_agent_loop
    tool_agent.py   tool_agent_loop: generate, parse calls, run tools, append their tokens, repeat
    openai_agent.py openai_agent_loop: your own agent (any SDK or command) through the gateway (agentloop.gateway)
    chat_session.py the gateway session of one episode: requests -> exact token ids, segments
    agent_command.py an agent command per episode: process group, deadline, output tail, result channel
    agent_workers.py long-lived harness workers (agent.workers): episodes over a JSON-lines protocol
    search_r1.py    search_r1_agent_loop: Search-R1's <search>/<information>/<answer> protocol
    template.py     chat-template diffing (append-only check, the turn suffix, glue vs content of new messages)
    env_tokens.py   environment text as plain text: no control token (`<|im_end|>`...) can come out of it
    env_chat.py     a conversation with a text environment, token-exact (the environment loops below share it)
    openenv_env.py  openenv_loop: an OpenEnv environment server by URL (its WebSocket session protocol)
    textarena_env.py textarena_loop: a TextArena game, single-player or against a fixed opponent
    verifiers_env.py verifiers_loop: a verifiers environment's own rollout code, in its own virtualenv, through
                    the gateway; verifiers_worker.py is that worker (run by the verifiers env's Python)

May import: the vocabulary, util, the client (server_manager), tools and the gateway.
"""

from agentloop.loops import (
           openai_agent,  # noqa: F401 - registers openai_agent_loop
           openenv_env,  # noqa: F401 - registers openenv_loop
           search_r1,  # noqa: F401 - registers search_r1_agent_loop
           single_turn,  # noqa: F401 - registers single_turn_agent_loop
           textarena_env,  # noqa: F401 - registers textarena_loop
           tool_agent,  # noqa: F401 - registers tool_agent_loop
           verifiers_env,  # noqa: F401 - registers verifiers_loop
)
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.loops.registry import (
           get_agent_loop,
           list_agent_loops,
           load_plugin,
           register_agent_loop,
)

__all__ = ["AgentLoopBase", "TrajectoryBuilder", "get_agent_loop", "list_agent_loops", "load_plugin",
           "register_agent_loop"]
