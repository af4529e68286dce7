"""The log-prob probe: before step 1 of a fresh run, the servers must give a fixed token sequence the log-probs the
learner's first forward gives it, so a server on another host that serves other weights (same model type and
architecture, which is all /model_info tells) is refused before it samples a single trained token.

    probe_ids              the fixed sequence: PROBE_TOKENS ids spread over the vocabulary (any ids are a valid
                           input; the same on both sides, from the vocabulary size alone)
    server_logprobs        one server's input log-probs of the sequence (POST /generate, logprob_start_len 0:
                           log_softmax of the logits, at temperature 1 whatever the sampling temperature)
    check_served_logprobs  every server against the learner's probe (LearnerInfo.probe): ConfigError naming each
                           server whose mean |difference| is above train.server_logprob_tol
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from agentloop.errors import ConfigError

if TYPE_CHECKING:
    from agentloop.server_manager import ServerManager

PROBE_TOKENS = 32
"""Length of the probe sequence."""

_TIMEOUT_S = 120.0


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """`n` token ids spread over a vocabulary of `vocab_size` (a stride coprime with most sizes; ids >= 10 skip
    the special tokens small vocabularies put first)."""
    span = max(1, vocab_size - 10)
    return [10 + (7919 * (i + 1)) % span for i in range(n)]


async def server_logprobs(url: str, ids: list[int], timeout_s: float = _TIMEOUT_S) -> list[float]:
    """Log-probs one SGLang server gives ids[1:] after the ids before each."""
    import aiohttp

    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            out = await r.json()
            if r.status != 200:
                raise ConfigError(f"{url}: the log-prob probe was answered HTTP {r.status}: {str(out)[:300]}")
    lps = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
    if len(lps) != len(ids) - 1 or any(x is None for x in lps):
        raise ConfigError(f"{url}: the log-prob probe got {len(lps)} log-probs for {len(ids) - 1} tokens")
    return [float(x) for x in lps]


async def check_served_logprobs(sm: "ServerManager", probe: dict[str, Any], tol: float,
                                say: Callable[[str], None] | None = None) -> dict[str, float]:
    """url -> mean |server - learner| log-prob over the probe; ConfigError naming every server above `tol`."""
    ids, ref = list(probe["ids"]), [float(x) for x in probe["logprobs"]]
    diffs: dict[str, float] = {}
    for url in sm.urls:
        lps = await server_logprobs(url, ids)
        diffs[url] = sum(abs(a - b) for a, b in zip(lps, ref)) / max(1, len(ref))
    bad = {u: d for u, d in diffs.items() if d > tol}
    if bad:
        lines = "\n  ".join(f"{u}: mean |server - learner| log-prob {d:.3g} over {len(ref)} tokens"
                             for u, d in bad.items())
        raise ConfigError(f"these servers do not serve the model the learner trains (its first forward of a fixed "
                          f"sequence differs by more than train.server_logprob_tol={tol:g}):\n  {lines}\n"
                          "serve model.path's weights there, or check that --model names what they serve")
    if say is not None:
        say("servers match the learner's log-probs: " + ", ".join(f"{u} {d:.2g}" for u, d in diffs.items()))
    return diffs


__all__ = ["PROBE_TOKENS", "check_served_logprobs", "probe_ids", "server_logprobs"]
