"""Sampling: one real SGLang server we launch (agentloop.inference.launcher), serving the base model, the LoRA
adapters saved for sampling (loaded by name, /load_lora_adapter, as agentloop/train/weights/lora_servers.py does)
and full-weights snapshots (an HF directory loaded with /update_weights_from_disk).

The server holds one set of base weights at a time: a full-weights snapshot replaces them. `Sampler` therefore
tracks which weights are loaded (None: the base model) and switches only when no request is in flight (a
condition variable: requests needing the loaded weights go on; a switch waits for the others to drain).
Token ids and the server's logprobs come back as SGLang computed them; nothing is re-tokenized.

Connections: SGLang closes a connection idle for 5 s (uvicorn's keep-alive), so ours are dropped after `KEEPALIVE_S`;
a request that still meets a connection the server closed under it (reset, or closed before any answer) is sent
again, up to `RETRIES` times. Every call here may be repeated: a sample is drawn afresh, a weights load reloads the
same files, an adapter found already loaded is loaded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from agentloop.tinker.wire import SampledSeq

KEEPALIVE_S = 3.0
"""Seconds an idle connection to the server is kept (under SGLang's 5 s keep-alive)."""
RETRIES = 2
"""Times a request is sent again after its connection failed under it."""


class SamplerError(RuntimeError):
    """The SGLang server refused or failed a request (the message names it)."""


def sglang_params(p: Any, num_samples: int) -> dict[str, Any]:
    """The SDK's SamplingParams -> SGLang's sampling_params (stop strings / token ids; `stop=[]` disables EOS too)."""
    out: dict[str, Any] = {"temperature": float(p.temperature), "top_p": float(p.top_p), "top_k": int(p.top_k),
                           "max_new_tokens": int(p.max_tokens) if p.max_tokens is not None else 128}
    if p.seed is not None:
        out["sampling_seed"] = int(p.seed)
    stop = p.stop
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif stop is not None:
        stop = list(stop)
        if not stop:
            out["ignore_eos"] = True
        elif all(isinstance(s, int) for s in stop):
            out["stop_token_ids"] = stop
        else:
            out["stop"] = [str(s) for s in stop]
    return out


class Sampler:
    """The SGLang server and what it has loaded (module doc)."""

    def __init__(self, model_path: str | Path, *, device: str = "cpu", max_lora_rank: int = 32,
                 log_path: str | Path | None = None, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, extra_args: list[str] | None = None, url: str | None = None):
        self.model_path = str(model_path)
        self.device = device
        self.max_lora_rank = max_lora_rank
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.extra_args = list(extra_args or [])
        self.server: Any = None
        self.url = url
        self.adapters: set[str] = set()
        self.loaded_full: str | None = None
        """The full-weights snapshot the server holds (None: the base model)."""
        self._inflight = 0
        self._cond = asyncio.Condition()
        self._adapter_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None

    def server_args(self) -> list[str]:
        """The LoRA flags agentloop's runs give their servers (every projection a client may adapt, up to
        max_lora_rank), then `extra_args`."""
        from agentloop.train.config import LoraConfig
        from agentloop.train.lora import server_args

        return server_args(LoraConfig(enabled=True, rank=self.max_lora_rank), self.device) + self.extra_args

    async def start(self) -> str:
        """Launch the server (unless `url` was given) and wait until it answers; its URL."""
        if self.url is None:
            from agentloop.inference.launcher import LocalServer

            self.server = LocalServer(self.model_path, device=self.device,  # type: ignore[arg-type]
                                      extra_args=self.server_args(), log_path=self.log_path,
                                      startup_timeout_s=self.startup_timeout_s).start()
            await self.server.wait_ready()
            self.url = self.server.url
        self._session = aiohttp.ClientSession(timeout=self.timeout,
                                              connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S))
        return self.url

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server = None

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        assert self._session is not None, "Sampler.start() first"
        for attempt in range(RETRIES + 1):
            try:
                async with self._session.post(f"{self.url}{path}", json=body) as r:
                    text = await r.text()
                    status = r.status
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:  # the module doc's connections
                if attempt == RETRIES:
                    raise SamplerError(f"SGLang {path}: the connection failed under the request {RETRIES + 1} "
                                       f"times ({type(e).__name__}: {e})") from None
        if status != 200:
            raise SamplerError(f"SGLang {path} answered {status}: {text[:500]}")
        import json

        out = json.loads(text) if text else {}
        if isinstance(out, dict) and out.get("success") is False:
            raise SamplerError(f"SGLang {path} failed: {out.get('message') or out.get('error_message')}")
        return out

    async def load_adapter(self, name: str, path: str) -> None:
        async with self._adapter_lock:
            if name in self.adapters:
                return
            try:
                await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
            except SamplerError as e:  # a load sent again after its answer was lost: the first one took
                if "already loaded" not in str(e):
                    raise
            self.adapters.add(name)

    async def _acquire(self, full: str | None) -> None:
        """Wait until the server holds the weights `full` (None: base) and count this request in flight."""
        async with self._cond:
            while self.loaded_full != full:
                if self._inflight == 0:
                    path = full or self.model_path
                    await self._post("/update_weights_from_disk", {"model_path": path})
                    self.loaded_full = full
                    self._cond.notify_all()
                    break
                await self._cond.wait()
            self._inflight += 1

    async def _release(self) -> None:
        async with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    async def sample(self, prompt: list[int], params: Any, num_samples: int, *, adapter: str | None = None,
                     full: str | None = None, prompt_logprobs: bool = False
                     ) -> tuple[list[SampledSeq], list[float | None] | None]:
        """`num_samples` sequences for `prompt` from the base model, an adapter (by name) or a full snapshot."""
        body: dict[str, Any] = {"input_ids": [list(prompt)] * num_samples,
                                "sampling_params": sglang_params(params, num_samples),
                                "return_logprob": True, "logprob_start_len": 0 if prompt_logprobs else -1}
        if adapter is not None:
            body["lora_path"] = [adapter] * num_samples
        await self._acquire(full)
        try:
            out = await self._post("/generate", body)
        finally:
            await self._release()
        seqs = []
        for o in out:
            meta = o["meta_info"]
            entries = meta.get("output_token_logprobs") or []
            fin = (meta.get("finish_reason") or {}).get("type")
            seqs.append(SampledSeq(tokens=[int(e[1]) for e in entries], logprobs=[float(e[0]) for e in entries],
                                   stop_reason="length" if fin == "length" else "stop"))
        plp = None
        if prompt_logprobs:
            plp = [None if e[0] is None else float(e[0]) for e in out[0]["meta_info"]["input_token_logprobs"]]
            if plp:
                plp[0] = None
        return seqs, plp
