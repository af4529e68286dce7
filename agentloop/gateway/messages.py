"""The gateway's own vocabulary: one chat request and one answer, whichever API they came in by.

    ToolCall        a tool call as the API shows it: id, function name, arguments (JSON text)
    Message         one chat message in canonical form: what history matching compares
    ChatRequest     a parsed request: messages, tools (OpenAI function schemas), limits, streaming
    Completion      one assistant turn as a session backend made it: text, tool calls, finish, usage
    GatewayError    a request the gateway refuses or cannot serve: HTTP status, error type, message
    SessionBackend  what serves a session's requests (agentloop.loops.chat_session.ChatSession)

Canonical form. Both APIs parse into the same Messages: OpenAI's `developer` is `system`; text parts
are joined; Anthropic's `tool_result` blocks become `tool` messages (in their order), its `tool_use`
blocks tool calls, its `system` a first system message. An empty content and a missing one are the
same; tool-call arguments compare as JSON values, so a harness that re-serializes them (other spacing
or key order) still sends back "the same" assistant message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Api = Literal["openai", "responses", "anthropic"]


class GatewayError(Exception):
    """A request the gateway answers with an error: `status` (HTTP), `kind` (the API's error type, e.g.
    invalid_request_error), `code` (OpenAI's error code, e.g. context_length_exceeded) and `param`."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (json.JSONDecodeError, RecursionError, TypeError):
        return text


@dataclass(frozen=True)
class ToolCall:
    id: str
    """The call's id (OpenAI `call_...`, Anthropic `toolu_...`); tool results name it."""
    name: str
    """Function name."""
    arguments: str
    """Arguments as JSON text (OpenAI's `function.arguments`; Anthropic's `input`, serialized)."""

    def key(self) -> tuple[str, str, str]:
        return self.id, self.name, _canonical_json(self.arguments)

    def arguments_value(self) -> Any:
        """The arguments decoded (the raw text when it is not JSON)."""
        try:
            return json.loads(self.arguments)
        except (json.JSONDecodeError, RecursionError):
            return self.arguments


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    """Text content ("" when absent)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Assistant messages: the calls it made."""
    tool_call_id: str | None = None
    """Tool messages: the call answered."""
    name: str | None = None
    """Optional participant name of user/system messages."""

    def key(self) -> tuple[Any, ...]:
        """What two messages must share to be the same message (history matching)."""
        return self.role, self.content, tuple(c.key() for c in self.tool_calls), self.tool_call_id, self.name


@dataclass
class ChatRequest:
    api: Api
    """Which API the request came in by (decides the answer's shape and tool-call id prefix)."""
    messages: list[Message]
    """The conversation, canonical (see the module doc)."""
    tools: list[dict[str, Any]] | None = None
    """Tools as OpenAI function schemas ({"type": "function", "function": {...}}), as given to the chat
    template; None when the request offers none."""
    tool_choice: str = "auto"
    """auto | none | required | the name of one function (only `none` changes what the gateway does: it
    then parses no tool calls; the others cannot be enforced on a sampled policy and are logged)."""
    max_tokens: int | None = None
    """The request's cap on new tokens (it may only lower the gateway's per-call cap)."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (they end the turn; the text returned excludes the one that matched)."""
    stream: bool = False
    """Answer as a stream (SSE) rather than one JSON body."""
    include_usage: bool = False
    """OpenAI streaming: end with a usage chunk (stream_options.include_usage)."""
    model: str = ""
    """The model name the request gave (echoed back; the policy is served whatever it says)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Sampling knobs the request set (temperature, top_p, ...): never applied, compared with the
    training policy's and logged when they differ."""
    ignored: list[str] = field(default_factory=list)
    """Other request fields the gateway cannot honour (logged once each)."""


@dataclass
class Completion:
    content: str
    """The assistant text returned (tool-call markup removed when calls were parsed)."""
    tool_calls: list[ToolCall]
    """Parsed tool calls (ids minted by the session)."""
    finish: Literal["stop", "length", "tool_calls"]
    """stop: the model ended its turn (or a stop string did); length: the token cap cut it; tool_calls:
    it called tools."""
    prompt_tokens: int
    """Tokens the model read for this turn."""
    completion_tokens: int
    """Tokens it sampled."""
    id: str
    """Id of the answer (chatcmpl-... / msg_...)."""
    stop_sequence: str | None = None
    """The request's stop string that ended the turn, if one did."""

    def message(self) -> Message:
        """The answer as the canonical assistant message a harness sends back in its next request."""
        return Message(role="assistant", content=self.content, tool_calls=tuple(self.tool_calls))


class SessionBackend(Protocol):
    """Serves one session's requests (one episode). Raises GatewayError for requests it refuses; any other
    exception is answered 500/503 and is the backend's to remember (it fails the episode)."""

    async def complete(self, request: ChatRequest) -> Completion: ...


def text_of(value: Any, where: str, *, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message content as text: a string, null, or a list of text parts/blocks (joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise bad_request(f"{where}[{i}] must be an object, got {type(part).__name__}", where)
            kind = part.get("type")
            if kind not in part_types:
                raise bad_request(f"{where}[{i}] has type {kind!r}; the gateway serves text only "
                                  f"(supported here: {', '.join(part_types)})", where)
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}[{i}].text must be a string", where)
            out.append(text)
        return "".join(out)
    raise bad_request(f"{where} must be a string or a list of text parts, got {type(value).__name__}", where)


__all__ = ["Api", "ChatRequest", "Completion", "GatewayError", "Message", "SessionBackend", "ToolCall",
           "bad_request", "text_of"]
