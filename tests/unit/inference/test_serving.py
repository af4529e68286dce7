"""Server pools (agentloop.inference.serving): `serving` runs any pool the same way, a started ServerManager
over the URLs it launched, and the pool is stopped whatever happens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentloop.config import load_config
from agentloop.inference.serving import LocalPool, ServerPool, UrlPool, pool_for, serving
from tests.fakes.fake_sglang import FakeSGLang


class FakePool(ServerPool):
    """Launches fake servers (what a Ray pool does with actors): the protocol's contract, observed."""

    def __init__(self, n: int):
        self.n, self.fakes, self.stopped = n, [], 0

    async def launch(self) -> list[str]:
        self.fakes = [await FakeSGLang().start() for _ in range(self.n)]
        return self.urls

    @property
    def urls(self) -> list[str]:
        return [f.url for f in self.fakes]

    async def stop(self) -> None:
        self.stopped += 1
        for f in self.fakes:
            await f.stop()


def test_serving_runs_a_pool_and_stops_it_even_when_the_body_fails(tmp_path: Path):
    cfg = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]"])  # ignored: the pool given wins
    pool = FakePool(2)
    lines: list[str] = []

    async def main():
        async with serving(cfg, tmp_path, tmp_path, pool=pool, initial_version=0, cache_salt=True,
                           on_event=lines.append) as sm:
            assert sm.urls == pool.urls and len(sm.urls) == 2
            out = await sm.generate("e", prompt_ids=[5, 6], sampling_params={"max_new_tokens": 2})
            assert pool.fakes[0].requests[-1]["extra_key"] == "agentloop-v0" or \
                pool.fakes[1].requests[-1]["extra_key"] == "agentloop-v0"
            assert out.token_ids
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        asyncio.run(asyncio.wait_for(main(), 60))
    assert pool.stopped == 1


def test_the_config_picks_urls_or_local_servers(tmp_path: Path):
    by_url = pool_for(load_config(None, ["server.urls=[\"http://h:1/\"]"]), tmp_path, tmp_path)
    assert isinstance(by_url, UrlPool) and asyncio.run(by_url.launch()) == ["http://h:1"]
    assert isinstance(pool_for(load_config(None, []), tmp_path, tmp_path), LocalPool)


@pytest.mark.parametrize("sync", ["nccl", "disk"])
def test_a_server_that_never_answers_names_the_nccl_broadcast_it_may_be_blocked_in(tmp_path: Path, sync: str):
    # a learner killed mid-broadcast leaves an external server blocked in the collective: the resumed run must say
    # to restart it, not only that it is unhealthy (and only where the weights go by nccl)
    cfg = load_config(None, ["server.urls=[\"http://127.0.0.1:1\"]", "server.startup_timeout_s=1",
                             f"learner.weight_sync={sync}"])
    pool = FakePool(1)

    async def main():
        async def launch() -> list[str]:
            urls = await FakePool.launch(pool)
            pool.fakes[0].healthy = False
            return urls

        pool.launch = launch
        async with serving(cfg, tmp_path, tmp_path, pool=pool):
            pass

    with pytest.raises(Exception, match="not healthy within") as err:
        asyncio.run(asyncio.wait_for(main(), 60))
    assert ("blocked in that broadcast" in str(err.value)) == (sync == "nccl")
    assert pool.stopped == 1
