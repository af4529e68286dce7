"""The reward registry: an explicit dict keyed by data_source (or by a reward's own name).

    register_reward(name, fn)        add one (a taken name needs override=True)
    get_reward(data_source, default) look one up, falling back to the registered `default`
    load_custom_reward(ref)          "path/to/file.py:function" or "package.module:function"

The built-in rewards are registered when `agentloop.rewards` is imported.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from agentloop.errors import RewardError
from agentloop.rewards.scoring import RewardCallable
from agentloop.util.cache import import_python_file

_REWARDS: dict[str, RewardCallable] = {}


def register_reward(name_or_data_source: str, fn: RewardCallable, *, override: bool = False) -> RewardCallable:
    """Register `fn` under a data_source (or a name usable as `reward.default`); returns `fn`.

    Re-registering the very same function is a no-op, so re-importing a plugin is harmless.
    """
    name = name_or_data_source
    if not isinstance(name, str) or not name:
        raise RewardError(f"reward name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise RewardError(f"reward {name!r}: {fn!r} is not callable")
    old = _REWARDS.get(name)
    if old is not None and old is not fn and not override:
        raise RewardError(
            f"reward {name!r} is already registered ({_describe(old)}); pass override=True to replace it"
        )
    _REWARDS[name] = fn
    return fn


def get_reward(data_source: str, default: str | None = None) -> RewardCallable:
    """The reward registered for `data_source`, else the one registered as `default`."""
    fn = _REWARDS.get(data_source)
    if fn is not None:
        return fn
    if default is not None:
        fn = _REWARDS.get(default)
        if fn is None:
            raise RewardError(f"default reward {default!r} is not registered; known: {sorted(_REWARDS)}")
        return fn
    raise RewardError(
        f"no reward registered for data source {data_source!r}; known: {sorted(_REWARDS)}. "
        "Register one with register_reward(), set reward.default, or set reward.custom"
    )


def list_rewards() -> list[str]:
    return sorted(_REWARDS)


def _describe(fn: RewardCallable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _import_file(path: Path, ref: str):
    try:
        return import_python_file(path, "agentloop_reward")
    except ImportError as e:
        raise RewardError(f"custom reward {ref!r}: {e}") from None
    except Exception as e:
        raise RewardError(f"custom reward {ref!r}: importing {str(path)!r} failed: {type(e).__name__}: {e}") from e


def load_custom_reward(ref: str) -> RewardCallable:
    """Load `path/to/file.py:function` or `package.module:function` (function defaults to compute_score).

    A file is imported once per absolute path (loading it again returns the same function).
    """
    if not isinstance(ref, str) or not ref.strip():
        raise RewardError(f"custom reward reference must be 'file.py:function' or 'module:function', got {ref!r}")
    target, sep, attr = ref.strip().rpartition(":")
    if not sep:
        target, attr = ref.strip(), "compute_score"
    if not target or not attr:
        raise RewardError(f"custom reward {ref!r} must look like 'path/to/file.py:function' or "
                          "'package.module:function'")
    path = Path(target)
    if target.endswith(".py") or "/" in target or "\\" in target:
        if not path.is_file():
            raise RewardError(f"custom reward {ref!r}: file {target!r} does not exist")
        module = _import_file(path, ref)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardError(f"custom reward {ref!r}: module {target!r} cannot be imported: {e}") from e
        except Exception as e:
            raise RewardError(f"custom reward {ref!r}: importing module {target!r} failed: "
                              f"{type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise RewardError(f"custom reward {ref!r}: {target!r} has no attribute {attr!r}; callables there: {public}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"custom reward {ref!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn
