"""BaseTool, the class a tool author subclasses, and ToolResponse, what a call returns.

Life cycle within one episode (driven by tool_agent_loop):

    tool = ToolCls(config)                       once per episode (cheap; share heavy state at module level)
    inst = await tool.create(sample, **kwargs)   kwargs = the row's tools_kwargs[tool.name]
    resp = await tool.execute(inst, arguments)   any number of times, arguments already schema-checked
    r    = await tool.reward(inst)               optional: a tool-side reward (None = no opinion)
    await tool.release(inst)                     always, in `finally`

An exception raised by `execute` becomes the tool message `error: Type: message` and is counted;
it never ends the episode.

With the episode journal (agentloop.journal) a call's result is journaled; a resumed episode gets it back without
the call running again. `idempotent` and `stateful` say what may be run again: a call running at a kill is run
again only when the tool is idempotent (else the episode ends as an error record naming it), and a stateful
tool's journaled calls are run again on a resume to rebuild its instance (idempotent ones only; else the episode
restarts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from agentloop.tools.schema import validate

if TYPE_CHECKING:
    from agentloop.records import Sample
    from agentloop.tools.config import ToolsConfig


class ToolResponse(BaseModel):
    """What one tool call returns to the loop."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    text: str = ""
    """The tool message the model reads."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Numbers to aggregate per episode (summed, reported as `tool/<name>/<key>`)."""
    error: str | None = None
    """Set when the call failed; the loop counts it as a tool error (the text still goes to the model)."""


class BaseTool(ABC):
    """Base class of tools. Set `name`, `description` and `parameters` (a JSON schema), write `execute`."""

    name: ClassVar[str] = ""
    """Name the model calls the tool by (set by register_tool when empty)."""
    description: ClassVar[str] = ""
    """One or two sentences for the model."""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    """JSON schema of the arguments object."""
    idempotent: ClassVar[bool] = False
    """Running a call twice does no more than running it once (a pure function, a read, a fresh sandbox per call):
    a call running when a run was killed is then run again on resume. False (the default): such an episode ends as
    an error record naming the tool (its group's prompt is given out again)."""
    stateful: ClassVar[bool] = False
    """The instance keeps what earlier calls did (a session, a counter a tool reward reads): on a resume its
    journaled calls are run again, in order, to rebuild it (the model still sees their journaled results), which
    needs `idempotent`; a stateful tool that is not idempotent makes its resumed episodes restart."""
    verl_style: ClassVar[bool] = False
    """True for the tools of a verl tool config (agentloop.tools.verl_tools): tool_agent_loop hands them
    `tools_kwargs[name].create_kwargs` only, as verl does."""

    def __init__(self, config: "ToolsConfig | None" = None):
        from agentloop.tools.config import ToolsConfig

        self.config = config or ToolsConfig()

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema given to the chat template."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def validate_arguments(self, arguments: Any) -> list[str]:
        """Problems of `arguments` against `parameters` (empty when valid)."""
        return validate(arguments, self.parameters)

    async def create(self, episode: "Sample", **kwargs: Any) -> Any:
        """Per-episode state (default: the kwargs dict)."""
        return dict(kwargs)

    @abstractmethod
    async def execute(self, instance: Any, arguments: dict[str, Any]) -> ToolResponse:
        """Run one call with validated arguments."""

    async def reward(self, instance: Any) -> float | None:
        """A tool-side reward for the episode, or None."""
        return None

    async def release(self, instance: Any) -> None:  # noqa: B027 - optional: most tools hold nothing to free
        """Free the instance's resources (always called)."""
