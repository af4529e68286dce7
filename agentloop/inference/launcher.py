"""Launch, health-check and tear down local SGLang servers.

Map:
    LocalServer       one `sglang.launch_server` process group: start(), wait_ready(), stop(), kill()
    launch_servers    start `ServerConfig.num_local` servers concurrently, wait until all are ready
    stop_servers      stop several servers concurrently (bounded by their shutdown timeouts)
    cpu_server_args   the SGLang flags used for CPU servers, and why

Lifecycle guarantees: each server runs in its own session (process group), so stop()/kill()
reach SGLang's scheduler and detokenizer children too; the server's main process gets
PR_SET_PDEATHSIG (SIGKILL) so it dies with the Python process that launched it, and SGLang
arms the same signal in its own children; servers still alive at interpreter exit are
stopped by an atexit hook. The launching call must come from the main thread (Linux sends
the parent-death signal when the spawning *thread* exits).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import aiohttp

from agentloop.config import ServerConfig
from agentloop.errors import ServerStartError
from agentloop.util.zygote import die_with_parent

if TYPE_CHECKING:
    from agentloop.util.forked import ForkedProcess

__all__ = ["LocalServer", "cpu_server_args", "launch_servers", "pick_free_port", "resolve_device", "stop_servers"]

_TAIL_LINES = 30

ZYGOTE_ENV = "AGENTLOOP_SGLANG_ZYGOTE"
"""The environment variable naming the socket of a zygote for CPU servers (agentloop.inference.sglang_cpu.zygote)."""


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now (another process may still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cpu_server_args(max_total_tokens: int | None) -> list[str]:
    """SGLang flags for the CPU engine (measured on a 2-core AVX2 box with the tiny model).

    --device cpu                     the CPU engine (with env SGLANG_USE_CPU_ENGINE=1)
    --attention-backend torch_native the only attention backend that needs no native kernels
                                     (it also turns CUDA graphs off; --disable-cuda-graph is
                                     deprecated in 0.5.23 and only adds a warning)
    --sampling-backend pytorch       no flashinfer sampling on CPU
    --dtype float32                  3x the decode throughput of bfloat16 on CPUs without
                                     AVX512-BF16/AMX (205 vs 628 tok/s at 64 concurrent requests)
    --disable-overlap-schedule       the overlap thread competes for the few cores (729 vs 628 tok/s)
    --sleep-on-idle                  the scheduler otherwise busy-polls a whole core while idle
    --max-total-tokens N             KV pool size; SGLang's default sizing takes ~15 GB on CPU
    Server warmup is kept: with --skip-server-warmup, 0.5.23 posts /freeze_gc before its HTTP
    server is up and logs a traceback; the warmup itself is one tiny /generate.
    Anything in `extra_args` comes later on the command line and wins.
    """
    args = [
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch",
        "--dtype", "float32",
        "--disable-overlap-schedule",
        "--sleep-on-idle",
    ]  # fmt: skip
    if max_total_tokens is not None:
        args += ["--max-total-tokens", str(max_total_tokens)]
    return args


_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory holding the agentloop package: on a server's PYTHONPATH, agentloop is importable in its children."""


