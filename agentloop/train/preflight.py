"""The checks of `agentloop train --dry-run`, which every `agentloop train` run makes before it starts anything.

In seconds, from the config, the data, the model's config.json and its tokenizer (never its weights), one line
per check, each failure naming the row, key or file that is wrong:
    data      `agentloop data check`'s rules on the rows the run uses (training rows, validation file), then the
              data section's own rules (the held-out slice, the row limits)
    rewards   a reward for every data_source, found as the Scorer finds it (reward.custom, the run's code reward,
              the registry, reward.default)
    template  the chat template on a real row, rendered prefix by prefix, each rendering extending the previous
              one token for token (what tool_agent_loop's trajectories rely on); a single-turn row gets a tool
              call and its result appended, as the loop would. A tokenizer without a template passes only with
              data.apply_chat_template=false and a loop that renders none
    prompts   the longest prompt (rendered as the loop renders it) fits the context
    model     the learner runs the model exactly (model_support.check_model_support, at model.context_length)
    tools     the tools each row is offered, resolved as tool_agent_loop resolves them (its own method)
    memory    the GPU memory plan (agentloop.train.plan): learner peak, server KV pool, placement
On CUDA (a visible GPU, or cluster.gpu_memory_gib on a machine without one), the plan also sizes the keys the
user left unset (`apply_plan`; a key in a --config file, a preset or an override counts as set) and prints
them once as the "plan:" block; they go into the run's config.yaml, so the run and a resumed run keep them.
On CPU nothing is derived.

Map:
    Check, Preflight     one check's line(s); all of them, the data and plan for the run, the derived keys
    run_preflight        every check in order; Preflight (raise_for_failures: ConfigError naming each failure)
    gpu_inventory        the visible GPUs (name, total and free memory) from a short child process, so the
                         orchestrator itself never holds a CUDA context
    Derived / apply_plan the plan's values written into the keys the user did not set
    served_kv_tokens     after the servers start: each one's KV pool as SGLang reports it
    plan_summary         plan.json + what was measured, for train_summary.json
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from agentloop.config import Config
from agentloop.errors import AgentLoopError, ConfigError, DataError
from agentloop.records import Sample
from agentloop.train import plan as planner

Status = Literal["ok", "warn", "FAIL"]

_PROMPTS_MEASURED = 64
"""Prompts rendered and tokenized to find the longest: the longest by characters (a row's tokens follow
its characters closely; the loop's budget caps any call by the context anyway)."""
_SHOWN = 5
"""Problem lines shown per check."""
_GPU_PROBE = ("import json, torch\n"
              "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
              "out = []\n"
              "for i in range(n):\n"
              "    free, total = torch.cuda.mem_get_info(i)\n"
              "    out.append({'name': torch.cuda.get_device_name(i), 'free': free, 'total': total})\n"
              "print(json.dumps(out))\n")


@dataclass
class Check:
    """One check's outcome."""

    name: str
    status: Status
    summary: str
    details: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"  {self.status:<5} {self.name:<9} {self.summary}"] + [f"          {d}" for d in self.details]


@dataclass
class Derived:
    """A key the plan sets (or would set, when the user set it: then it is only shown)."""

    key: str
    value: Any
    why: str
    user_set: bool


@dataclass
class Preflight:
    """Everything the checks found."""

    checks: list[Check]
    data: Any | None
    """TrainData of the run (None when the data check failed)."""
    plan: planner.Plan | None
    machine: str
    """What the plan was made for, in words ('' on CPU)."""
    derived: list[Derived]
    seconds: float
    record: dict[str, Any] = field(default_factory=dict)
    """The plan's numbers (plan.json in the run dir, train_summary.json's `plan`)."""

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def lines(self) -> list[str]:
        out = [line for c in self.checks for line in c.lines()]
        if self.plan is not None:
            out.append(f"plan: {self.machine}")
            out += [f"  {line}" for line in plan_lines(self.plan)]
            for d in self.derived:
                out.append(f"  {d.key:<32} {_show(d.value):<10} " + ("(set)" if d.user_set else f"(derived: {d.why})"))
        return out

    def raise_for_failures(self) -> None:
        if self.failed:
            raise ConfigError(f"preflight: {len(self.failed)} check(s) failed:\n" + "\n".join(
                f"  {c.name}: {c.summary}" + "".join(f"\n    {d}" for d in c.details) for c in self.failed))

    def save(self, run_dir: Path) -> None:
        if self.record:
            (run_dir / "plan.json").write_text(json.dumps(self.record, indent=2) + "\n")


