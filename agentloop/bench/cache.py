"""`agentloop bench cache`: prefix-cache reuse across servers with sticky routing (manager.sticky) vs without.

The same 3-turn tool episodes (tool_agent_loop, calculator, GRPO groups of 4) run against `--bench-servers`
servers, rounds alternating the order of the two sides; the servers' caches are flushed before each side, and
each side has its own ServerManager (its own counters):

    sticky      manager.sticky=true: every turn of an episode goes to the server that ran its first turn
    not sticky  manager.sticky=false: every request to the least-loaded server

Hit rate = cached prompt tokens / prompt tokens. Two readings: `all` (every request, as the servers' answers
report it: SGLang's meta_info.cached_tokens, so this works on real servers too) and `later turns` (requests after
an episode's first turn, whose prefix its earlier turns put in some server's cache: what sticky routing can
reuse). The second needs the servers to say which requests are later turns: the scripted servers do (/stats).

CPU: `--scripted-server` starts scripted SGLang servers (agentloop.bench.scripted_server) that model SGLang's
radix cache (a radix tree of token ids, LRU eviction, a capacity of `--bench-cache-tokens` tokens each), not
real ones. Their answers are scripted: turns 1..n-1 call the calculator, the last one answers; each turn starts
with `--bench-think-tokens` tokens drawn from the request's sampling seed, so two episodes (siblings of a GRPO
group too) share no more than their prompt, as sampled episodes do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import aiohttp

from agentloop.config import Config

SIDES = ("sticky", "not_sticky")


async def _stats(urls: list[str]) -> list[dict[str, Any]] | None:
    """Each scripted server's /stats (None: a server that does not have it, e.g. real SGLang)."""
    out = []
    async with aiohttp.ClientSession() as s:
        for u in urls:
            try:
                async with s.get(u + "/stats", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status != 200:
                        return None
                    out.append(await r.json(content_type=None))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None
    return out


def _diff(after: list[dict[str, Any]] | None, before: list[dict[str, Any]] | None) -> dict[str, float] | None:
    if after is None or before is None:
        return None
    keys = ("requests", "prompt_tokens", "cached_tokens", "later_turn_requests", "later_turn_prompt_tokens",
            "later_turn_cached_tokens")
    return {k: float(sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before))) for k in keys}


