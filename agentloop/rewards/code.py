"""Code reward: run the answer's code against the row's tests; verdicts are computed outside the sandbox.

    CodeRewardConfig      mode (pass_rate | all_or_nothing), time limits, concurrency, output cap
    extract_code          the last ```python block of the answer, else the answer's last assistant text
    parse_ground_truth    the row's ground truth -> entry point and checked tests
    run_code_tests        await it: CodeTestResult (passed, total, reason, first failure)
    make_code_reward      CodeRewardConfig (+ sandbox limits) -> async verl-signature reward
    compute_score         the registered reward of `agentloop/code` (default config)

Ground truth: `{"entry_point": "fn", "tests": [...]}` (or that dict as a JSON string); a test is one of

    "assert fn(1, 2) == 3"                      test code, run in the parent with fn a proxy to the solution
    [[1, 2], 3]                                 fn(*args) == expected, tuples in the result compared as lists
    {"stdin": "1 2\n", "stdout": "3\n"}          the solution run as a program on that stdin; its stdout must
                                                match line by line after whitespace normalisation (runs of
                                                spaces/tabs are one space, line ends stripped, trailing
                                                empty lines ignored); entry_point not needed

Where each part runs (code_judge.py has the details): the solution runs in the python tool's sandbox
(`SandboxLimits`: isolating backend, own uid, rlimits/cgroups) and only reports what it returned, as
plain JSON data, or which exception it raised, by type name. The test code, the expected values and
the comparison stay in this process, so reading files, walking frames, returning an object whose
`__eq__` is always True, printing or writing forged lines to any fd, exiting early or patching the
child's modules cannot raise the score: at best the solution chooses its own return values.
The solution is loaded with `__name__ == "solution"` (its `if __name__ == "__main__":` block does
not run) and its stdout/stderr go to /dev/null. Loading and each test get `per_test_timeout_s`; a test
past it fails and the next one gets a fresh process, so with `pass_rate` the other tests still count.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ConfigDict

from agentloop.rewards.code_judge import (
    AssertTest,
    IoTest,
    Outcome,
    PairTest,
    parse_test,
    run_function_tests,
    run_io_tests,
)
from agentloop.rewards.config import CodeRewardConfig
from agentloop.tools.sandbox import SandboxLimits, loop_semaphore


class CodeTestResult(BaseModel):
    """What one test run found."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    passed: int = 0
    """Tests that passed."""
    total: int = 0
    """Tests in the ground truth."""
    reason: str = "ok"
    """ok, or the worst thing the runs hit (setup_error, memory_limit, cpu_limit, timeout, killed, error, ...),
    or no_code."""
    first_failure: str = ""
    """Message of the first failing test (or of loading the solution)."""
    extracted: str = "none"
    """Where the code came from: block (a fenced block), text (the answer's text), none."""


# ------------------------------------------------------------------ extraction

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_SPECIALS = re.compile(r"<\|[a-z_]+\|>")


def extract_code(answer: str) -> tuple[str, str]:
    """(code, where): the last ```python block (```py, ```python3, then a plain ``` block), else the
    text after the last `<|im_start|>assistant` with ChatML markers removed (a ChatML heuristic), else ""."""
    blocks = _FENCE.findall(answer)
    tagged = [code for lang, code in blocks if lang]
    if tagged or blocks:
        return (tagged or [code for _, code in blocks])[-1], "block"
    text = answer.rsplit("<|im_start|>assistant", 1)[-1]
    text = _SPECIALS.sub("", text).strip()
    return (text, "text") if text else ("", "none")


# ------------------------------------------------------------------ ground truth and the run


def parse_ground_truth(ground_truth: Any) -> tuple[str, list[Any]]:
    """(entry_point, tests) from the row's ground truth; ValueError when it is malformed."""
    entry, tests = _parse(ground_truth)
    return entry, [t for t, _ in tests]