def _show(v: Any) -> str:
    return "null" if v is None else str(v)


# ------------------------------------------------------------------------------------------------ data


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


# ------------------------------------------------------------------------------------------------ rewards


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


# ------------------------------------------------------------------------------------------------ template


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


# ------------------------------------------------------------------------------------------------ prompts


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


# ------------------------------------------------------------------------------------------------ model


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


# ------------------------------------------------------------------------------------------------ tools


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


# ------------------------------------------------------------------------------------------------ the machine


def gpu_inventory(timeout_s: float = 120.0, *, dev: Path = Path("/dev")) -> list[dict[str, Any]]:
    """The visible GPUs: [{name, total, free}] in bytes. Empty without a GPU device node in `dev` (then torch is
    not even imported); else asked of torch in a child process, which takes its CUDA contexts with it when it
    exits (the orchestrator never holds one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return []
    if not any(dev.glob("nvidia[0-9]*")):
        return []
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=timeout_s,
                             check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        raise ConfigError(f"could not read the GPUs' memory (torch.cuda.mem_get_info in a child process): "
                          f"{type(e).__name__}: {e}; set cluster.gpu_memory_gib and cluster.num_gpus to plan without "
                          "reading them") from None


def _on_gpu(device: str, gpus_here: bool, planned: bool) -> bool:
    return device == "cuda" or (device == "auto" and (gpus_here or planned))


def machine_for(cfg: Config, inventory: list[dict[str, Any]], *, dry_run: bool) -> tuple[list[float], str]:
    """Each planned GPU's usable GiB, and the machine in words ([] : a CPU run, nothing planned)."""
    cl = cfg.cluster
    planned = cl.gpu_memory_gib is not None
    servers_gpu = not cfg.server.urls and _on_gpu(cfg.server.device, bool(inventory), planned)
    learner_gpu = _on_gpu(cfg.learner.device, bool(inventory), planned)
    if not (servers_gpu or learner_gpu):
        return [], ""
    if not inventory:
        if not planned:
            raise ConfigError("server.device / learner.device is cuda but no GPU is visible; set "
                              "cluster.gpu_memory_gib (and cluster.num_gpus) to plan for GPUs from this machine with "
                              "--dry-run")
        if not dry_run:
            raise ConfigError(f"cluster.gpu_memory_gib={cl.gpu_memory_gib:g} plans for GPUs, but none is visible "
                              "here: this run would run on CPU. Plan for GPUs with --dry-run, or unset "
                              "cluster.gpu_memory_gib")
        n = cl.num_gpus or 1
        return [float(cl.gpu_memory_gib)] * n, (f"{n} GPU{'s' if n > 1 else ''} of {cl.gpu_memory_gib:g} GiB "
                                                "(cluster.gpu_memory_gib; none visible here)")
    n = cl.num_gpus or len(inventory)
    if n > len(inventory):
        if not dry_run:
            raise ConfigError(f"cluster.num_gpus={n} but {len(inventory)} GPU(s) are visible; plan for more with "
                              "--dry-run only")
        inventory = inventory + [inventory[-1]] * (n - len(inventory))
    gib = [float(cl.gpu_memory_gib) if planned else g["free"] / planner.GIB for g in inventory[:n]]
    names = Counter(g["name"] for g in inventory[:n])
    what = ", ".join(f"{c} x {name}" for name, c in names.items())
    size = f"{cl.gpu_memory_gib:g} GiB each (cluster.gpu_memory_gib)" if planned else \
        "free: " + ", ".join(f"{x:.1f}" for x in gib) + " GiB"
    return gib, f"{what}, {size}"


# ------------------------------------------------------------------------------------------------ the plan


def _workload(cfg: Config, kind: str, longest_prompt: int, ctx: int, max_new_tokens: int) -> planner.Workload:
    t, r = cfg.train, cfg.rollout
    window = (t.max_staleness + 1) if t.schedule == "async" else 1
    episodes = window * t.prompts_per_step * r.n_samples  # the admission rule's most groups in flight
    if _set(r, "max_concurrency"):
        episodes = min(r.max_concurrency, episodes)
    response = max_new_tokens if kind == "single" else min(cfg.tools.max_response_tokens, ctx - longest_prompt)
    return planner.Workload(episodes=episodes, group_size=r.n_samples, prompt_tokens=longest_prompt,
                            response_tokens=max(1, response))


