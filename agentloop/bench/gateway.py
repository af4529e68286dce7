"""`agentloop bench gateway`: your agent through the gateway against tool_agent_loop, same workload, same server.

Every side runs the same episodes (the first `--bench-prompts` rows x `--bench-samples`, same seeds) on the
same server(s), sides taking turns within each round, the prefix cache flushed before each side:

    tool_agent_loop     the loop doing the tool turns itself (tools settings from the config)
    gateway_sdk         openai_agent_loop with `agent.entry` (default: the repository's
                        examples/calculator_agent.py, the calculator task on the OpenAI SDK): every model
                        turn is an HTTP request of the SDK to the gateway, in this process
    gateway_http        openai_agent_loop with `raw_http_agent`: the same agent without the SDK (aiohttp
                        JSON requests), so the gateway's own cost shows apart from the SDK's (the OpenAI SDK
                        spends ~3 ms of CPU per request building and parsing it, measured against a canned
                        gateway; the gateway and a plain client ~0.4 ms)

Reported per side: episodes/s and model tokens/s (wall clock of its rounds), this process's CPU seconds
per episode (the engine, the gateway and the agent share it), mean reward; then the ratio of episodes/s
of each gateway side to the tool loop's (target >= 0.9), and how many episodes came out token-identical
to the tool loop's (same prompt ids, response ids and mask; the server's seeded sampling makes that the
expected case when the agent does what the tool loop does).

Without --config it runs the main job's preset (agentloop/presets/rollout_main.yaml: the warm-started
tiny model on the calculator set, 3 turns at most), like `agentloop rollout`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from agentloop.config import Config
from agentloop.data import load_samples
from agentloop.errors import ConfigError
from agentloop.inference.serving import serving
from agentloop.loops import get_agent_loop
from agentloop.models.loading import load_tokenizer_for, resolve_model
from agentloop.records import EpisodeRecord, Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.tools.calculator import CalcError, CalculatorTool, calculate, format_number
from agentloop.util.rundir import RecordWriter

EXAMPLE_AGENT = Path(__file__).resolve().parents[2] / "examples" / "calculator_agent.py"
"""The default agent: the repository's SDK calculator agent (present in a source checkout)."""

SIDES = ("tool_agent_loop", "gateway_sdk", "gateway_http")
_TOOLS = [CalculatorTool().schema]
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=600)


