"""Search-R1's retrieval API: our BM25 server and our client, against each other over a real socket."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from agentloop.tools import SearchToolConfig, ToolsConfig
from agentloop.tools.retrieval import (
    RetrievalError,
    endpoint,
    passages_to_string,
    retrieve,
    title_and_text,
)
from agentloop.tools.retriever_server import serve
from agentloop.tools.search import DEMO_CORPUS, SearchTool, load_corpus


async def _with_server(corpus, body, topk=3):
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(corpus, port=0, topk=topk, ready=lambda url, n: started.set_result((url, n))))
    try:
        url, n = await asyncio.wait_for(started, 30)
        return await body(url, n)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_server_speaks_search_r1s_api():
    async def body(url, n):
        assert n >= 40 and url.endswith("/retrieve")
        res = await retrieve(url, ["capital of Australia", "river of Paris"], 2)
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"queries": ["the capital city of the country"], "topk": 0}) as r:  # no scores, default topk
                plain = await r.json()
            async with s.post(url, json={"queries": "Berlin"}) as r:
                bad = (r.status, await r.json())
            async with s.get(url.replace("/retrieve", "/health")) as r:
                health = await r.json()
        return res, plain, bad, health

    res, plain, bad, health = asyncio.run(_with_server(DEMO_CORPUS, body, topk=3))
    assert [len(r) for r in res] == [2, 2]
    top = res[0][0]
    assert set(top) == {"document", "score"} and top["score"] > 0
    assert top["document"]["contents"] == '"Canberra"\n' + top["document"]["text"]
    assert title_and_text(top["document"]) == ('"Canberra"', top["document"]["text"])
    assert len(plain["result"][0]) == 3 and "contents" in plain["result"][0][0]  # documents, no scores
    assert bad == (400, {"error": "'queries' must be a list of strings"})
    assert health["status"] == "ok"
    assert passages_to_string(res[0]).startswith('Doc 1(Title: "Canberra") ')


def test_search_tool_uses_the_service_and_search_r1_corpora(tmp_path):
    corpus = tmp_path / "wiki.jsonl"
    rows = [{"id": "0", "contents": '"Walrus"\nThe walrus is a large marine mammal.'},
            {"id": "1", "contents": '"Otter"\nOtters eat fish.'}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_corpus(corpus)[0]["title"] == "Walrus"

    async def body(url, n):
        tool = SearchTool(ToolsConfig(search=SearchToolConfig(url=url.replace("/retrieve", ""), top_k=1)))
        return await tool.execute(None, {"query": "walrus mammal"})

    r = asyncio.run(_with_server(corpus, body))
    assert r.text == 'Doc 1(Title: "Walrus") The walrus is a large marine mammal.' and r.metrics == {"hits": 1.0}


def test_client_errors_name_the_service():
    assert endpoint("http://h:8000") == "http://h:8000/retrieve"
    assert endpoint("http://h:8000/retrieve/") == "http://h:8000/retrieve"
    with pytest.raises(RetrievalError, match="must start with http"):
        endpoint("h:8000")

    async def refused():
        # a port nobody listens on: connection refused on every attempt
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        await retrieve(f"http://127.0.0.1:{port}", ["q"], 3, timeout_s=5, max_attempts=2)

    with pytest.raises(RetrievalError, match=r"failed after 2 attempts.*ClientConnectorError"):
        asyncio.run(refused())

    async def wrong_shape(url, n):
        from aiohttp import web

        async def handler(request):
            return web.json_response({"result": []})

        app = web.Application()
        app.router.add_post("/retrieve", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            return await retrieve(f"http://127.0.0.1:{runner.addresses[0][1]}", ["q"], 3)
        finally:
            await runner.cleanup()

    with pytest.raises(RetrievalError, match=r"expected \{\"result\": \[one list per query\]\} for 1 queries"):
        asyncio.run(wrong_shape(None, None))