def _set(section: Any, key: str) -> bool:
    return key in section.model_fields_set


def derive(cfg: Config, kind: str, ctx: int, longest_prompt: int, gpu_gib: list[float],
           model: planner.ModelShape) -> tuple[planner.Plan, list[Derived]]:
    """The plan for `gpu_gib`, and the keys it sizes: the user's value where one was set, the plan's otherwise."""
    s, lc, m, smp = cfg.server, cfg.learner, cfg.manager, cfg.sampling
    derived: list[Derived] = []

    def pick(section: Any, key: str, value: Any, why: str, *, user: bool | None = None) -> Any:
        user = _set(section, key) if user is None else user
        name = {id(cfg.server): "server", id(cfg.learner): "learner", id(cfg.manager): "manager",
                id(cfg.sampling): "sampling", id(cfg.rollout): "rollout"}[id(section)]
        derived.append(Derived(f"{name}.{key}", getattr(section, key) if user else value, why, user))
        return getattr(section, key) if user else value

    budget = planner.response_budget(ctx, longest_prompt)
    mnt = pick(smp, "max_new_tokens", max(1, budget),
               f"min({planner.MAX_NEW_TOKENS_CAP}, context {ctx} - longest prompt {longest_prompt})")
    local = 0 if s.urls else s.num_local
    sync_given = lc.weight_sync if _set(lc, "weight_sync") else None
    learner_on_gpu = lc.device != "cpu"
    setup = planner.LearnerSetup(
        nproc=lc.nproc, micro_batch_tokens=lc.micro_batch_tokens, gradient_checkpointing=lc.gradient_checkpointing,
        compile=lc.compile != "off", logprob_chunk_tokens=lc.logprob_chunk_tokens,
        reference=cfg.algo.kl_coef > 0 or cfg.algo.use_kl_in_reward,  # the learner's needs_reference rule
        sync_bucket_gib=0.0 if (sync_given or ("tensor" if local else "disk")) == "disk"
        else lc.weight_sync_bucket_mb / 1024)
    servers = planner.ServerSetup(
        count=local, gpus=s.gpus,
        mem_fraction_static=s.mem_fraction_static,  # None (unset or null): planned
        max_total_tokens=s.max_total_tokens if _set(s, "max_total_tokens") else None,
        max_inflight=m.max_inflight_per_server)  # None: planned
    work = _workload(cfg, kind, longest_prompt, ctx, mnt)
    plan = planner.make_plan(model, setup, servers, work, gpu_gib, learner_gpus=lc.gpus,
                             learner_on_gpu=learner_on_gpu, weight_sync=sync_given)
    ray = cfg.cluster.backend == "ray"
    if local:
        # with Ray, Ray places the actors on GPUs (cluster.colocate, cluster.*_gpus): no GPU lists of ours
        if not ray and (plan.server_gpus != list(range(local)) or _set(s, "gpus")):
            pick(s, "gpus", plan.server_gpus, "separate from the learner" if not plan.colocated else "as placed")
        if not ray and learner_on_gpu and (plan.learner_gpus != list(range(lc.nproc)) or _set(lc, "gpus")):
            pick(lc, "gpus", plan.learner_gpus, "the first GPUs")
        pick(s, "max_total_tokens", None, "the KV pool from free memory")
        pick(s, "mem_fraction_static", plan.mem_fraction_static,
             "weights + the KV of the episodes in flight, next to the learner" if plan.colocated
             else "SGLang's own sizing (the server has its GPU to itself)", user=s.mem_fraction_static is not None)
        at_once = plan.episodes_per_server * local >= work.episodes
        pick(m, "max_inflight_per_server", plan.max_inflight_per_server,
             "every episode in flight at once" if at_once else "what the KV pool holds at once",
             user=m.max_inflight_per_server is not None)
        pick(cfg.rollout, "max_concurrency", min(work.episodes, plan.episodes_per_server * local),
             "every episode the schedule keeps in flight" if at_once else "what the KV pools hold at once")
        if ray and learner_on_gpu and plan.weight_sync is not None:
            # Ray: where the learner has GPUs its rank 0 broadcasts to the servers' GPUs (nccl), or hands them CUDA
            # IPC handles when colocated; never whole weight directories through the object store each step
            pick(lc, "weight_sync", "tensor" if cfg.cluster.colocate else "nccl",
                 "Ray, colocated: CUDA IPC" if cfg.cluster.colocate
                 else "Ray: NCCL broadcast from the learner's GPUs to the servers'")
        elif plan.weight_sync is not None:
            pick(lc, "weight_sync", plan.weight_sync, "CUDA IPC: colocated" if plan.weight_sync == "tensor"
                 else "broadcast to servers on other GPUs")
    call = mnt if kind == "single" else (cfg.tools.max_tokens_per_turn or max(mnt, cfg.tools.max_response_tokens))
    timeout = pick(m, "request_timeout_s", planner.request_timeout_s(call),
                   f"{call} tokens at {planner.SLOW_DECODE_TOKENS_PER_S:g} tokens/s, at least "
                   f"{planner.MIN_REQUEST_TIMEOUT_S:g} s")
    if timeout > m.retry_budget_s:
        pick(m, "retry_budget_s", 1.5 * timeout, "1.5 x the request timeout")
    if timeout > cfg.rollout.episode_timeout_s:
        derived.append(Derived("rollout.episode_timeout_s", cfg.rollout.episode_timeout_s
                               if _set(cfg.rollout, "episode_timeout_s") else 2 * timeout, "2 x the request timeout",
                               _set(cfg.rollout, "episode_timeout_s")))
    return plan, derived