def _calculator(arguments: str) -> str:
    try:
        return format_number(calculate(json.loads(arguments)["expression"]))
    except (CalcError, ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


async def raw_http_agent(sample: Sample, base_url: str, api_key: str) -> None:
    """examples/calculator_agent.py without the OpenAI SDK: the same requests as plain aiohttp JSON."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}, timeout=_REQUEST_TIMEOUT) as http:
        messages = list(sample.messages)
        for _ in range(3):
            async with http.post(f"{base_url}/chat/completions",
                                 json={"model": "policy", "messages": messages, "tools": _TOOLS}) as resp:
                body = await resp.json()
                resp.raise_for_status()
            message = body["choices"][0]["message"]
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": _calculator(call["function"]["arguments"])})


def _side(records: list[EpisodeRecord], wall_s: float, cpu_s: float) -> dict[str, Any]:
    episodes = [r for r in records if r.segment == 0]
    rewards = [r.reward for r in episodes if r.error is None and r.reward is not None]
    tokens = sum(r.num_model_tokens for r in records)
    return {"episodes": len(episodes), "errors": sum(r.error is not None for r in episodes), "wall_s": wall_s,
            "episodes_per_s": len(episodes) / wall_s if wall_s > 0 else 0.0,
            "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0, "cpu_s": cpu_s,
            "cpu_ms_per_episode": 1000 * cpu_s / max(1, len(episodes)),
            "turns_per_episode": sum(r.num_turns for r in records) / max(1, len(episodes)),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None}


def _identical(a: list[EpisodeRecord], b: list[EpisodeRecord]) -> int:
    key = {r.episode_id: (r.prompt_ids, r.response_ids, r.response_mask) for r in a if r.segment == 0}
    return sum(key.get(r.episode_id) == (r.prompt_ids, r.response_ids, r.response_mask) for r in b if r.segment == 0)


async def bench_gateway_async(cfg: Config, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    if not cfg.agent.entry and not cfg.agent.command:
        if not EXAMPLE_AGENT.is_file():
            raise ConfigError(f"no agent to bench: set agent.entry=path.py:fn (the default {EXAMPLE_AGENT} is "
                              "missing outside a source checkout)")
        cfg.agent.entry = f"{EXAMPLE_AGENT}:run"
    model_path = resolve_model(cfg)
    tokenizer = load_tokenizer_for(cfg, model_path)
    samples = load_samples(cfg.data.model_copy(update={"max_samples": args.bench_prompts}))
    http_cfg = cfg.model_copy(deep=True)
    http_cfg.agent.command, http_cfg.agent.entry = None, f"{__name__}:raw_http_agent"
    sides = {"tool_agent_loop": (cfg, get_agent_loop("tool_agent_loop")),
             "gateway_sdk": (cfg, get_agent_loop("openai_agent_loop")),
             "gateway_http": (http_cfg, get_agent_loop("openai_agent_loop"))}
    report: dict[str, Any] = {"model": str(model_path), "prompts": len(samples), "samples": args.bench_samples,
                              "rounds": args.bench_rounds, "agent": cfg.agent.entry or cfg.agent.command,
                              "max_concurrency": cfg.rollout.max_concurrency, "per_round": []}
    totals: dict[str, dict[str, Any]] = {s: {"wall": 0.0, "cpu": 0.0, "records": []} for s in SIDES}
    async with serving(cfg, model_path, run_dir) as sm:
        report["servers"] = list(sm.urls)
        for c, loop_cls in sides.values():  # warm-up (first requests allocate and compile, the gateway starts)
            await RolloutEngine(c, sm, tokenizer, loop_cls, progress=False).run(samples[:2], n_samples=1)
        last: dict[str, list[EpisodeRecord]] = {}
        for rnd in range(args.bench_rounds):
            row: dict[str, Any] = {"round": rnd}
            for side, (c, loop_cls) in sides.items():
                await sm.flush_cache()
                with RecordWriter(run_dir / f"records-{side}-round{rnd}.jsonl") as writer:
                    engine = RolloutEngine(c, sm, tokenizer, loop_cls, progress=False)
                    t0, c0 = time.perf_counter(), time.process_time()
                    res = await engine.run(samples, n_samples=args.bench_samples, on_record=writer)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                totals[side]["wall"] += wall
                totals[side]["cpu"] += cpu
                totals[side]["records"] += res.records
                last[side] = res.records
                row[side] = _side(res.records, wall, cpu)
                print(f"  round {rnd} {side:<16} {row[side]['episodes']} episodes in {wall:.2f}s "
                      f"({row[side]['episodes_per_s']:.2f}/s, cpu {row[side]['cpu_ms_per_episode']:.1f} ms/episode)",
                      file=sys.stderr, flush=True)
            for side in SIDES[1:]:
                row[f"ratio_{side}"] = row[side]["episodes_per_s"] / max(1e-9, row["tool_agent_loop"]["episodes_per_s"])
            report["per_round"].append(row)
    for side in SIDES:
        report[side] = _side(totals[side]["records"], totals[side]["wall"], totals[side]["cpu"])
    for side in SIDES[1:]:
        base = report["tool_agent_loop"]["episodes_per_s"]
        report[f"ratio_{side}"] = report[side]["episodes_per_s"] / max(1e-9, base)
        report[f"ratio_{side}_median_round"] = statistics.median(r[f"ratio_{side}"] for r in report["per_round"])
        report[f"identical_{side}"] = _identical(last["tool_agent_loop"], last[side])
    return report


def run_bench_gateway(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    from agentloop.bench.rollout import run_bench

    run_dir, report = run_bench(cfg, args, "gateway", bench_gateway_async)
    n = report["tool_agent_loop"]["episodes"] // max(1, report["rounds"])
    print(f"bench gateway ({report['prompts']} prompts x {report['samples']} samples = {n} episodes per side and "
          f"round, {report['rounds']} rounds alternating, concurrency {report['max_concurrency']}; agent "
          f"{report['agent']})")
    for side in SIDES:
        m = report[side]
        reward = "-" if m["mean_reward"] is None else f"{m['mean_reward']:.3f}"
        print(f"  {side:<16} {m['episodes_per_s']:7.2f} episodes/s  {m['tokens_per_s']:8.1f} tok/s  "
              f"cpu {m['cpu_ms_per_episode']:6.1f} ms/episode  turns {m['turns_per_episode']:.2f}  "
              f"errors {m['errors']}  reward {reward}")
    for side in SIDES[1:]:
        print(f"  ratio {side}/tool loop  {report[f'ratio_{side}']:.3f}  (target >= 0.9; median of rounds "
              f"{report[f'ratio_{side}_median_round']:.3f}); token-identical episodes "
              f"{report[f'identical_{side}']}/{n} (last round)")
    print(f"  report: {run_dir / 'bench_gateway.json'}")
    return report
