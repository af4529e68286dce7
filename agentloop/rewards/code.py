"""Code reward: run the answer's code against the row's tests in the python tool's sandbox.

    CodeRewardConfig      mode (pass_rate | all_or_nothing), time limits, concurrency
    extract_code          the last ```python block of the answer, else the answer's last assistant text
    build_test_program    answer + tests -> one program whose results come back on a private channel
    run_code_tests        await it: CodeTestResult (passed, total, sandbox reason, first failure)
    make_code_reward      CodeRewardConfig (+ sandbox limits) -> async verl-signature reward
    compute_score         the registered reward of `agentloop/code` (default config)

Ground truth: `{"entry_point": "fn", "tests": [...]}` where a test is an assert statement (a string,
run in the solution's namespace) or an `[args, expected]` pair (`fn(*args) == expected`, tuples in
the result compared as lists, since JSON has no tuples). A JSON string of that dict works too.

Containment is exactly the python tool's: the program runs through `run_python` with the tool's
`SandboxLimits` (own uid, namespaces, rlimits, scrubbed env, wall and CPU limits), only `timeout_s`
and `cpu_s` raised for the whole test run. The solution is loaded with `__name__ != "__main__"`, so
its `if __name__ == "__main__":` block does not run; its stdout/stderr go to /dev/null (so printing
cannot hit the output cap); each test has its own SIGALRM deadline inside the sandbox, so with
`pass_rate` the tests before an endless one still count.

Results come back as lines `<nonce> <i> <ok> <message>` on a duplicate of the original stdout,
with a per-run random nonce. Simplification, on purpose: the solution runs in the same process as
the harness, so a program written to read its own source or the harness's frames can learn the
nonce and forge results; the sandbox contains what such a program can do to the machine, not what it
can claim about itself. Treat a sudden jump to 1.0 from odd code as a reward hack to inspect.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ConfigDict

from agentloop.rewards.config import CodeRewardConfig
from agentloop.tools.sandbox import SandboxLimits, loop_semaphore, run_python


class CodeTestResult(BaseModel):
    """What one test run found."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    passed: int = 0
    """Tests that passed."""
    total: int = 0
    """Tests in the ground truth."""
    reason: str = "ok"
    """The sandbox's verdict (ok, error, timeout, cpu_limit, ...) or no_code / bad_ground_truth."""
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


# ------------------------------------------------------------------ the test program

_HARNESS = r'''
import json as _j, os as _o, signal as _g
_NONCE = {nonce!r}
_ENTRY = {entry!r}
_TESTS = _j.loads({tests!r})
_SRC = {source!r}
_LIMIT = {per_test!r}
_out = _o.dup(1)
_null = _o.open(_o.devnull, _o.O_WRONLY)
_o.dup2(_null, 1)
_o.dup2(_null, 2)


class _Deadline(BaseException):
    pass


def _alarm(signum, frame):
    raise _Deadline("test took longer than %gs" % _LIMIT)


_g.signal(_g.SIGALRM, _alarm)


def _report(i, ok, msg):
    line = "%s %d %d %s\n" % (_NONCE, i, 1 if ok else 0, _j.dumps(str(msg)[:1000]))
    _o.write(_out, line.encode("utf-8", "replace"))


def _plain(x):
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {{k: _plain(v) for k, v in x.items()}}
    return x


def _describe(e):
    return "%s: %s" % (type(e).__name__, e) if str(e) else type(e).__name__


_ns = {{"__name__": "solution", "__builtins__": __builtins__}}
try:
    _g.setitimer(_g.ITIMER_REAL, _LIMIT)
    exec(compile(_SRC, "solution.py", "exec"), _ns)
    _g.setitimer(_g.ITIMER_REAL, 0)
    _loaded = True
except BaseException as _e:
    _g.setitimer(_g.ITIMER_REAL, 0)
    _report(-1, False, "loading the solution failed: " + _describe(_e))
    _loaded = False

for _i, _t in enumerate(_TESTS):
    if not _loaded:
        _report(_i, False, "not run")
        continue
    try:
        _g.setitimer(_g.ITIMER_REAL, _LIMIT)
        if isinstance(_t, str):
            exec(compile(_t, "test_%d" % _i, "exec"), _ns)
            _ok, _msg = True, ""
        else:
            _args, _want = _t
            _got = _ns[_ENTRY](*_args)
            _ok = _plain(_got) == _want
            _msg = "" if _ok else "%s(*%r) returned %r, expected %r" % (_ENTRY, _args, _got, _want)
        _g.setitimer(_g.ITIMER_REAL, 0)
    except BaseException as _e:
        _g.setitimer(_g.ITIMER_REAL, 0)
        _ok, _msg = False, (_t if isinstance(_t, str) else repr(_t)) + " -> " + _describe(_e)
    _report(_i, _ok, _msg)
_o._exit(0)
'''