def apply_plan(cfg: Config, derived: list[Derived]) -> None:
    """Write the derived values into the keys the user did not set."""
    for d in derived:
        if d.user_set:
            continue
        section, key = d.key.split(".")
        setattr(getattr(cfg, section), key, d.value)


def plan_lines(plan: planner.Plan) -> list[str]:
    out = []
    mem = plan.learner
    if mem is not None:
        out.append(f"learner    peak {mem.peak:.1f} GiB per rank at {mem.tokens} tokens per micro-batch "
                   f"({mem.parts()}); reserved {mem.need:.1f}, on GPU(s) {plan.learner_gpus}")
    if plan.server_gpus:
        kv = f"KV pool {plan.kv_tokens:,} tokens per server" if plan.kv_tokens is not None else "KV pool: SGLang's"
        out.append(f"servers    on GPU(s) {plan.server_gpus}, {'colocated with' if plan.colocated else 'apart from'} "
                   f"the learner; {kv} (the episodes in flight take {plan.kv_tokens_needed:,})")
    for b in plan.gpus:
        if b.learner_ranks or b.servers:
            out.append(f"GPU {b.index:<6} {b.capacity:.1f} GiB: learner {b.learner:.1f} + servers {b.server:.1f}, "
                       f"{b.left:.1f} left")
    out += [f"note: {n}" for n in plan.notes]
    return out


def check_memory(plan: planner.Plan | None, machine: str) -> Check:
    if plan is None:
        return Check("memory", "ok", "CPU run: nothing to plan (no GPU visible, cluster.gpu_memory_gib unset)")
    if not plan.ok:
        return Check("memory", "FAIL", f"the plan for {machine} does not fit", plan.problems)
    mem = plan.learner
    said = f"fits {machine}" + (f": learner peak {mem.peak:.1f} GiB per rank" if mem is not None else "")
    if plan.kv_tokens is not None:
        said += f", server KV {plan.kv_tokens:,} tokens"
    return Check("memory", "warn" if plan.notes else "ok", said, [f"note: {n}" for n in plan.notes])


# ------------------------------------------------------------------------------------------------ all of it


