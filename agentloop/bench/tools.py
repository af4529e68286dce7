"""`agentloop bench tools`: the tool loop against the single-turn loop, same prompts, same server(s).

For each built-in set in `--bench-sets` (default calculator and code), the first `--bench-prompts`
rows x `--bench-samples` episodes run twice, prefix cache flushed before each side:

    tool_agent_loop   the rows' tools enabled (tools settings from the config)
    single_turn       single_turn_agent_loop, timed around its one generate call

Reported per side: episodes/s and model tokens/s (wall clock of the side), turns and tool calls per
episode, and where the episodes' time went: tool_time_s and gen_time_s summed from the records'
metrics, each as a fraction of the summed episode wall time (`other` = the rest: templating,
parsing, scoring, e.g. the code reward's sandbox run, and waiting for a worker). Tool time sums the
calls' own durations, so parallel calls in one turn count once each.

The tiny random model almost never calls a tool, so its tool share is ~0. `--bench-force-tools`
measures the tool path anyway: the tool side then uses a parser that reads every turn as one call of
the row's tool with fixed arguments (FORCED_CALLS), so each episode runs tools.max_turns real
generate calls with a real tool call between each pair; only the decision to call is scripted.
Note the tool side's prompts are longer (the template lists the tools), so even at one turn per
episode it prefills more than the single-turn side.

Output: a table on stdout, `bench_tools.json` plus one records file per (set, side) in the run dir.

`--remote`: local vs remote tools instead (agentloop.bench.remote_tools).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from agentloop.bench.forced import FORCED_CALLS, forced_parser  # noqa: F401 - FORCED_CALLS re-exported
from agentloop.config import Config, SamplingParams
from agentloop.data import load_samples
from agentloop.inference.serving import serving
from agentloop.loops import get_agent_loop
from agentloop.loops.single_turn import SingleTurnAgentLoop
from agentloop.models.loading import load_tokenizer_for, resolve_model
from agentloop.records import AgentLoopOutput, EpisodeRecord, Sample, TokenOutput
from agentloop.rollout.engine import RolloutEngine
from agentloop.tools.parsers import register_parser
from agentloop.util.rundir import RecordWriter


class _TimedSingleTurn(SingleTurnAgentLoop):
    """single_turn_agent_loop plus a gen_time_s metric (the one generate call's wall time)."""

    name = "single_turn_agent_loop"

    async def generate(self, episode_id: str, prompt_ids: list[int], sampling_params: SamplingParams,
                       *, max_new_tokens: int | None = None) -> TokenOutput:
        t0 = time.monotonic()
        try:
            return await super().generate(episode_id, prompt_ids, sampling_params, max_new_tokens=max_new_tokens)
        finally:
            self._gen_s = getattr(self, "_gen_s", 0.0) + time.monotonic() - t0

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        out = await super().run(sample, sampling_params)
        out.metrics["gen_time_s"] = getattr(self, "_gen_s", 0.0)
        out.metrics.setdefault("tool_time_s", 0.0)
        return out


def measure(records: list[EpisodeRecord], wall_s: float) -> dict[str, Any]:
    """Throughput and the time split of one side's records."""
    n = len(records)
    ok = [r for r in records if r.error is None]
    model_tokens = sum(r.num_model_tokens for r in records)
    episode_s = sum(r.wall_s for r in records)
    tool_s = sum(r.metrics.get("tool_time_s", 0.0) for r in records)
    gen_s = sum(r.metrics.get("gen_time_s", 0.0) for r in records)
    rewards = [r.reward for r in ok if r.reward is not None]

    def frac(x: float) -> float:
        return x / episode_s if episode_s > 0 else 0.0

    return {
        "episodes": n, "errors": n - len(ok), "wall_s": wall_s,
        "episodes_per_s": n / wall_s if wall_s > 0 else 0.0,
        "model_tokens": model_tokens, "tokens_per_s": model_tokens / wall_s if wall_s > 0 else 0.0,
        "response_tokens": sum(len(r.response_ids) for r in records),
        "turns_per_episode": sum(r.num_turns for r in records) / n if n else 0.0,
        "tool_calls_per_episode": sum(r.metrics.get("tool_calls", 0.0) for r in records) / n if n else 0.0,
        "episode_time_s": episode_s, "tool_time_s": tool_s, "gen_time_s": gen_s,
        "tool_share": frac(tool_s), "gen_share": frac(gen_s), "other_share": frac(max(0.0, episode_s - tool_s - gen_s)),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "finish_reasons": {k: sum(r.finish_reason == k for r in records)
                           for k in sorted({r.finish_reason for r in records})},
    }


async def bench_tools_async(cfg: Config, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    model_path = resolve_model(cfg)
    tokenizer = load_tokenizer_for(cfg, model_path)
    sets = [s.strip() for s in args.bench_sets.split(",") if s.strip()]
    tool_cls = get_agent_loop("tool_agent_loop")
    report: dict[str, Any] = {"sets": {}, "prompts_per_set": args.bench_prompts, "samples": args.bench_samples,
                              "max_new_tokens": cfg.sampling.max_new_tokens, "model": str(model_path),
                              "max_turns": cfg.tools.max_turns, "forced_tools": bool(args.bench_force_tools)}
    sides: list[tuple[str, type]] = [("tool_agent_loop", tool_cls), ("single_turn", _TimedSingleTurn)]
    async with serving(cfg, model_path, run_dir) as sm:
        report["servers"] = list(sm.urls)
        data = {name: load_samples(cfg.data.model_copy(update={"path": None, "builtin": name,
                                                                "max_samples": args.bench_prompts}))
                for name in sets}
        # warm-up (first requests allocate and compile), not timed
        await RolloutEngine(cfg, sm, tokenizer, _TimedSingleTurn, progress=False).run(data[sets[0]][:2], n_samples=1)
        for name in sets:
            report["sets"][name] = {}
            side_cfg = {"tool_agent_loop": cfg, "single_turn": cfg}
            if args.bench_force_tools:
                tool = next(iter(data[name][0].tools_kwargs or {"calculator": {}}))
                register_parser(f"bench_forced_{tool}", forced_parser(tool), override=True)
                side_cfg["tool_agent_loop"] = cfg.model_copy(deep=True)
                side_cfg["tool_agent_loop"].tools.parser = f"bench_forced_{tool}"
            for side, loop_cls in sides:
                await sm.flush_cache()
                c = side_cfg[side]
                with RecordWriter(run_dir / f"records-{name}-{side}.jsonl") as writer:
                    engine = RolloutEngine(c, sm, tokenizer, loop_cls, progress=False)
                    t0 = time.perf_counter()
                    res = await engine.run(data[name], n_samples=args.bench_samples, on_record=writer)
                    wall = time.perf_counter() - t0
                m = report["sets"][name][side] = measure(res.records, wall)
                print(f"  {name:<11} {side:<16} {m['episodes']} episodes in {wall:.2f}s", file=sys.stderr,
                      flush=True)
    return report


def format_report(report: dict[str, Any]) -> str:
    head = (f"{'set':<11} {'loop':<16} {'episodes':>8} {'errors':>6} {'ep/s':>7} {'tok/s':>8} {'turns':>6} "
            f"{'calls':>6} {'tool %':>7} {'gen %':>7} {'other %':>8} {'reward':>7}")
    lines = [head, "-" * len(head)]
    for name, sides in report["sets"].items():
        for side, m in sides.items():
            reward = "-" if m["mean_reward"] is None else f"{m['mean_reward']:.3f}"
            lines.append(f"{name:<11} {side:<16} {m['episodes']:>8} {m['errors']:>6} {m['episodes_per_s']:>7.2f} "
                         f"{m['tokens_per_s']:>8.1f} {m['turns_per_episode']:>6.2f} "
                         f"{m['tool_calls_per_episode']:>6.2f} "
                         f"{100 * m['tool_share']:>7.1f} {100 * m['gen_share']:>7.1f} {100 * m['other_share']:>8.1f} "
                         f"{reward:>7}")
    return "\n".join(lines)


def run_bench_tools(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    from agentloop.bench.rollout import run_bench

    if getattr(args, "remote", False):
        from agentloop.bench.remote_tools import bench_remote_async, format_remote

        run_dir, report = run_bench(cfg, args, "tools", bench_remote_async)
        print(format_remote(report))
        print(f"  report: {run_dir / 'bench_tools.json'}")
        return report
    run_dir, report = run_bench(cfg, args, "tools", bench_tools_async)
    forced = "; tool calls FORCED (scripted parser, real generation and tools)" if report["forced_tools"] else ""
    print(f"bench tools ({report['prompts_per_set']} prompts x {report['samples']} samples per set, "
          f"max_new_tokens {report['max_new_tokens']}, max_turns {report['max_turns']}; shares are of summed "
          f"episode wall time{forced})")
    print(format_report(report))
    print(f"  report: {run_dir / 'bench_tools.json'}")
    return report
