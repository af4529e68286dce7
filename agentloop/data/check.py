"""`agentloop data check FILE`: what is wrong with a verl data file, row by row (every problem, not the first).

Errors make a row unusable or silently wrong; warnings name things that work differently from verl.

    structure       a JSON object; data_source a non-empty string; the prompt a non-empty list of
                    {role, content}; reward_model a dict; extra_info a dict; tools_kwargs a dict per tool
    reward          a reward is registered for the data_source (warning: reward.custom / reward.default may
                    cover it); verl's own names that are not ours to score ("math") and our names that
                    verl rejects ("gsm8k") are named
    ground truth    by data_source: openai/gsm8k a string that verl's rule can match (`#### <gt>` scores 1;
                    an int or "1,234" never does); countdown {target: int, numbers: [int]}; Search-R1's
                    names {target: [str]}; MATH names a string; agentloop/code {"tests": [...]} (or its JSON)
    tools           tools_kwargs names registered tools or tools of the verl tool config given with
                    --tools-config (warning: a plugin may register them later); verl's searchR1_* rows without
                    verl's search tool config are named; `tools` says per data_source which tools its rows
                    are offered (a verl config's tools: every row) and which their tools_kwargs name
    verl only       a top-level agent_name (verl picks the loop per row; here rollout.loop picks it per run)

    check_rows / check_file   -> CheckReport (problems, rows, data sources); format_report -> text lines
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from agentloop.data.loader import _check_messages
from agentloop.errors import DataError

Level = Literal["error", "warning"]


class Problem(BaseModel):
    """One thing wrong with one row."""

    where: str
    """File and row (or line) it was found at."""
    level: Level
    """error: the row is unusable or scores wrong; warning: it works, differently from verl or maybe not at all."""
    message: str
    """What is wrong and what to do about it."""


class CheckReport(BaseModel):
    """Everything `check_file` found."""

    rows: int = 0
    """Rows read."""
    problems: list[Problem] = Field(default_factory=list)
    """Every problem, in file order."""
    data_sources: dict[str, int] = Field(default_factory=dict)
    """Rows per data_source."""
    tools: dict[str, dict[str, int]] = Field(default_factory=dict)
    """Per data_source: tool name -> rows that can call it (the verl tool config's tools: every row; other
    tools: rows whose tools_kwargs name them)."""
    verl_tools: list[str] = Field(default_factory=list)
    """The verl tool config's tools, one line each (name, class, implementation), when one was given."""

    @property
    def errors(self) -> int:
        return sum(p.level == "error" for p in self.problems)

    @property
    def warnings(self) -> int:
        return sum(p.level == "warning" for p in self.problems)


_VERL_ONLY = {"math": "verl scores data_source 'math' with its DAPO reward, which agentloop does not have; "
                      "use 'lighteval/MATH' (verl's MATH rules) or 'agentloop/math' (ours)"}
_OURS_NOT_VERLS = {"gsm8k": "verl has no reward for 'gsm8k' (its GSM8K name is 'openai/gsm8k'); here 'gsm8k' is "
                            "our lenient GSM8K reward (agentloop/gsm8k)"}
_LOOP_NAMES = {"tool_agent": "tool_agent_loop", "single_turn_agent": "single_turn_agent_loop"}


def _gsm8k_truth(gt: Any) -> str | None:
    from agentloop.rewards.verl_gsm8k import verl_gsm8k_score

    if not isinstance(gt, str):
        return (f"ground truth {gt!r} is a {type(gt).__name__}: verl compares the extracted answer as a STRING, "
                f"so no answer ever matches; write it as a string ({str(gt)!r})")
    if verl_gsm8k_score("#### " + gt, gt) != 1.0:
        return (f"ground truth {gt!r} cannot be matched by verl's rule (`#### ` + digits, dots, commas, "
                "with commas removed); write the bare number, e.g. '1234'")
    return None


def _countdown_truth(gt: Any) -> str | None:
    ok = (isinstance(gt, dict) and isinstance(gt.get("target"), int) and isinstance(gt.get("numbers"), list)
          and gt["numbers"] and all(isinstance(n, int) for n in gt["numbers"]))
    return None if ok else f"countdown ground truth must be {{'target': int, 'numbers': [int, ...]}}, got {gt!r}"


def _qa_truth(gt: Any) -> str | None:
    target = gt.get("target") if isinstance(gt, dict) else None
    if isinstance(target, str) or (isinstance(target, list) and target and all(isinstance(t, str) for t in target)):
        return None
    return f"Search-R1 ground truth must be {{'target': [answers]}}, got {gt!r}"


def _string_truth(gt: Any) -> str | None:
    return None if isinstance(gt, str) else f"ground truth must be a string (verl's MATH rules compare strings), got {gt!r}"


