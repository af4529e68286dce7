"""The tool registry: an explicit dict plus register/get (the built-ins register on import)."""

from __future__ import annotations

from typing import Callable, TypeVar, overload

from agentloop.errors import ConfigError
from agentloop.tools.base import BaseTool
from agentloop.util.registries import admit_class

_TOOLS: dict[str, type[BaseTool]] = {}

T = TypeVar("T", bound=type[BaseTool])


@overload
def register_tool(name: str, cls: None = None, *, override: bool = False) -> Callable[[T], T]: ...
@overload
def register_tool(name: str, cls: T, *, override: bool = False) -> T: ...


def register_tool(name, cls=None, *, override=False):
    """Register tool class `cls` under `name`; without `cls`, return a class decorator.

    A taken name is an error unless `override=True`; re-registering the same class is a no-op.
    """

    def _register(c):
        admit_class(_TOOLS, "tool", name, c, BaseTool, override)
        if not c.name:
            c.name = name
        return c

    if cls is None:
        return _register
    return _register(cls)


def get_tool(name: str) -> type[BaseTool]:
    """The tool class registered under `name` (the built-ins register when the package is imported)."""
    try:
        return _TOOLS[name]
    except KeyError:
        raise ConfigError(f"unknown tool {name!r}; registered: {sorted(_TOOLS)}") from None


def list_tools() -> list[str]:
    return sorted(_TOOLS)
