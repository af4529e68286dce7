"""Measurement only: transformers generation on the `calculator` eval set with the real tool."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from agentloop.data.tasks import CALCULATOR_SOURCE, calculator_rows
from agentloop.models.modelzoo import load_tokenizer
from agentloop.models.warmstart.build import _quiet_hf
from agentloop.models.warmstart.renderings import Rendering, renderings
from agentloop.models.warmstart.sft import _common_prefix_len, _forward_shared_prefix
from agentloop.models.warmstart.spec import EVAL_SEED, ToolUseStats
from agentloop.models.warmstart.traces import _Renderer


def _generate(model: Any, rows: list[list[int]], *, max_new_tokens: int, temperature: float, eos_id: int,
              pad_id: int, generator: Any) -> list[list[int]]:
    """Batched generation continuing each row; stops a row at EOS (kept) or after max_new_tokens.

    The rows' common prefix is run once; the rest is left-padded after it (padding masked out,
    positions counted from the prefix so every row sees itself contiguous).
    """
    import torch

    P = min(_common_prefix_len(rows), min(len(r) for r in rows) - 1)
    B, S = len(rows), max(len(r) for r in rows) - P
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    attn = torch.ones((B, P + S), dtype=torch.long)
    pos = torch.full((B, S), P, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r) - P
        ids[b, S - n:] = torch.tensor(r[P:])
        attn[b, P:P + S - n] = 0
        pos[b, S - n:] = torch.arange(P, P + n)
    dev = next(model.parameters()).device
    ids, attn, pos = ids.to(dev), attn.to(dev), pos.to(dev)
    hidden, cache = _forward_shared_prefix(model, torch.tensor(rows[0][:P], device=dev), ids, attention_mask=attn,
                                           position_ids=pos)
    logits = model.lm_head(hidden[:, -1])
    new: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    next_pos = pos[:, -1] + 1
    for _ in range(max_new_tokens):
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(dev)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        for b, (t, d) in enumerate(zip(nxt.tolist(), done.tolist())):
            if not d:
                new[b].append(t)
        done |= nxt == eos_id
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        next_pos = next_pos + 1
    return new


def _rendered(m: dict[str, Any], how: Rendering) -> dict[str, Any]:
    """An eval prompt's message as the rendering writes it (its system prompt, its user prefix)."""
    if m["role"] == "system" and how.system is not None:
        return {**m, "content": how.system}
    if m["role"] == "user" and how.user_prefix:
        return {**m, "content": how.user_prefix + m["content"]}
    return m


def evaluate_tool_use(model_dir: str | Path, *, n: int = 64, temperature: float = 1.0, seed: int = 0,
                      max_new_tokens: int = 64, num_threads: int = 2, device: str = "cpu",
                      rendering: str = "agentloop") -> ToolUseStats:
    """Run the first `n` rows of the `calculator` eval set as two-turn tool episodes with transformers, the task
    rendered as `rendering` renders it (renderings.py: agentloop's own, or a harness's tools and system prompt).

    Turn 1 is generated from the prompt rendered with the calculator schema; a turn holding tool
    calls gets the real calculator's result (or the parser's error) appended as tool_agent_loop
    would, and turn 2 is generated. The reward is the task's own (GSM8K `#### n`) on the last
    assistant message. Simplified: at most two turns, first call only, no per-episode token budget.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop.rewards import get_reward
    from agentloop.tools.parsers import parse_hermes
    from agentloop.tools.registry import get_tool

    tok = load_tokenizer(model_dir)
    how = renderings()[rendering]
    schemas = how.tools
    r = _Renderer(tok, schemas)
    tool = get_tool("calculator")()
    reward = get_reward(CALCULATOR_SOURCE)
    rows = calculator_rows(n=n, seed=EVAL_SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with _quiet_hf():
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
        gen = torch.Generator().manual_seed(seed)
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_id=r.eos_id,
                  pad_id=tok.pad_token_id, generator=gen)
        histories = [[_rendered(dict(m), how) for m in row["prompt"]] for row in rows]
        prompts = [r.encode(r.render(h, schemas, True)) for h in histories]
        with torch.no_grad():
            first = _generate(model, prompts, **kw)
        well_formed, attempted, right_expr, finals = [], [], [], []
        second_rows, second_idx = [], []
        for i, (h, ids) in enumerate(zip(histories, first)):
            end_text = tok.eos_token if ids and ids[-1] == r.eos_id else ""
            content = tok.decode(ids[:len(ids) - (1 if end_text else 0)], skip_special_tokens=False)
            h.append({"role": "assistant", "content": content})
            parsed = parse_hermes(content)
            call = parsed.calls[0] if parsed.calls else None
            ok = call is not None and call.name == "calculator" and not tool.validate_arguments(call.arguments)
            well_formed.append(ok)
            attempted.append(parsed.attempted)
            result = None
            if ok:
                result = asyncio.run(tool.execute({}, call.arguments)).text  # type: ignore[union-attr]
            right_expr.append(result == str(rows[i]["reward_model"]["ground_truth"]))
            if not parsed.attempted:
                finals.append(content)
                continue
            text = result if result is not None else (
                f"error: could not parse tool call: {parsed.errors[0]}" if parsed.errors
                else "error: invalid call")
            env = r.env_ids(h, [{"role": "tool", "name": "calculator", "content": text}], end_text)
            second_rows.append(prompts[i] + ids + env)
            second_idx.append(i)
            finals.append("")
        if second_rows:
            with torch.no_grad():
                second = _generate(model, second_rows, **kw)
            for i, ids in zip(second_idx, second):
                finals[i] = tok.decode(ids, skip_special_tokens=True)
                histories[i].append({"role": "assistant", "content": finals[i]})
    finally:
        torch.set_num_threads(threads)
    scores = [float(reward(CALCULATOR_SOURCE, f, row["reward_model"]["ground_truth"], row["extra_info"]))
              for f, row in zip(finals, rows)]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return ToolUseStats(
        n=n, temperature=temperature,
        tool_call_rate=mean([float(x) for x in well_formed]),
        attempted_call_rate=mean([float(x) for x in attempted]),
        right_expression_rate=mean([float(x) for x in right_expr]),
        accuracy=mean(scores),
        accuracy_with_tool=mean([s for s, w in zip(scores, well_formed) if w]),
        accuracy_without_tool=mean([s for s, w in zip(scores, well_formed) if not w]),
        examples=[json.dumps(h[2:]) for h in histories[:4]],
    )
