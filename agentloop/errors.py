"""The exception hierarchy of agentloop, in one place.

    AgentLoopError
    ├── ConfigError            bad config value, override or plugin
    ├── DataError              malformed data row (names file and line)
    ├── RewardError            reward function missing or failing to load
    ├── ServerError            anything about inference servers
    │   ├── ServerStartError   a local server did not come up (carries its log tail)
    │   ├── RequestError       one /generate call failed
    │   │   ├── RetryableError     transport error, 5xx, timeout: worth another server
    │   │   └── FatalRequestError  4xx or bad response: retrying cannot help
    │   ├── RetryBudgetExhausted   retries of one call ran out of time or attempts
    │   └── AllServersDownError    no healthy server left: the run must stop
    └── EpisodeError           an episode-level failure a loop raises on purpose
        ├── PromptTooLongError the prompt does not fit the context
        ├── EpisodeTimeout     the episode ran past rollout.episode_timeout_s (the engine's)
        ├── ToolLifecycleTimeout  a tool's create ran past tools.lifecycle_timeout_s (the environment's)
        └── AgentError         your agent (openai_agent_loop) crashed, answered badly or made no request
            ├── AgentTimeoutError  it ran past agent.timeout_s
            └── AgentPolicyError   it failed on what the policy produced (a context overflow, a tool call
                                   its SDK could not use), as the gateway recorded it

Inside the engine, every exception raised by an episode becomes an error record
(type + message), except AllServersDownError, which stops the run after the records
already made are flushed. A reward that raises or times out is not an error record: the
episode scores `reward.failure_score`, counted (agentloop.rollout.scorer).

Whose fault a failed episode is, for training (`failure_kind`, the one place that decides):
    policy   the sampled output caused it: the episode (or the user agent of openai_agent_loop) ran past its
             timeout (too many turns, tool calls, tokens), or the user agent failed after the gateway saw the
             policy overflow the context or make a tool call the harness cannot use (AgentPolicyError). It
             stays in its GRPO group at `reward.failure_score`, with the tokens it made; a reward that rejected
             the output (raised, timed out) already scored it so. Only the episode's own deadline is a
             policy timeout: a TimeoutError an environment raises inside a loop is the environment's.
    infra    anything else: a server aborted the request, the retry budget ran out, every server went
             down, the loop or a plugin raised (an environment's timeout included), the prompt does not fit,
             no reward applies. Its whole group is left out of training (never a partial group).
"""

from __future__ import annotations

from typing import Literal

FailureKind = Literal["ok", "policy", "infra"]

POLICY_ERRORS = frozenset({"EpisodeTimeout", "AgentTimeoutError", "AgentPolicyError"})
"""Error types (the `Type` of a record's `Type: message`) that the sampled output caused."""


def failure_kind(error: str | None, finish_reason: str) -> FailureKind:
    """ok (a normal episode: any finish, length included), policy or infra; see the module doc."""
    if error is None:
        return "infra" if finish_reason == "abort" else "ok"
    return "policy" if error.split(":", 1)[0].strip() in POLICY_ERRORS else "infra"


class AgentLoopError(Exception):
    """Base class of every error agentloop raises on purpose."""


class ConfigError(AgentLoopError, ValueError):
    """A config value, CLI override or plugin reference is invalid."""


class DataError(AgentLoopError, ValueError):
    """A data file or row is malformed; the message names the file and line."""


class RewardError(AgentLoopError):
    """A reward function cannot be found, loaded, or returned something unusable."""


class ServerError(AgentLoopError):
    """Base class for inference-server problems."""


class ServerStartError(ServerError):
    """A local SGLang server failed to start; the message ends with its log tail."""


class RequestError(ServerError):
    """One request to one server failed."""

    def __init__(self, message: str, *, server: str | None = None, status: int | None = None):
        super().__init__(message)
        self.server = server
        self.status = status


class RetryableError(RequestError):
    """Transport error, HTTP 5xx or timeout: another attempt (elsewhere) may succeed."""


class FatalRequestError(RequestError):
    """HTTP 4xx or an unusable response: retrying the same request cannot help."""


class RetryBudgetExhausted(ServerError):
    """A request was retried until its total time or attempt budget ran out."""


class AllServersDownError(ServerError):
    """Every server is ejected or gone; the run cannot make progress."""


class EpisodeError(AgentLoopError):
    """An episode-level failure raised on purpose by a loop."""


class PromptTooLongError(EpisodeError):
    """The prompt (plus at least one new token) does not fit the model's context."""


class EpisodeTimeout(EpisodeError):
    """The episode ran past `rollout.episode_timeout_s`; the engine keeps the turns it finished."""


class ToolLifecycleTimeout(EpisodeError):
    """A tool's create (or another lifecycle call that must finish) ran past `tools.lifecycle_timeout_s`."""


class EnvError(EpisodeError):
    """An environment library's environment failed: it raised, its server is down or answered an error, an
    observation is not text, a rubric returned no reward. The message is the library's own."""


class AgentError(EpisodeError):
    """A user agent run by openai_agent_loop failed: it raised, its command exited non-zero, its result was
    unusable, or it never called the model."""


class AgentTimeoutError(AgentError):
    """A user agent ran past agent.timeout_s (it was cancelled, its process group killed)."""


class AgentPolicyError(AgentError):
    """A user agent failed after the policy overflowed the context or made a tool call the harness could not use
    (the gateway recorded it): the policy's failure, trained at `reward.failure_score` with its tokens."""
