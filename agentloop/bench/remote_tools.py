"""`agentloop bench tools --remote`: tool_agent_loop with its tools in this process vs on a tool service.

The same episodes on both sides (calculator rows, GRPO groups of 4, `--bench-episodes` in flight at once and in
all), rounds alternating the order: `local` (tools in this process) and `remote` (`tools.server_url`: the given
`--tool-server-url`, else one `agentloop tools serve` started here in its own process, on this machine).
LLM servers: the configured / launched SGLang ones (every turn read as a calculator call by the bench parser), or
with `--scripted-server` a scripted server whose answers call the calculator on every turn but the last.
Reported per side (medians over rounds): episodes/s, time in tools (summed calls, per call and as a share of
episode time), tool errors, and whether every episode's tokens and tool messages were the same on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from statistics import median
from typing import Any

from agentloop.config import Config


@contextlib.asynccontextmanager
async def tool_service_process(cfg: Config, timeout_s: float = 120.0) -> AsyncIterator[str]:
    """`agentloop tools serve --port 0` (with the run's plugins) in a child process; yields its URL."""
    argv = [sys.executable, "-m", "agentloop.cli", "tools", "serve", "--port", "0"]
    for p in cfg.plugins:
        argv += ["--plugin", p]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout_s)).decode()
        if "serving" not in line:
            err = (await asyncio.wait_for(proc.stderr.read(), 10)).decode()
            raise RuntimeError(f"the tool service did not start: {line!r} {err[-2000:]}")
        yield line.rsplit(" on ", 1)[1].split()[0]
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


def _side_metrics(records: list[Any], wall: float) -> dict[str, Any]:
    n = len(records)
    calls = sum(r.metrics.get("tool_calls", 0.0) for r in records)
    tool_s = sum(r.metrics.get("tool_time_s", 0.0) for r in records)
    ep_s = sum(r.wall_s for r in records)
    return {"episodes": n, "errors": sum(r.error is not None for r in records), "wall_s": wall,
            "episodes_per_s": n / wall if wall > 0 else 0.0, "tool_calls": calls,
            "tool_errors": sum(r.metrics.get("tool_errors", 0.0) for r in records),
            "tool_time_s": tool_s, "tool_ms_per_call": 1000 * tool_s / calls if calls else 0.0,
            "tool_share": tool_s / ep_s if ep_s > 0 else 0.0}


def _fingerprint(records: list[Any]) -> dict[str, Any]:
    return {r.episode_id: (r.response_ids, r.response_mask,
                           [m["content"] for m in r.extra.get("messages", []) if m.get("role") == "tool"])
            for r in records}


