"""Calling a reward function and normalizing what it returns into a `RewardResult`.

A reward function has verl's signature:

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

It is called by keyword, as verl does (see `call_reward` for the fallbacks). A dict return
holds "score" plus extra info (numbers, strings, bools or None), which ends up
in the episode record's `reward_info`.

What `solution_str` holds differs between the frameworks users come from, so a reward says which text
it was written for (`solution_view`; the scorer builds that text from the episode's tokens):

    loop             the loop's own response text (special tokens kept): our rewards
    response         the response decoded without special tokens: verl's reward manager (verl's
                     data sources and custom `compute_score` files)
    prompt_response  prompt + response decoded, special tokens kept: TinyZero's and Search-R1's
                     reward managers (their countdown / qa_em rewards split on the prompt's text)

A loop that sets `extra["solution_str"]` overrides the view: that text is scored.
"""

from __future__ import annotations

import inspect
import math
from numbers import Real
from typing import Any, Callable, Literal, Protocol, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field

from agentloop.errors import RewardError


class RewardFn(Protocol):
    """verl's `compute_score` signature."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> float | dict[str, Any]: ...


RewardCallable = Callable[..., Any]
"""What the registry stores: any callable with the RewardFn signature."""

SolutionView = Literal["loop", "response", "prompt_response"]
"""Which text a reward function receives as `solution_str` (see the module docstring)."""

SOLUTION_VIEWS: tuple[str, ...] = get_args(SolutionView)

F = TypeVar("F", bound=RewardCallable)


def solution_view(view: SolutionView) -> Callable[[F], F]:
    """Decorator: mark a reward function as written for `view` (stored as `fn.solution_view`)."""
    if view not in SOLUTION_VIEWS:
        raise RewardError(f"solution view must be one of {list(SOLUTION_VIEWS)}, got {view!r}")

    def mark(fn: F) -> F:
        fn.solution_view = view  # type: ignore[attr-defined]
        return fn

    return mark


def view_of(fn: RewardCallable) -> SolutionView:
    """The text `fn` was written for: its `solution_view` mark, else "loop"."""
    view = getattr(fn, "solution_view", "loop")
    if view not in SOLUTION_VIEWS:
        raise RewardError(f"reward {getattr(fn, '__qualname__', repr(fn))} has solution_view {view!r}; "
                          f"expected one of {list(SOLUTION_VIEWS)}")
    return view


class RewardResult(BaseModel):
    """One episode's normalized reward."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    score: float
    """The scalar reward (finite)."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Extra fields the reward function returned besides "score" (str, int, float, bool or None)."""


def _unwrap(value: Any) -> Any:
    """numpy scalars (and 0-d arrays) -> the Python scalar inside; anything else unchanged."""
    if isinstance(value, (str, bytes, bool, int, float)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):  # e.g. an array of several elements
            return value
    return value


def _as_score(value: Any, data_source: str, what: str) -> float:
    value = _unwrap(value)
    if not isinstance(value, Real):
        raise RewardError(
            f"reward for data source {data_source!r} returned {what} {value!r} ({type(value).__name__}); "
            "expected a finite number, a bool, or a dict with a numeric 'score'"
        )
    score = float(value)
    if not math.isfinite(score):
        raise RewardError(f"reward for data source {data_source!r} returned {what} {score!r}; it must be finite")
    return score


def _as_info_value(key: str, value: Any, data_source: str) -> Any:
    value = _unwrap(value)
    for t in (bool, int, float, str):  # bool first: it is an int
        if isinstance(value, t):
            return t(value)
    if value is None:
        return None
    raise RewardError(
        f"reward for data source {data_source!r} returned info {key!r} = {value!r} ({type(value).__name__}); "
        "info values must be str, int, float, bool or None"
    )


def normalize_reward(value: Any, data_source: str) -> RewardResult:
    """A reward function's return value as a RewardResult, or RewardError naming the data source."""
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(
                f"reward for data source {data_source!r} returned a dict without 'score' "
                f"(keys: {sorted(map(str, value))})"
            )
        score = _as_score(value["score"], data_source, "score")
        info = {}
        for k, v in value.items():
            if k == "score":
                continue
            if not isinstance(k, str):
                raise RewardError(f"reward for data source {data_source!r} returned a non-string info key {k!r}")
            info[k] = _as_info_value(k, v, data_source)
        return RewardResult(score=score, info=info)
    return RewardResult(score=_as_score(value, data_source, "score"))


def call_reward(fn: RewardCallable, args: dict[str, Any]) -> Any:
    """Call `fn` the way verl does, by keyword; a function whose parameters have other names
    gets them by position, one without `extra_info` gets the other three."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return fn(*args.values())
    for kwargs in (args, {k: v for k, v in args.items() if k != "extra_info"}):
        try:
            sig.bind(**kwargs)
        except TypeError:
            continue
        return fn(**kwargs)
    try:
        sig.bind(*args.values())
    except TypeError:
        raise RewardError(
            f"reward {getattr(fn, '__qualname__', repr(fn))}{sig} cannot take "
            "(data_source, solution_str, ground_truth, extra_info)"
        ) from None
    return fn(*args.values())


def score_episode(
    fn: RewardCallable,
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> RewardResult:
    """Call `fn` verl-style and normalize its result; any failure is a RewardError naming the data source."""
    args = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
            "extra_info": extra_info}
    try:
        value = call_reward(fn, args)
    except RewardError:
        raise
    except Exception as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise RewardError(f"reward {name} for data source {data_source!r} raised {type(e).__name__}: {e}") from e
    if inspect.isawaitable(value):
        close = getattr(value, "close", None)
        if callable(close):
            close()  # never awaited: close it rather than leak a warning
        raise RewardError(
            f"reward for data source {data_source!r} is async; await call_reward(fn, args) "
            "and pass the value to normalize_reward instead of using score_episode"
        )
    return normalize_reward(value, data_source)
