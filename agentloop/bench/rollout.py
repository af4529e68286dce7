"""`agentloop bench rollout`: engine overhead vs a bare aiohttp client, and episode capacity.

Side by side in one run, against the same server(s):
  bare    a plain aiohttp loop: semaphore(C) + POST /generate, nothing else
  engine  RolloutEngine + ServerManager + a one-call loop, max_concurrency = C
Both send the same shape of requests (random prompt ids, ignore_eos, fixed new tokens); rounds
alternate bare/engine and the prefix cache is flushed before each side, each side gets fresh
prompts, so neither benefits from the other's cache. Reported: output tok/s of each and their
ratio (target >= 0.95), then a capacity test: `--bench-episodes` episodes admitted at once
(max_concurrency = that number) with event-loop lag p99 and the process's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from agentloop.config import Config, SamplingParams
from agentloop.inference.serving import serving
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.models.loading import resolve_model
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


def _rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


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


async def bench_async(cfg: Config, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    model_path = resolve_model(cfg)
    import json

    vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    rng = random.Random(cfg.rollout.seed)
    new = args.bench_new_tokens
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    cfg = cfg.model_copy(deep=True)
    cfg.sampling = cfg.sampling.model_copy(update={"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0})
    report: dict[str, Any] = {"requests_per_side": args.bench_requests, "concurrency": args.bench_concurrency,
                              "prompt_tokens": args.bench_prompt_tokens, "new_tokens": new, "rounds": []}
    async with serving(cfg, model_path, run_dir) as sm:
        urls = sm.urls
        report["servers"] = urls
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
        if args.bench_episodes:
            await sm.flush_cache()
            rss0 = _rss_mb()
            cap_prompts = _prompts(args.bench_episodes, 16, vocab, rng)
            cfg_cap = cfg.model_copy(deep=True)
            cfg_cap.sampling = cfg_cap.sampling.model_copy(update={"max_new_tokens": 4})
            cfg_cap.manager = cfg_cap.manager.model_copy(
                update={"max_inflight_per_server": max(cfg.manager.max_inflight_per_server, args.bench_episodes)})
            toks, wall, summary = await _engine(cfg_cap, sm, cap_prompts, args.bench_episodes)
            report["capacity"] = {
                "episodes_in_flight": args.bench_episodes,
                "completed": summary["episodes"], "errors": summary["errors"], "wall_s": wall,
                "episodes_per_s": summary["episodes"] / wall,
                "loop_lag_p99_ms": summary["loop/lag_p99_ms"], "loop_lag_max_ms": summary["loop/lag_max_ms"],
                "rss_mb_before": rss0, "rss_mb_after": _rss_mb(),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
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
    run_dir, report = run_bench(cfg, args, "rollout", bench_async)
    print(f"bench rollout ({report['requests_per_side']} requests/side, concurrency {report['concurrency']}, "
          f"{report['new_tokens']} new tokens, {len(report['rounds'])} rounds)")
    print(f"  bare aiohttp client   {report['bare_tok_s']:,.0f} tok/s")
    print(f"  agentloop engine      {report['engine_tok_s']:,.0f} tok/s")
    print(f"  ratio engine/bare     {report['ratio']:.3f}  (target >= 0.95)")
    if "capacity" in report:
        c = report["capacity"]
        print(f"  capacity: {c['completed']}/{c['episodes_in_flight']} episodes in flight at once, "
              f"{c['errors']} errors, loop lag p99 {c['loop_lag_p99_ms']:.1f} ms, "
              f"RSS {c['rss_mb_before']:.0f} -> {c['rss_mb_after']:.0f} MB")
    print(f"  report: {run_dir / 'bench_rollout.json'}")
    return report
