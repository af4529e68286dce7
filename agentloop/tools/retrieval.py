"""A client of Search-R1's retrieval API, so the retrievers users already run (e5 + FAISS, BM25) plug in.

The API (Search-R1's `retrieval_server.py`; `agentloop retriever serve` speaks it too):

    POST <url>   {"queries": [str, ...], "topk": int, "return_scores": true}
    200          {"result": [[{"document": DOC, "score": float}, ...] per query]}
                 (without return_scores: [[DOC, ...] per query])
    DOC          {"id": str, "contents": "\\"<title>\\"\\n<text>"}  (BM25 servers add "title" and "text")

    retrieve           one POST, retried on connection errors / HTTP 5xx within one deadline
    document_of        a result item (scored or not) -> its DOC dict
    title_and_text     DOC -> (title, text) the way Search-R1 splits "contents" (quotes kept)
    passages_to_string Search-R1's observation text: "Doc {i}(Title: {title}) {text}\\n" per passage

One request per call (no batching of concurrent episodes' queries into one POST).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentloop.errors import AgentLoopError

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


class RetrievalError(AgentLoopError):
    """The retrieval service could not be reached or answered something that is not the API's shape."""


def endpoint(url: str) -> str:
    """`url` as the /retrieve endpoint: a bare http://host:port gets "/retrieve" appended."""
    u = url.rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise RetrievalError(f"retrieval url {url!r} must start with http:// or https://")
    rest = u.split("://", 1)[1]
    return u if "/" in rest else u + "/retrieve"


def document_of(item: Any) -> dict[str, Any]:
    """The document of one result item: `{"document": DOC, "score": s}` or DOC itself."""
    doc = item.get("document", item) if isinstance(item, dict) else None
    if not isinstance(doc, dict):
        raise RetrievalError(f"retrieval result item is not a document: {str(item)[:200]}")
    return doc


def title_and_text(doc: dict[str, Any]) -> tuple[str, str]:
    """Search-R1's split: the first line of "contents" is the title (quotes kept), the rest the text.
    A document without "contents" uses its "title" and "text"."""
    contents = doc.get("contents")
    if isinstance(contents, str):
        lines = contents.split("\n")
        return lines[0], "\n".join(lines[1:])
    return str(doc.get("title", "")), str(doc.get("text", ""))


def passages_to_string(items: list[Any]) -> str:
    """Search-R1's formatting of one query's results (1-based, no space before "(Title")."""
    out = []
    for i, item in enumerate(items, 1):
        title, text = title_and_text(document_of(item))
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


async def retrieve(url: str, queries: list[str], topk: int, *, timeout_s: float = 30.0, max_attempts: int = 3,
                   return_scores: bool = True) -> list[list[Any]]:
    """The per-query result lists for `queries` from the service at `url` (RetrievalError on failure)."""
    import aiohttp

    target = endpoint(url)
    payload = {"queries": list(queries), "topk": int(topk), "return_scores": return_scores}
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    for attempt in range(max_attempts):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=left)) as session:
                async with session.post(target, json=payload) as resp:
                    if resp.status in RETRYABLE_STATUS:
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    elif resp.status != 200:
                        raise RetrievalError(f"retrieval service {target} answered HTTP {resp.status}: "
                                             f"{(await resp.text())[:200]}")
                    else:
                        body = await resp.json(content_type=None)
                        return _results(body, len(queries), target)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            last = f"{type(e).__name__}: {e}"
        if attempt + 1 < max_attempts:
            await asyncio.sleep(min(0.2 * 2 ** attempt, max(0.0, deadline - time.monotonic())))
    raise RetrievalError(f"retrieval service {target} failed after {max_attempts} attempts within "
                         f"{timeout_s:g}s: {last}")


def _results(body: Any, n: int, target: str) -> list[list[Any]]:
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != n or not all(isinstance(r, list) for r in result):
        raise RetrievalError(f"retrieval service {target} answered {str(body)[:200]!r}; expected "
                             f'{{"result": [one list per query]}} for {n} queries')
    return result