def _code_truth(gt: Any) -> str | None:
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError:
            return "code ground truth is a string but not JSON"
    if isinstance(gt, dict) and isinstance(gt.get("tests"), list) and gt["tests"]:
        return None
    return f"code ground truth must be {{'entry_point': ..., 'tests': [...]}} or {{'tests': [{{stdin, stdout}}]}}, got {str(gt)[:80]}"


def _truth_rule(data_source: str):
    from agentloop.rewards.search_r1_qa import SEARCH_R1_SOURCES, VERL_SEARCH_R1_SOURCES
    from agentloop.rewards.verl_math import VERL_MATH_SOURCES

    if data_source == "openai/gsm8k":
        return _gsm8k_truth
    if data_source in ("countdown", "agentloop/countdown"):
        return _countdown_truth
    if data_source in SEARCH_R1_SOURCES or data_source in VERL_SEARCH_R1_SOURCES or data_source == "agentloop/search_qa":
        return _qa_truth
    if data_source in VERL_MATH_SOURCES:
        return _string_truth
    if data_source == "agentloop/code":
        return _code_truth
    return None


class Unreadable:
    """A row that could not be read (bad JSON or UTF-8): checked as one error."""

    def __init__(self, reason: str):
        self.reason = reason


def _tools_kwargs(row: Any) -> dict | None:
    if not isinstance(row, dict):
        return None
    kw = row.get("tools_kwargs")
    extra = row.get("extra_info")
    if kw is None and isinstance(extra, dict):
        kw = extra.get("tools_kwargs")
    return kw if isinstance(kw, dict) else None


def check_row(row: Any, where: str, prompt_key: str = "prompt",
              verl_tools: Iterable[str] = ()) -> tuple[str | None, list[Problem]]:
    """(data_source or None, problems) of one row; `verl_tools`: the names of a verl tool config's tools."""
    from agentloop.rewards import list_rewards
    from agentloop.tools import list_tools

    verl_tools = set(verl_tools)

    out: list[Problem] = []

    def err(msg: str) -> None:
        out.append(Problem(where=where, level="error", message=msg))

    def warn(msg: str) -> None:
        out.append(Problem(where=where, level="warning", message=msg))

    if isinstance(row, Unreadable):
        err(row.reason)
        return None, out
    if not isinstance(row, dict):
        err(f"a row must be a JSON object, got {type(row).__name__}")
        return None, out
    ds = row.get("data_source")
    if not isinstance(ds, str) or not ds:
        err("missing 'data_source'" if ds is None else f"'data_source' must be a non-empty string, got {ds!r}")
        ds = None
    if prompt_key not in row:
        err(f"missing {prompt_key!r} (the chat messages)")
    else:
        try:
            _check_messages(row[prompt_key], prompt_key)
        except ValueError as e:
            err(str(e))
    rm = row.get("reward_model")
    gt = None
    if rm is not None and not isinstance(rm, dict):
        err(f"'reward_model' must be a dict with 'ground_truth', got {type(rm).__name__}")
    elif rm is None or rm.get("ground_truth") is None:
        warn("no reward_model.ground_truth: rule rewards get None")
    else:
        gt = rm["ground_truth"]
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        err(f"'extra_info' must be a dict, got {type(extra).__name__}")
        extra = None
    tools_kwargs = row.get("tools_kwargs")
    if tools_kwargs is None and extra:
        tools_kwargs = extra.get("tools_kwargs")
    if tools_kwargs is not None:
        if not isinstance(tools_kwargs, dict):
            err(f"tools_kwargs must be a dict keyed by tool name, got {type(tools_kwargs).__name__}")
        else:
            known = set(list_tools()) | verl_tools
            for name, kw in tools_kwargs.items():
                if kw is not None and not isinstance(kw, dict):
                    err(f"tools_kwargs[{name!r}] must be a dict, got {type(kw).__name__}")
                elif kw is not None and name not in known:
                    warn(f"tools_kwargs names tool {name!r}, which is not registered (registered: {sorted(known)}); "
                         "register it in a plugin or load it with tools.verl_tool_config")
                elif name in verl_tools and kw and not isinstance(kw.get("create_kwargs"), dict):
                    warn(f"tools_kwargs[{name!r}] has no 'create_kwargs' dict: verl (and agentloop with a verl tool "
                         "config) passes only tools_kwargs[name]['create_kwargs'] to the tool's create(), so it "
                         "gets {}")
            if (isinstance(ds, str) and ds.startswith("searchR1_") and "search" in tools_kwargs
                    and "search" not in verl_tools):
                warn("a searchR1_* row calls verl's `search` tool (argument query_list); without verl's search tool "
                     "config (--tools-config / tools.verl_tool_config) it binds to agentloop's built-in `search` "
                     "(argument query), which refuses verl's calls")
    elif extra and extra.get("need_tools_kwargs"):
        warn("extra_info.need_tools_kwargs is true but the row has no tools_kwargs")
    agent = row.get("agent_name")
    if agent is not None:
        ours = _LOOP_NAMES.get(agent, agent)
        warn(f"agent_name {agent!r} is verl's per-row loop choice; agentloop runs one loop per run: set "
             f"rollout.loop={ours}")
    if ds is not None:
        if ds in _VERL_ONLY:
            warn(_VERL_ONLY[ds])
        elif ds in _OURS_NOT_VERLS:
            warn(_OURS_NOT_VERLS[ds])
        if ds not in set(list_rewards()):
            warn(f"no reward is registered for data_source {ds!r} (verl would raise NotImplementedError); set "
                 "reward.custom or reward.default, or register one in a plugin")
        rule = _truth_rule(ds)
        if rule is not None and gt is not None:
            msg = rule(gt)
            if msg:
                err(msg)
    return ds, out


