"""The checks of a run's start that need no GPU, in seconds, from the config, the data, the model's config.json
and its tokenizer (never its weights); one `Check` each, every failure naming the row, key or file that is wrong.

Map:
    Check           one check's outcome and its lines
    check_data      `agentloop data check`'s rules on the rows the run uses, then the data section's own rules
    check_rewards   a reward for every data_source, found as the Scorer finds it; reward_floors: each reward's
                    lowest score, against reward.failure_score
    check_template  the chat template on a real row, rendered prefix by prefix, each rendering extending the
                    previous one token for token
    check_prompts   the longest prompt (rendered as the loop renders it) fits the context (longest_prompts,
                    context_length)
    check_model     the learner runs the model exactly (agentloop.train.model_support)
    check_tools     the tools each row is offered, resolved as tool_agent_loop resolves them
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Literal

from agentloop.config import Config
from agentloop.errors import AgentLoopError, ConfigError, DataError
from agentloop.records import Sample
from agentloop.train.planning import memory as planner

Status = Literal["ok", "warn", "FAIL"]


_PROMPTS_MEASURED = 64
"""Prompts rendered and tokenized to find the longest: the longest by characters (a row's tokens follow
its characters closely; the loop's budget caps any call by the context anyway)."""


_SHOWN = 5
"""Problem lines shown per check."""


@dataclass
class Check:
    """One check's outcome."""

    name: str
    status: Status
    summary: str
    details: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"  {self.status:<5} {self.name:<9} {self.summary}"] + [f"          {d}" for d in self.details]


def _file_rows(path: str, limit: int | None) -> Iterable[tuple[str, Any]]:
    from agentloop.data.check import _jsonl_rows_tolerant
    from agentloop.data.loader import JSONL_SUFFIXES, PARQUET_SUFFIXES, read_parquet_rows, to_plain

    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: data file does not exist")
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        rows: Iterable[tuple[str, Any]] = _jsonl_rows_tolerant(p)
    elif suffix in PARQUET_SUFFIXES:
        rows = ((w, to_plain(r)) for w, r in read_parquet_rows(p))
    else:
        raise DataError(f"{p}: unknown extension {p.suffix!r}; expected .jsonl or .parquet")
    return islice(rows, limit)


def check_data(cfg: Config) -> tuple[Check, Any | None]:
    """`agentloop data check` on the rows the run reads, then load_train_data (the held-out slice's rule)."""
    from agentloop.data import builtin_rows, check_rows, load_train_data

    d = cfg.data
    validate = bool(cfg.train.val_every)
    sources = [("training", d.path, d.builtin, d.max_samples)]
    if validate and d.val_path is not None:
        sources.append(("validation", d.val_path, None, d.val_max_samples))
    elif validate and d.path is None and d.val_builtin is not None:
        sources.append(("validation", None, d.val_builtin, d.val_max_samples))
    problems, warnings = [], []
    try:
        verl_tools: list[str] = []
        if cfg.tools.verl_tool_config:  # its tools are offered to every row, as data check --tools-config says
            from agentloop.tools.verl_tools import load_verl_tool_config

            verl_tools = load_verl_tool_config(cfg.tools.verl_tool_config)
        for _, path, builtin, limit in sources:
            rows = (_file_rows(path, limit) if path is not None else
                    ((f"builtin:{builtin} row {i}", r) for i, r in enumerate(islice(builtin_rows(builtin), limit))))
            report = check_rows(rows, prompt_key=d.prompt_key if path is not None else "prompt",
                                verl_tools=verl_tools)
            problems += [f"{p.where}: {p.message}" for p in report.problems if p.level == "error"]
            warnings += [f"{p.where}: warning: {p.message}" for p in report.problems if p.level == "warning"]
        if problems:
            return Check("data", "FAIL", f"{len(problems)} error(s) in the rows (agentloop data check FILE lists "
                                         "them all)", problems[:_SHOWN] + _more(problems)), None
        data = load_train_data(d, validate=validate)
    except (DataError, ConfigError) as e:
        return Check("data", "FAIL", str(e)), None
    held = data.config.val_holdout
    summary = (f"{len(data.train)} training rows of {data.train_source}"
               + (f" ({held} held out for validation)" if held and data.val else "")
               + f"; validation: {data.val_source if not (held and data.val) else f'{len(data.val)} held-out rows'}")
    if warnings:
        return Check("data", "warn", summary + f"; {len(warnings)} warning(s)", _dedupe(warnings)), data
    return Check("data", "ok", summary), data


