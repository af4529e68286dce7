"""ToolsConfig: settings of the tool layer and of `tool_agent_loop` (mounted as `config.tools`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentloop.tools.sandbox.limits import SandboxLimits


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class PythonToolConfig(SandboxLimits):
    """Settings of the built-in `python` tool: the sandbox limits plus a global concurrency cap."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    max_concurrent: int = Field(default=4, ge=1)
    """Sandboxed programs running at once in this process, over all episodes."""


class SearchToolConfig(_Section):
    url: str | None = None
    """A retrieval service speaking Search-R1's API (POST {queries, topk, return_scores} to this URL, e.g.
    http://127.0.0.1:8000/retrieve: Search-R1's e5/BM25 servers or `agentloop retriever serve`).
    None: BM25 over `corpus_path` in this process."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one request to the retrieval service (all attempts together)."""
    max_attempts: int = Field(default=3, ge=1)
    """Attempts per request on connection errors and HTTP 5xx (a 4xx is not retried)."""
    corpus_path: str | None = None
    """JSONL corpus of {id, title, text} or Search-R1's {id, contents}; None uses the bundled demo corpus."""
    top_k: int = Field(default=3, ge=1, le=50)
    """Passages returned per query (the model may ask for fewer)."""
    max_passage_chars: int = Field(default=600, ge=50)
    """Passages are cut to this many characters in the result."""
    k1: float = Field(default=1.2, ge=0)
    """BM25 term-frequency saturation."""
    b: float = Field(default=0.75, ge=0, le=1)
    """BM25 length normalisation."""


class ToolServiceConfig(_Section):
    """`agentloop tools serve` (agentloop.tools.service): where it listens and its limits."""

    host: str = "127.0.0.1"
    """Interface to bind. Any other than localhost needs the shared secret AGENTLOOP_TOOLS_TOKEN (it runs code) and
    TLS (`tls_cert` and `tls_key`): the token would otherwise travel in plain HTTP."""
    tls_cert: str | None = None
    """PEM certificate (chain) the service presents over HTTPS; with `tls_key`. Clients reach it as https://...
    and verify it against the system CAs or `tools.server_ca_file`."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    port: int = Field(default=8200, ge=0, le=65535)
    """Port to listen on (0: a free one, printed)."""
    lease_s: float = Field(default=1800.0, gt=0)
    """An instance not touched for this long (every call renews it) is released: its episode vanished."""
    max_concurrent_calls: int = Field(default=512, ge=1)
    """Tool calls executing at once over all instances; the others wait their turn."""
    max_call_timeout_s: float = Field(default=300.0, gt=0)
    """Upper bound on one call (create, execute, reward, release), whatever the client asks."""
    max_instances: int = Field(default=100_000, ge=1)
    """Live instances at most; creates beyond it are refused (HTTP 503)."""
    sandbox_tools: list[str] = Field(default_factory=lambda: ["python"])
    """Tools whose calls each start a sandbox process: paced by `sandbox_start_rate`."""
    sandbox_start_rate: float = Field(default=100.0, gt=0)
    """Sandbox starts per second at most (a token bucket with a burst of one second's worth)."""


class ToolsConfig(_Section):
    names: list[str] = Field(default_factory=list)
    """Tools every episode gets; a row's `tools_kwargs` keys add more (and every tool of `verl_tool_config`)."""
    verl_tool_config: str | None = None
    """verl's tool config YAML (its `multi_turn.tool_config_path`): each `class_name` (a class with verl's
    tool API) is loaded and, as in verl, offered to every row under its schema's function name, ahead of a
    built-in tool of the same name (agentloop.tools.verl_tools says how its tools are driven)."""
    parser: str = "hermes"
    """Registered tool-call parser (hermes, llama3_json, qwen3_coder, or a plugin's)."""
    max_turns: int = Field(default=8, ge=1)
    """Assistant turns (generate calls) per episode."""
    max_response_tokens: int = Field(default=4096, ge=1)
    """Token budget of the whole response (model + tool tokens) per episode."""
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    """Cap on one turn's new tokens. None: tool_agent_loop gives each turn what is left of
    `max_response_tokens` (and of the context), verl's rule (its only cap is the remaining response length);
    search_r1_agent_loop gives each turn sampling.max_new_tokens (Search-R1's per-turn max_response_length)."""
    max_tool_calls_per_turn: int = Field(default=4, ge=1)
    """Calls executed per assistant turn (verl's rollout.multi_turn.max_parallel_calls); what happens to the
    others: `excess_calls`."""
    excess_calls: Literal["message", "drop"] | None = None
    """A turn's calls beyond `max_tool_calls_per_turn`: message: not run, each answered by an error message;
    drop: not run and not answered (verl drops them silently). None: drop with `verl_tool_config` set, else
    message."""
    max_parallel_calls: int = Field(default=4, ge=1)
    """Calls of one turn running concurrently (ours: verl runs all of a turn's calls at once)."""
    lifecycle_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of a tool's create, reward and release call in tool_agent_loop: a create past it fails the episode
    (ToolLifecycleTimeout, the environment's failure), a reward past it gives no tool reward and a release past
    it is abandoned (each counted), so a hanging tool never holds an episode, a timed-out one included."""
    tool_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one tool call (asyncio.wait_for); past it the call's message says it timed out."""
    max_tool_response_tokens: int = Field(default=512, ge=8)
    """Tool messages longer than this (in tokens) are cut, with a marker saying so."""
    continue_after_length: bool = True
    """A turn cut by its token cap still runs the complete tool calls it holds (else the episode ends)."""
    free_calls: int | None = Field(default=None, ge=0)
    """Tool calls per episode free of penalty; None: no penalty."""
    excess_call_penalty: float = Field(default=0.0, ge=0)
    """Penalty per call beyond `free_calls` (reported in extra['tool_penalty']; the engine applies it)."""
    check_template: bool = True
    """Check once per tokenizer that the chat template is append-only for tool turns (ConfigError if not)."""
    python: PythonToolConfig = Field(default_factory=PythonToolConfig)
    """The `python` tool's sandbox."""
    server_url: list[str] = Field(default_factory=list)
    """Tool services (`agentloop tools serve`) running the episodes' tools instead of this process; several are
    balanced (least live instances; a failing one is skipped for a while). Empty: tools run here."""
    remote_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of a remote create, reward or release call (execute has `tool_timeout_s`)."""
    server_ca_file: str | None = None
    """PEM CA bundle that signed the tool services' certificates (https:// URLs; None: the system CAs)."""
    allow_unisolated_service: bool = False
    """Accept a tool service whose catalog says it runs a sandboxed tool (model-written code) without isolation
    (its host has no working sandbox and it was started with tools.python.allow_unisolated=true). Off: episodes
    using it are error records naming the tools."""
    service: ToolServiceConfig = Field(default_factory=ToolServiceConfig)
    """`agentloop tools serve`: bind address and limits."""
    search: SearchToolConfig = Field(default_factory=SearchToolConfig)
    """The `search` tool's corpus and ranking."""

    @model_validator(mode="after")
    def _checks(self) -> "ToolsConfig":
        if self.max_parallel_calls > self.max_tool_calls_per_turn:
            self.__dict__["max_parallel_calls"] = self.max_tool_calls_per_turn
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"tools.names has duplicates: {self.names}")
        return self
