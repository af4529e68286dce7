"""The code reward's parent side: tests run here, the solution runs in the sandbox, verdicts never leave here.

    parse_test           a ground-truth test -> AssertTest | PairTest | IoTest (checked, compiled)
    run_function_tests   assert and [args, expected] tests against one solution process (restarted after a
                         test that hangs or kills it)
    run_io_tests         stdin/stdout tests: one sandboxed run of the solution per test
    same_output          the stdout comparison (whitespace-normalised per line)

How a function test runs: the test's code (an `assert ...` string, or `entry(*args) == expected`) is
executed *in this process*, in a worker thread, with every name the solution defines bound to a `Remote`
proxy. Calling a proxy sends the call to the sandboxed child (code_child.py), which calls the solution
and sends back the result as plain JSON data; comparisons, `assert`, arithmetic all happen here, on
values this process built from that data. So the solution never sees an expected value or a verdict,
and what it returns can only be data: an object with its own `__eq__` stays in the child (a `$ref`) and
equals nothing here. Exceptions come back by type name (a built-in exception type is raised again here,
so `try: f(-1) except ValueError` tests work). Arguments cross as data too: lists, dicts and sets the
solution changes in place are updated here after the call; a lambda or other code cannot be passed
(that test fails with a TypeError naming it). Objects of the solution (`Solution()`) stay in the child
and can be called, iterated (the child makes a list), passed back, len()'d and bool()'d.

Test code is ground truth (trusted data), but it runs here, so it is restricted: no names or attributes
starting with "_", no str.format, imports of a few pure modules only, a builtins dict without open,
eval, exec, getattr and friends. It should be a few asserts, not a program.

Deadlines: loading the solution and each test get `per_test_timeout_s`; a call still running then
kills the child, the test fails ("took longer than"), and the next test gets a fresh child.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import json
import math
import os
import select
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType
from typing import Any

from agentloop.tools.sandbox import (
    SandboxLimits,
    SandboxProcess,
    SandboxResult,
    run_python,
    start_python,
)

CHILD_SOURCE = Path(__file__).with_name("code_child.py").read_text()

# ------------------------------------------------------------------ ground-truth tests


@dataclass(frozen=True)
class AssertTest:
    """Test code (usually one `assert`), run here with the solution's names as proxies."""

    source: str
    code: CodeType
    solution_names: frozenset[str]


@dataclass(frozen=True)
class PairTest:
    """`entry_point(*args)` must equal `expected` (tuples compared as lists)."""

    args: list
    expected: Any


@dataclass(frozen=True)
class IoTest:
    """The solution run as a program with `stdin` must print `stdout` (whitespace-normalised per line)."""

    stdin: str
    stdout: str


_SAFE_MODULES = frozenset({"math", "cmath", "re", "string", "collections", "itertools", "functools", "operator",
                           "heapq", "bisect", "fractions", "decimal", "statistics", "typing", "copy", "datetime"})
_UNSAFE_BUILTINS = frozenset({"open", "eval", "exec", "compile", "input", "globals", "locals", "vars", "getattr",
                              "setattr", "delattr", "breakpoint", "help", "exit", "quit", "dir", "memoryview",
                              "__import__", "__build_class__", "__loader__", "__spec__", "classmethod",
                              "staticmethod", "property", "super", "object", "license", "credits", "copyright"})
_NO_ATTRS = frozenset({"format", "format_map", "mro"})


def _safe_import(name: str, globals=None, locals=None, fromlist=(), level=0):  # import protocol
    if level != 0 or name.split(".")[0] not in _SAFE_MODULES:
        raise ImportError(f"test code may import only {sorted(_SAFE_MODULES)}, not {name!r}")
    return __import__(name, globals, locals, fromlist, level)


def _noop_print(*args: Any, **kwargs: Any) -> None:
    """Tests may print; here that goes nowhere."""


_BUILTINS: dict[str, Any] = {k: v for k, v in vars(builtins).items()
                             if not k.startswith("_") and k not in _UNSAFE_BUILTINS}
_BUILTINS.update(__import__=_safe_import, print=_noop_print)


