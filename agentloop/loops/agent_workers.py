"""Long-lived harness workers: `agent.command` started `agent.workers` times, each taking episodes over a small
protocol (several at once, `agent.worker_concurrency`), so a harness imports its SDK once, not once per episode.

Protocol (JSON, one object per line):
    agentloop -> worker, on its stdin:
        {"type": "episode", "id": ID, "task": TASK, "episode_id": E,
         "openai_base_url": URL, "anthropic_base_url": URL, "api_key": KEY}
                                            run one episode: TASK is what a per-episode command reads on stdin
                                            (the task, without the answer unless agent.send_answer); the URLs
                                            and key are that episode's gateway session
        {"type": "cancel", "id": ID}        the episode's deadline passed (its session is already closed): stop it
    worker -> agentloop, on the file descriptor AGENTLOOP_RESULT_FD names (never stdout, which the model's text
    can reach, like a per-episode command's result):
        {"id": ID, "result": R}             the episode ended; R as a command's result ({"reward": x, ...} or null)
        {"id": ID, "error": "message"}      the harness failed on it (an AgentError, as a command exiting non-zero)
The worker's environment has AGENTLOOP_WORKER=1 and AGENTLOOP_WORKER_CONCURRENCY (how many episodes it gets at
once, at most) on top of agent.env. Its stdout and stderr are read and dropped (the stderr tail goes into the
error of the episodes in flight when it exits). A worker that exits fails its episodes in flight (AgentError)
and is started again for the next ones; ids are random per episode, so nothing the model writes can name one.

    WorkerPool      the workers of one command: start on first use, dispatch to the least busy, restart the dead
    worker_pool     the pool of a ServerManager (closed with it), one per command
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentloop.errors import AgentError, AgentTimeoutError
from agentloop.loops.agent_command import RESULT_FD_ENV

if TYPE_CHECKING:
    from agentloop.gateway.config import AgentConfig
    from agentloop.server_manager import ServerManager

_KILL_WAIT_S = 5.0
_LINE_LIMIT = 1 << 24
"""Longest result line accepted from a worker (16 MiB)."""


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process
    results: asyncio.StreamReader
    inflight: dict[str, asyncio.Future] = field(default_factory=dict)
    stderr_tail: bytearray = field(default_factory=bytearray)
    tasks: list[asyncio.Task] = field(default_factory=list)
    dead: bool = False


class WorkerPool:
    """`cfg.workers` long-lived processes of `cfg.command`; see the module doc."""

    def __init__(self, cfg: "AgentConfig", env: dict[str, str]):
        self.cfg = cfg
        self.env = env
        self._workers: list[_Worker | None] = [None] * cfg.workers
        self._slots = asyncio.Semaphore(cfg.workers * cfg.worker_concurrency)
        self._lock = asyncio.Lock()
        self._closed = False
        self.m = {"started": 0, "exited": 0, "episodes": 0}

    async def _start(self) -> _Worker:
        r_fd, w_fd = os.pipe()
        try:
            proc = await asyncio.create_subprocess_shell(
                self.cfg.command or "", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, cwd=self.cfg.cwd, start_new_session=True, pass_fds=(w_fd,),
                env={**self.env, RESULT_FD_ENV: str(w_fd), "AGENTLOOP_WORKER": "1",
                     "AGENTLOOP_WORKER_CONCURRENCY": str(self.cfg.worker_concurrency)})
        except BaseException:
            os.close(r_fd)
            raise
        finally:
            os.close(w_fd)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_LINE_LIMIT)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r_fd, "rb", 0))
        w = _Worker(proc, reader)
        w.tasks = [asyncio.create_task(self._read_results(w), name="agent-worker-results"),
                   asyncio.create_task(self._read_stderr(w), name="agent-worker-stderr")]
        self.m["started"] += 1
        return w

    async def _read_stderr(self, w: _Worker) -> None:
        assert w.proc.stderr is not None
        while chunk := await w.proc.stderr.read(1 << 16):
            w.stderr_tail += chunk
            del w.stderr_tail[:-4000]

    async def _read_results(self, w: _Worker) -> None:
        try:
            while line := await w.results.readline():
                try:
                    msg = json.loads(line)
                    fut = w.inflight.pop(str(msg["id"]), None)
                except (ValueError, KeyError, TypeError):
                    continue  # not a result line of ours: ignored (the worker's bug, not an episode's)
                if fut is None or fut.done():
                    continue
                if "error" in msg:
                    fut.set_exception(AgentError(f"the agent worker failed the episode: {str(msg['error'])[:2000]}"))
                else:
                    fut.set_result(msg.get("result"))
        except (ValueError, asyncio.LimitOverrunError):  # a line over _LINE_LIMIT: the channel is unusable
            pass
        finally:
            await self._died(w)

    async def _died(self, w: _Worker) -> None:
        """The worker closed its result channel (it exited): its episodes in flight fail, it is replaced on demand."""
        w.dead = True
        try:
            code = await asyncio.wait_for(w.proc.wait(), _KILL_WAIT_S)
        except asyncio.TimeoutError:
            _kill(w.proc.pid)
            code = None
        self.m["exited"] += 1
        tail = bytes(w.stderr_tail).decode(errors="replace")[-2000:].strip()
        for fut in w.inflight.values():
            if not fut.done():
                fut.set_exception(AgentError(f"the agent worker exited (code {code}) with this episode in flight; "
                                             f"stderr tail: {tail!r}"))
        w.inflight.clear()

    async def _pick(self) -> _Worker:
        async with self._lock:
            if self._closed:
                raise AgentError("the agent worker pool is closed")
            best = None
            for i, w in enumerate(self._workers):
                if w is None or w.dead:
                    w = self._workers[i] = await self._start()
                if len(w.inflight) < self.cfg.worker_concurrency and (best is None or
                                                                      len(w.inflight) < len(best.inflight)):
                    best = w
            assert best is not None  # the slots semaphore admits no more episodes than workers * concurrency
            return best

    async def run(self, message: dict[str, Any], timeout_s: float) -> Any:
        """Run one episode on a worker: its result, AgentError (the worker failed it or exited), AgentTimeoutError."""
        async with self._slots:
            w = await self._pick()
            eid = secrets.token_hex(12)
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            w.inflight[eid] = fut
            self.m["episodes"] += 1
            try:
                await self._send(w, {"type": "episode", "id": eid, **message})
                return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            except asyncio.TimeoutError:
                await self._send(w, {"type": "cancel", "id": eid})
                raise AgentTimeoutError(f"the agent worker ran past agent.timeout_s={timeout_s:g} on this episode "
                                        "(it was told to cancel it)") from None
            except asyncio.CancelledError:
                await asyncio.shield(self._send(w, {"type": "cancel", "id": eid}))
                raise
            finally:
                w.inflight.pop(eid, None)

    async def _send(self, w: _Worker, msg: dict[str, Any]) -> None:
        if w.dead or w.proc.stdin is None:
            return
        try:
            w.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            await asyncio.wait_for(w.proc.stdin.drain(), _KILL_WAIT_S)
        except (BrokenPipeError, ConnectionResetError, RuntimeError, asyncio.TimeoutError):
            pass  # it is exiting (uvloop: RuntimeError, "the handler is closed"): its reader fails what is in flight

    async def close(self) -> None:
        """Close every worker's stdin (its cue to exit), then kill its process group."""
        self._closed = True
        for w in self._workers:
            if w is None:
                continue
            if w.proc.stdin is not None:
                w.proc.stdin.close()
            try:
                await asyncio.wait_for(w.proc.wait(), _KILL_WAIT_S)
            except asyncio.TimeoutError:
                pass
            _kill(w.proc.pid)
            for t in w.tasks:
                t.cancel()
            await asyncio.gather(*w.tasks, return_exceptions=True)
            try:
                await asyncio.wait_for(w.proc.wait(), _KILL_WAIT_S)
            except asyncio.TimeoutError:
                pass


def _kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_POOLS: "weakref.WeakKeyDictionary[Any, dict[str, WorkerPool]]" = weakref.WeakKeyDictionary()


def worker_pool(sm: "ServerManager", cfg: "AgentConfig", env: dict[str, str]) -> WorkerPool:
    """The pool of `cfg.command` for `sm` (made on first use, closed when `sm` closes)."""
    pools = _POOLS.get(sm)
    if pools is None:
        pools = _POOLS[sm] = {}
    pool = pools.get(cfg.command or "")
    if pool is None:
        pool = pools[cfg.command or ""] = WorkerPool(cfg, env)
        sm.on_close(pool.close)
    return pool


__all__ = ["WorkerPool", "worker_pool"]
