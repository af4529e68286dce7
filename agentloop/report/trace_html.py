"""Episode records as one static HTML page: see exactly which tokens the learner trains on.

    render_traces_html   records + tokenizer -> the page (str); no JavaScript, inline CSS, all text escaped
    write_trace_html     `agentloop trace RECORDS.jsonl`: read records, find the run's tokenizer, write the page
    write_run_traces     what `agentloop rollout` calls: the first N records (by index, repeat) -> traces.html
    load_run_tokenizer   the tokenizer of a run: --model, else config.yaml's model.tokenizer_path / model.path,
                         else the project's tiny model

Per episode: identity, reward, finish reason, error, metrics and reward info; the conversation
(`extra["messages"]`) and the tool calls (`extra["tool_trace"]`) when the loop kept them; then every
token of prompt and response, decoded one at a time, as its own <span>:

    prompt tokens     class "t p"   grey, in a collapsed block (never trained on)
    mask-0 response   class "t m0"  grey, hatched (tool / template tokens, not trained on)
    mask-1 response   class "t m1"  background from red (p = exp(logprob) = 0) to green (p = 1)

Each span's title holds `id`, `mask` and `logprob` (and p). The response is split into runs of equal
mask: a mask-1 run is a model turn, a mask-0 run the environment's text after it; the tool calls of
turn k are listed before the k-th environment run (exact for tool_agent_loop, whose every tool turn
is followed by environment tokens; loops that put two model turns back to back show them as one run).
A newline inside a token is drawn as "↵" followed by a real line break.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable

from agentloop.records import EpisodeRecord, read_records

DEFAULT_LIMIT = 20

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d2327;background:#fafafa}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:0 0 8px}h3{font-size:13px;margin:12px 0 4px;color:#555}
section.ep{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:14px 16px;margin:16px 0}
table{border-collapse:collapse;font-size:12px;margin:4px 0}td,th{border:1px solid #e1e4e8;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f3f4f6}
.kv td:first-child{color:#555;white-space:nowrap}
.err{color:#b00020;font-weight:600}
.toks{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.9;
white-space:pre-wrap;word-break:break-all}
.t{border-radius:2px;padding:1px 0;margin:0 1px 0 0;border-bottom:1px solid rgba(0,0,0,.12)}
.t.p{background:#eceff1;color:#6b7280}
.t.m0{background:repeating-linear-gradient(135deg,#e5e7eb 0 4px,#f3f4f6 4px 8px);color:#4b5563}
.seg{border-left:4px solid #cbd5e1;padding:2px 0 2px 8px;margin:6px 0}
.seg.model{border-left-color:#16a34a}.seg.env{border-left-color:#9ca3af}
.seglabel{font-size:11px;color:#555;margin-bottom:2px}
.msg{margin:4px 0;padding:4px 8px;border-radius:4px;background:#f6f8fa}
.msg pre{margin:2px 0;white-space:pre-wrap;word-break:break-word;font-size:12px}
.role{font-size:11px;font-weight:600;text-transform:uppercase;color:#555}
.role-assistant{background:#ecfdf5}.role-tool{background:#fff7ed}.role-system{background:#eef2ff}
details{margin:4px 0}summary{cursor:pointer;font-size:12px;color:#374151}
.legend span.t{display:inline-block;min-width:44px;text-align:center}
.calls td pre{margin:0;white-space:pre-wrap;font-size:11px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def prob_color(logprob: float) -> str:
    """Background of a mask-1 token: hue 0 (red, p=0) to 120 (green, p=1), p = exp(logprob)."""
    p = math.exp(min(0.0, logprob)) if math.isfinite(logprob) else 0.0
    return f"hsl({120 * p:.0f},75%,80%)"


def _show(text: str) -> str:
    if text == "":
        return "∅"
    return text.replace("\n", "↵\n")


class _Decoder:
    """decode([id]) with a cache (one token at a time, special tokens kept)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return s


def token_spans(ids: list[int], decode_one: Callable[[int], str], *, mask: list[int] | None = None,
                logprobs: list[float] | None = None, prompt: bool = False) -> str:
    """One <span> per token: prompt ("t p"), mask 0 ("t m0") or mask 1 ("t m1", coloured by probability)."""
    out = []
    for i, tid in enumerate(ids):
        text = _e(_show(decode_one(tid)))
        if prompt:
            out.append(f'<span class="t p" title="id={tid} prompt (mask 0)">{text}</span>')
            continue
        m = mask[i] if mask is not None else 1
        lp = logprobs[i] if logprobs is not None else 0.0
        if m:
            title = f"id={tid} mask=1 logprob={lp:.4f} p={math.exp(min(0.0, lp)):.3f}"
            out.append(f'<span class="t m1" style="background:{prob_color(lp)}" title="{_e(title)}">{text}</span>')
        else:
            out.append(f'<span class="t m0" title="id={tid} mask=0 logprob={lp:.4f}">{text}</span>')
    return "".join(out)


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of each run of equal mask values."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        s = json.dumps(v, ensure_ascii=False)
        return s if len(s) <= 400 else s[:400] + " …"
    return str(v)


