"""The gateway: an OpenAI- and Anthropic-compatible HTTP server inside the engine process through which
your own agent (any SDK, any harness) is trained, with the exact token ids recorded at the engine seam.

    config.py        AgentConfig (`agent.*`) and GatewayConfig (`gateway.*`): vocabulary
    messages.py      the gateway's own request/answer types, whatever API a call came in by
    openai_api.py    Chat Completions: request -> ChatRequest, Completion -> JSON or SSE chunks
    responses_api.py Responses (the Agents SDK's default): input items -> ChatRequest, Completion -> the response
                     object or its SSE events
    anthropic_api.py Messages: request -> ChatRequest, Completion -> JSON or the event stream
    server.py        the aiohttp server: routes /s/{session}/v1/..., per-session keys, one gateway per
                     ServerManager (started on first use in a context of its own, closed with it)

What happens to the tokens is not here: a session backend (agentloop.loops.chat_session) turns each
ChatRequest into token ids, generates through the ServerManager and answers with a Completion. The
gateway sits below the loops layer and never imports it; `openai_agent_loop` (agentloop.loops) opens
one session per episode. Import the submodules directly (this file imports nothing, so the config tree
can read gateway/config.py without starting aiohttp).
"""