def run_preflight(cfg: Config, model_path: Path, *, dry_run: bool = False) -> Preflight:
    """Every check in order, for the run's model directory. `cfg.data` becomes the data section as resolved
    (load_train_data); on CUDA the derived keys are written into `cfg` (only when every check passed).
    `dry_run`: cluster.gpu_memory_gib / num_gpus may name GPUs this machine does not have."""
    from agentloop.loops import get_agent_loop
    from agentloop.models.loading import load_tokenizer_for

    t0 = time.monotonic()
    checks: list[Check] = []
    data_check, data = check_data(cfg)
    checks.append(data_check)
    if data is not None:
        cfg.data = data.config  # the held-out slice's size, no unused built-in set: what config.yaml saves
    kind = _loop_kind(get_agent_loop(cfg.rollout.loop))
    if data is not None:
        checks.append(check_rewards(cfg, data))
    try:
        model_config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {model_path}/config.json: {e}") from None
    ctx = context_length(cfg, model_config)
    tokenizer, longest = None, 0
    try:
        tokenizer = load_tokenizer_for(cfg, Path(model_path))
    except ConfigError as e:
        checks.append(Check("template", "FAIL", str(e)))
    if tokenizer is not None and data is not None:
        checks.append(check_template(cfg, tokenizer, data, kind))
        prompt_check, longest = check_prompts(cfg, tokenizer, data, kind, ctx)
        checks.append(prompt_check)
    model_check = check_model(cfg, Path(model_path), model_config)
    checks.append(model_check)
    if tokenizer is not None and data is not None:
        checks.append(check_tools(cfg, tokenizer, data, kind))
    plan, derived, machine, record = None, [], "", {}
    try:
        gpu_gib, machine = machine_for(cfg, gpu_inventory(), dry_run=dry_run)
    except ConfigError as e:
        checks.append(Check("memory", "FAIL", str(e)))
        gpu_gib = None
    if gpu_gib and model_check.status != "FAIL" and longest:
        shape = planner.ModelShape.from_config(model_config)
        plan, derived = derive(cfg, kind, ctx, longest, gpu_gib, shape)
        record = plan_record(plan, machine, gpu_gib, shape)
    if gpu_gib is not None:
        checks.append(check_memory(plan, machine) if plan is not None or not gpu_gib else
                      Check("memory", "warn", "not planned: it needs the checks above"))
    pre = Preflight(checks, data, plan, machine, derived, time.monotonic() - t0, record)
    if plan is not None and not pre.failed:
        apply_plan(cfg, derived)
    return pre


def plan_record(plan: planner.Plan, machine: str, gpu_gib: list[float], shape: planner.ModelShape) -> dict[str, Any]:
    mem = plan.learner
    return {"machine": machine, "gpu_gib": gpu_gib,
            "learner_peak_gib": round(mem.peak, 3) if mem else None,
            "learner_reserved_gib": round(mem.need, 3) if mem else None,
            "learner_parts_gib": ({k: round(getattr(mem, k), 3)
                                   for k in ("states", "reference", "activations", "logprob_head", "gathered")}
                                  if mem else None),
            "learner_micro_batch_tokens": mem.tokens if mem else None,
            "server_mem_fraction": plan.mem_fraction_static, "server_kv_tokens": plan.kv_tokens,
            "kv_tokens_needed": plan.kv_tokens_needed, "kv_bytes_per_token": shape.kv_bytes_per_token,
            "learner_gpus": plan.learner_gpus, "server_gpus": plan.server_gpus, "weight_sync": plan.weight_sync,
            "max_inflight_per_server": plan.max_inflight_per_server}


def find_key(tree: Any, key: str) -> Any:
    """The first value under `key` anywhere in a JSON tree (None if absent)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for v in tree:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


async def served_kv_tokens(sm: Any) -> list[int | None]:
    """Each server's KV pool in tokens (SGLang's max_total_num_tokens in GET /server_info)."""
    return [find_key(await sm.server_info(i), "max_total_num_tokens") for i in range(len(sm.urls))]


def plan_summary(run_dir: Path, rows: list[dict[str, Any]], kv_tokens: list[int | None]) -> dict[str, Any] | None:
    """plan.json with what the run measured: the learner's peak (learner/perf/peak_memory_gib, the highest of any
    step) and each server's KV pool. None when the run made no plan (CPU)."""
    p = run_dir / "plan.json"
    if not p.is_file():
        return None
    out = json.loads(p.read_text())
    peaks = [r["learner/perf/peak_memory_gib"] for r in rows if isinstance(r.get("learner/perf/peak_memory_gib"),
                                                                             (int, float))]
    reserved = [r["learner/perf/peak_reserved_gib"] for r in rows
                if isinstance(r.get("learner/perf/peak_reserved_gib"), (int, float))]
    out["measured"] = {"learner_peak_gib": max(peaks) if peaks else None,
                       "learner_reserved_gib": max(reserved) if reserved else None,
                       "server_kv_tokens": kv_tokens}
    return out


def say_lines(pre: Preflight, say: Callable[[str], None], header: str) -> None:
    say(f"{header} ({pre.seconds:.1f} s)")
    for line in pre.lines():
        say(line)


__all__ = ["Check", "Derived", "Preflight", "apply_plan", "derive", "gpu_inventory", "plan_summary",
           "run_preflight", "served_kv_tokens"]