def _kv_table(rows: Iterable[tuple[str, Any]], cls: str = "kv") -> str:
    body = "".join(f"<tr><td>{_e(k)}</td><td>{_e(_fmt(v))}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def _calls_table(calls: list[dict[str, Any]]) -> str:
    head = "<tr><th>tool</th><th>arguments</th><th>status</th><th>time s</th><th>result (start)</th></tr>"
    body = []
    for c in calls:
        args = json.dumps(c.get("arguments"), ensure_ascii=False)
        status = c.get("status")
        err = f' <span class="err">{_e(c.get("error"))}</span>' if c.get("error") else ""
        body.append(f"<tr><td>{_e(c.get('name'))}</td><td><pre>{_e(args)}</pre></td><td>{_e(status)}{err}</td>"
                    f"<td>{_e(_fmt(c.get('time_s', 0.0)))}</td><td><pre>{_e(c.get('text', ''))}</pre></td></tr>")
    return f'<table class="calls">{head}{"".join(body)}</table>'


def _messages_block(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        role = str(m.get("role", "?"))
        name = f" · {m['name']}" if m.get("name") else ""
        parts.append(f'<div class="msg role-{_e(role)}"><span class="role">{_e(role + name)}</span>'
                     f"<pre>{_e(m.get('content', ''))}</pre></div>")
    return (f"<details><summary>conversation ({len(messages)} messages, as the chat template saw them)</summary>"
            f"{''.join(parts)}</details>")


def render_episode(rec: EpisodeRecord, decode_one: Callable[[int], str]) -> str:
    """One <section> for one record."""
    anchor = f"ep-{rec.episode_id}"
    reward = "—" if rec.reward is None else f"{rec.reward:.4g}"
    head = (f'<h2>episode {_e(rec.episode_id)} · reward {_e(reward)} · finish {_e(rec.finish_reason)}'
            + (' · <span class="err">error</span>' if rec.error else "") + "</h2>")
    info = [("data_source", rec.data_source), ("loop", rec.loop), ("index / repeat", f"{rec.index} / {rec.repeat}"),
            ("reward", reward), ("finish_reason", rec.finish_reason), ("num_turns", rec.num_turns),
            ("tokens: prompt / response / model (mask 1)",
             f"{len(rec.prompt_ids)} / {len(rec.response_ids)} / {rec.num_model_tokens}"),
            ("wall_s", rec.wall_s), ("seed", rec.seed), ("ground_truth", rec.ground_truth)]
    if rec.step is not None:
        info.append(("step", rec.step))
    parts = [f'<section class="ep" id="{_e(anchor)}">', head]
    if rec.error:
        parts.append(f'<p class="err">error: {_e(rec.error)}</p>')
    parts.append(_kv_table(info))
    if rec.metrics:
        parts.append(f"<details><summary>metrics ({len(rec.metrics)})</summary>"
                     f"{_kv_table(sorted(rec.metrics.items()))}</details>")
    if rec.reward_info:
        parts.append(f"<details><summary>reward info</summary>{_kv_table(sorted(rec.reward_info.items()))}</details>")
    messages = rec.extra.get("messages")
    if isinstance(messages, list) and messages:
        parts.append(_messages_block(messages))
    trace = rec.extra.get("tool_trace") if isinstance(rec.extra.get("tool_trace"), list) else []
    by_turn: dict[int, list[dict[str, Any]]] = {}
    for c in trace:
        by_turn.setdefault(int(c.get("turn", 0)), []).append(c)
    if rec.prompt_ids or rec.response_ids:
        parts.append("<h3>tokens</h3>")
        parts.append(f"<details><summary>prompt · {len(rec.prompt_ids)} tokens (mask 0, conditioned on, "
                     f"not trained)</summary><div class=\"toks\">{token_spans(rec.prompt_ids, decode_one, prompt=True)}"
                     "</div></details>")
        model_turn = env_seen = 0
        for m, a, b in _runs(rec.response_mask):
            ids, lps = rec.response_ids[a:b], rec.response_logprobs[a:b]
            spans = token_spans(ids, decode_one, mask=rec.response_mask[a:b], logprobs=lps)
            if m:
                model_turn += 1
                mean_lp = sum(lps) / len(lps)
                label = (f"turn {model_turn} · model · {b - a} tokens (mask 1, trained) · mean logprob "
                         f"{mean_lp:.3f}")
                parts.append(f'<div class="seg model"><div class="seglabel">{_e(label)}</div>'
                             f'<div class="toks">{spans}</div></div>')
            else:
                calls = by_turn.pop(env_seen, [])
                env_seen += 1
                if calls:
                    parts.append(f"<h3>tool calls of turn {env_seen}</h3>{_calls_table(calls)}")
                label = f"environment · {b - a} tokens (mask 0: tool results and template, not trained)"
                parts.append(f'<div class="seg env"><div class="seglabel">{_e(label)}</div>'
                             f'<div class="toks">{spans}</div></div>')
        rest = [c for t in sorted(by_turn) for c in by_turn[t]]
        if rest:
            parts.append(f"<h3>tool calls without environment tokens after them</h3>{_calls_table(rest)}")
    parts.append("</section>")
    return "\n".join(parts)


def _legend() -> str:
    samples = "".join(f'<span class="t m1 key" style="background:{prob_color(math.log(p))}">p={p:g}</span>'
                      for p in (1.0, 0.75, 0.5, 0.25, 0.05))
    return (f'<p class="legend toks">model tokens (mask 1, trained on): {samples} &nbsp; '
            '<span class="t m0 key">tool/template (mask 0)</span> &nbsp; <span class="t p key">prompt</span> &nbsp; '
            '<span style="font-family:system-ui;font-size:12px">hover a token for id, mask, logprob</span></p>')


def _index_table(records: list[EpisodeRecord]) -> str:
    head = ("<tr><th>episode</th><th>reward</th><th>finish</th><th>turns</th><th>tool calls</th>"
            "<th>model tokens</th><th>error</th></tr>")
    rows = []
    for r in records:
        reward = "—" if r.reward is None else f"{r.reward:.4g}"
        rows.append(f'<tr><td><a href="#ep-{_e(r.episode_id)}">{_e(r.episode_id)}</a></td><td>{_e(reward)}</td>'
                    f"<td>{_e(r.finish_reason)}</td><td>{r.num_turns}</td>"
                    f"<td>{_e(_fmt(r.metrics.get('tool_calls', 0)))}</td><td>{r.num_model_tokens}</td>"
                    f'<td class="err">{_e(r.error or "")}</td></tr>')
    return f"<table>{head}{''.join(rows)}</table>"


def render_traces_html(records: list[EpisodeRecord], tokenizer: Any, *, title: str = "agentloop traces",
                       total: int | None = None) -> str:
    """The whole page for `records` (decoded with `tokenizer`); `total` = how many records there were."""
    decode_one = _Decoder(tokenizer)
    shown = f"{len(records)} episodes" + (f" of {total}" if total is not None and total != len(records) else "")
    body = [f"<h1>{_e(title)}</h1>", f"<p>{_e(shown)}</p>", _legend(), _index_table(records)]
    body.extend(render_episode(r, decode_one) for r in records)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


# ------------------------------------------------------------------ files and tokenizers


def load_run_tokenizer(run_dir: Path | None, model_dir: str | Path | None = None) -> Any:
    """The tokenizer to decode a run's records: `model_dir`, else the run's config.yaml, else the tiny model."""
    from agentloop.config import Config, ModelConfig
    from agentloop.models.loading import load_tokenizer_for, resolve_model

    path = tok_path = None
    if model_dir is not None:
        path = str(model_dir)
    elif run_dir is not None and (run_dir / "config.yaml").is_file():
        import yaml

        model = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("model") or {}
        path, tok_path = model.get("path"), model.get("tokenizer_path")
    cfg = Config(model=ModelConfig(path=path, tokenizer_path=tok_path))
    return load_tokenizer_for(cfg, resolve_model(cfg))


def _select(records: Iterable[EpisodeRecord], limit: int | None) -> tuple[list[EpisodeRecord], int]:
    recs = sorted(records, key=lambda r: (r.step if r.step is not None else -1, r.index, r.repeat))
    return (recs if limit is None else recs[:limit]), len(recs)


def write_run_traces(run_dir: Path, records: list[EpisodeRecord], tokenizer: Any,
                     limit: int = DEFAULT_LIMIT) -> Path:
    """Write `run_dir/traces.html` for the first `limit` records (by index, repeat); returns its path."""
    shown, total = _select(records, limit)
    out = Path(run_dir) / "traces.html"
    out.write_text(render_traces_html(shown, tokenizer, title=f"agentloop traces · {Path(run_dir).name}",
                                      total=total))
    return out


def write_trace_html(records_path: str | Path, out: str | Path | None = None, *, limit: int | None = DEFAULT_LIMIT,
                     model_dir: str | Path | None = None) -> Path:
    """`agentloop trace`: render a records.jsonl (first `limit` records) to `out` (default: next to it)."""
    src = Path(records_path)
    if not src.is_file():
        from agentloop.errors import ConfigError

        raise ConfigError(f"records file {str(src)!r} does not exist")
    shown, total = _select(read_records(src), limit)
    tokenizer = load_run_tokenizer(src.parent, model_dir)
    dest = Path(out) if out is not None else src.with_name(src.stem + ".html")
    dest.write_text(render_traces_html(shown, tokenizer, title=f"agentloop traces · {src}", total=total))
    return dest