def _check_test(t: Any, i: int) -> Any:
    if isinstance(t, str):
        return t
    if isinstance(t, (list, tuple)) and len(t) == 2:
        args, expected = t
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"test {i}: the args of an [args, expected] pair must be a list, got {args!r}")
        return [list(args), expected]
    raise ValueError(f"test {i} must be an assert statement or an [args, expected] pair, got {t!r}")


def parse_ground_truth(ground_truth: Any) -> tuple[str, list[Any]]:
    """(entry_point, tests) from the row's ground truth; ValueError when it has neither shape."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(gt, dict) or not isinstance(gt.get("tests"), list) or not gt["tests"]:
        raise ValueError(f"code ground truth must be {{'entry_point': str, 'tests': [...]}}, got {ground_truth!r}")
    entry = gt.get("entry_point") or ""
    tests = [_check_test(t, i) for i, t in enumerate(gt["tests"])]
    if not entry and any(not isinstance(t, str) for t in tests):
        raise ValueError("code ground truth with [args, expected] tests needs an entry_point")
    return str(entry), tests


def build_test_program(source: str, entry_point: str, tests: list[Any], nonce: str,
                       per_test_timeout_s: float) -> str:
    """The program the sandbox runs: the harness with the solution and tests embedded as literals."""
    return _HARNESS.format(nonce=nonce, entry=entry_point, tests=json.dumps(tests), source=source,
                           per_test=float(per_test_timeout_s))


def _parse_results(stdout: str, nonce: str, total: int) -> tuple[int, str]:
    seen: dict[int, tuple[bool, str]] = {}
    for line in stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[0] != nonce:
            continue
        try:
            i, ok = int(parts[1]), parts[2] == "1"
            msg = json.loads(parts[3]) if len(parts) == 4 else ""
        except ValueError:
            continue
        if i not in seen and -1 <= i < total:
            seen[i] = (ok, str(msg))
    passed = sum(1 for i in range(total) if seen.get(i, (False, ""))[0])
    failures = [seen[i][1] for i in sorted(seen) if not seen[i][0]]
    return passed, failures[0] if failures else ""


def _run_limits(limits: SandboxLimits | None, cfg: CodeRewardConfig) -> SandboxLimits:
    base = limits if limits is not None else SandboxLimits()
    fields = base.model_dump(include=set(SandboxLimits.model_fields))  # drops e.g. PythonToolConfig's extras
    fields.update(timeout_s=cfg.timeout_s, cpu_s=max(int(fields["cpu_s"]), math.ceil(cfg.timeout_s)))
    return SandboxLimits(**fields)


async def run_code_tests(answer: str, ground_truth: Any, cfg: CodeRewardConfig | None = None,
                         limits: SandboxLimits | None = None) -> CodeTestResult:
    """Extract the answer's code and run it against the tests in the sandbox (never raises for the code)."""
    cfg = cfg or CodeRewardConfig()
    entry, tests = parse_ground_truth(ground_truth)
    source, where = extract_code(answer)
    if not source:
        return CodeTestResult(total=len(tests), reason="no_code", extracted=where)
    nonce = secrets.token_hex(16)
    program = build_test_program(source, entry, tests, nonce, cfg.per_test_timeout_s)
    async with loop_semaphore("code_reward", cfg.max_concurrent):
        res = await run_python(program, _run_limits(limits, cfg))
    passed, failure = _parse_results(res.stdout, nonce, len(tests))
    if not failure and passed < len(tests):
        failure = f"sandbox: {res.reason}"
    return CodeTestResult(passed=passed, total=len(tests), reason=res.reason,
                          first_failure=failure[:cfg.max_message_chars], extracted=where)


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