def check_rows(rows: Iterable[tuple[str, Any]], prompt_key: str = "prompt",
               verl_tools: Iterable[str] = ()) -> CheckReport:
    """Check (where, row) pairs; `verl_tools`: a verl tool config's tool names (offered to every row)."""
    report = CheckReport()
    verl_tools = list(verl_tools)
    sources: Counter[str] = Counter()
    callable_by: dict[str, Counter[str]] = {}
    for where, row in rows:
        report.rows += 1
        ds, problems = check_row(row, where, prompt_key, verl_tools)
        if ds:
            sources[ds] += 1
            kw = _tools_kwargs(row) or {}
            names = verl_tools + [n for n in kw if n not in verl_tools]
            if names:
                callable_by.setdefault(ds, Counter()).update(names)
        report.problems.extend(problems)
    report.data_sources = dict(sources)
    report.tools = {ds: dict(c) for ds, c in callable_by.items()}
    return report


def check_file(path: str | Path, prompt_key: str = "prompt", tools_config: str | Path | None = None) -> CheckReport:
    """Check every row of a verl .jsonl / .parquet file (an unreadable line is reported and skipped);
    `tools_config`: verl's tool config file (loaded as `tools.verl_tool_config` loads it)."""
    from agentloop.data.loader import (
        JSONL_SUFFIXES,
        PARQUET_SUFFIXES,
        read_parquet_rows,
        to_plain,
    )

    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: data file does not exist")
    entries = []
    if tools_config is not None:
        from agentloop.tools.verl_tools import verl_tool_entries

        entries = verl_tool_entries(tools_config)
    names = [e.name for e in entries]
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        report = check_rows(_jsonl_rows_tolerant(p), prompt_key, names)
    elif suffix in PARQUET_SUFFIXES:
        report = check_rows(((w, to_plain(r)) for w, r in read_parquet_rows(p)), prompt_key, names)
    else:
        raise DataError(f"{p}: unknown extension {p.suffix!r}; expected .jsonl or .parquet")
    report.verl_tools = [
        f"{e.name}: {e.class_name}" + ("" if e.implementation == e.class_name else
                                       f" (verl is not installed: agentloop's port {e.implementation})")
        for e in entries]
    if report.rows == 0:
        report.problems.append(Problem(where=str(p), level="error", message="no rows"))
    return report


def _jsonl_rows_tolerant(p: Path):
    """(where, row) per non-blank line; a line that cannot be read comes as an Unreadable row."""
    with p.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield where, Unreadable(f"not UTF-8 text ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, Unreadable(f"invalid JSON ({e.msg} at column {e.colno})")


def format_report(report: CheckReport, path: str, limit: int | None = 50) -> list[str]:
    """Human-readable lines: each problem (up to `limit`), the tools each data_source's rows can call, then a
    summary line."""
    lines = [f"{p.where}: {p.level}: {p.message}" for p in report.problems[:limit]]
    if limit is not None and len(report.problems) > limit:
        lines.append(f"... {len(report.problems) - limit} more problems (--max-problems 0 shows all)")
    if report.verl_tools:
        lines.append("verl tool config, offered to every row: " + "; ".join(report.verl_tools))
    for ds, tools in report.tools.items():
        n = report.data_sources.get(ds, 0)
        said = ", ".join(f"{t} ({c} of {n} rows)" if c != n else f"{t} (all {n} rows)" for t, c in tools.items())
        lines.append(f"  {ds}: rows can call {said}")
    bad_rows = len({p.where for p in report.problems if p.level == "error"})
    lines.append(f"{path}: {report.rows} rows, {report.errors} errors in {bad_rows} rows, {report.warnings} warnings; "
                 f"data sources: {report.data_sources}")
    return lines
