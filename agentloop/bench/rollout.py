"""`agentloop bench rollout`: engine overhead vs a bare aiohttp client, and episode capacity.

Two parts, each side by side with a bare client in one run, against the same server(s):

Throughput (`--bench-requests` per side, `--bench-concurrency` at once; 0 requests skips it):
  bare    a plain aiohttp loop: semaphore(C) + POST /generate, nothing else
  engine  RolloutEngine + ServerManager + a one-call loop, max_concurrency = C
Both send the same shape of requests (random prompt ids, ignore_eos, fixed new tokens); rounds
alternate bare/engine and the prefix cache is flushed before each side, each side gets fresh
prompts, so neither benefits from the other's cache. Reported: output tok/s of each and their ratio.

Capacity (`--bench-episodes` N in flight at once, 0 skips it): agentloop.bench.capacity. The real loops
(single_turn_agent_loop; tool_agent_loop with the calculator tool for `--bench-turns` turns) with N episodes in
flight, beside a bare client sending the same requests: episodes/s, engine/bare, event-loop lag p50/p99/max,
CPU, memory per in-flight episode, the machine's load.

Servers: the configured or launched SGLang ones, or with `--scripted-server` `--bench-servers` scripted ones
(agentloop.bench.scripted_server: SGLang's API, answers after `--bench-latency-s` +- `--bench-jitter`, tool calls
scripted), started in their own processes: a server that is never the bottleneck, to measure the engine alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from agentloop.config import Config, SamplingParams
from agentloop.inference.serving import serving
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.models.loading import load_tokenizer_for, resolve_model
from agentloop.records import AgentLoopOutput, Sample
from agentloop.rollout.engine import RolloutEngine
from agentloop.util.rundir import make_run_dir, write_json
from agentloop.util.runtime import run_async


class _BenchLoop(AgentLoopBase):
    """One generate call on the prompt ids carried in extra_info; reward 0 (no scoring cost)."""

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        prompt = sample.extra_info["prompt_ids"]
        traj = TrajectoryBuilder(prompt)
        traj.add_model(await self.server_manager.generate(sample.episode_id, prompt_ids=prompt,
                                                          sampling_params=sampling_params))
        return traj.build(reward=0.0)


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


async def _bare(urls: list[str], prompts: list[list[int]], sp: dict[str, Any], conc: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(conc)
    tokens = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int, ids: list[int]) -> None:
            nonlocal tokens
            async with sem:
                payload = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                           "logprob_start_len": -1}
                async with session.post(urls[i % len(urls)] + "/generate", json=payload,
                                        timeout=aiohttp.ClientTimeout(total=600)) as r:
                    body = await r.json(content_type=None)
                    tokens += len(body["meta_info"]["output_token_logprobs"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return tokens, time.perf_counter() - t0


async def _engine(cfg: Config, sm: Any, prompts: list[list[int]], conc: int) -> tuple[int, float, dict]:
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.max_concurrency = conc
    samples = [Sample(index=i, data_source="bench", messages=[{"role": "user", "content": ""}],
                      extra_info={"prompt_ids": p}) for i, p in enumerate(prompts)]
    engine = RolloutEngine(cfg, sm, tokenizer=None, loop_cls=_BenchLoop, progress=False)
    t0 = time.perf_counter()
    res = await engine.run(samples, n_samples=1)
    wall = time.perf_counter() - t0
    errors = [r.error for r in res.records if r.error]
    if errors:
        raise RuntimeError(f"engine side had {len(errors)} errors, first: {errors[0]}")
    return sum(r.num_model_tokens for r in res.records), wall, res.summary


@contextlib.asynccontextmanager
async def _servers(cfg: Config, args: argparse.Namespace, model_path: Path, run_dir: Path,
                   tokenizer: Any) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    """A started ServerManager over the bench's servers: `--scripted-server` ones (started here, in their own
    processes) or the configured / launched SGLang ones; and a description for the report."""
    if not args.scripted_server:
        async with serving(cfg, model_path, run_dir) as sm:
            yield sm, {"kind": "sglang", "urls": list(sm.urls)}
        return
    from agentloop.bench.capacity import scripted_turns
    from agentloop.bench.scripted_server import ScriptedProcess, ScriptedSpec
    from agentloop.server_manager import ServerManager

    spec = ScriptedSpec(**scripted_turns(tokenizer, args.bench_turns), vocab=len(tokenizer),
                        base_s=args.bench_latency_s, jitter=args.bench_jitter, cache_tokens=args.bench_cache_tokens)
    procs = [ScriptedProcess(spec) for _ in range(args.bench_servers)]
    try:
        for p in procs:
            await p.start()
        urls = [p.url for p in procs]
        async with ServerManager(urls, cfg.manager) as sm:
            yield sm, {"kind": "scripted", "urls": urls, "latency_s": args.bench_latency_s,
                       "jitter": args.bench_jitter, "cache_tokens": args.bench_cache_tokens}
    finally:
        for p in procs:
            await p.stop()


async def _throughput(cfg: Config, args: argparse.Namespace, sm: Any, vocab: int,
                      rng: random.Random) -> dict[str, Any]:
    """Rounds of bare vs engine output tok/s at `--bench-concurrency` (see the module docstring)."""
    new = args.bench_new_tokens
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    cfg = cfg.model_copy(deep=True)
    cfg.sampling = cfg.sampling.model_copy(update={"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0})
    report: dict[str, Any] = {"requests_per_side": args.bench_requests, "concurrency": args.bench_concurrency,
                              "prompt_tokens": args.bench_prompt_tokens, "new_tokens": new, "rounds": []}
    urls = sm.urls
    # warm-up (compiles, allocates) on both paths, not timed
    await _bare(urls, _prompts(8, args.bench_prompt_tokens, vocab, rng), sp.to_sglang(), 8)
    totals = {"bare": [0, 0.0], "engine": [0, 0.0]}
    for rnd in range(args.bench_rounds):
        row: dict[str, Any] = {"round": rnd}
        order = ("bare", "engine") if rnd % 2 == 0 else ("engine", "bare")
        for side in order:
            await sm.flush_cache()
            prompts = _prompts(args.bench_requests, args.bench_prompt_tokens, vocab, rng)
            if side == "bare":
                toks, wall = await _bare(urls, prompts, sp.to_sglang(), args.bench_concurrency)
            else:
                toks, wall, _ = await _engine(cfg, sm, prompts, args.bench_concurrency)
            row[f"{side}_tok_s"] = toks / wall
            totals[side][0] += toks
            totals[side][1] += wall
            print(f"  round {rnd} {side:<6} {toks} tokens in {wall:.2f}s = {toks / wall:,.0f} tok/s",
                  file=sys.stderr, flush=True)
        row["ratio"] = row["engine_tok_s"] / row["bare_tok_s"]
        report["rounds"].append(row)
    report["bare_tok_s"] = totals["bare"][0] / totals["bare"][1]
    report["engine_tok_s"] = totals["engine"][0] / totals["engine"][1]
    report["ratio"] = report["engine_tok_s"] / report["bare_tok_s"]
    return report


async def bench_async(cfg: Config, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from agentloop.bench.capacity import machine, run_capacity

    model_path = resolve_model(cfg)
    tokenizer = load_tokenizer_for(cfg, model_path)
    vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    rng = random.Random(cfg.rollout.seed)
    report: dict[str, Any] = {"machine": machine()}
    async with _servers(cfg, args, model_path, run_dir, tokenizer) as (sm, servers):
        report["servers"] = servers
        if args.bench_requests:
            report["throughput"] = await _throughput(cfg, args, sm, vocab, rng)
        if args.bench_episodes:
            report["capacity"] = await run_capacity(cfg, args, run_dir, sm, tokenizer, model_path)
    report["machine_end"] = machine()
    return report


def run_bench(cfg: Config, args: argparse.Namespace, name: str, bench: Any) -> tuple[Path, dict[str, Any]]:
    """Plugins, a run dir named `bench-<name>`, the async `bench(cfg, args, run_dir)`, its JSON report saved."""
    from agentloop.rollout.run import load_plugins

    load_plugins(cfg)
    cfg = cfg.model_copy(update={"name": f"bench-{name}"})
    run_dir = make_run_dir(cfg)
    report = run_async(bench(cfg, args, run_dir))
    write_json(run_dir / f"bench_{name}.json", report)
    if args.out:
        write_json(Path(args.out), report)
    return run_dir, report


def run_bench_rollout(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    from agentloop.bench.capacity import format_capacity

    run_dir, report = run_bench(cfg, args, "rollout", bench_async)
    m = report["machine"]
    print(f"bench rollout on {m.get('cpu', '?')} x{m['nproc']}, load average {m['loadavg'][0]:.1f} at the start, "
          f"{report['machine_end']['loadavg'][0]:.1f} at the end; servers: {report['servers']['kind']} "
          f"x{len(report['servers']['urls'])}")
    if "throughput" in report:
        t = report["throughput"]
        print(f"throughput ({t['requests_per_side']} requests/side, concurrency {t['concurrency']}, "
              f"{t['new_tokens']} new tokens, {len(t['rounds'])} rounds)")
        print(f"  bare aiohttp client   {t['bare_tok_s']:,.0f} tok/s")
        print(f"  agentloop engine      {t['engine_tok_s']:,.0f} tok/s")
        print(f"  ratio engine/bare     {t['ratio']:.3f}  (target >= 0.98)")
    if "capacity" in report:
        print(format_capacity(report["capacity"]))
    print(f"  report: {run_dir / 'bench_rollout.json'}")
    return report