def _more(items: list[str]) -> list[str]:
    return [f"... {len(items) - _SHOWN} more"] if len(items) > _SHOWN else []


def _dedupe(lines: list[str]) -> list[str]:
    """Warnings of many rows with the same message: the first one, and how many rows share it."""
    by_msg: dict[str, list[str]] = {}
    for line in lines:
        where, _, msg = line.partition(": warning: ")
        by_msg.setdefault(msg, []).append(where)
    out = [f"{w[0]}{f' (and {len(w) - 1} more rows)' if len(w) > 1 else ''}: {m}" for m, w in by_msg.items()]
    return out[:_SHOWN] + _more(out)


def _where(sample: Sample, data: Any) -> str:
    """Which row, by its position in its file counted from 0 (Sample.index; a Parquet row's own numbering)."""
    val = any(s is sample for s in data.val) and not any(s is sample for s in data.train)
    source = data.config.val_path if val and data.config.val_path else data.train_source
    return f"{'validation' if val else 'training'} row {sample.index} of {source}"


def check_rewards(cfg: Config, data: Any) -> Check:
    """The Scorer's lookup for every data_source of the run's rows."""
    from agentloop.rollout.scorer import Scorer

    try:
        scorer = Scorer(cfg)
    except (ConfigError, AgentLoopError) as e:
        return Check("rewards", "FAIL", f"reward.custom={cfg.reward.custom!r}: {e}")
    first: dict[str, Sample] = {}
    counts: Counter[str] = Counter()
    for s in list(data.train) + list(data.val):
        first.setdefault(s.data_source, s)
        counts[s.data_source] += 1
    ok, bad, missing = [], [], []
    for ds, s in first.items():
        try:
            fn = scorer.reward_fn(s)
        except AgentLoopError:  # the registry's lookup (a custom reward would have been returned)
            missing.append(ds)
            said = (f"neither it nor reward.default={cfg.reward.default!r} is a registered reward" if cfg.reward.default
                    else "no reward is registered under this name, and reward.default is unset")
            bad.append(f"data_source {ds!r} ({counts[ds]} rows, first: {_where(s, data)}): {said}")
            continue
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        how = ("reward.custom" if scorer.custom is not None else
               "reward.default" if ds not in _registered() and ds not in scorer.overrides else "")
        ok.append(f"{ds} ({counts[ds]} rows): {name}" + (f" ({how})" if how else ""))
    if bad:
        return Check("rewards", "FAIL", "no reward for data_source " + ", ".join(repr(ds) for ds in missing),
                     bad + ["register one (a plugin's register_reward), set reward.default to a registered reward, "
                            "or reward.custom to path/file.py:function; registered: "
                            + ", ".join(sorted(_registered()))])
    above = [f"{ds}: the reward's floor is {floor:g}" for ds, floor in reward_floors(cfg, list(first.values())).items()
             if cfg.reward.failure_score > floor]
    if above:
        return Check("rewards", "warn", "; ".join(ok) + f"; reward.failure_score={cfg.reward.failure_score:g} is above "
                     "the lowest score the reward gives, so an episode that fails (times out, overflows the context, "
                     "its agent fails on its output) scores better than one that answers wrong",
                     above + ["set reward.failure_score to the reward's floor (or below) unless that is meant"])
    return Check("rewards", "ok", "; ".join(ok))


_FLOOR_PROBE_S = 30.0
"""How long the reward floor probe may take, all data_sources together."""


