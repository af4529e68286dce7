"""RewardPool: synchronous reward functions run off the event loop, every call under a deadline.

    RewardPool.score(fn, args)   await it: a RewardResult; RewardTimeout past `timeout_s`, RewardError
                                 when the function raised or returned something unusable
    reward_ref(fn)               how a fresh process finds `fn` again (module, file, qualified name);
                                 None when it cannot (closures, lambdas, callable objects, __main__)
    worker_main                  a worker process: import by reference, call, normalize, answer

Why processes: rewards are CPU-bound Python (regexes, sympy, parsers). Inline they freeze every episode
of the run while they compute, and a reward that loops never gives the loop back; in a thread they still
share the GIL with the event loop, and a thread cannot be stopped. A worker process that runs past the
deadline is killed (SIGKILL) and replaced, so a looping reward costs one worker for `timeout_s`, never the run.

What goes to a process: any function a fresh process can import by module and qualified name: the
built-in rewards, functions of installed modules, and functions of files loaded by path (`reward.custom=
file.py:fn`, `--plugin file.py`), which the worker loads from the same file. What cannot (see `reward_ref`)
runs on a thread pool of the same size: still off the loop and still under the deadline, but a thread
past it cannot be killed; it runs on until it returns and its slot is lost meanwhile (said once, on the
first such call). `executor="thread"` sends every reward there.

Workers are fresh interpreters (`python -c`, the parent's sys.path; forking a process with an event loop
and threads is not safe, and multiprocessing's spawn would re-run the parent's __main__), started on the
first call, each importing `agentloop.rewards` once (~1 s); a worker is used once it said it is ready, so
start-up never counts against a call's deadline. They talk over a socket pair (multiprocessing's framing),
ignore SIGINT (Ctrl-C is the parent's to handle) and exit when the parent's end closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.machinery
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import weakref
from typing import Any, Callable, Literal

from agentloop.errors import RewardError
from agentloop.rewards.scoring import RewardCallable, RewardResult, call_reward, normalize_reward
from agentloop.util.cache import exec_module_file

RewardRef = tuple[str, str | None, str]
"""(module name, the module's file or None, qualified name): what a worker imports a reward by."""


class RewardTimeout(RewardError):
    """A reward call ran past `reward.timeout_s`."""


def reward_ref(fn: RewardCallable) -> RewardRef | None:
    """How a fresh process finds `fn`: its module and qualified name, when those lead back to this very
    object (a closure, lambda, bound method or callable object does not), plus the module's file for a
    module loaded from a path (a fresh process cannot import it by name)."""
    mod_name, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(mod_name, str) or not isinstance(qual, str) or "<" in qual or mod_name == "__main__":
        return None
    module = sys.modules.get(mod_name)
    if module is None:
        return None
    obj: Any = module
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        return None
    # A module found on sys.path is imported by name; one loaded with spec_from_file_location under a
    # name of its own (plugins, custom reward files) is not on any path, so its file travels along.
    top = mod_name.partition(".")[0]
    try:
        by_name = importlib.machinery.PathFinder.find_spec(top) is not None
    except (ImportError, ValueError):
        by_name = False
    path = getattr(module, "__file__", None)
    if not by_name and not isinstance(path, str):  # made at run time: nothing a worker could import
        return None
    return (mod_name, None if by_name else path, qual)


def resolve_ref(ref: RewardRef) -> RewardCallable:
    """The function `ref` names, imported in this process (the worker's side of `reward_ref`)."""
    mod_name, path, qual = ref
    module = sys.modules.get(mod_name)
    if module is None:
        if path is None:
            module = importlib.import_module(mod_name)
        else:
            module = exec_module_file(mod_name, path)
    obj: Any = module
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _score(fn: RewardCallable, args: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Call and normalize, raising RewardError (naming the data source) for anything unusable."""
    ds = args.get("data_source", "?")
    try:
        value = call_reward(fn, args)
    except RewardError:
        raise
    except Exception as e:  # named and re-raised as the reward's failure
        name = getattr(fn, "__qualname__", repr(fn))
        raise RewardError(f"reward {name} for data source {ds!r} raised {type(e).__name__}: {e}") from e
    if asyncio.iscoroutine(value):
        value.close()
        raise RewardError(f"reward for data source {ds!r} returned a coroutine from a synchronous call")
    r = normalize_reward(value, ds)
    return r.score, r.info


def worker_main(fd: int) -> None:
    """A reward worker on socket `fd`: answer ("ready",), then for each (ref, args) one ("ok", score, info)
    or ("error", message), until the parent's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = multiprocessing.connection.Connection(fd)
    import agentloop.rewards  # noqa: F401 - registers the built-ins; the first call pays no import

    fns: dict[RewardRef, RewardCallable] = {}
    conn.send(("ready",))
    while True:
        try:
            ref, args = conn.recv()
        except (EOFError, OSError):
            return
        fn = fns.get(ref)
        if fn is None:
            try:
                fn = fns[ref] = resolve_ref(ref)
            except BaseException as e:  # noqa: BLE001 - the parent runs this reward on a thread instead
                conn.send(("unresolvable", f"{type(e).__name__}: {e}"))
                continue
        try:
            score, info = _score(fn, args)
            answer: tuple[Any, ...] = ("ok", score, info)
        except RewardError as e:
            answer = ("error", str(e))
        except BaseException as e:  # noqa: BLE001 - any failure is the call's answer, the worker lives on
            answer = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return


class _Worker:
    """One worker process and our end of its socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The parent's sys.path (plugin folders, a test's root) without re-running its __main__, which
        # multiprocessing's spawn would do.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c",
                 f"from agentloop.rewards.pool import worker_main; worker_main({theirs.fileno()})"],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.conn.close()


class RewardPool:
    """Runs synchronous reward functions in `workers` processes (or threads), `timeout_s` per call.

    Use on one event loop; `await close()` when done (else the workers are killed when the pool is
    garbage-collected or this process exits; a worker whose parent died exits on its socket's EOF).
    `on_note` receives one line when a reward has to run on a thread, or when no worker can start."""

    def __init__(self, workers: int = 4, timeout_s: float = 60.0,
                 executor: Literal["process", "thread"] = "process",
                 on_note: Callable[[str], None] | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.executor = executor
        self.on_note = on_note
        self._procs: list[_Worker] = []
        self._idle: asyncio.Queue[_Worker | None] | None = None
        self._starting: set[asyncio.Task] = set()
        self._reaping: set[asyncio.Task] = set()  # reaping killed workers, draining cancelled calls
        self._killed: list[_Worker] = []  # killed, not yet reaped
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._refs: dict[int, tuple[RewardCallable, RewardRef | None]] = {}
        self._noted: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Workers die with the pool even when nobody awaits close() (a test's asyncio.run, a crash).
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)
        self.killed = 0
        """Workers killed for running past the deadline (or found dead) and replaced."""

    # ------------------------------------------------------------------ the call

    async def score(self, fn: RewardCallable, args: dict[str, Any]) -> RewardResult:
        """Score one episode with `fn` off the loop; RewardTimeout past the deadline, RewardError otherwise."""
        ref = self._ref(fn)
        if ref is None:
            return await self._in_thread(fn, args)
        worker = await self._take()
        if worker is None:  # no worker process could start: threads it is (said when it happened)
            return await self._in_thread(fn, args)
        try:
            worker.conn.send((ref, args))
        except OSError as e:  # the idle worker died
            self._replace(worker)
            raise RewardError(f"the reward worker for {_name(fn)} died ({e}); it was replaced") from None
        except Exception as e:  # noqa: BLE001 - did not pickle: nothing was sent, the worker is fine
            self._idle_put(worker)
            raise RewardError(f"the arguments of {_name(fn)} cannot be sent to a worker: {e}") from None
        try:
            answer = await asyncio.wait_for(self._recv(worker), self.timeout_s)
        except asyncio.TimeoutError:
            self._replace(worker)
            raise RewardTimeout(f"{_name(fn)} for data source {args.get('data_source')!r} ran past "
                                f"reward.timeout_s={self.timeout_s:g}s; its worker was killed") from None
        except (EOFError, OSError) as e:
            self._replace(worker)
            raise RewardError(f"the reward worker running {_name(fn)} died ({type(e).__name__}: {e}); "
                              "it was replaced") from None
        except asyncio.CancelledError:
            # The episode was cancelled while its reward computes: the worker's answer is read and dropped
            # (or the worker killed at the deadline) before it serves another call.
            self._background(self._drain(worker), "reward-worker-drain")
            raise
        self._idle_put(worker)
        if answer[0] == "ok":
            return RewardResult(score=answer[1], info=answer[2])
        if answer[0] == "unresolvable":  # a worker cannot import it after all: threads for this function
            self._refs[id(fn)] = (fn, None)
            self._noted.add(_name(fn))
            self._note(f"a reward worker cannot import {_name(fn)} ({answer[1]}): it runs on a thread, where a "
                       "call past reward.timeout_s cannot be stopped")
            return await self._in_thread(fn, args)
        raise RewardError(answer[1])

    async def _drain(self, worker: _Worker) -> None:
        try:
            await asyncio.wait_for(self._recv(worker), self.timeout_s)
        except (asyncio.TimeoutError, EOFError, OSError):
            self._replace(worker)
        else:
            self._idle_put(worker)

    def _idle_put(self, worker: _Worker) -> None:
        if self._idle is not None and worker in self._procs:
            self._idle.put_nowait(worker)

    def _background(self, coro: Any, name: str) -> None:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._reaping.add(t)
        t.add_done_callback(self._reaping.discard)

    def _ref(self, fn: RewardCallable) -> RewardRef | None:
        if self.executor == "thread":
            return None
        hit = self._refs.get(id(fn))
        if hit is not None and hit[0] is fn:
            return hit[1]
        ref = reward_ref(fn)
        self._refs[id(fn)] = (fn, ref)
        return ref

    async def _in_thread(self, fn: RewardCallable, args: dict[str, Any]) -> RewardResult:
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="agentloop-reward")
        name = _name(fn)
        if self.executor == "process" and name not in self._noted:
            self._noted.add(name)
            self._note(f"reward {name} cannot be imported by a worker process (a closure, lambda or object?): "
                       f"it runs on a thread, where a call past reward.timeout_s cannot be stopped")
        fut = asyncio.get_running_loop().run_in_executor(self._threads, _score, fn, args)
        try:
            score, info = await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            raise RewardTimeout(f"{name} for data source {args.get('data_source')!r} ran past "
                                f"reward.timeout_s={self.timeout_s:g}s (on a thread: it runs on)") from None
        return RewardResult(score=score, info=info)

    # ------------------------------------------------------------------ workers

    async def _take(self) -> _Worker | None:
        """An idle worker (starting them on first use); None when none can start (threads then)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # used from a new event loop: the old loop's queue and tasks are gone
            _kill_all(self._procs + self._killed)
            self._procs.clear()
            self._killed.clear()
            self._idle, self._loop = None, loop
            self._starting.clear()
            self._reaping.clear()
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.workers):
                self._start_one()
        w = await self._idle.get()
        if w is None:
            self._idle.put_nowait(None)  # wakes the next waiter too
        return w

    def _start_one(self) -> None:
        try:
            w = _Worker()
        except OSError as e:
            self._fall_back(f"could not start a reward worker ({type(e).__name__}: {e})")
            return
        self._procs.append(w)
        t = asyncio.get_running_loop().create_task(self._wait_ready(w), name="reward-worker-start")
        self._starting.add(t)
        t.add_done_callback(self._starting.discard)

    async def _wait_ready(self, w: _Worker) -> None:
        try:
            msg = await self._recv(w)
        except (EOFError, OSError) as e:
            if w in self._procs:
                self._procs.remove(w)
            w.kill()
            self._fall_back(f"a reward worker died while starting ({type(e).__name__}: {e}; its stderr says why)")
            return
        if msg != ("ready",):
            raise RewardError(f"a reward worker said {msg!r} instead of ready")
        assert self._idle is not None
        self._idle.put_nowait(w)

    async def _recv(self, w: _Worker) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        fd = w.conn.fileno()

        def readable() -> None:
            loop.remove_reader(fd)
            if fut.done():
                return
            try:
                fut.set_result(w.conn.recv())
            except BaseException as e:  # noqa: BLE001 - EOF (the worker died) and the like, to the waiter
                fut.set_exception(e)

        loop.add_reader(fd, readable)
        try:
            return await fut
        finally:
            if not w.conn.closed:
                loop.remove_reader(fd)

    async def _reap(self, w: _Worker) -> None:
        await asyncio.to_thread(w.proc.wait, 10)
        if w in self._killed:
            self._killed.remove(w)

    def _fall_back(self, why: str) -> None:
        """No worker process: every reward runs on a thread from now on (still under the deadline)."""
        if self.executor != "thread":
            self._note(f"{why}: rewards run on threads from now on")
        self.executor = "thread"
        self._refs.clear()
        if self._idle is not None:
            self._idle.put_nowait(None)

    def _replace(self, w: _Worker) -> None:
        self.killed += 1
        if w in self._procs:
            self._procs.remove(w)
        w.kill()
        self._killed.append(w)
        self._background(self._reap(w), "reward-worker-reap")
        if self.executor == "process":
            self._start_one()

    def _note(self, line: str) -> None:
        if self.on_note is not None:
            self.on_note(line)

    async def close(self) -> None:
        """Stop every worker (and the thread pool, without waiting for threads still running)."""
        pending = list(self._starting) + list(self._reaping)  # no reader may outlive its socket
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        procs = list(self._procs) + self._killed
        self._procs.clear()  # in place: the finalizer holds this list
        self._killed.clear()
        for w in procs:
            w.kill()
        await asyncio.gather(*(asyncio.to_thread(w.proc.wait, 10) for w in procs), return_exceptions=True)
        self._idle = None
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def gauges(self) -> dict[str, float]:
        return {"reward/workers": float(len(self._procs)), "reward/workers_killed": float(self.killed)}


def _kill_all(procs: list[_Worker]) -> None:
    for w in procs:
        w.kill()
    for w in procs:
        try:
            w.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _name(fn: RewardCallable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
