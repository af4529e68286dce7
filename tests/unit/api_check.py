"""One check for a folder package's public API, shared by the folder tests (the root package's is
tests/unit/test_public_api.py): `__all__` is exactly the package's public namespace, both ways, without
duplicates, and every exported class or function is agentloop's own (not a re-exported third-party object)."""

from __future__ import annotations

import inspect
import types
from typing import Any


def assert_public_api(pkg: types.ModuleType, names: Any = None) -> None:
    """`names`: the public names when the package resolves them lazily (default: its namespace)."""
    exported = list(pkg.__all__)
    assert len(exported) == len(set(exported)), f"{pkg.__name__}.__all__ has duplicates"
    if names is None:
        names = {n for n, v in vars(pkg).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert set(exported) == set(names), (f"{pkg.__name__}: public but not in __all__: {sorted(set(names) - set(exported))}; "
                                         f"in __all__ but not public: {sorted(set(exported) - set(names))}")
    for name in exported:
        obj = getattr(pkg, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.startswith("agentloop."), f"{pkg.__name__}.{name} comes from {obj.__module__}"