def reward_floors(cfg: Config, samples: list[Sample]) -> dict[str, float]:
    """data_source -> the lowest score its reward gives (the floor a failure score is compared with): the score a
    built-in or registered reward gives an empty answer on the data_source's first row; for `reward.custom`, the
    function's own `floor` attribute (`compute_score.floor = -1.0`), never a call (a custom reward may count its
    calls, cost money or be slow). A reward that raises, does not answer in time or declares nothing is left out.
    Runs in a thread of its own with its own event loop (the caller may be inside one)."""
    import concurrent.futures

    from agentloop.rollout.scorer import Scorer

    async def probe() -> dict[str, float]:
        scorer = Scorer(cfg)
        out: dict[str, float] = {}
        try:
            for s in samples:
                if scorer.custom is not None:
                    floor = getattr(scorer.custom, "floor", None)
                    if isinstance(floor, (int, float)) and not isinstance(floor, bool):
                        out[s.data_source] = float(floor)
                    continue
                try:
                    out[s.data_source] = float((await scorer.score(s, ""))[0])
                except Exception:  # noqa: BLE001 - a reward that cannot score an empty answer has no floor to say
                    continue
        finally:
            await scorer.close()
        return out

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(asyncio.run, asyncio.wait_for(probe(), _FLOOR_PROBE_S))
        try:
            return fut.result(_FLOOR_PROBE_S + 5)
        except Exception:  # noqa: BLE001 - the probe is advice: a failure to run it is no failure of the check
            return {}


def _registered() -> set[str]:
    from agentloop.rewards import list_rewards

    return set(list_rewards())


def _loop_kind(loop_cls: type) -> str:
    """tools: tool_agent_loop (tools, the template's append-only property); single: one call; multi: another
    multi-turn loop (its own appends)."""
    from agentloop.loops.single_turn import SingleTurnAgentLoop
    from agentloop.loops.tool_agent import ToolAgentLoop

    if issubclass(loop_cls, ToolAgentLoop):
        return "tools"
    if issubclass(loop_cls, SingleTurnAgentLoop):
        return "single"
    return "multi"


def _probe_loop(cfg: Config, tokenizer: Any) -> Any:
    """A ToolAgentLoop without a server: the loop's own rendering, tokenizing and tool resolution."""
    from agentloop.loops.tool_agent import ToolAgentLoop

    return ToolAgentLoop(server_manager=None, tokenizer=tokenizer, config=cfg)


def _row_tools(probe: Any, sample: Sample, kind: str) -> list[dict] | None:
    if kind != "tools":
        return None
    tools, _ = probe._episode_tools(sample)  # the loop's own resolution: the check cannot disagree with the run
    return [t.schema for t in tools.values()] or None