async def bench_cache_async(cfg: Config, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from agentloop.bench.capacity import bench_rows, machine, scripted_turns
    from agentloop.bench.forced import forced_parser
    from agentloop.bench.scripted_server import ScriptedProcess, ScriptedSpec
    from agentloop.data import rows_to_samples
    from agentloop.inference.serving import serving
    from agentloop.loops import get_agent_loop
    from agentloop.models.loading import load_tokenizer_for, resolve_model
    from agentloop.rollout.engine import RolloutEngine
    from agentloop.server_manager import ServerManager
    from agentloop.tools.parsers import register_parser

    model_path = resolve_model(cfg)
    tokenizer = load_tokenizer_for(cfg, model_path)
    n, group = args.bench_episodes, 4
    base = cfg.model_copy(deep=True)
    base.rollout.loop = "tool_agent_loop"
    base.rollout.max_concurrency = n
    base.rollout.n_samples = group
    base.tools.max_turns = args.bench_turns
    base.tools.max_tokens_per_turn = 64 + getattr(args, "bench_think_tokens", 0)
    if not args.scripted_server:
        register_parser("bench_forced_calculator", forced_parser("calculator"), override=True)
        base.tools.parser = "bench_forced_calculator"
    loop_cls = get_agent_loop("tool_agent_loop")
    report: dict[str, Any] = {"machine": machine(), "episodes": n, "group": group, "turns": args.bench_turns,
                              "servers": args.bench_servers if args.scripted_server else None, "rounds": []}
    async with contextlib.AsyncExitStack() as stack:
        if args.scripted_server:
            # each turn starts with seeded tokens: episodes diverge after their first turn, as sampled ones do
            think = list(tokenizer.encode(" Let me think about which numbers to multiply and add first.",
                                          add_special_tokens=False))
            spec = ScriptedSpec(**scripted_turns(tokenizer, args.bench_turns), vocab=len(tokenizer),
                                base_s=args.bench_latency_s, jitter=args.bench_jitter,
                                cache_tokens=args.bench_cache_tokens, think_ids=think,
                                think_tokens=args.bench_think_tokens)
            urls = []
            for _ in range(args.bench_servers):
                p = ScriptedProcess(spec)
                stack.push_async_callback(p.stop)
                await p.start()
                urls.append(p.url)
            report["server_kind"] = (f"scripted x{len(urls)} (a model of SGLang's radix cache, "
                                     f"{args.bench_cache_tokens} tokens each)")
        else:
            urls = list((await stack.enter_async_context(serving(cfg, model_path, run_dir))).urls)
            report["server_kind"] = f"sglang x{len(urls)}"
        report["urls"] = urls
        for rnd in range(args.bench_rounds):
            samples = rows_to_samples(bench_rows(max(1, n // group), 3000 + rnd), source="bench")
            row: dict[str, Any] = {"round": rnd}
            for side in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
                mcfg = base.manager.model_copy(update={"sticky": side == "sticky",
                                                       "max_inflight_per_server": max(n, 1)})
                async with ServerManager(urls, mcfg) as sm:
                    await sm.flush_cache()
                    before = await _stats(urls)
                    t0 = time.perf_counter()
                    res = await RolloutEngine(base, sm, tokenizer, loop_cls, progress=False).run(samples)
                    wall = time.perf_counter() - t0
                    g = sm.gauges()
                    d = _diff(await _stats(urls), before)
                row[side] = m = {
                    "episodes": len(res.records), "errors": sum(r.error is not None for r in res.records),
                    "wall_s": wall,
                    "turns_per_episode": sum(r.num_turns for r in res.records) / max(1, len(res.records)),
                    "hit_rate_all": g["server/prefix_cache_hit_rate"],
                    "hit_rate_later_turns": (d["later_turn_cached_tokens"] / d["later_turn_prompt_tokens"]
                                             if d and d["later_turn_prompt_tokens"] else None),
                    "server_stats": d}
                later = "-" if m["hit_rate_later_turns"] is None else f"{100 * m['hit_rate_later_turns']:.1f}%"
                print(f"  round {rnd} {side:<10} {m['episodes']} episodes ({m['errors']} errors, "
                      f"{m['turns_per_episode']:.2f} turns each) in {wall:.1f}s; hit rate all "
                      f"{100 * m['hit_rate_all']:.1f}%, later turns {later}", file=sys.stderr, flush=True)
            report["rounds"].append(row)
    report["median"] = {}
    for side in SIDES:
        rows = [r[side] for r in report["rounds"]]
        later = [x["hit_rate_later_turns"] for x in rows if x["hit_rate_later_turns"] is not None]
        report["median"][side] = {"hit_rate_all": median(x["hit_rate_all"] for x in rows),
                                  "hit_rate_later_turns": median(later) if later else None,
                                  "errors": sum(x["errors"] for x in rows)}
    report["machine_end"] = machine()
    return report


def format_cache(report: dict[str, Any]) -> str:
    lines = [f"bench cache: {report['episodes']} tool_agent_loop episodes ({report['turns']} turns max, groups of "
             f"{report['group']}) on {report['server_kind']}; medians of {len(report['rounds'])} rounds",
             f"  {'routing':<11} {'hit rate, all':>14} {'hit rate, later turns':>22} {'errors':>6}"]
    for side in SIDES:
        m = report["median"][side]
        later = "-" if m["hit_rate_later_turns"] is None else f"{100 * m['hit_rate_later_turns']:.1f}%"
        lines.append(f"  {side:<11} {100 * m['hit_rate_all']:>13.1f}% {later:>22} {m['errors']:>6}")
    return "\n".join(lines)


def run_bench_cache(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    from agentloop.bench.rollout import run_bench

    run_dir, report = run_bench(cfg, args, "cache", bench_cache_async)
    print(format_cache(report))
    print(f"  report: {run_dir / 'bench_cache.json'}")
    return report
