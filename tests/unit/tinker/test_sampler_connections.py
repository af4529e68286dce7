"""The Tinker service's Sampler against a scripted SGLang (fault injection only; the real server is
tests/integration/test_tinker_real.py's): a request whose connection the server closes or resets under it is sent
again, a bounded number of times, and an adapter load whose first answer was lost is not an error.

A long cookbook run met this on the real server (2026-12-02): SGLang closes connections idle for 5 s, and a pooled
one reused as it closed failed a sample with `ClientOSError: [Errno 104] Connection reset by peer`, which failed
the recipe's run."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from types import SimpleNamespace

import pytest

from agentloop.tinker.sampler import RETRIES, Sampler, SamplerError

PARAMS = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, seed=None, stop=None)


class Scripted:
    """A raw HTTP/1.1 server: the first `drop` requests are read and then dropped (alternately closed and reset,
    the two ways a reused connection fails), the rest answered with `answer(path)`."""

    def __init__(self, drop: int, answer):
        self.drop, self.answer, self.seen = drop, answer, []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                               if ln.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                path = head.split(b" ")[1].decode()
                self.seen.append(path)
                if len(self.seen) <= self.drop:
                    if len(self.seen) % 2:  # reset: RST instead of FIN
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.close()
                    return
                status, body = self.answer(path)
                data = json.dumps(body).encode()
                writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                             "\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def _generate(path: str):
    out = {"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-0.25, 9, None]],
                         "finish_reason": {"type": "length"}}}
    return 200, [out, out]


async def _sample(drop: int):
    script = Scripted(drop, _generate)
    async with script as url:
        sampler = Sampler("unused", url=url)
        await sampler.start()
        try:
            seqs, _ = await asyncio.wait_for(sampler.sample([1, 2, 3], PARAMS, 2), 30)
        finally:
            await sampler.close()
    return seqs, script.seen


def test_a_request_whose_connection_fails_under_it_is_sent_again():
    seqs, seen = asyncio.run(_sample(RETRIES))
    assert seen == ["/generate"] * (RETRIES + 1)
    assert [s.tokens for s in seqs] == [[7, 9], [7, 9]] and seqs[0].logprobs == [-0.5, -0.25]
    assert seqs[0].stop_reason == "length"


def test_a_connection_that_keeps_failing_is_an_error_naming_it():
    with pytest.raises(SamplerError, match=r"/generate: the connection failed under the request 3 times"):
        asyncio.run(_sample(RETRIES + 1))


def test_an_adapter_load_whose_answer_was_lost_is_loaded():
    def answer(path: str):
        return 400, {"success": False, "message": "Failed to load LoRA adapter s1 because it is already loaded"}

    async def go():
        script = Scripted(1, answer)  # the first load's connection dropped; the load sent again finds it loaded
        async with script as url:
            sampler = Sampler("unused", url=url)
            await sampler.start()
            try:
                await sampler.load_adapter("s1", "/ckpt/s1")
                assert sampler.adapters == {"s1"}
                await sampler.load_adapter("s1", "/ckpt/s1")  # known: not sent
                bad = Scripted(0, lambda p: (400, {"success": False, "message": "no such file /ckpt/s2"}))
                async with bad as url2:
                    sampler.url = url2
                    with pytest.raises(SamplerError, match="no such file"):
                        await sampler.load_adapter("s2", "/ckpt/s2")
                assert sampler.adapters == {"s1"}
            finally:
                await sampler.close()
        return script.seen

    assert asyncio.run(go()) == ["/load_lora_adapter", "/load_lora_adapter"]
