"""AgentConfig and GatewayConfig: settings of `openai_agent_loop` (mounted as `config.agent`) and of the
HTTP gateway it serves user agents through (`config.gateway`). Vocabulary: imports pydantic only."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class AgentConfig(_Section):
    entry: str | None = None
    """`path/to/file.py:fn` or `package.module:fn`: `async def fn(sample, base_url, api_key)` run in this
    process once per episode; it returns a reward (float), a dict ({"reward": x, ...}) or None (the
    data_source's reward then scores the last assistant message). Must not block the event loop."""
    command: str | None = None
    """A shell command run once per episode in its own process group (any language, any SDK) with
    OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY, AGENTLOOP_EPISODE_ID and
    AGENTLOOP_RESULT_FD set and the task as JSON on stdin (without the answer unless `send_answer`); it may
    write its result ({"reward": x, ...}) as JSON on the file descriptor AGENTLOOP_RESULT_FD names (never
    stdout, which the model's text can reach). No isolation beyond the process group (wrap it, e.g. in bwrap,
    for more). Exclusive with `entry`."""
    send_answer: bool = False
    """Give the agent the whole sample: `ground_truth`, `extra_info` and `tools_kwargs` (which may hold the
    answer) on a command's stdin and in an entry's `sample`. Off: the agent gets the task only (episode_id,
    index, uid, repeat, data_source, messages); turn it on only for a harness that scores itself and is
    trusted not to show the answer to the policy."""
    workers: int = Field(default=0, ge=0)
    """0: `command` runs once per episode (a process each). N > 0: `command` is a long-lived harness worker
    started N times, each taking up to `worker_concurrency` episodes at once over the protocol of
    agentloop.loops.agent_workers (episodes as JSON lines on its stdin, results on AGENTLOOP_RESULT_FD), so its
    SDK is imported once per worker, not once per episode."""
    worker_concurrency: int = Field(default=8, ge=1)
    """Episodes one worker runs at once (`workers` > 0)."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Wall-time limit of one agent run; past it the agent is cancelled (its process group killed) and the
    episode becomes an error record."""
    max_concurrency: int | None = Field(default=None, ge=1)
    """Agents running at once in this process (None: rollout.max_concurrency bounds them)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of a `command` (on top of this process's environment); numbers and booleans
    are written as text (`agent.env.X=1` is "1", true is "true")."""
    cwd: str | None = None
    """Working directory of a `command` (None: this process's)."""
    max_tokens_per_call: int | None = Field(default=None, ge=1)
    """New-token cap of one model request (None: sampling.max_new_tokens). A request's own max_tokens may
    only lower it; the model's context always bounds it."""
    output_limit_bytes: int = Field(default=1 << 20, ge=1024)
    """A `command`'s stdout and stderr are kept up to this many trailing bytes each (the stderr tail goes into the
    error message; stdout is never read for the result), and its result on AGENTLOOP_RESULT_FD may be this long
    at most (longer: an AgentError)."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_text(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for k, x in v.items():
            if isinstance(x, bool):
                x = "true" if x else "false"
            elif isinstance(x, (int, float)):
                x = str(x)
            elif not isinstance(x, str):
                raise ValueError(f"agent.env.{k} must be a string, number or boolean, got {type(x).__name__}")
            out[k] = x
        return out

    @model_validator(mode="after")
    def _one_way(self) -> "AgentConfig":
        if self.entry and self.command:
            raise ValueError("set agent.entry or agent.command, not both")
        if self.workers and not self.command:
            raise ValueError("agent.workers needs agent.command (the worker to start)")
        return self


class GatewayConfig(_Section):
    host: str = "127.0.0.1"
    """Interface the gateway listens on (keep it local: the per-episode key is its only access control)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the gateway; 0 picks a free one at start."""
    max_request_mb: float = Field(default=64.0, gt=0)
    """Largest request body accepted (a bigger one is answered 413)."""
    shutdown_timeout_s: float = Field(default=5.0, gt=0)
    """Grace given to open connections when the gateway closes at the end of the run."""


__all__ = ["AgentConfig", "GatewayConfig"]
