"""HTML traces: escaped text, one span per token, mask-0 tokens styled apart, the CLI and config lookup."""

from __future__ import annotations

import json
import math
import re

import pytest

from agentloop.cli import main
from agentloop.records import EpisodeRecord
from agentloop.report.trace_html import prob_color, render_traces_html, write_run_traces

EVIL = '<script>alert("x")</script> & \'q\''


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from agentloop.config import Config, ModelConfig
    from agentloop.models.loading import load_tokenizer_for

    return load_tokenizer_for(Config(model=ModelConfig(path=str(tiny_model_path))), tiny_model_path)


def _record(tok, **kw) -> EpisodeRecord:
    messages = [{"role": "user", "content": f"Compute 2+2 {EVIL}"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    turn1 = tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>',
                       add_special_tokens=False)
    env = tok.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n4 <b>bold</b>\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n", add_special_tokens=False)
    turn2 = tok.encode("The answer is 4.\n#### 4<|im_end|>", add_special_tokens=False)
    response = turn1 + env + turn2
    mask = [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
    lps = [-0.01 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    fields = dict(
        prompt_ids=prompt_ids, response_ids=response, response_mask=mask, response_logprobs=lps, num_turns=2,
        reward=1.0, metrics={"tool_calls": 1.0, "tool_time_s": 0.01}, finish_reason="stop",
        extra={"messages": messages + [{"role": "assistant", "content": "call"},
                                       {"role": "tool", "name": "calculator", "content": "4 <b>bold</b>"}],
               "tool_trace": [{"turn": 0, "name": "calculator", "arguments": {"expression": "2+2 <i>"},
                               "status": "ok", "error": None, "time_s": 0.01, "text": "4 <b>bold</b>"}]},
        episode_id="3-1", index=3, repeat=1, data_source="agentloop/calculator", loop="tool_agent_loop", seed=1,
        ground_truth=EVIL)
    fields.update(kw)
    return EpisodeRecord(**fields)


def test_html_escapes_and_has_one_span_per_token(tok):
    rec = _record(tok)
    page = render_traces_html([rec], tok)
    assert "<script" not in page and "<b>" not in page and "<i>" not in page  # no JS, nothing unescaped
    assert "&lt;script&gt;" in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    spans = re.findall(r'<span class="t (p|m0|m1)"([^>]*)>', page)
    assert len(spans) == len(rec.prompt_ids) + len(rec.response_ids)
    kinds = [k for k, _ in spans]
    assert kinds.count("p") == len(rec.prompt_ids)
    assert kinds.count("m1") == sum(rec.response_mask)
    assert kinds.count("m0") == len(rec.response_mask) - sum(rec.response_mask)
    # response spans in order, with id, mask and logprob in the title; only mask-1 spans carry a colour
    resp = [(k, attrs) for k, attrs in spans if k != "p"]
    for (k, attrs), tid, m, lp in zip(resp, rec.response_ids, rec.response_mask, rec.response_logprobs):
        assert k == ("m1" if m else "m0")
        assert f"id={tid} mask={m} logprob={lp:.4f}" in attrs
        assert ("style=\"background:hsl(" in attrs) == bool(m)
    assert ".t.m0{" in page and ".t.p{" in page  # grey styles for mask-0 and prompt tokens
    assert "tool calls of turn 1" in page and "turn 2 · model" in page
    assert 'id="ep-3-1"' in page and 'href="#ep-3-1"' in page


def test_decoded_tokens_reassemble_the_text(tok):
    rec = _record(tok)
    page = render_traces_html([rec], tok)
    import html as _html

    found = re.findall(r'<span class="t (?:p|m0|m1)"[^>]*>(.*?)</span>', page, re.DOTALL)
    texts = [_html.unescape(t).replace("↵\n", "\n") for t in found]
    assert "".join(texts) == tok.decode(rec.prompt_ids + rec.response_ids, skip_special_tokens=False)


def test_colours_and_error_records(tok):
    assert prob_color(0.0) == "hsl(120,75%,80%)"
    assert prob_color(math.log(0.5)) == "hsl(60,75%,80%)"
    assert prob_color(-1e9) == "hsl(0,75%,80%)"
    err = EpisodeRecord(prompt_ids=[], response_ids=[], response_mask=[], response_logprobs=[], num_turns=0,
                        finish_reason="error", error="TimeoutError: <slow> & stuck", episode_id="0-0", index=0,
                        repeat=0, data_source="x", loop="tool_agent_loop", seed=0)
    page = render_traces_html([err], tok)
    assert "TimeoutError: &lt;slow&gt; &amp; stuck" in page and "<slow>" not in page


def test_run_traces_pick_first_records_by_index(tok, tmp_path):
    recs = [_record(tok, episode_id=f"{i}-0", index=i, repeat=0) for i in (5, 1, 3)]
    out = write_run_traces(tmp_path, recs, tok, limit=2)
    page = out.read_text()
    assert out.name == "traces.html" and "2 episodes of 3" in page
    assert page.index('id="ep-1-0"') < page.index('id="ep-3-0"') and 'id="ep-5-0"' not in page


def test_cli_trace_uses_the_run_config(tok, tmp_path, tiny_model_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"model:\n  path: {json.dumps(str(tiny_model_path))}\n")
    with (run / "records.jsonl").open("w") as fh:
        for i in range(3):
            fh.write(_record(tok, episode_id=f"{i}-0", index=i, repeat=0).model_dump_json() + "\n")
    assert main(["trace", str(run / "records.jsonl"), "--limit", "2"]) == 0
    page = (run / "records.html").read_text()
    assert page.count('<section class="ep"') == 2
    out = tmp_path / "all.html"
    assert main(["trace", str(run / "records.jsonl"), "--out", str(out), "--limit", "0",
                 "--model", str(tiny_model_path)]) == 0
    assert out.read_text().count('<section class="ep"') == 3
    assert main(["trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
