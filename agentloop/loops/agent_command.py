"""Running an agent command for one episode: its own process group, a deadline, bounded output, the group
killed at the end.

    run_command     start `sh -c COMMAND` in a new session (process group), feed stdin, read stdout and
                    stderr (their trailing bytes kept), wait until it exits or the deadline passes, then
                    SIGKILL the whole group (so children it left behind die with it)
    CommandResult   exit code, stdout/stderr tails, whether it timed out
    read_result     the result JSON the command's last stdout line may carry ({"reward": x, ...})

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
    """Run `command` through the shell in a new process group; see the module doc."""
    proc = await asyncio.create_subprocess_shell(
        command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, cwd=cwd, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    readers = asyncio.gather(_tail(proc.stdout, limit), _tail(proc.stderr, limit))

    async def feed_and_wait() -> int:
        try:
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it exited or closed stdin without reading it all
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
            out, err = await asyncio.wait_for(readers, _KILL_WAIT_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            readers.cancel()  # a grandchild that left the group still holds a pipe: stop reading
            await asyncio.gather(readers, return_exceptions=True)
            out, err = b"", b""
        try:
            await asyncio.wait_for(proc.wait(), _KILL_WAIT_S)
        except asyncio.TimeoutError:
            pass
    return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out)


def read_result(stdout: str) -> dict[str, Any] | None:
    """The JSON object on the last non-empty line of `stdout`, or None when that line is not one.

    A last line that starts with "{" but is not a JSON object is an AgentError (bad output)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return None
    last = lines[-1].strip()
    if not last.startswith("{"):
        return None
    try:
        value = json.loads(last)
    except (json.JSONDecodeError, RecursionError) as e:
        raise AgentError(f"the agent command's last stdout line looks like JSON but is not ({e.msg}): "
                         f"{last[:200]!r}") from None
    if not isinstance(value, dict):
        raise AgentError(f"the agent command's last stdout line must be a JSON object, got {last[:200]!r}")
    return value


__all__ = ["CommandResult", "read_result", "run_command"]
