"""The zygote for CPU SGLang servers (agentloop.util.zygote): it imports SGLang once and forks each server from that
process.

A CPU server's start is mostly importing SGLang (~30 s of CPU on the 2-core box, GPU libraries included), paid again
by every server a run or a test starts. `python -m agentloop.inference.sglang_cpu.zygote --socket PATH` imports what
a server needs (it re-execs with a CPU server's environment if started without it), then forks one server per
request; the forked process runs SGLang's own launcher (`launch_server.run`) exactly as a spawned one would.
`launcher.LocalServer` asks the zygote named by `AGENTLOOP_SGLANG_ZYGOTE` for its CPU servers and spawns them itself
when there is none, when the zygote does not answer, or when the server's environment differs from the zygote's in a
variable read at import time. The test suite starts one for its session (tests/conftest.py); a user may start one
for repeated CPU runs.

Map:
    SERVER          the program: what a server imports, and SGLang's launcher on the request's argv
    start           start a zygote for the servers this process would start (the test session's fixture does)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from agentloop.inference.launcher import ZYGOTE_ENV as ENV
from agentloop.inference.launcher import LocalServer
from agentloop.util.forked import ForkedProcess
from agentloop.util.zygote import Program
from agentloop.util.zygote import main as _main
from agentloop.util.zygote import start as _start

__all__ = ["ENV", "SERVER", "ForkedProcess", "server_environment", "start"]

_MODULE = "agentloop.inference.sglang_cpu.zygote"


def server_environment() -> dict[str, str]:
    """The environment this process's CPU servers start with (LocalServer's, from ours)."""
    return LocalServer("-", device="cpu").environment()


def _preload() -> None:
    """What every CPU server imports before it serves, in the zygote's process, once."""
    from agentloop.inference.sglang_cpu import launch_server

    launch_server.prepare(fork_children=True)
    # what sglang.launch_server imports (runpy runs that module itself, so it is not imported here), the HTTP server,
    # the managers (the scheduler's and detokenizer's come with prepare), the model
    import sglang.srt.arg_groups.overrides
    import sglang.srt.entrypoints.http_server
    import sglang.srt.managers.tokenizer_manager
    import sglang.srt.models.qwen2
    import sglang.srt.plugins
    import sglang.srt.server_args  # noqa: F401
    import transformers.models.qwen2  # noqa: F401


def _run(argv: list[str]) -> None:
    from agentloop.inference.sglang_cpu import launch_server

    launch_server.run(argv)


SERVER = Program(module="agentloop.inference.sglang_cpu.launch_server", preload=_preload, run=_run)
"""A CPU SGLang server, as agentloop.inference.sglang_cpu.launch_server starts one."""


def start(sock_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Start a zygote on `sock_path` for the CPU servers this process (and those inheriting its environment) would
    start; it dies with this process (agentloop.util.zygote.start)."""
    return _start(_MODULE, sock_path, log_path, server_environment())


def main(argv: list[str] | None = None) -> None:
    _main(SERVER, zygote_module=_MODULE, environment=server_environment(), doc=__doc__, argv=argv)


if __name__ == "__main__":
    main()
