"""The agent-loop registry: an explicit dict plus register/get, and plugin discovery.

Plugins are found three ways:
  1. imported by the user's own code (which calls `register_agent_loop`);
  2. `--plugin path/to/file.py` or `--plugin package.module` (see `load_plugin`);
  3. the entry-point group `agentloop.loops` of installed packages: each entry point
     names a module (imported, it registers itself) or an AgentLoopBase subclass
     (registered under the entry point's name).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar, overload

from agentloop.errors import ConfigError
from agentloop.util.cache import import_python_file
from agentloop.util.registries import admit_class

if TYPE_CHECKING:
    from agentloop.loops.base import AgentLoopBase

_LOOPS: dict[str, type["AgentLoopBase"]] = {}
_ENTRY_POINTS_LOADED = False
ENTRY_POINT_GROUP = "agentloop.loops"

L = TypeVar("L", bound="type[AgentLoopBase]")


@overload
def register_agent_loop(name: str, cls: None = None, *, override: bool = False) -> Callable[[L], L]: ...
@overload
def register_agent_loop(name: str, cls: L, *, override: bool = False) -> L: ...


def register_agent_loop(name, cls=None, *, override=False):
    """Register `cls` under `name`; without `cls`, return a class decorator.

    Registering a taken name is an error unless `override=True` (re-registering the very
    same class is a no-op, so re-importing a plugin module is harmless).
    """
    from agentloop.loops.base import AgentLoopBase

    def _register(c):
        admit_class(_LOOPS, "agent loop", name, c, AgentLoopBase, override)
        c.name = name
        return c

    if cls is None:
        return _register
    return _register(cls)


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from agentloop.loops.base import AgentLoopBase

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as e:  # re-raised with the entry point named
            raise ConfigError(f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP} failed to load: "
                              f"{e}") from e
        if isinstance(obj, type) and issubclass(obj, AgentLoopBase) and ep.name not in _LOOPS:
            register_agent_loop(ep.name, obj)


def get_agent_loop(name: str) -> type["AgentLoopBase"]:
    """The class registered under `name` (entry points are loaded on demand; the built-ins registered
    themselves when the package was imported, which Python does before this module)."""
    if name not in _LOOPS:
        _load_entry_points()
    try:
        return _LOOPS[name]
    except KeyError:
        raise ConfigError(f"unknown agent loop {name!r}; registered: {sorted(_LOOPS)}") from None


def list_agent_loops() -> list[str]:
    _load_entry_points()
    return sorted(_LOOPS)


def load_plugin(ref: str) -> None:
    """Import a plugin given as a path to a .py file or as a dotted module name."""
    path = Path(ref)
    if ref.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"plugin file {ref!r} does not exist")
        try:
            import_python_file(path, "agentloop_plugin")
        except Exception as e:
            raise ConfigError(f"plugin file {ref!r} failed to import: {type(e).__name__}: {e}") from e
        return
    try:
        importlib.import_module(ref)
    except ImportError as e:
        raise ConfigError(f"plugin module {ref!r} cannot be imported: {e}") from e
