"""The built-in `search` tool: BM25 over a local JSONL corpus of {id, title, text} (Search-R1 style results).

The index is built once per (corpus path, k1, b) per process and shared by all episodes. Tokenization is
lower-cased alphanumeric words; the title counts as part of the passage. Without `tools.search.corpus_path`
the bundled demo corpus (agentloop/data/corpus_demo.jsonl, ~40 short passages) is used.
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

DEMO_CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus_demo.jsonl"
_WORD = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25Index:
    """Okapi BM25 over a list of passages."""

    def __init__(self, docs: list[dict[str, str]], k1: float = 1.2, b: float = 0.75):
        self.docs = docs
        self.k1, self.b = k1, b
        self.tfs = [Counter(tokenize(d.get("title", "") + " " + d.get("text", ""))) for d in docs]
        self.lens = [sum(tf.values()) for tf in self.tfs]
        self.avg_len = (sum(self.lens) / len(self.lens)) if self.lens else 0.0
        df: Counter[str] = Counter()
        for tf in self.tfs:
            df.update(tf.keys())
        n = len(docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}

    def search(self, query: str, k: int) -> list[tuple[float, dict[str, str]]]:
        terms = set(tokenize(query))
        scored = []
        for i, tf in enumerate(self.tfs):
            s = 0.0
            norm = self.k1 * (1 - self.b + self.b * self.lens[i] / (self.avg_len or 1.0))
            for w in terms:
                f = tf.get(w)
                if f:
                    s += self.idf[w] * f * (self.k1 + 1) / (f + norm)
            if s > 0:
                scored.append((s, i))
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [(s, self.docs[i]) for s, i in scored[:k]]


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    """Read a JSONL corpus; a bad line raises DataError naming file and line."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"search corpus {str(p)!r} does not exist")
    docs = []
    with p.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise DataError(f"{p}:{lineno}: a corpus row needs a string 'text' (and optional 'id', 'title')")
            docs.append({"id": str(row.get("id", lineno)), "title": str(row.get("title", "")), "text": row["text"]})
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
        hits = self.index().search(arguments["query"], k)
        if not hits:
            return ToolResponse(text="No results found.", metrics={"hits": 0.0})
        lines = []
        for i, (_, doc) in enumerate(hits, 1):
            text = doc["text"] if len(doc["text"]) <= s.max_passage_chars else doc["text"][:s.max_passage_chars] + "..."
            lines.append(f"Doc {i}(Title: {doc['title']}) {text}")
        return ToolResponse(text="\n".join(lines), metrics={"hits": float(len(hits))})