def _check_test_ast(tree: ast.AST, src: str) -> frozenset[str]:
    """Reject what test code may not do; return the free names (the solution's)."""
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        bad = None
        if isinstance(node, ast.Attribute) and (node.attr.startswith("_") or node.attr in _NO_ATTRS):
            bad = f"attribute {node.attr!r}"
        elif isinstance(node, ast.Name) and node.id.startswith("__"):
            bad = f"name {node.id!r}"
        elif isinstance(node, (ast.ClassDef, ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith,
                               ast.Global, ast.Nonlocal)):
            bad = type(node).__name__
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] not in _SAFE_MODULES for m in mods) or getattr(node, "level", 0):
                bad = f"import of {mods}"
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        if bad:
            raise ValueError(f"test code may not use {bad}: {src[:200]!r}")
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            if isinstance(node, ast.FunctionDef):
                bound.add(node.name)
            a = node.args
            bound.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    free = loaded - bound
    if free & _UNSAFE_BUILTINS:
        raise ValueError(f"test code may not use {sorted(free & _UNSAFE_BUILTINS)}: {src[:200]!r}")
    return frozenset(free - set(_BUILTINS))


def parse_test(t: Any, i: int) -> AssertTest | PairTest | IoTest:
    """One ground-truth test; ValueError naming test `i` when it has none of the three shapes."""
    if isinstance(t, str):
        try:
            tree = ast.parse(t, f"<test {i}>", "exec")
        except SyntaxError as e:
            raise ValueError(f"test {i} is not valid Python: {e}") from None
        names = _check_test_ast(tree, t)
        return AssertTest(t, compile(tree, f"<test {i}>", "exec"), names)
    if isinstance(t, (list, tuple)) and len(t) == 2:
        args, expected = t
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"test {i}: the args of an [args, expected] pair must be a list, got {args!r}")
        return PairTest(list(args), expected)
    if isinstance(t, dict) and set(t) == {"stdin", "stdout"}:
        if not isinstance(t["stdin"], str) or not isinstance(t["stdout"], str):
            raise ValueError(f"test {i}: stdin and stdout must be strings, got {t!r}")
        return IoTest(t["stdin"], t["stdout"])
    raise ValueError(f"test {i} must be an assert statement, an [args, expected] pair or "
                     f"{{'stdin': str, 'stdout': str}}, got {t!r}")


# ------------------------------------------------------------------ values across the boundary


class ProtocolError(Exception):
    """The child's reply is not what the protocol allows (or too large)."""


class SessionBroken(BaseException):
    """The child cannot answer any more (deadline, exit, garbage); BaseException so tests cannot catch it."""


class RemoteError(Exception):
    """The solution raised an exception that is not a built-in one (type name and message)."""


_BUILTIN_EXC = {k: v for k, v in vars(builtins).items()
                if isinstance(v, type) and issubclass(v, Exception) and not k.startswith("_")}


def encode_arg(x: Any, depth: int = 0) -> Any:
    """A value of the test -> the child's wire format (see code_child.py)."""
    if depth > 200:
        raise ValueError("argument too deep to send")
    t = type(x)
    if x is None or t in (bool, int, str):
        return x
    if t is float:
        return x if math.isfinite(x) else {"$float": repr(x)}
    if t is list:
        return [encode_arg(v, depth + 1) for v in x]
    if t in (tuple, set, frozenset):
        return {"$" + t.__name__: [encode_arg(v, depth + 1) for v in x]}
    if t is dict:
        return {"$dict": [[encode_arg(k, depth + 1), encode_arg(v, depth + 1)] for k, v in x.items()]}
    if t is bytes:
        return {"$bytes": x.decode("latin-1")}
    if t is complex:
        return {"$complex": [x.real, x.imag]}
    if t is Remote:
        target = object.__getattribute__(x, "_target")
        if target.get("attrs"):
            raise TypeError("only solution names and returned objects can be passed back, not their attributes")
        return {"$ref": target["ref"]} if "ref" in target else {"$name": target["name"]}
    raise TypeError(f"a {t.__name__} cannot be passed to the solution (only plain data and its own objects)")


def decode_value(v: Any, channel: "Channel", depth: int = 0) -> Any:
    """The child's wire format -> a value built here (only built-in types, or a Remote for `$ref`)."""
    if depth > 200:
        raise ProtocolError("value too deep")
    if v is None or type(v) in (bool, int, str, float):
        return v
    if type(v) is list:
        return [decode_value(x, channel, depth + 1) for x in v]
    if type(v) is not dict:
        raise ProtocolError(f"unexpected {type(v).__name__}")
    if "$ref" in v and isinstance(v["$ref"], int):
        return Remote(channel, {"ref": v["$ref"], "attrs": []}, str(v.get("type", "?")))
    if len(v) != 1:
        raise ProtocolError("unexpected object")
    (tag, body), = v.items()
    try:
        if tag in ("$tuple", "$set", "$frozenset") and type(body) is list:
            items = [decode_value(x, channel, depth + 1) for x in body]
            return {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag](items)
        if tag == "$dict" and type(body) is list:
            return {decode_value(k, channel, depth + 1): decode_value(x, channel, depth + 1) for k, x in body}
        if tag == "$bytes" and type(body) is str:
            return body.encode("latin-1")
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$complex" and type(body) is list and len(body) == 2:
            return complex(float(body[0]), float(body[1]))
    except (TypeError, ValueError) as e:  # e.g. an unhashable item of a set
        raise ProtocolError(f"bad {tag}: {e}") from None
    raise ProtocolError(f"unexpected tag {tag!r}")