def _conversation(sample: Sample, tools: list[dict] | None) -> tuple[list[dict[str, Any]], list[dict] | None, bool]:
    """(messages, tools, appended): the row's messages, and for a row without an assistant turn a tool call, its
    result and a final answer appended as tool_agent_loop would write them."""
    msgs = [dict(m) for m in sample.messages]
    if any(m["role"] == "assistant" for m in msgs):
        return msgs, tools, False
    schema = tools or [{"type": "function", "function": {
        "name": "lookup", "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    name = schema[0]["function"]["name"]
    call = json.dumps({"name": name, "arguments": {}})
    msgs += [{"role": "assistant", "content": f"Let me check.\n<tool_call>\n{call}\n</tool_call>"},
             {"role": "tool", "name": name, "content": "42"},
             {"role": "assistant", "content": "The answer is 42."}]
    return msgs, schema, True


def _cuts(msgs: list[dict[str, Any]]) -> list[tuple[int, bool]]:
    """(k, add_generation_prompt) of each rendering the loop makes of msgs[:k]: after the prompt and after each
    run of tool/user messages with the generation prompt, after each assistant message without it."""
    first = next((i for i, m in enumerate(msgs) if m["role"] not in ("system",)), 0)
    cuts = []
    for k in range(first + 1, len(msgs) + 1):
        last, nxt = msgs[k - 1]["role"], (msgs[k]["role"] if k < len(msgs) else "assistant")
        if last == "assistant":
            cuts.append((k, False))
        elif nxt == "assistant":
            cuts.append((k, True))
    return cuts


def _token_diff(tokenizer: Any, a: list[int], b: list[int]) -> str:
    i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
    show = lambda ids: repr(tokenizer.decode(ids[max(0, i - 3):i + 3]))  # noqa: E731
    return f"token {i}: {a[i:i + 3]} {show(a)} vs {b[i:i + 3]} {show(b)}"


def check_template(cfg: Config, tokenizer: Any, data: Any, kind: str) -> Check:
    """The chat template on the run's most multi-turn row (else its first row plus a tool call and result)."""
    from agentloop.loops.template import require_prefix

    has_template = getattr(tokenizer, "chat_template", None) is not None
    if not cfg.data.apply_chat_template:
        bad = [s for s in list(data.train) + list(data.val)
               if len(s.messages) != 1 or not isinstance(s.messages[0].get("content"), str)]
        if bad:
            return Check("template", "FAIL", f"data.apply_chat_template=false sends each row's single text message "
                                             f"as is, but {len(bad)} rows have another prompt (first: "
                                             f"{_where(bad[0], data)}, {len(bad[0].messages)} messages): set "
                                             "data.apply_chat_template=true (needs a chat template)")
        if kind == "tools" and not has_template:
            return Check("template", "FAIL", f"{cfg.rollout.loop} renders tool turns with the chat template, and the "
                                             "tokenizer has none: give model.tokenizer_path a tokenizer with one, or "
                                             "use a loop that appends raw text (search_r1_agent_loop)")
        if kind != "tools":
            return Check("template", "ok", "not used: data.apply_chat_template=false, each prompt is its row's text"
                                           + ("" if has_template else " (the tokenizer has no chat template)"))
    probe = _probe_loop(cfg, tokenizer)
    rows = list(data.train)
    sample = max(rows, key=lambda s: sum(m["role"] == "assistant" for m in s.messages))
    if not any(m["role"] == "assistant" for m in sample.messages):
        sample = rows[0]
    try:
        tools = _row_tools(probe, sample, kind)
    except (ConfigError, AgentLoopError) as e:
        tools = None
        if kind == "tools":
            return Check("template", "FAIL", f"{_where(sample, data)}: its tools cannot be built: {e}")
    msgs, tools, appended = _conversation(sample, tools)
    cuts = _cuts(msgs)
    what = (f"{_where(sample, data)}" + (" + a tool call, its result and an answer" if appended else
                                         f" ({len(msgs)} messages)"))
    try:
        texts = [probe.render_chat(msgs[:k], tools=tools, add_generation_prompt=gen) for k, gen in cuts]
    except Exception as e:  # noqa: BLE001 - a template that cannot render the conversation is the finding
        status: Status = "FAIL" if kind == "tools" else "warn"
        return Check("template", status, f"the chat template cannot render {what}: {type(e).__name__}: {e}")
    problem = None
    for (k, _), a, b in zip(cuts[1:], texts, texts[1:]):
        try:
            require_prefix(a, b, f"adding message {k - 1} ({msgs[k - 1]['role']}) changes the text before it")
        except ConfigError as e:
            problem = str(e)
            break
        ia = list(tokenizer.encode(a, add_special_tokens=False))
        ib = list(tokenizer.encode(b, add_special_tokens=False))
        if ib[:len(ia)] != ia:
            problem = (f"the chat template is append-only in text but not in tokens: adding message {k - 1} "
                       f"({msgs[k - 1]['role']}) re-tokenizes the text before it ({_token_diff(tokenizer, ia, ib)})")
            break
    if problem is not None:
        if kind == "tools":
            return Check("template", "FAIL", f"{what}: {problem}")
        return Check("template", "warn", f"{what}: {problem} (only multi-turn tool loops rely on it)")
    return Check("template", "ok", f"{what}: {len(texts)} renderings, each extends the previous one token for token")


def longest_prompts(cfg: Config, tokenizer: Any, data: Any, kind: str) -> list[tuple[int, Sample]]:
    """(tokens, sample) of the longest prompts by characters, rendered as the loop renders them, longest first."""
    probe = _probe_loop(cfg, tokenizer)
    samples = list(data.train) + list(data.val)
    chars = sorted(samples, key=lambda s: -sum(len(str(m.get("content", ""))) for m in s.messages))
    out = []
    for s in chars[:_PROMPTS_MEASURED]:
        tools = _row_tools(probe, s, kind)
        out.append((len(probe.apply_chat_template([dict(m) for m in s.messages], tools=tools)), s))
    return sorted(out, key=lambda t: -t[0])


def context_length(cfg: Config, model_config: dict[str, Any]) -> int:
    """The run's context: model.context_length, else the model's max_position_embeddings, else 32768 (the
    loops' own fallback)."""
    if cfg.model.context_length:
        return cfg.model.context_length
    c = model_config.get("text_config") if isinstance(model_config.get("text_config"), dict) else model_config
    return int(c.get("max_position_embeddings") or model_config.get("max_position_embeddings") or 32768)


def check_prompts(cfg: Config, tokenizer: Any, data: Any, kind: str, ctx: int) -> tuple[Check, int]:
    try:
        measured = longest_prompts(cfg, tokenizer, data, kind)
    except (ConfigError, AgentLoopError) as e:
        return Check("prompts", "FAIL", str(e)), 0
    n, s = measured[0]
    too_long = [(k, t) for k, t in measured if k >= ctx]
    if too_long:
        return Check("prompts", "FAIL", f"{len(too_long)} of the {len(measured)} longest prompts leave no room to "
                                        f"answer in the context of {ctx} tokens (model.context_length, else "
                                        "max_position_embeddings)",
                     [f"{_where(t, data)}: {k} tokens" for k, t in too_long[:_SHOWN]]
                     + ["drop or shorten those rows, or raise model.context_length"]), n
    return Check("prompts", "ok", f"longest {n} tokens ({_where(s, data)}) of a {ctx}-token context"), n


def check_model(cfg: Config, model_path: Path, model_config: dict[str, Any]) -> Check:
    from agentloop.train.model_support import check_model_support

    try:
        support = check_model_support(model_path, max_len=cfg.model.context_length)
        shape = planner.ModelShape.from_config(model_config)
    except (ConfigError, ValueError) as e:
        return Check("model", "FAIL", f"{model_path}: {e}")
    if not support.ok:
        return Check("model", "FAIL", f"the learner cannot run {model_path} (model_type {support.model_type!r}) "
                                      "exactly", list(support.problems))
    return Check("model", "ok", f"{support.model_type} ({shape.params / 1e6:,.0f}M parameters, {shape.layers} layers) "
                                f"at {model_path}: the learner runs it exactly", list(support.applied))


def check_tools(cfg: Config, tokenizer: Any, data: Any, kind: str) -> Check:
    """The tools each row is offered, by tool_agent_loop's own resolution (one row per distinct tool set)."""
    samples = list(data.train) + list(data.val)
    named = [s for s in samples if s.tools_kwargs or s.extra_info.get("tools_kwargs")]
    if kind != "tools":
        said = []
        if named:
            said.append(f"{len(named)} rows name tools (tools_kwargs; first: {_where(named[0], data)}), which "
                        f"{cfg.rollout.loop} does not call (tool_agent_loop does)")
        if cfg.tools.names:
            said.append(f"tools.names={cfg.tools.names} is not used by {cfg.rollout.loop}")
        return Check("tools", "warn" if said else "ok", "; ".join(said) or f"none ({cfg.rollout.loop} calls no tools)")
    probe = _probe_loop(cfg, tokenizer)
    groups: dict[tuple[str, ...], list[Sample]] = {}
    for s in samples:
        kw = s.tools_kwargs or s.extra_info.get("tools_kwargs") or {}
        groups.setdefault(tuple(sorted(kw)) if isinstance(kw, dict) else ("?",), []).append(s)
    offered: Counter[str] = Counter()
    bad = []
    for members in groups.values():
        try:
            names = [t["function"]["name"] for t in (_row_tools(probe, members[0], kind) or [])]
        except (ConfigError, AgentLoopError) as e:
            bad.append(f"{_where(members[0], data)} (and {len(members) - 1} more rows naming the same tools): {e}")
            continue
        if names and not cfg.data.apply_chat_template:
            bad.append(f"{_where(members[0], data)}: data.apply_chat_template=false sends the prompt as is, so its "
                       f"tools {names} cannot be offered; use the chat template")
        for n in names or ["(none)"]:
            offered[n] += len(members)
    if bad:
        return Check("tools", "FAIL", f"{len(bad)} tool set(s) cannot be built", bad[:_SHOWN] + _more(bad))
    return Check("tools", "ok", ", ".join(f"{n}: {c} rows" for n, c in offered.most_common()))


__all__ = ["Check", "check_data", "check_model", "check_prompts", "check_rewards", "check_template", "check_tools",
           "context_length", "longest_prompts", "reward_floors"]
