"""search_r1_agent_loop: Search-R1's own tag protocol, token-exact, retrieved text masked out.

The protocol (Search-R1 `llm_agent/generation.py`): the model writes in one assistant turn

    <think> ... </think> <search> query </search>          -> the loop appends (mask 0)
    "\\n\\n<information>" + passages + "</information>\\n\\n"     and the model goes on
    ... <answer> final answer </answer>                     -> the episode ends

Per round (up to `tools.max_turns`, Search-R1's `max_turns`):
  1. generate, with the stop strings `</search>` and `</answer>` added: the server stops right after them
     and its token ids are kept as returned (Search-R1 cuts its decoded text there and re-tokenizes it);
  2. the action is the FIRST `<(search|answer)>(.*?)</same tag>` of the round's text (special tokens
     skipped), content stripped (`parse_action`);
  3. answer: done. search: the retriever's top `tools.search.top_k` passages for the query, formatted as
     Search-R1 does ("Doc {i}(Title: {title}) {text}\\n"), wrapped as above. Neither: Search-R1's
     "My previous action is invalid. ..." text. Either observation is cut to
     `tools.max_tool_response_tokens` tokens (Search-R1's max_obs_length) and appended with mask 0.
After `tools.max_turns` rounds without an answer the model gets one last generation whose action is not
executed (Search-R1's final rollout). Limits: `tools.max_response_tokens` for the whole response (model +
observations) and the context; the finish reason says which ended the episode (stop, max_turns,
token_budget, context, abort).

Retrieval: `tools.search.url` (Search-R1's API: its e5 + FAISS server, or `agentloop retriever serve`),
else BM25 over `tools.search.corpus_path` in this process. A retrieval failure (after the client's retries)
makes the episode an error record rather than an observation the model would be trained on.

The EOS of a round that ends without an action stays in the response (its tokens are what the model
sampled); Search-R1 drops it when it re-tokenizes. Prompt: the chat template applied to the row's
messages, as Search-R1 does for tokenizers that have one (`data.apply_chat_template=false`: raw text).
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any

from agentloop.config import SamplingParams
from agentloop.errors import PromptTooLongError
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.loops.registry import register_agent_loop
from agentloop.records import AgentLoopOutput, Sample
from agentloop.tools.config import ToolsConfig
from agentloop.tools.retrieval import passages_to_string, retrieve
from agentloop.tools.search import DEMO_CORPUS, contents_of, get_index

STOP_STRINGS = ("</search>", "</answer>")
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n")
"""Search-R1's observation after a round without a valid action (verbatim)."""

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def parse_action(text: str) -> tuple[str | None, str]:
    """("search" | "answer" | None, stripped content) of the first complete action tag in `text`."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def information(passages: str) -> str:
    """The observation appended after a search."""
    return f"\n\n<information>{passages.strip()}</information>\n\n"


async def search_passages(cfg: ToolsConfig, query: str) -> str:
    """Search-R1's formatted top-k passages for `query`, from the service or the local BM25 index."""
    s = cfg.search
    if s.url:
        results = await retrieve(s.url, [query], s.top_k, timeout_s=s.timeout_s, max_attempts=s.max_attempts)
        return passages_to_string(results[0])
    hits = get_index(str(s.corpus_path or DEMO_CORPUS), s.k1, s.b).search(query, s.top_k)
    return passages_to_string([{"document": {"contents": contents_of(doc)}, "score": sc} for sc, doc in hits])


@register_agent_loop("search_r1_agent_loop")
class SearchR1AgentLoop(AgentLoopBase):
    """Search-R1's `<search>` / `<information>` / `<answer>` loop (settings: `config.tools`)."""

    resumable = True  # its prompts are its TrajectoryBuilder's tokens; searches go through `effect`

    @property
    def tools_config(self) -> ToolsConfig:
        return getattr(self.config, "tools", None) or ToolsConfig()

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        cfg = self.tools_config
        prompt_ids = self.apply_chat_template([dict(m) for m in sample.messages])
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLongError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context "
                                     f"of {self.context_length} tokens")
        traj = TrajectoryBuilder(prompt_ids)
        stop = list(sampling_params.stop) + [s for s in STOP_STRINGS if s not in sampling_params.stop]
        per_turn = cfg.max_tokens_per_turn or sampling_params.max_new_tokens
        m = {k: 0.0 for k in ("turns", "tool_calls", "searches", "answers", "invalid_actions", "truncated_observations",
                              "gen_time_s", "tool_time_s")}
        trace: list[dict[str, Any]] = []
        finish = "max_turns"
        for turn in range(cfg.max_turns + 1):
            final = turn == cfg.max_turns  # Search-R1's last rollout: its action is not executed
            want, limit = traj.next_turn(per_turn, cfg.max_response_tokens, self.context_length)
            if want == 0:
                finish = limit
                break
            params = self.turn_params(sampling_params, turn).model_copy(update={"max_new_tokens": want, "stop": stop})
            t0 = time.monotonic()
            out = await self.server_manager.generate(sample.episode_id, prompt_ids=traj.all_ids, sampling_params=params)
            m["gen_time_s"] += time.monotonic() - t0
            m["turns"] += 1
            traj.add_model(out)
            if out.finish_reason == "abort":
                finish = "abort"
                break
            action, content = parse_action(self.tokenizer.decode(out.token_ids, skip_special_tokens=True))
            if action == "answer":
                m["answers"] += 1
                finish = "stop"
                break
            if final:
                break
            if action == "search":
                t0 = time.monotonic()
                # journaled: a resumed episode gets the passages back without asking the retriever again
                obs = information(await self.effect("search", {"query": content},
                                                    functools.partial(search_passages, cfg, content), idempotent=True))
                dt = time.monotonic() - t0
                m["tool_time_s"] += dt
                m["searches"] += 1
                m["tool_calls"] += 1
                trace.append({"turn": turn, "name": "search", "arguments": {"query": content}, "status": "ok",
                              "error": None, "time_s": round(dt, 4), "text": obs.strip()[:200]})
            else:
                obs = INVALID_ACTION
                m["invalid_actions"] += 1
            obs_ids = self.encode_env(obs)  # retrieved text is plain text: no control token can come out of it
            if len(obs_ids) > cfg.max_tool_response_tokens:
                obs_ids = obs_ids[:cfg.max_tool_response_tokens]
                m["truncated_observations"] += 1
            limit = traj.env_limit(obs_ids, cfg.max_response_tokens, self.context_length)
            if limit is not None:
                finish = limit
                break
            traj.add_env(obs_ids)
        return traj.build(finish_reason=finish, metrics=m,
                          extra={"response_text": self.decode(traj.response_ids), "tool_trace": trace})
