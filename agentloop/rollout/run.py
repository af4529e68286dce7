"""Eval-only rollouts: `agentloop rollout`. The engine against a frozen model, records + summary on disk."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agentloop.config import Config
from agentloop.data import load_samples
from agentloop.inference.serving import serving
from agentloop.loops import get_agent_loop, load_plugin
from agentloop.models.loading import load_tokenizer_for, resolve_model
from agentloop.rollout.engine import RolloutEngine, RolloutResult
from agentloop.rollout.scorer import Scorer
from agentloop.util.rundir import RecordWriter, make_run_dir, write_json
from agentloop.util.runtime import run_async


def load_plugins(cfg: Config) -> None:
    """Import the configured plugins, then register the tools of a verl tool config file if one is given."""
    for ref in cfg.plugins:
        load_plugin(ref)
    if cfg.tools.verl_tool_config:
        from agentloop.tools.verl_tools import load_verl_tool_config

        load_verl_tool_config(cfg.tools.verl_tool_config)


async def rollout_async(cfg: Config, run_dir: Path, progress: bool = True) -> RolloutResult:
    loop_cls = get_agent_loop(cfg.rollout.loop)
    samples = load_samples(cfg.data)
    scorer = Scorer(cfg, on_note=_note)  # fail on a bad custom reward before servers start
    model_path = resolve_model(cfg)
    tokenizer = load_tokenizer_for(cfg, model_path)
    print(f"agentloop rollout: {len(samples)} prompts x {cfg.rollout.n_samples} samples, loop "
          f"{cfg.rollout.loop}, model {model_path}, run dir {run_dir}", file=sys.stderr, flush=True)
    try:
        async with serving(cfg, model_path, run_dir) as sm:
            with RecordWriter(run_dir / "records.jsonl") as writer:
                engine = RolloutEngine(cfg, sm, tokenizer, loop_cls, scorer=scorer, progress=progress)
                result = await engine.run(samples, on_record=writer)
    finally:
        await scorer.close()
    summary = dict(result.summary)
    summary["run_dir"] = str(run_dir)
    summary["stopped"] = result.stopped
    try:
        write_json(run_dir / "summary.json", summary)
    except OSError as e:  # e.g. the disk that stopped the run: the summary is still printed
        _note(f"could not write {run_dir / 'summary.json'}: {e}")
        return result
    _write_traces(run_dir, result, tokenizer)
    return result


def _note(line: str) -> None:
    print(f"agentloop rollout: {line}", file=sys.stderr, flush=True)


def _write_traces(run_dir: Path, result: RolloutResult, tokenizer: Any) -> None:
    """traces.html for the first records; a rendering failure is reported, never fails the finished run."""
    from agentloop.report.trace_html import write_run_traces

    try:
        write_run_traces(run_dir, result.records, tokenizer)
    except Exception as e:  # noqa: BLE001 - the records and summary are already on disk
        print(f"agentloop rollout: could not write traces.html: {type(e).__name__}: {e}", file=sys.stderr)


def format_summary(summary: dict[str, Any]) -> str:
    keys = ["episodes", "errors", "reward_errors", "reward_timeouts", "mean_reward", "accuracy"] + sorted(k for k in summary if k.startswith("pass@")) + [
        "tokens_per_s", "episodes_per_s", "mean_response_tokens", "wall_s", "loop/lag_p99_ms",
        "server/prefix_cache_hit_rate", "server/retries", "server/latency_p50_s", "server/latency_p99_s"]
    lines = []
    for k in keys:
        v = summary.get(k)
        if v is None:
            continue
        lines.append(f"  {k:<30} {v:.4g}" if isinstance(v, float) else f"  {k:<30} {v}")
    if summary.get("errors_by_type"):
        lines.append(f"  {'errors_by_type':<30} {summary['errors_by_type']}")
    lines.append(f"  {'finish_reasons':<30} {summary.get('finish_reasons')}")
    return "\n".join(lines)


def run_rollout(cfg: Config, progress: bool = True) -> tuple[Path, RolloutResult]:
    load_plugins(cfg)
    run_dir = make_run_dir(cfg)
    result = run_async(rollout_async(cfg, run_dir, progress=progress))
    return run_dir, result