class Channel:
    """Blocking request/reply over the child's pipes, every wait bounded by `deadline` (monotonic)."""

    def __init__(self, request_fd: int, reply_fd: int, max_reply_bytes: int):
        self.wfd, self.rfd, self.cap = request_fd, reply_fd, max_reply_bytes
        self.buf = bytearray()
        self.next_id = 1
        self.deadline = math.inf
        self.broken: str | None = None
        os.set_blocking(self.wfd, False)
        os.set_blocking(self.rfd, False)

    def _wait(self, fd: int, write: bool) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._break("deadline")
        r, w, _ = select.select([] if write else [fd], [fd] if write else [], [], left)
        if not r and not w:
            raise self._break("deadline")

    def _break(self, why: str) -> SessionBroken:
        self.broken = self.broken or why
        return SessionBroken(self.broken)

    def _send(self, obj: dict) -> None:
        data = (json.dumps(obj) + "\n").encode()
        while data:
            self._wait(self.wfd, True)
            try:
                data = data[os.write(self.wfd, data):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise self._break("exited") from None

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[:i + 1]
                return line
            if len(self.buf) > self.cap:
                raise self._break("reply too large")
            self._wait(self.rfd, False)
            try:
                chunk = os.read(self.rfd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise self._break("exited")
            self.buf.extend(chunk)

    def reply(self, rid: int) -> dict:
        """The first reply line with id `rid` (other lines: replies the solution forged or stale ones).
        At most 2 x the reply cap is read per request, so a flood of lines cannot keep this thread busy."""
        if self.broken:
            raise SessionBroken(self.broken)
        budget = 2 * self.cap
        while True:
            line = self._line()
            budget -= len(line) + 1
            if budget < 0:
                raise self._break("reply too large")
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not JSON: written by the solution, not by the child's harness
            if isinstance(msg, dict) and msg.get("id") == rid:
                return msg

    def request(self, op: str, target: dict | None = None, args: list | None = None,
                kwargs: dict | None = None) -> Any:
        """Send one request, return the decoded value or raise what the solution raised."""
        if self.broken:
            raise SessionBroken(self.broken)
        rid = self.next_id
        self.next_id += 1
        req: dict[str, Any] = {"id": rid, "op": op}
        if target is not None:
            req["target"] = target
        if args is not None:
            req["args"] = [encode_arg(a) for a in args]
        if kwargs is not None:
            req["kwargs"] = {str(k): encode_arg(v) for k, v in kwargs.items()}
        self._send(req)
        msg = self.reply(rid)
        if msg.get("ok") is True:
            try:
                value = decode_value(msg.get("value"), self)
                _apply_after(args or [], msg.get("args_after"), self)
                _apply_after(kwargs or {}, msg.get("kwargs_after"), self)
                return value
            except ProtocolError as e:
                raise self._break(f"unreadable reply: {e}") from None
        name, message = str(msg.get("error", "Exception"))[:100], str(msg.get("message", ""))[:500]
        exc = _BUILTIN_EXC.get(name)
        if exc is not None and exc not in (StopIteration, StopAsyncIteration):
            raise exc(message)
        raise RemoteError(f"{name}: {message}" if message else name)

    def close(self) -> None:
        try:
            self._send({"id": self.next_id, "op": "exit"})
        except SessionBroken:
            pass


def _apply_after(sent: list | dict, after: Any, channel: "Channel") -> None:
    """Apply the solution's in-place changes of list/dict/set arguments to the test's own objects."""
    if after is None:
        return
    if isinstance(sent, list) and isinstance(after, list):
        pairs = list(zip(sent, after))
    elif isinstance(sent, dict) and isinstance(after, dict):
        pairs = [(sent[k], v) for k, v in after.items() if k in sent]
    else:
        raise ProtocolError("bad args_after")
    for obj, new in pairs:
        if new is None or type(obj) not in (list, dict, set):
            continue
        value = decode_value(new, channel)
        if type(value) is not type(obj):
            raise ProtocolError("an argument changed type")
        if isinstance(obj, list):
            obj[:] = value
        else:
            obj.clear()
            obj.update(value)


class Remote:
    """A name of the solution, or an object it returned, living in the child: call it, read attributes,
    iterate it (the child makes a list), len() and bool() it. Equal only to itself."""

    __slots__ = ("_channel", "_target", "_type")

    def __init__(self, channel: Channel, target: dict, type_name: str = ""):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_type", type_name)

    def __getattr__(self, name: str) -> "Remote":
        if name.startswith("_"):
            raise AttributeError(name)
        t = self._target
        return Remote(self._channel, {**t, "attrs": [*t["attrs"], name]})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the solution's objects are read-only here")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._channel.request("call", self._target, list(args), kwargs)

    def __iter__(self):
        return iter(self._channel.request("iter", self._target))

    def __len__(self) -> int:
        n = self._channel.request("len", self._target)
        if type(n) is not int:
            raise TypeError("len() of a solution object is not an int")
        return n

    def __bool__(self) -> bool:
        b = self._channel.request("bool", self._target)
        if type(b) is not bool:
            raise TypeError("bool() of a solution object is not a bool")
        return b

    def __repr__(self) -> str:
        t = self._target
        what = t.get("name") or f"<{self._type or 'object'} from the solution>"
        return ".".join([what, *t["attrs"]])


# ------------------------------------------------------------------ running function tests


@dataclass
class Outcome:
    """Per test: passed?, message; plus what stopped the run early."""

    results: list[tuple[bool, str] | None]
    reasons: list[str] = field(default_factory=list)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _plain(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _broken_message(why: str, per_test: float, what: str) -> str:
    if why == "deadline":
        return f"{what} took longer than {per_test:g}s"
    if why == "exited":
        return f"the solution's process ended during {what}"
    return f"{what}: {why}"


def _drive(channel: Channel, entry: str, tests: list[AssertTest | PairTest], todo: list[int],
           out: Outcome, per_test: float, run_deadline: float) -> tuple[int, bool]:
    """In a worker thread: load the solution, run tests `todo` in order. Returns (tests done, load failed)."""
    channel.deadline = run_deadline  # interpreter start-up is not the solution's time
    if channel.reply(0).get("ready") is not True:
        raise SessionBroken("no ready message")
    channel.deadline = min(run_deadline, time.monotonic() + per_test)
    try:
        channel.request("load")
    except SessionBroken as e:
        msg = _broken_message(str(e), per_test, "loading the solution")
        for i in todo:
            out.results[i] = (False, "loading the solution failed: " + msg if i == todo[0] else "not run")
        out.reasons.append("timeout" if str(e) == "deadline" else "error")
        return len(todo), True
    except Exception as e:  # noqa: BLE001 - the solution's own error at import time
        for i in todo:
            out.results[i] = (False, "loading the solution failed: " + _describe(e) if i == todo[0] else "not run")
        return len(todo), True
    for n, i in enumerate(todo):
        t = tests[i]
        channel.deadline = min(run_deadline, time.monotonic() + per_test)
        try:
            if isinstance(t, PairTest):
                got = channel.request("call", {"name": entry, "attrs": []}, t.args, {})
                ok = _plain(got) == t.expected
                msg = "" if ok else f"{entry}(*{t.args!r}) returned {got!r}, expected {t.expected!r}"
            else:
                env = {"__builtins__": _BUILTINS}
                env.update({name: Remote(channel, {"name": name, "attrs": []}) for name in t.solution_names})
                exec(t.code, env)
                ok, msg = True, ""
        except SessionBroken as e:
            ok, msg = False, f"test {i}: " + _broken_message(str(e), per_test, "the test")
        except Exception as e:  # noqa: BLE001 - assertion failures, the solution's exceptions, bad data
            ok = False
            msg = (t.source if isinstance(t, AssertTest) else f"{entry}(*{t.args!r})") + " -> " + _describe(e)
        if channel.broken:  # also when the test code caught what broke the session
            ok = False
            msg = msg or f"test {i}: " + _broken_message(channel.broken, per_test, "the test")
            out.results[i] = (ok, msg)
            out.reasons.append("timeout" if channel.broken == "deadline" else "error")
            return n + 1, False
        out.results[i] = (ok, msg)
    channel.close()
    return len(todo), False


_EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="code-judge")


async def run_function_tests(source: str, entry: str, tests: list[AssertTest | PairTest], per_test: float,
                             deadline: float, limits: SandboxLimits, max_reply_bytes: int,
                             out: Outcome, indices: list[int]) -> None:
    """Run tests `indices` (into `out.results`) against `source` in as few sandboxed children as possible."""
    loop = asyncio.get_running_loop()
    todo = list(indices)
    while todo:
        left = deadline - time.monotonic()
        if left <= 0:
            for i in todo:
                out.results[i] = (False, "not run: the whole test run took longer than its limit")
            out.reasons.append("timeout")
            return
        proc = await start_python(CHILD_SOURCE, limits.model_copy(update={"timeout_s": left}),
                                  files={"solution.py": source}, channels=True)
        if proc.request_fd < 0:  # the sandbox could not start
            res = await proc.wait()
            for i in todo:
                out.results[i] = (False, f"sandbox: {res.reason}: {res.stderr.strip()[-200:]}")
            out.reasons.append(res.reason)
            return
        channel = Channel(proc.request_fd, proc.reply_fd, max_reply_bytes)
        fut = loop.run_in_executor(_EXECUTOR, _drive, channel, entry, tests, todo, out, per_test, deadline)
        try:
            done, load_failed = await asyncio.shield(fut)
        except SessionBroken:  # the child died or hung before it was ready
            done, load_failed = -1, True
        finally:
            if not fut.done():  # cancelled: EOF ends the thread's waits; its fds stay open until it has
                proc.kill()
                await asyncio.wait([fut])
            if channel.broken:  # hung, flooding or gone: no graceful exit to wait for
                proc.kill()
            res = await _end(proc)
        if done < 0:
            for i in todo:
                out.results[i] = (False, f"the solution's process did not start ({res.reason}): "
                                         f"{res.stderr.strip()[-200:]}")
            out.reasons.append(res.reason if res.reason != "ok" else "error")
            return
        if res.reason not in ("ok", "killed", "timeout"):
            out.reasons.append(res.reason)  # e.g. memory_limit, cpu_limit: worth reporting
        todo = [] if load_failed else todo[done:]


async def _end(proc: SandboxProcess) -> SandboxResult:
    """Let the child finish (it exits on EOF of its requests), kill it if it does not at once."""
    if proc.request_fd >= 0:
        os.close(proc.request_fd)
        proc.request_fd = -1
    try:
        return await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=1.0)
    except asyncio.TimeoutError:
        proc.kill()
        return await proc.wait()


# ------------------------------------------------------------------ stdin/stdout tests


def normalize_output(text: str) -> list[str]:
    """Lines with runs of whitespace made one space, ends stripped; trailing empty lines dropped."""
    lines = [" ".join(line.split()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def same_output(got: str, expected: str) -> bool:
    """Whether a program's stdout matches the expected one, whitespace-normalised per line."""
    return normalize_output(got) == normalize_output(expected)


async def run_io_tests(source: str, tests: list[IoTest], per_test: float, deadline: float, limits: SandboxLimits,
                       max_output_bytes: int, out: Outcome, indices: list[int]) -> None:
    """Each test: a fresh sandboxed run of the solution as a program, its stdin fed, its stdout compared here."""
    for i in indices:
        t = tests[i]
        left = deadline - time.monotonic()
        if left <= 0:
            out.results[i] = (False, "not run: the whole test run took longer than its limit")
            out.reasons.append("timeout")
            continue
        run_limits = limits.model_copy(update={"timeout_s": min(per_test, left),
                                               "max_output_bytes": max(limits.max_output_bytes, max_output_bytes)})
        res = await run_python(source, run_limits, stdin=t.stdin.encode())
        if res.reason == "ok" and same_output(res.stdout, t.stdout):
            out.results[i] = (True, "")
            continue
        if res.reason == "ok":
            msg = f"stdin test {i}: wrong output: got {res.stdout[:80]!r}, expected {t.stdout[:80]!r}"
        elif res.reason == "timeout":
            msg = f"stdin test {i}: took longer than {run_limits.timeout_s:g}s"
        else:
            tail = res.stderr.strip().splitlines()[-1:] or [""]
            msg = f"stdin test {i}: {res.reason} {tail[0][:150]}".strip()
        if res.reason != "ok":
            out.reasons.append(res.reason)
        out.results[i] = (False, msg)
