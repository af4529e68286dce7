"""The one admission rule shared by the class registries (agent loops, tools)."""

from __future__ import annotations

from typing import Any

from agentloop.errors import ConfigError


def admit_class(table: dict[str, Any], kind: str, name: Any, cls: Any, base: type, override: bool) -> None:
    """Put `cls` into `table[name]` if it is a `base` subclass and the name is free.

    A taken name is an error unless `override`; re-registering the very same class is a no-op,
    so re-importing a plugin module is harmless.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{kind} name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{kind} {name!r}: {cls!r} is not a subclass of {base.__name__}")
    old = table.get(name)
    if old is not None and old is not cls and not override:
        raise ConfigError(f"{kind} {name!r} is already registered ({old.__module__}.{old.__qualname__}); "
                          "pass override=True to replace it")
    table[name] = cls