async def bench_remote_async(cfg: Config, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from agentloop.bench.capacity import bench_rows, machine
    from agentloop.bench.forced import forced_parser
    from agentloop.bench.rollout import _servers
    from agentloop.data import rows_to_samples
    from agentloop.loops import get_agent_loop
    from agentloop.models.loading import load_tokenizer_for, resolve_model
    from agentloop.rollout.engine import RolloutEngine
    from agentloop.tools.parsers import register_parser

    model_path = resolve_model(cfg)
    tokenizer = load_tokenizer_for(cfg, model_path)
    n, group = args.bench_episodes, 4
    base = cfg.model_copy(deep=True)
    base.rollout.max_concurrency = n
    base.rollout.n_samples = group
    base.manager.max_inflight_per_server = max(n, 1)
    base.tools.max_turns = args.bench_turns
    base.tools.max_tokens_per_turn = 64
    if not args.scripted_server:
        register_parser("bench_forced_calculator", forced_parser("calculator"), override=True)
        base.tools.parser = "bench_forced_calculator"
    loop_cls = get_agent_loop("tool_agent_loop")
    report: dict[str, Any] = {"machine": machine(), "episodes_in_flight": n, "group": group, "turns": args.bench_turns,
                              "rounds": []}
    async with contextlib.AsyncExitStack() as stack:
        sm, servers = await stack.enter_async_context(_servers(cfg, args, model_path, run_dir, tokenizer))
        urls = list(cfg.tools.server_url)
        if not urls:
            urls = [await stack.enter_async_context(tool_service_process(cfg))]
        report["servers"], report["tool_servers"] = servers, urls
        sides = {"local": base.model_copy(deep=True), "remote": base.model_copy(deep=True)}
        sides["local"].tools.server_url = []
        sides["remote"].tools.server_url = urls
        # untimed warm-up of both paths (template measured, connections, the service's catalog)
        for c in sides.values():
            await RolloutEngine(c, sm, tokenizer, loop_cls, progress=False).run(
                rows_to_samples(bench_rows(1, 7), source="warm-up"), n_samples=1)
        for rnd in range(args.bench_rounds):
            samples = rows_to_samples(bench_rows(max(1, n // group), 2000 + rnd), source="bench")
            row: dict[str, Any] = {"round": rnd}
            prints = {}
            for side in (("local", "remote") if rnd % 2 == 0 else ("remote", "local")):
                await sm.flush_cache()
                engine = RolloutEngine(sides[side], sm, tokenizer, loop_cls, progress=False)
                t0 = time.perf_counter()
                res = await engine.run(samples)
                row[side] = m = _side_metrics(res.records, time.perf_counter() - t0)
                m["lag_p99_ms"] = res.summary.get("loop/lag_p99_ms", float("nan"))
                prints[side] = _fingerprint(res.records)
                print(f"  round {rnd} {side:<6} {m['episodes']} episodes ({m['errors']} errors, {m['tool_errors']:.0f} "
                      f"tool errors) in {m['wall_s']:.1f}s = {m['episodes_per_s']:.1f}/s; "
                      f"tools {m['tool_ms_per_call']:.2f} "
                      f"ms per call, {100 * m['tool_share']:.1f}% of episode time", file=sys.stderr, flush=True)
            row["same_records"] = prints["local"] == prints["remote"]
            row["ratio"] = row["remote"]["episodes_per_s"] / row["local"]["episodes_per_s"]
            report["rounds"].append(row)
    report["median"] = {side: {k: median(r[side][k] for r in report["rounds"]) for k in (
        "episodes_per_s", "wall_s", "tool_ms_per_call", "tool_share", "lag_p99_ms")} for side in ("local", "remote")}
    for side in ("local", "remote"):
        report["median"][side]["errors"] = sum(r[side]["errors"] for r in report["rounds"])
        report["median"][side]["tool_errors"] = sum(r[side]["tool_errors"] for r in report["rounds"])
    report["median"]["ratio"] = median(r["ratio"] for r in report["rounds"])
    report["same_records"] = all(r["same_records"] for r in report["rounds"])
    report["machine_end"] = machine()
    return report


def format_remote(report: dict[str, Any]) -> str:
    med = report["median"]
    lines = [f"bench tools --remote: {report['episodes_in_flight']} tool_agent_loop episodes in flight "
             f"({report['turns']} "
             f"turns max, calculator), servers {report['servers']['kind']}, tool service(s) "
             f"{', '.join(report['tool_servers'])}; medians of {len(report['rounds'])} rounds",
             f"  {'side':<7} {'ep/s':>7} {'wall s':>7} {'ms/call':>8} {'tool %':>7} {'lag p99 ms':>10} {'errors':>6} "
             f"{'tool errors':>11}"]
    for side in ("local", "remote"):
        m = med[side]
        lines.append(f"  {side:<7} {m['episodes_per_s']:>7.1f} {m['wall_s']:>7.1f} {m['tool_ms_per_call']:>8.2f} "
                     f"{100 * m['tool_share']:>7.1f} {m['lag_p99_ms']:>10.1f} {m['errors']:>6} "
                     f"{m['tool_errors']:>11.0f}")
    lines.append(f"  remote/local episodes/s {med['ratio']:.3f}; records (tokens, masks, tool messages) the same on "
                 f"both sides: {report['same_records']}")
    return "\n".join(lines)