def _parse(ground_truth: Any) -> tuple[str, list[tuple[Any, AssertTest | PairTest | IoTest]]]:
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(gt, dict) or not isinstance(gt.get("tests"), list) or not gt["tests"]:
        raise ValueError(f"code ground truth must be {{'entry_point': str, 'tests': [...]}}, got {ground_truth!r}")
    entry = str(gt.get("entry_point") or "")
    tests = []
    for i, t in enumerate(gt["tests"]):
        parsed = parse_test(t, i)
        tests.append(([list(parsed.args), parsed.expected] if isinstance(parsed, PairTest) else t, parsed))
    if not entry and any(isinstance(p, PairTest) for _, p in tests):
        raise ValueError("code ground truth with [args, expected] tests needs an entry_point")
    return entry, tests


def _run_limits(limits: SandboxLimits | None, cfg: CodeRewardConfig) -> SandboxLimits:
    base = limits if limits is not None else SandboxLimits()
    fields = base.model_dump(include=set(SandboxLimits.model_fields))  # drops e.g. PythonToolConfig's extras
    fields.update(timeout_s=cfg.timeout_s, cpu_s=max(int(fields["cpu_s"]), math.ceil(cfg.timeout_s)))
    return SandboxLimits(**fields)


_SEVERITY = ["setup_error", "memory_limit", "cpu_limit", "file_size_limit", "output_limit", "timeout", "killed",
             "error"]


async def run_code_tests(answer: str, ground_truth: Any, cfg: CodeRewardConfig | None = None,
                         limits: SandboxLimits | None = None) -> CodeTestResult:
    """Extract the answer's code and run it against the tests (never raises for the code)."""
    cfg = cfg or CodeRewardConfig()
    entry, parsed = _parse(ground_truth)
    tests = [p for _, p in parsed]
    source, where = extract_code(answer)
    if not source:
        return CodeTestResult(total=len(tests), reason="no_code", extracted=where)
    run_limits = _run_limits(limits, cfg)
    out = Outcome(results=[None] * len(tests))
    fn_idx = [i for i, t in enumerate(tests) if not isinstance(t, IoTest)]
    io_idx = [i for i, t in enumerate(tests) if isinstance(t, IoTest)]
    async with loop_semaphore("code_reward", cfg.max_concurrent):
        deadline = time.monotonic() + cfg.timeout_s
        if fn_idx:
            await run_function_tests(source, entry, tests, cfg.per_test_timeout_s, deadline, run_limits,  # type: ignore[arg-type]
                                     cfg.max_output_bytes, out, fn_idx)
        if io_idx:
            await run_io_tests(source, tests, cfg.per_test_timeout_s, deadline, run_limits,  # type: ignore[arg-type]
                               cfg.max_output_bytes, out, io_idx)
    passed = sum(1 for r in out.results if r is not None and r[0])
    failures = [r[1] for r in out.results if r is not None and not r[0] and r[1] != "not run"]
    reason = next((r for r in _SEVERITY if r in out.reasons), "ok")
    return CodeTestResult(passed=passed, total=len(tests), reason=reason,
                          first_failure=(failures[0] if failures else "")[:cfg.max_message_chars], extracted=where)


def score_of(result: CodeTestResult, mode: str) -> float:
    if result.total == 0:
        return 0.0
    if mode == "all_or_nothing":
        return 1.0 if result.passed == result.total else 0.0
    return result.passed / result.total


RewardCoroutineFn = Callable[..., Awaitable[dict[str, Any]]]


def make_code_reward(cfg: CodeRewardConfig | None = None, limits: SandboxLimits | None = None) -> RewardCoroutineFn:
    """An async verl-signature reward with these settings; `limits` defaults to the python tool's defaults
    (pass `cfg.tools.python` to share the configured sandbox)."""
    cfg = cfg or CodeRewardConfig()

    async def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                            extra_info: dict | None = None) -> dict[str, Any]:
        r = await run_code_tests(solution_str, ground_truth, cfg, limits)
        return {"score": score_of(r, cfg.mode), "tests_passed": r.passed, "tests_total": r.total,
                "sandbox": r.reason, "code_from": r.extracted, "first_failure": r.first_failure}

    compute_score.__qualname__ = "code_reward"
    return compute_score


compute_score = make_code_reward()
"""The reward registered for data_source `agentloop/code` (default CodeRewardConfig, default sandbox)."""
