"""Running an agent command for one episode: its own process group, a deadline, bounded output, the group
killed at the end.

    run_command     start `sh -c COMMAND` in a new session (process group), feed stdin, read stdout and
                    stderr (their trailing bytes kept) and the result channel, wait until it exits or the
                    deadline passes, then SIGKILL the whole group (so children it left behind die with it)
    CommandResult   exit code, stdout/stderr tails, what it wrote on the result channel, whether it timed out
    read_result     the result JSON the command wrote on its result channel ({"reward": x, ...})

The result channel is a pipe of its own, handed to the command as the file descriptor named in
AGENTLOOP_RESULT_FD, never stdout: a harness that prints tool output or the model's text on stdout would
otherwise let the model print `{"reward": 1}` as the last line and score itself.

Isolation: none beyond the process group. The command runs as this process's user, with its filesystem
and network (it must reach the gateway on localhost); wrap it yourself (e.g. `bwrap ... python agent.py`)
when the agent runs untrusted code.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass
from typing import Any

from agentloop.errors import AgentError

_KILL_WAIT_S = 5.0
"""After SIGKILL: how long to wait for the pipes to close and the process to be reaped."""


@dataclass
class CommandResult:
    returncode: int | None
    """Exit code (negative: killed by that signal); None when it had to be killed at the deadline."""
    stdout: str
    """The trailing `limit` bytes of stdout, decoded (undecodable bytes replaced)."""
    stderr: str
    """The trailing `limit` bytes of stderr, decoded."""
    timed_out: bool
    result: str = ""
    """What the command wrote on its result channel (AGENTLOOP_RESULT_FD), at most `limit` bytes."""
    result_overflow: bool = False
    """It wrote more than `limit` bytes there (the result is refused, not cut)."""


RESULT_FD_ENV = "AGENTLOOP_RESULT_FD"
"""The environment variable naming the command's result file descriptor."""


async def _head(pipe: Any, limit: int) -> tuple[bytes, bool]:
    """Everything written on `pipe` (a file object) until every writer closed it: (up to `limit` bytes,
    overflowed)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except BaseException:
        pipe.close()
        raise
    buf, over = bytearray(), False
    try:
        while chunk := await reader.read(1 << 16):
            if len(buf) + len(chunk) > limit:
                over = True  # keep draining, so the writer never blocks on a full pipe
                continue
            buf += chunk
    finally:
        transport.close()
    return bytes(buf), over


async def _tail(stream: asyncio.StreamReader, limit: int) -> bytes:
    buf = bytearray()
    while True:
        chunk = await stream.read(1 << 16)
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            del buf[:len(buf) - limit]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is already gone
        pass


async def run_command(command: str, *, stdin: bytes, env: dict[str, str], cwd: str | None, timeout_s: float,
                      limit: int) -> CommandResult:
    """Run `command` through the shell in a new process group; see the module doc. The command's result
    channel is the write end of a pipe, its number in `env[AGENTLOOP_RESULT_FD]`."""
    r_fd, w_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_shell(
            command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**env, RESULT_FD_ENV: str(w_fd)}, cwd=cwd, start_new_session=True, pass_fds=(w_fd,))
    except BaseException:
        os.close(r_fd)
        raise
    finally:
        os.close(w_fd)  # only the command holds the write end now: its exit (or its group's) ends the read
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    readers = asyncio.gather(_tail(proc.stdout, limit), _tail(proc.stderr, limit),
                             _head(os.fdopen(r_fd, "rb", 0), limit))

    async def feed_and_wait() -> int:
        try:
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            # it exited or closed stdin without reading it all (uvloop says so with a RuntimeError: "the handler
            # is closed")
            pass
        return await proc.wait()

    timed_out = False
    try:
        code: int | None = await asyncio.wait_for(feed_and_wait(), timeout_s)
    except asyncio.TimeoutError:
        timed_out, code = True, None
    finally:
        _kill_group(proc.pid)  # start_new_session: the group id is the shell's pid
        try:
            out, err, (res, over) = await asyncio.wait_for(readers, _KILL_WAIT_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            readers.cancel()  # a grandchild that left the group still holds a pipe: stop reading
            await asyncio.gather(readers, return_exceptions=True)
            out, err, res, over = b"", b"", b"", False
        try:
            await asyncio.wait_for(proc.wait(), _KILL_WAIT_S)
        except asyncio.TimeoutError:
            pass
    return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out,
                         res.decode(errors="replace"), over)


def read_result(text: str, *, overflow: bool = False) -> dict[str, Any] | None:
    """The JSON object the command wrote on its result channel; None when it wrote nothing (the data_source's
    reward then scores the episode). Anything else there is an AgentError (a harness bug: only the harness's
    own code writes on that descriptor)."""
    if overflow:
        raise AgentError(f"the agent command wrote more than agent.output_limit_bytes on ${RESULT_FD_ENV}")
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise AgentError(f"the agent command's result (${RESULT_FD_ENV}) is not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise AgentError(f"the agent command's result (${RESULT_FD_ENV}) must be a JSON object, got {text[:200]!r}")
    return value


__all__ = ["RESULT_FD_ENV", "CommandResult", "read_result", "run_command"]
