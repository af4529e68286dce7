"""The built-in `search` tool: passages for a query, from a retrieval service or from BM25 in this process.

    tools.search.url set    POST to that service in Search-R1's API (agentloop.tools.retrieval): the
                            retriever users already run (e5 + FAISS), or `agentloop retriever serve`
    otherwise               BM25 over a local JSONL corpus (`tools.search.corpus_path`, else the bundled
                            demo corpus agentloop/data/corpus_demo.jsonl, ~40 short passages)

Corpus rows: {id, title, text} or Search-R1's {id, contents} with contents = '"<title>"\n<text>'.
The BM25 index (an inverted index: a query touches only passages holding its words) is built once per
(corpus path, k1, b) per process and shared by all episodes. Tokenization is lower-cased alphanumeric
words; the title counts as part of the passage.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

from agentloop.errors import DataError
from agentloop.tools.base import BaseTool, ToolResponse
from agentloop.tools.registry import register_tool
from agentloop.tools.retrieval import document_of, retrieve, title_and_text

DEMO_CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus_demo.jsonl"
_WORD = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25Index:
    """Okapi BM25 over a list of passages, with postings so a query scores only passages holding its words."""

    def __init__(self, docs: list[dict[str, str]], k1: float = 1.2, b: float = 0.75):
        self.docs = docs
        self.k1, self.b = k1, b
        self.postings: dict[str, list[tuple[int, int]]] = {}
        self.lens: list[int] = []
        for i, d in enumerate(docs):
            tf = Counter(tokenize(d.get("title", "") + " " + d.get("text", "")))
            self.lens.append(sum(tf.values()))
            for w, f in tf.items():
                self.postings.setdefault(w, []).append((i, f))
        self.avg_len = (sum(self.lens) / len(self.lens)) if self.lens else 0.0
        n = len(docs)
        self.idf = {w: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for w, p in self.postings.items()}

    def search(self, query: str, k: int) -> list[tuple[float, dict[str, str]]]:
        scores: dict[int, float] = {}
        avg = self.avg_len or 1.0
        for w in set(tokenize(query)):
            idf = self.idf.get(w)
            if idf is None:
                continue
            for i, f in self.postings[w]:
                norm = self.k1 * (1 - self.b + self.b * self.lens[i] / avg)
                scores[i] = scores.get(i, 0.0) + idf * f * (self.k1 + 1) / (f + norm)
        ranked = sorted(((s, i) for i, s in scores.items() if s > 0), key=lambda x: (-x[0], x[1]))
        return [(s, self.docs[i]) for s, i in ranked[:k]]


def contents_of(doc: dict[str, str]) -> str:
    """Search-R1's "contents" of a passage: the row's own, else '"<title>"\n<text>'."""
    return doc.get("contents") or f'"{doc.get("title", "")}"\n{doc.get("text", "")}'


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    """Read a JSONL corpus ({id, title, text} or {id, contents}); a bad line raises DataError naming file
    and line. Rows come back as {id, title, text} (+ contents when the row had it)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"search corpus {str(p)!r} does not exist")
    docs = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON: {e}") from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                docs.append({"id": str(row.get("id", lineno)), "title": str(row.get("title", "")),
                             "text": row["text"]})
            elif isinstance(row, dict) and isinstance(row.get("contents"), str):
                title, text = title_and_text(row)
                docs.append({"id": str(row.get("id", lineno)), "title": title.strip().strip('"'), "text": text,
                             "contents": row["contents"]})
            else:
                raise DataError(f"{p}:{lineno}: a corpus row needs a string 'text' (and optional 'id', 'title') "
                                "or Search-R1's string 'contents'")
    return docs


@lru_cache(maxsize=8)
def get_index(path: str, k1: float, b: float) -> BM25Index:
    return BM25Index(load_corpus(path), k1=k1, b=b)


@register_tool("search")
class SearchTool(BaseTool):
    """Returns the top passages for a query."""

    name = "search"
    description = "Search a knowledge base and return the most relevant passages for a query."
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for.", "minLength": 1},
            "top_k": {"type": "integer", "description": "How many passages (default 3).", "minimum": 1,
                      "maximum": 10},
        },
        "required": ["query"],
        "additionalProperties": False,
    }

    def index(self) -> BM25Index:
        s = self.config.search
        return get_index(str(s.corpus_path or DEMO_CORPUS), s.k1, s.b)

    async def execute(self, instance: Any, arguments: dict[str, Any]) -> ToolResponse:
        s = self.config.search
        k = min(int(arguments.get("top_k", s.top_k)), s.top_k)
        if s.url:
            results = await retrieve(s.url, [arguments["query"]], k, timeout_s=s.timeout_s,
                                     max_attempts=s.max_attempts)
            passages = [title_and_text(document_of(item)) for item in results[0]]
        else:
            passages = [(doc["title"], doc["text"]) for _, doc in self.index().search(arguments["query"], k)]
        if not passages:
            return ToolResponse(text="No results found.", metrics={"hits": 0.0})
        lines = []
        for i, (title, text) in enumerate(passages, 1):
            text = text if len(text) <= s.max_passage_chars else text[:s.max_passage_chars] + "..."
            lines.append(f"Doc {i}(Title: {title}) {text}")
        return ToolResponse(text="\n".join(lines), metrics={"hits": float(len(passages))})

