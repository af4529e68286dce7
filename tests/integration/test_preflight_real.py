"""What the preflight's plan is measured against, read from the real SGLang CPU server: its KV pool in tokens
(GET /server_info's max_total_num_tokens), the number train_summary.json puts next to the planned pool."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import ManagerConfig
from agentloop.server_manager import ServerManager
from agentloop.train.planning.render import served_kv_tokens

pytestmark = pytest.mark.sglang


def test_the_servers_kv_pool_is_read_from_the_server(sglang_server):
    async def main() -> list[int | None]:
        async with ServerManager([sglang_server.url], ManagerConfig(health_interval_s=60)) as sm:
            return await served_kv_tokens(sm)

    (tokens,) = asyncio.run(main())
    # the conftest server is launched with --max-total-tokens 16384 (LocalServer's default)
    assert isinstance(tokens, int) and 0 < tokens <= 16384, tokens
