"""`agentloop retriever serve`: BM25 over a JSONL corpus behind Search-R1's retrieval API.

    POST /retrieve  {"queries": [str, ...], "topk": int (optional; 0/absent: the server's), "return_scores": bool}
                    -> {"result": [per query: [{"document": DOC, "score": float}, ...]]}, or [DOC, ...] per
                    query without return_scores. DOC = {"id", "title", "text", "contents"} (contents =
                    '"<title>"\\n<text>', what Search-R1's clients split).
    GET  /health    {"status": "ok", "documents": N}

A request that is not that shape gets HTTP 400 with a message naming the problem. Search is plain BM25
(agentloop.tools.search.BM25Index) in the server's event loop: fine for corpora of up to a few hundred
thousand passages; for Wikipedia-sized ones run Search-R1's own e5 + FAISS server, which speaks the same API.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentloop.tools.search import BM25Index, contents_of, load_corpus

MAX_QUERIES = 4096
MAX_TOPK = 1000


class BadRequest(ValueError):
    """The request body is not Search-R1's retrieval request."""


def parse_request(body: Any, default_topk: int) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a request body, or BadRequest naming what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object with 'queries', got {type(body).__name__}")
    queries = body.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest("'queries' must be a list of strings")
    if len(queries) > MAX_QUERIES:
        raise BadRequest(f"at most {MAX_QUERIES} queries per request, got {len(queries)}")
    topk = body.get("topk") or default_topk  # Search-R1: a falsy topk means the server's
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
        raise BadRequest(f"'topk' must be an integer from 1 to {MAX_TOPK}, got {topk!r}")
    scores = body.get("return_scores", False)
    if not isinstance(scores, bool):
        raise BadRequest(f"'return_scores' must be true or false, got {scores!r}")
    return queries, topk, scores


def answer(index: BM25Index, queries: list[str], topk: int, return_scores: bool) -> dict[str, Any]:
    """The response body for a parsed request."""
    result = []
    for q in queries:
        hits = []
        for score, doc in index.search(q, topk):
            d = {"id": doc["id"], "title": doc["title"], "text": doc["text"], "contents": contents_of(doc)}
            hits.append({"document": d, "score": score} if return_scores else d)
        result.append(hits)
    return {"result": result}


def make_app(index: BM25Index, default_topk: int = 3) -> Any:
    """The aiohttp application serving `index`."""
    from aiohttp import web

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body is not JSON"}, status=400)
        try:
            queries, topk, scores = parse_request(body, default_topk)
        except BadRequest as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(answer(index, queries, topk, scores))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "documents": len(index.docs)})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app


async def serve(corpus: str | Path, host: str = "127.0.0.1", port: int = 8000, topk: int = 3, k1: float = 1.2,
                b: float = 0.75, ready: Any = None) -> None:
    """Build the index and serve until cancelled; prints (or calls `ready` with) the URL once listening."""
    from aiohttp import web

    docs = load_corpus(corpus)
    index = BM25Index(docs, k1=k1, b=b)
    runner = web.AppRunner(make_app(index, topk), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        bound = runner.addresses[0][1] if runner.addresses else port
        url = f"http://{host}:{bound}/retrieve"
        if ready is not None:
            ready(url, len(docs))
        else:
            print(f"agentloop retriever: {len(docs)} passages from {corpus}; serving {url}", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