def _put_first_on_pythonpath(env: dict[str, str], *dirs: str) -> None:
    """`dirs` first on env's PYTHONPATH, each once (so an environment built from one built before is the same)."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in dirs]
    env["PYTHONPATH"] = os.pathsep.join([*dirs, *rest])


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids of process group `pgid`."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel whether anything is left in the group
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # fields after "(comm)": state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


class LocalServer:
    """One local SGLang server process (group) with its log file.

    `start()` spawns it; `await wait_ready()` returns once it answers /health and a one-token
    /generate, or raises ServerStartError (ending with the log tail) if it exits or misses its
    deadline, after stopping it. `stop()` is idempotent: SIGTERM to the group, up to
    `shutdown_timeout_s` of grace, then SIGKILL.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        device: Literal["cpu", "cuda"] = "cpu",
        gpu_id: int | None = None,
        max_total_tokens: int | None = 16384,
        mem_fraction_static: float | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        log_path: str | Path | None = None,
        startup_timeout_s: float = 300.0,
        shutdown_timeout_s: float = 20.0,
    ):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.model_path = str(model_path)
        self.host = host
        self.port = port or pick_free_port(host)
        self.device = device
        self.gpu_id = gpu_id
        self.max_total_tokens = max_total_tokens
        self.mem_fraction_static = mem_fraction_static
        self.extra_args = list(extra_args)
        if log_path is None:
            log_path = Path(tempfile.gettempdir()) / f"agentloop-sglang-{os.getpid()}-{self.port}.log"
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.process: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        """Seconds from start() to the end of a successful wait_ready()."""
        self._stopped = False

    # ------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def __repr__(self) -> str:
        state = "alive" if self.alive() else "down"
        return f"LocalServer({self.url}, device={self.device}, pid={self.pid}, {state})"

    # ------------------------------------------------------------ start

    def command(self) -> list[str]:
        """The argv this server runs."""
        if self.device == "cpu":
            argv = [sys.executable, "-m", "agentloop.inference.sglang_cpu.launch_server"]
        elif "--enable-lora" in self.extra_args:  # SGLang's own launcher, with a LoRA fix older releases need
            argv = [sys.executable, "-m", "agentloop.inference.sglang_fixes"]
        else:
            argv = [sys.executable, "-m", "sglang.launch_server"]
        argv += ["--model-path", self.model_path, "--host", self.host, "--port", str(self.port)]
        if self.device == "cpu":
            argv += cpu_server_args(self.max_total_tokens)
        else:
            if self.max_total_tokens is not None:
                argv += ["--max-total-tokens", str(self.max_total_tokens)]
            if self.mem_fraction_static is not None:
                argv += ["--mem-fraction-static", str(self.mem_fraction_static)]
        return argv + self.extra_args

    def environment(self) -> dict[str, str]:
        """The child's environment: ours plus offline hub flags and, on CPU, the op fallback."""
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env["PYTHONUNBUFFERED"] = "1"
        if "--enable-lora" in self.extra_args:
            # LoRA training loads an adapter every step and unloads the one before. SGLang restacks each load's
            # q/k/v and gate/up into new host tensors; past glibc's default thresholds those are fresh mappings,
            # page-faulted at every load. Kept in the heap, the unloaded adapter's memory takes the next one.
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
            env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
        if self.device == "cpu":
            from agentloop.inference.sglang_cpu import site_dir

            env["SGLANG_USE_CPU_ENGINE"] = "1"
            # OpenMP threads that spin while idle starve every other process on a small CPU box
            # (a learner, a second server, the engine itself): decode fell from ~700 to ~15 tok/s.
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            _put_first_on_pythonpath(env, str(site_dir()), _PACKAGE_ROOT)
        else:
            # The weight-update NCCL group (learner + servers, agentloop.train.weights.sync) failed at its
            # first broadcast with "Cuda failure 'invalid argument'" on an H200 pair while NCCL used
            # cuMem handles across processes; the legacy IPC path works (0.07 s per 0.5B sync).
            env.setdefault("NCCL_CUMEM_ENABLE", "0")
            if "--enable-lora" in self.extra_args:  # agentloop.inference.sglang_fixes importable in the child
                _put_first_on_pythonpath(env, _PACKAGE_ROOT)
            if self.gpu_id is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_id)
        return env

    def start(self) -> LocalServer:
        """Start the server (returns at once; then `await wait_ready()`): spawned, or on CPU forked by the zygote
        `AGENTLOOP_SGLANG_ZYGOTE` names, when one runs and can serve this server's environment."""
        if self.process is not None:
            raise RuntimeError(f"{self!r} was already started")
        if importlib.util.find_spec("sglang") is None:
            raise ServerStartError("sglang is not installed: pip install 'agentloop[sglang]'")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start LocalServer from the main thread (parent-death signal is per thread)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"# agentloop: {' '.join(self.command())}\n".encode())
            log.flush()
            forked = self._forked()
            if isinstance(forked, str) and forked:  # a zygote is named: say why it did not fork this one
                log.write(f"# agentloop: spawned, not forked: {forked}\n".encode())
                log.flush()
        self.process = forked if not isinstance(forked, str) else self._spawned()
        self.started_at = time.monotonic()
        _LIVE.add(self)
        return self

    def _forked(self) -> ForkedProcess | str:
        """A CPU server forked by the zygote named in the environment, or why not ('' when none is named)."""
        if self.device != "cpu":
            return ""
        if "--enable-memory-saver" in self.extra_args:
            return "the memory saver's children need a fresh process"
        from agentloop.util import forked

        return forked.spawn(ZYGOTE_ENV, self.command()[3:], self.environment(), self.log_path)

    def _spawned(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )

    async def wait_ready(self, poll_interval_s: float = 0.5) -> None:
        """Wait until /health answers 200 and a one-token /generate succeeds.

        Raises ServerStartError (message ending with the log tail) if the process exits or
        `startup_timeout_s` (counted from start()) passes; the server is stopped first.
        """
        if self.process is None or self.started_at is None:
            raise RuntimeError("call start() before wait_ready()")
        deadline = self.started_at + self.startup_timeout_s
        probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        async with aiohttp.ClientSession() as session:
            while True:
                rc = self.process.poll()
                if rc is not None:
                    self.stop()
                    raise self._start_error(f"exited with code {rc} during startup")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stop()
                    raise self._start_error(f"was not ready within {self.startup_timeout_s:.0f} s")
                try:
                    timeout = aiohttp.ClientTimeout(total=min(5.0, remaining))
                    async with session.get(f"{self.url}/health", timeout=timeout) as r:
                        healthy = r.status == 200
                    if healthy:
                        timeout = aiohttp.ClientTimeout(total=max(1.0, min(60.0, remaining)))
                        async with session.post(f"{self.url}/generate", json=probe, timeout=timeout) as r:
                            if r.status == 200 and (await r.json()).get("output_ids"):
                                self.ready_after_s = time.monotonic() - self.started_at
                                return
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass  # not up yet: connection refused, 503 while starting, or a half-written reply
                await asyncio.sleep(poll_interval_s)

    def _start_error(self, what: str) -> ServerStartError:
        tail = self.log_tail(_TAIL_LINES)
        return ServerStartError(
            f"SGLang server {self.url} (model {self.model_path}, device {self.device}) {what}; "
            f"log: {self.log_path}\n--- last {_TAIL_LINES} log lines ---\n{tail}"
        )

    # ------------------------------------------------------------ state

    def alive(self) -> bool:
        """The server's main process is running (says nothing about readiness)."""
        return self.process is not None and self.process.poll() is None

    def log_tail(self, n: int = _TAIL_LINES) -> str:
        """The last `n` lines of the server log ('' if there is none yet)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 256 * 1024))
                lines = deque(f.read().decode(errors="replace").splitlines(), maxlen=n)
        except FileNotFoundError:
            return ""
        return "\n".join(lines)

    def group_pids(self) -> list[int]:
        """Live pids of the server's process group (main process and SGLang's children)."""
        return [] if self.process is None else _group_members(self.process.pid)

    # ------------------------------------------------------------ stop

    def stop(self) -> None:
        """SIGTERM (a CPU server's main process, a GPU server's group), wait up to shutdown_timeout_s for the group to
        end, then SIGKILL the group. Idempotent."""
        if self.process is None or self._stopped:
            return
        pgid = self.process.pid
        # A CPU server gets SIGTERM in its main process alone: SGLang drains, stops its children itself and exits 0
        # (~4 s on the CPU box). Sent to the whole group, the scheduler dies first and the main process takes that for
        # a crash: a 5 s wait "for crash diagnostics", then SIGKILL (~5.5 s, exit -9). GPU servers keep the group's
        # SIGTERM, the form the GPU acceptance runs proved. The group is SIGKILLed at the deadline either way.
        if self.device == "cpu":
            try:
                os.kill(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        else:
            self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout_s
        while time.monotonic() < deadline:
            self.process.poll()
            if self.process.returncode is not None and not _group_members(pgid):
                break
            time.sleep(0.1)
        else:
            self._signal_group(signal.SIGKILL)
        self._reap()
        self._stopped = True
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL the whole process group now (fault injection, or a hung server)."""
        if self.process is None:
            return
        self._signal_group(signal.SIGKILL)
        self._reap()
        self._stopped = True
        _LIVE.discard(self)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass  # the whole group is already gone

    def _reap(self) -> None:
        """Collect the main process and wait (briefly) for the group to empty after a SIGKILL."""
        assert self.process is not None
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while _group_members(self.process.pid) and time.monotonic() < deadline:
            self._signal_group(signal.SIGKILL)
            time.sleep(0.05)


