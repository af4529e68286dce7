"""The built-in `python` tool: runs the model's code in the sandbox (agentloop.tools.sandbox)."""

from __future__ import annotations

from typing import Any

from agentloop.tools.base import BaseTool, ToolResponse
from agentloop.tools.registry import register_tool
from agentloop.tools.sandbox import SandboxLimits, loop_semaphore, run_python


@register_tool("python")
class PythonTool(BaseTool):
    """Executes a Python program in a fresh sandbox and returns what it printed.

    Each call is a new sandbox (no state carries over between calls); everything a call started is gone
    when it returns, so `release` has nothing left to clean. Row kwargs may set `timeout_s` (capped by the
    config's value). Metrics per call: wall_s, cpu_s, reason_<reason>, isolated (0 when the sandbox runs
    unisolated, see `tools.python.allow_unisolated`), oom_kills.
    """

    name = "python"
    idempotent = True  # a fresh sandbox per call, nothing kept: a call cut by a kill is run again
    description = ("Run a Python 3 program in a sandbox and return its stdout and stderr. "
                   "Each call starts fresh; print the values you need. No network access.")
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The complete program to run."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    async def create(self, episode: Any, **kwargs: Any) -> dict[str, Any]:
        limits = SandboxLimits(**self.config.python.model_dump(exclude={"max_concurrent"}))
        if "timeout_s" in kwargs:
            limits = limits.model_copy(update={"timeout_s": min(float(kwargs["timeout_s"]), limits.timeout_s)})
        return {"limits": limits, "runs": 0}

    async def execute(self, instance: dict[str, Any], arguments: dict[str, Any]) -> ToolResponse:
        limits: SandboxLimits = instance["limits"]
        async with loop_semaphore("python_tool", self.config.python.max_concurrent):
            res = await run_python(arguments["code"], limits)
        instance["runs"] += 1
        metrics = {"wall_s": res.wall_s, "cpu_s": res.cpu_s, f"reason_{res.reason}": 1.0,
                   "isolated": float(res.backend != "none"), "oom_kills": float(res.oom_kills)}
        error = None if res.reason == "ok" else res.reason
        return ToolResponse(text=res.summary(limits), metrics=metrics, error=error)
