"""The `agentloop` command line.

    agentloop rollout [--config F] [--server-url URL]... [--model DIR] [--loop NAME] [--plugin P]... [key.sub=value]...
    agentloop train [--config F] [same flags]   GRPO (embedded default: agentloop/presets/train_tiny.yaml)
    agentloop bench rollout [...same flags...] [--bench-requests N] [--bench-concurrency C]
    agentloop bench tools [...same flags...] [--bench-sets calculator,code] [--bench-prompts N]
    agentloop bench train [--model PATH|tiny|qwen2.5-0.5b-shape] [--bench-sequences N] [--nproc N] ...
                          learner tok/s and MFU on synthetic batches
    agentloop bench train --run-dir RUN | --full [--full-steps 3]   time split of a train step
    agentloop trace RECORDS.jsonl [--out FILE.html] [--limit N] [--model DIR]   episodes as an HTML page
    agentloop build-model          build (or find) the cached tiny model and print its directory
    agentloop loops                list registered agent loops (plugins included)
    agentloop config [...]         print the resolved config without running anything

Flags are shorthands for config overrides; everything else is `key.sub=value`.
Exit codes: 0 done, 1 the run stopped early (e.g. every server died), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agentloop.errors import AgentLoopError, ConfigError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--server-url", action="append", default=[], metavar="URL",
                   help="use a running SGLang server (repeatable); default: launch local ones")
    p.add_argument("--model", metavar="DIR", help="local Hugging Face model directory (default: built-in tiny model)")
    p.add_argument("--loop", metavar="NAME", help="registered agent loop (default from config)")
    p.add_argument("--plugin", action="append", default=[], metavar="P",
                   help="python file or module to import first (registers loops/tools/rewards); repeatable")
    p.add_argument("--data", metavar="FILE", help="JSONL or Parquet data file in verl row format")
    p.add_argument("-n", "--n-samples", type=int, metavar="N", help="episodes per prompt")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--run-dir", metavar="DIR", help="exact run directory")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    import json

    out: list[str] = []
    if args.server_url:
        out.append("server.urls=" + json.dumps(args.server_url))
    if args.model:
        out.append("model.path=" + json.dumps(args.model))
    if args.loop:
        out.append("rollout.loop=" + json.dumps(args.loop))
    if args.data:
        out.append("data.path=" + json.dumps(args.data))
    if args.n_samples is not None:
        out.append(f"rollout.n_samples={args.n_samples}")
    if args.seed is not None:
        out.append(f"rollout.seed={args.seed}")
    if args.run_dir:
        out.append("run_dir=" + json.dumps(args.run_dir))
    return out


TRAIN_PRESET = "presets/train_tiny.yaml"


def build_config(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from agentloop.config import load_config

    config = args.config
    if config is None and (args.command == "train" or getattr(args, "full", False)):
        config = Path(__file__).parent / TRAIN_PRESET  # the embedded default run
    cfg = load_config(config, list(args.overrides) + _flag_overrides(args))
    if args.plugin:
        cfg.plugins = list(cfg.plugins) + list(args.plugin)
    return cfg


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentloop", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rollout", help="eval-only rollouts: run the loop on a data set, write records + summary")
    _common(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    t = sub.add_parser("train", help="GRPO training: rollouts -> FSDP learner -> weight push, step after step")
    _common(t)
    t.add_argument("--quiet", action="store_true")
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    br = bsub.add_parser("rollout", help="engine vs bare aiohttp client, same requests, same server")
    _common(br)
    br.add_argument("--bench-requests", type=int, default=512, help="requests per side")
    br.add_argument("--bench-concurrency", type=int, default=64, help="concurrent requests per side")
    br.add_argument("--bench-prompt-tokens", type=int, default=64)
    br.add_argument("--bench-new-tokens", type=int, default=64)
    br.add_argument("--bench-rounds", type=int, default=2, help="alternating rounds per side")
    br.add_argument("--bench-episodes", type=int, default=2000,
                    help="concurrent episodes for the capacity test (0 skips it)")
    br.add_argument("--out", help="write the report JSON here")
    bt = bsub.add_parser("tools", help="tool loop vs single-turn loop on the same prompts: episodes/s, tok/s, "
                                       "share of time in tools and generation")
    _common(bt)
    bt.add_argument("--bench-sets", default="calculator,code", help="comma-separated built-in sets")
    bt.add_argument("--bench-prompts", type=int, default=16, help="prompts per set")
    bt.add_argument("--bench-samples", type=int, default=2, help="episodes per prompt")
    bt.add_argument("--bench-force-tools", action="store_true",
                    help="read every turn as a tool call (measures the tool path with a model that never calls)")
    bt.add_argument("--out", help="also write the report JSON here")
    btr = bsub.add_parser("train", help="learner tokens/s, step time, peak memory and MFU on synthetic batches "
                                        "through the real train_step; or (--run-dir/--full) a train step's time split")
    btr.add_argument("--config", help="YAML config file: its learner/algo sections configure the learner")
    btr.add_argument("--model", dest="bench_model", metavar="PATH|tiny|qwen2.5-0.5b-shape",
                     help="model directory or named shape (default: model.path, else tiny)")
    btr.add_argument("--run-dir", dest="split_run_dir", metavar="DIR",
                     help="report the step time split of this `agentloop train` run (its metrics.jsonl)")
    btr.add_argument("--full", action="store_true",
                     help="run a short `agentloop train` (train preset unless --config) and report its split")
    btr.add_argument("--full-steps", type=int, default=3, metavar="N", help="steps of the --full run")
    btr.add_argument("--bench-sequences", type=int, metavar="N", help="sequences per step (default 64)")
    btr.add_argument("--bench-group-size", type=int, metavar="G", help="episodes per prompt (default 8)")
    btr.add_argument("--bench-prompt-tokens", type=int, metavar="P", help="prompt length (default 256)")
    btr.add_argument("--bench-response-tokens", type=int, metavar="R", help="response length (default 768)")
    btr.add_argument("--bench-env-tokens", type=int, metavar="E", help="mask-0 tokens inside each response (default 0)")
    btr.add_argument("--bench-warmup", type=int, metavar="K", help="untimed steps first (default 1)")
    btr.add_argument("--bench-steps", type=int, metavar="K", help="timed steps (default 3)")
    btr.add_argument("--bench-seed", type=int, metavar="S", help="seed of the synthetic records (default 0)")
    btr.add_argument("--bench-max-lag", type=int, metavar="K",
                     help="give the records token versions lagging 0..K behind the step (asynchronous rollouts)")
    btr.add_argument("--nproc", type=int, metavar="N", help="learner ranks (torchrun when > 1; = learner.nproc)")
    btr.add_argument("--peak-tflops", type=float, metavar="T",
                     help="peak dense TFLOP/s per device for MFU (default: by GPU name; none on CPU)")
    btr.add_argument("--out", help="also write the report JSON here")
    btr.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (learner.*, algo.*, ...)")
    # the shared flags that build_config reads; --run-dir and --model mean something else here
    btr.set_defaults(server_url=[], model=None, loop=None, data=None, n_samples=None, seed=None, run_dir=None,
                     plugin=[])
    sub.add_parser("build-model", help="build (once) the tiny model and print its directory")
    tp = sub.add_parser("trace", help="render episode records as a static HTML page (tokens shaded by mask/logprob)")
    tp.add_argument("records", metavar="RECORDS.jsonl")
    tp.add_argument("--out", metavar="FILE.html", help="default: RECORDS.html next to the records")
    tp.add_argument("--limit", type=int, default=20, metavar="N", help="first N episodes by (index, repeat); 0 = all")
    tp.add_argument("--model", metavar="DIR", help="tokenizer/model dir (default: the run's config.yaml model.path)")
    lp = sub.add_parser("loops", help="list registered agent loops")
    lp.add_argument("--plugin", action="append", default=[])
    cp = sub.add_parser("config", help="print the resolved config")
    _common(cp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("agentloop: interrupted; servers stopped, records kept", file=sys.stderr)
        return 130
    except (ConfigError, AgentLoopError) as e:
        print(f"agentloop: error: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "build-model":
        from agentloop.models.modelzoo import ensure_tiny_model

        print(ensure_tiny_model())
        return 0
    if args.command == "loops":
        from agentloop.loops import list_agent_loops, load_plugin

        for ref in args.plugin:
            load_plugin(ref)
        print("\n".join(list_agent_loops()))
        return 0
    if args.command == "trace":
        from agentloop.report.trace_html import write_trace_html

        out = write_trace_html(args.records, args.out, limit=args.limit or None, model_dir=args.model)
        print(f"agentloop trace: wrote {out}")
        return 0
    cfg = build_config(args)
    if args.command == "config":
        from agentloop.config import dump_config

        print(dump_config(cfg), end="")
        return 0
    if args.command == "rollout":
        from agentloop.rollout.run import format_summary, run_rollout

        run_dir, result = run_rollout(cfg, progress=not args.quiet)
        print(f"agentloop rollout: done, run dir {run_dir}")
        print(format_summary({**result.summary}))
        print(f"  records: {run_dir / 'records.jsonl'}  summary: {run_dir / 'summary.json'}")
        if (run_dir / "traces.html").exists():
            print(f"  traces:  {run_dir / 'traces.html'} (tokens shaded by mask and logprob)")
        if result.stopped:
            print(f"agentloop: the run stopped early: {result.stopped}; "
                  f"{len(result.records)} records kept in {run_dir / 'records.jsonl'}", file=sys.stderr)
            return 1
        return 0
    if args.command == "train":
        from agentloop.train.orchestrator import run_train

        run_dir, final = run_train(cfg)
        m = final.get("metrics", {})
        print(f"agentloop train: done, run dir {run_dir}")
        for k in ("train/reward", "train/accuracy", "train/tool_call_rate", "val/reward", "val/accuracy"):
            if k in m:
                print(f"  {k:<24} {m[k]:.4g}")
        print(f"  reward curve: {final['curves']}\n  checkpoint:   {final.get('checkpoint')}\n"
              f"  weights:      {final.get('last_weights')}")
        return 0
    if args.command == "bench" and args.bench == "rollout":
        from agentloop.bench.rollout import run_bench_rollout

        run_bench_rollout(cfg, args)
        return 0
    if args.command == "bench" and args.bench == "tools":
        from agentloop.bench.tools import run_bench_tools

        run_bench_tools(cfg, args)
        return 0
    if args.command == "bench" and args.bench == "train":
        from agentloop.bench.train import run_bench_train

        run_bench_train(cfg, args)
        return 0
    raise ConfigError(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