# Servers started and not yet stopped, stopped by the atexit hook if the caller did not.
_LIVE: set[LocalServer] = set()


@atexit.register
def _stop_all_at_exit() -> None:
    for server in list(_LIVE):
        server.stop()


def resolve_device(device: str) -> Literal["cpu", "cuda"]:
    """'auto' -> 'cuda' if torch sees a GPU, else 'cpu'."""
    if device != "auto":
        return device  # type: ignore[return-value]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


async def launch_servers(server_cfg: ServerConfig, model_path: str | Path, run_dir: str | Path, *,
                         memory_saver: Sequence[int] = ()) -> list[LocalServer]:
    """Start `server_cfg.num_local` servers concurrently and wait until all are ready.

    On CUDA, server i uses GPU i. Logs go to `<run_dir>/servers/server<i>.log`. If any server
    fails, all are stopped and the first ServerStartError is raised.
    """
    device = resolve_device(server_cfg.device)
    n = server_cfg.num_local
    if device == "cuda":
        import torch

        visible = torch.cuda.device_count()
        want = server_cfg.gpus if server_cfg.gpus is not None else list(range(n))
        if max(want, default=-1) >= visible:
            raise ServerStartError(f"local CUDA servers on GPUs {want} requested but {visible} GPU(s) are visible")
    log_dir = Path(run_dir) / "servers"
    servers: list[LocalServer] = []
    used_ports: set[int] = set()
    try:
        for i in range(n):
            port = server_cfg.base_port + i if server_cfg.base_port else 0
            while port == 0 or port in used_ports:
                port = pick_free_port(server_cfg.host)
            used_ports.add(port)
            server = LocalServer(
                model_path,
                host=server_cfg.host,
                port=port,
                device=device,
                gpu_id=(server_cfg.gpus[i] if server_cfg.gpus is not None else i) if device == "cuda" else None,
                max_total_tokens=server_cfg.max_total_tokens,
                mem_fraction_static=server_cfg.mem_fraction_static,
                # a lent server releases its KV cache while the learner trains: SGLang's memory saver on CUDA
                extra_args=(["--enable-memory-saver"] if device == "cuda" and i in memory_saver else [])
                + list(server_cfg.extra_args),
                log_path=log_dir / f"server{i}.log",
                startup_timeout_s=server_cfg.startup_timeout_s,
                shutdown_timeout_s=server_cfg.shutdown_timeout_s,
            )
            servers.append(server.start())
        results = await asyncio.gather(*(s.wait_ready() for s in servers), return_exceptions=True)
    except BaseException:
        await stop_servers(servers)
        raise
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await stop_servers(servers)
        raise errors[0]
    return servers


async def stop_servers(servers: list[LocalServer]) -> None:
    """Stop servers concurrently; returns when all are gone (each within its shutdown timeout)."""
    await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers))
