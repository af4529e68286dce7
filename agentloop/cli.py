"""The `agentloop` command line.

    agentloop rollout [--config F] [--server-url URL]... [--model DIR] [--loop NAME] [--plugin P]... [key.sub=value]...
                  no --config: the main job (agentloop/presets/rollout_main.yaml): the shipped warm-started
                  tiny model on the calculator set with the calculator tool; --random-model: the random
                  tiny model on the arithmetic set (the plumbing run, configs/rollout.yaml)
    agentloop train [--config F] [same flags] [--val-data FILE] [--force-settings] [--force-data] [--dry-run]
                  GRPO (embedded default: agentloop/presets/train_tiny.yaml); --data trains on a file (validation:
                  --val-data, else a slice held out of it); --run-dir of an existing run resumes it with its
                  saved config.yaml plus the values given now (a changed model or optimizer-state setting needs
                  --force-settings, changed rows or rollout.seed --force-data; --force is both)
                  --dry-run: the preflight every run makes (data, rewards, template, prompts, model, tools, GPU
                  memory plan), nothing started
    agentloop bench rollout [...same flags...] [--bench-requests N] [--bench-concurrency C] [--bench-episodes N]
                          [--bench-kinds single,tool] [--scripted-server] [--bench-journal]
                          engine vs bare client, capacity (and the episode journal's cost)
    agentloop bench tools [...same flags...] [--bench-sets calculator,code] [--bench-prompts N]
                          [--remote [--bench-episodes 1000] [--scripted-server]]   local vs remote tools
    agentloop bench cache [...same flags...] [--scripted-server] [--bench-servers 4] [--bench-episodes N]
                          prefix-cache hit rate, sticky routing vs not, 3-turn tool episodes
    agentloop bench gateway [...same flags...] [--bench-prompts N] [--bench-samples K] [--bench-rounds R]
                          your agent through the gateway vs tool_agent_loop, episodes/s (main job's preset)
    agentloop bench train [--model PATH|tiny|qwen2.5-0.5b-shape] [--bench-sequences N] [--nproc N] ...
                          learner tok/s and MFU on synthetic batches
    agentloop bench train --run-dir RUN | --full [--full-steps 3]   time split of a train step
    agentloop trace RECORDS.jsonl [--out FILE.html] [--limit N] [--model DIR]   episodes as an HTML page
    agentloop data prepare RECIPE (--input FILE | --generate N | --builtin SET) [--output FILE] ...
                                   the data set's own files -> verl rows (gsm8k, countdown, search_r1, code)
    agentloop data check FILE      what is wrong with a verl .jsonl/.parquet file, row by row (exit 1 on errors)
    agentloop retriever serve --corpus FILE [--port 8000] [--topk 3]
                                   BM25 over a JSONL corpus behind Search-R1's /retrieve API
    agentloop tools serve [--config F] [--plugin P]... [--host H] [--port N] [key.sub=value]...
                                   the registered tools behind an HTTP service (tools.service.*); clients
                                   use it with --tool-server-url URL (tools.server_url)
    agentloop tinker serve [--model tiny|DIR|SHAPE] [--host H] [--port N] [--device cpu|cuda] [--run-dir DIR]
                                   a Tinker-compatible service (the tinker SDK and tinker-cookbook recipes run
                                   against it: TINKER_BASE_URL=http://H:N), our learner + a real SGLang server
    agentloop build-model          build (or find) the cached tiny model and print its directory
    agentloop loops                list registered agent loops (plugins included)
    agentloop config [...]         print the resolved config without running anything

Flags are shorthands for config overrides; everything else is `key.sub=value`.
Exit codes: 0 done, 1 the run stopped early (e.g. every server died), 2 bad input.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from agentloop.errors import AgentLoopError, ConfigError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--server-url", action="append", default=[], metavar="URL",
                   help="use a running SGLang server (repeatable); default: launch local ones")
    p.add_argument("--tool-server-url", action="append", default=[], metavar="URL",
                   help="run the episodes' tools on this tool service (`agentloop tools serve`; repeatable, "
                        "balanced): tools.server_url")
    p.add_argument("--model", metavar="DIR", help="local Hugging Face model directory (default: built-in tiny model; "
                   "train with --server-url needs it: the directory the servers were started with)")
    p.add_argument("--loop", metavar="NAME", help="registered agent loop (default from config)")
    p.add_argument("--plugin", action="append", default=[], metavar="P",
                   help="python file or module to import first (registers loops/tools/rewards); repeatable")
    p.add_argument("--env", metavar="LIB:SPEC",
                   help="an environment library's environment as the loop and rows: verifiers:MODULE[:{kwargs}], "
                        "reasoning_gym:TASK[,TASK...], textarena:ENV_ID, openenv:URL (docs/environments.md)")
    p.add_argument("--data", metavar="FILE",
                   help="JSONL or Parquet file in verl row format (data.path): the rows rolled out, or trained on")
    p.add_argument("-n", "--n-samples", type=int, metavar="N", help="episodes per prompt")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--run-dir", metavar="DIR",
                   help="exact run directory (train: an existing run's is resumed, with its saved config)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    import json

    out: list[str] = []
    if args.server_url:
        out.append("server.urls=" + json.dumps(args.server_url))
    if getattr(args, "tool_server_url", None):
        out.append("tools.server_url=" + json.dumps(args.tool_server_url))
    if args.model:
        out.append("model.path=" + json.dumps(args.model))
    if args.loop:
        out.append("rollout.loop=" + json.dumps(args.loop))
    if args.data:
        out.append("data.path=" + json.dumps(args.data))
    if getattr(args, "val_data", None):
        out.append("data.val_path=" + json.dumps(args.val_data))
    if args.n_samples is not None:
        out.append(f"rollout.n_samples={args.n_samples}")
    if args.seed is not None:
        out.append(f"rollout.seed={args.seed}")
    if args.run_dir:
        out.append("run_dir=" + json.dumps(args.run_dir))
    return out


def _env_overrides(args: argparse.Namespace) -> list[str]:
    """What `--env LIB:SPEC` stands for (before the user's own overrides, which win)."""
    if not getattr(args, "env", None):
        return []
    from agentloop.rollout.env_spec import env_overrides

    return env_overrides(args.env)


TRAIN_PRESET = "presets/train_tiny.yaml"
ROLLOUT_PRESET = "presets/rollout_main.yaml"


def uses_main_preset(args: argparse.Namespace) -> bool:
    """`agentloop rollout` without --config and without --random-model runs the main job's preset, and so
    does `agentloop bench gateway` without --config (its workload: the calculator task)."""
    if args.command == "bench" and getattr(args, "bench", None) == "gateway":
        return args.config is None
    return args.command == "rollout" and args.config is None and not getattr(args, "random_model", False)


def _existing_run_dir(args: argparse.Namespace) -> Any:
    """The run dir `agentloop train` is given (--run-dir, else a run_dir= override, else the --config file's)
    when it already holds a run (a config.yaml); else None."""
    from pathlib import Path

    from agentloop.config import parse_override, read_config_file

    run_dir = args.run_dir
    for arg in args.overrides if run_dir is None else []:
        key, value = parse_override(arg)
        run_dir = value if key == "run_dir" else run_dir
    if run_dir is None and args.config is not None:
        run_dir = read_config_file(args.config).get("run_dir")
    return Path(run_dir) if run_dir and (Path(run_dir) / "config.yaml").is_file() else None


def build_config(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from agentloop.config import load_config

    resumed = _existing_run_dir(args) if args.command == "train" else None
    if resumed is not None:
        # an existing run goes on with its own config: the values given now are overrides of it (no preset)
        from agentloop.train.orchestrator.resume import resume_config

        cfg, changes = resume_config(resumed, args.config, _env_overrides(args) + list(args.overrides) +
                                     _flag_overrides(args),
                                     force=args.force, force_settings=args.force_settings,
                                     force_data=args.force_data)
        said = "; changed: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes) if changes else ""
        print(f"agentloop train: {resumed} holds a run: resuming it with its config.yaml{said}",
              file=sys.stderr, flush=True)
        cfg.plugins = list(cfg.plugins) + [p for p in args.plugin if p not in cfg.plugins]
        return cfg
    config = args.config
    if config is None and (args.command == "train" or getattr(args, "full", False)):
        config = Path(__file__).parent / TRAIN_PRESET  # the embedded default run
    main_job = uses_main_preset(args)
    if main_job:
        config = Path(__file__).parent / ROLLOUT_PRESET
    cfg = load_config(config, _env_overrides(args) + list(args.overrides) + _flag_overrides(args))
    if getattr(args, "env", None) and args.command in ("rollout", "train"):
        from agentloop.rollout.env_spec import prepare_env_rows

        said = prepare_env_rows(cfg)
        if said:
            print(f"agentloop {args.command}: {said}", file=sys.stderr, flush=True)
    if main_job and cfg.model.path is None:
        # The preset's model: the tiny model's shipped supervised warm start (installed into the cache once).
        from agentloop.models.warmstart import ensure_warm_model

        cfg.model.path = str(ensure_warm_model())
    if args.plugin:
        cfg.plugins = list(cfg.plugins) + [p for p in args.plugin if p not in cfg.plugins]
    return cfg


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentloop", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rollout", help="eval-only rollouts: run the loop on a data set, write records + summary")
    _common(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--random-model", action="store_true",
                   help="without --config: the random tiny model on the arithmetic set, single turn (the plumbing "
                        "run) instead of the main job (warm-started model, calculator tool)")
    t = sub.add_parser("train", help="GRPO training: rollouts -> FSDP learner -> weight push, step after step",
                       description="GRPO training. Without --config: the embedded default "
                                   "(agentloop/presets/train_tiny.yaml: the built-in calculator_train set, validated "
                                   "on the built-in calculator set). --data FILE trains on FILE (data.path); "
                                   "validation runs on --val-data FILE (data.val_path), else on data.val_holdout rows "
                                   "held out of the training rows and never trained on (default min(32, rows // 10); "
                                   "0: none); a data file is never validated on a built-in set. "
                                   "--run-dir of an existing run (one holding config.yaml) resumes it: its saved "
                                   "config.yaml plus only the values given now (--config file, flags, key=value); "
                                   "a changed setting that carries state is refused unless --force-settings (the "
                                   "model, learner.betas/adam_eps/dtype, algo.kl_ctrl*) or --force-data (the rows, "
                                   "rollout.seed).")
    _common(t)
    _val_data(t)
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--dry-run", action="store_true",
                   help="check everything without starting servers or the learner, in seconds: the data, a reward "
                        "per data_source, the chat template, the prompts' lengths, the model, the tools, the GPU "
                        "memory plan (plan for GPUs this machine lacks with cluster.gpu_memory_gib=G "
                        "cluster.num_gpus=N); exit 2 naming what is wrong")
    t.add_argument("--force-settings", action="store_true",
                   help="resume an existing --run-dir although a setting its checkpoint's state was made with changed "
                        "(the model, learner.betas/adam_eps/dtype, algo.kl_ctrl*); the old config is kept as "
                        "config.prev.yaml")
    t.add_argument("--force-data", action="store_true",
                   help="resume an existing --run-dir although the training/validation rows or rollout.seed changed, "
                        "or the rows differ from those the checkpoint's data position was stored for")
    t.add_argument("--force", action="store_true", help="both --force-settings and --force-data")
    ln = sub.add_parser("learner-node", help="one more node of a learner spanning hosts without Ray "
                        "(learner.nnodes > 1): start this host's ranks, which join the run's torchrun rendezvous",
                        description="Run on each learner host but the first, once `agentloop train` with "
                                    "learner.nnodes > 1 has started there; RUN_DIR is the run's directory on the "
                                    "filesystem every node shares. Exits with the learner.")
    ln.add_argument("--run-dir", required=True, help="the run's directory (shared by every node)")
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
                    help="capacity test: episodes in flight at once (0 skips it)")
    br.add_argument("--bench-kinds", default="single,tool",
                    help="capacity workloads: single (single_turn_agent_loop), tool (tool_agent_loop, calculator)")
    br.add_argument("--bench-turns", type=int, default=3, help="capacity: turns of a tool episode")
    br.add_argument("--bench-waves", type=int, default=2,
                    help="capacity: episodes run = waves x --bench-episodes (later waves start as earlier ones end)")
    br.add_argument("--bench-group", type=int, default=4, help="capacity: episodes per prompt (GRPO group)")
    br.add_argument("--bench-new-tokens-per-turn", type=int, default=64, help="capacity: max new tokens per turn")
    br.add_argument("--bench-side-timeout-s", type=float, default=1800, help="capacity: deadline of one side")
    br.add_argument("--scripted-server", action="store_true",
                    help="bench against scripted SGLang servers started in their own processes (no model: "
                         "they answer after --bench-latency-s, tool calls scripted) instead of real ones")
    br.add_argument("--bench-servers", type=int, default=1, help="--scripted-server: how many")
    br.add_argument("--bench-latency-s", type=float, default=10.0, help="--scripted-server: latency of an answer")
    br.add_argument("--bench-jitter", type=float, default=0.5,
                    help="--scripted-server: latencies spread over [1 - j, 1 + j] x --bench-latency-s")
    br.add_argument("--bench-cache-tokens", type=int, default=0,
                    help="--scripted-server: prefix cache capacity in tokens (0: none)")
    br.add_argument("--bench-journal", action="store_true",
                    help="capacity: a third side, the engine with the episode journal on (journal.* settings), "
                         "beside the engine without it: the journal's cost in episodes/s and its bytes per episode")
    br.add_argument("--out", help="write the report JSON here")
    bt = bsub.add_parser("tools", help="tool loop vs single-turn loop on the same prompts: episodes/s, tok/s, "
                                       "share of time in tools and generation")
    _common(bt)
    bt.add_argument("--bench-sets", default="calculator,code", help="comma-separated built-in sets")
    bt.add_argument("--bench-prompts", type=int, default=16, help="prompts per set")
    bt.add_argument("--bench-samples", type=int, default=2, help="episodes per prompt")
    bt.add_argument("--bench-force-tools", action="store_true",
                    help="read every turn as a tool call (measures the tool path with a model that never calls)")
    bt.add_argument("--remote", action="store_true",
                    help="local vs remote tools instead: tool_agent_loop with its tools in this process, then on a "
                         "tool service (--tool-server-url, else one `agentloop tools serve` started here), "
                         "--bench-episodes at once")
    bt.add_argument("--bench-episodes", type=int, default=1000, help="--remote: episodes in flight (and per side)")
    bt.add_argument("--bench-rounds", type=int, default=2, help="--remote: alternating rounds per side")
    bt.add_argument("--bench-turns", type=int, default=3, help="--remote --scripted-server: turns of an episode")
    bt.add_argument("--scripted-server", action="store_true",
                    help="--remote: against a scripted SGLang server (answers scripted, calculator calls every turn "
                         "but the last) instead of a real one")
    bt.add_argument("--bench-latency-s", type=float, default=0.5, help="--scripted-server: latency of an answer")
    bt.add_argument("--bench-jitter", type=float, default=0.5, help="--scripted-server: latency spread")
    bt.set_defaults(bench_servers=1, bench_cache_tokens=0)
    bt.add_argument("--out", help="also write the report JSON here")
    bc = bsub.add_parser("cache", help="prefix-cache hit rate across servers: sticky routing vs not, same 3-turn tool "
                                       "episodes")
    _common(bc)
    bc.add_argument("--scripted-server", action="store_true",
                    help="scripted SGLang servers modelling the radix cache (CPU) instead of real ones")
    bc.add_argument("--bench-servers", type=int, default=4, help="--scripted-server: how many")
    bc.add_argument("--bench-episodes", type=int, default=1000, help="episodes per side (all in flight at once)")
    bc.add_argument("--bench-turns", type=int, default=3, help="turns of an episode")
    bc.add_argument("--bench-rounds", type=int, default=2, help="alternating rounds per side")
    bc.add_argument("--bench-cache-tokens", type=int, default=1_000_000,
                    help="--scripted-server: each server's cache capacity in tokens")
    bc.add_argument("--bench-think-tokens", type=int, default=64,
                    help="--scripted-server: seeded tokens before each scripted turn (episodes diverge after turn 1)")
    bc.add_argument("--bench-latency-s", type=float, default=0.5, help="--scripted-server: latency of an answer")
    bc.add_argument("--bench-jitter", type=float, default=0.5, help="--scripted-server: latency spread")
    bc.add_argument("--out", help="also write the report JSON here")
    bg = bsub.add_parser("gateway", help="your agent through the gateway (openai_agent_loop) vs tool_agent_loop: "
                                         "episodes/s on the same episodes and server")
    _common(bg)
    bg.add_argument("--bench-prompts", type=int, default=64, help="prompts (the first rows of the data set)")
    bg.add_argument("--bench-samples", type=int, default=4, help="episodes per prompt")
    bg.add_argument("--bench-rounds", type=int, default=2, help="alternating rounds per side")
    bg.add_argument("--out", help="also write the report JSON here")
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
    btr.add_argument("--nproc", type=int, metavar="N",
                     help="learner ranks on this host (torchrun when > 1; = learner.ranks)")
    btr.add_argument("--peak-tflops", type=float, metavar="T",
                     help="peak dense TFLOP/s per device for MFU (default: by GPU name; none on CPU)")
    btr.add_argument("--out", help="also write the report JSON here")
    btr.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (learner.*, algo.*, ...)")
    # the shared flags that build_config reads; --run-dir and --model mean something else here
    btr.set_defaults(server_url=[], model=None, loop=None, data=None, n_samples=None, seed=None, run_dir=None,
                     plugin=[])
    _data_parsers(sub)
    ev = sub.add_parser("envs", help="environment libraries run in virtualenvs of their own (verifiers)")
    evsub = ev.add_subparsers(dest="envs", required=True)
    es = evsub.add_parser("setup", help="build (once) the virtualenv an environment library runs in")
    es.add_argument("library", choices=["verifiers"])
    es.add_argument("--extra", action="append", default=[], metavar="PKG",
                    help="also install PKG there (your environment's package, e.g. vf-my-env or ./my_env); repeatable")
    rv = sub.add_parser("retriever", help="retrieval service for Search-R1-style search")
    rvsub = rv.add_subparsers(dest="retriever", required=True)
    rs = rvsub.add_parser("serve", help="BM25 over a JSONL corpus behind Search-R1's POST /retrieve API")
    rs.add_argument("--corpus", required=True, metavar="FILE",
                    help="JSONL: {id, title, text} or Search-R1's {id, contents} rows")
    rs.add_argument("--host", default="127.0.0.1")
    rs.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    rs.add_argument("--topk", type=int, default=3, help="passages per query when a request names none")
    rs.add_argument("--k1", type=float, default=1.2, help="BM25 term-frequency saturation")
    rs.add_argument("--b", type=float, default=0.75, help="BM25 length normalisation")
    tl = sub.add_parser("tools", help="tool service")
    tlsub = tl.add_subparsers(dest="tools", required=True)
    ts = tlsub.add_parser("serve", help="the registered tools (built-ins, plugins, tools.verl_tool_config) behind an "
                                        "HTTP service: per-episode instances, leases, limits, /health, /metrics")
    ts.add_argument("--config", help="YAML config file (its tools section is used)")
    ts.add_argument("--plugin", action="append", default=[], metavar="P", help="import first (registers tools)")
    ts.add_argument("--host", help="tools.service.host (default 127.0.0.1; another needs AGENTLOOP_TOOLS_TOKEN)")
    ts.add_argument("--port", type=int, help="tools.service.port (default 8200; 0: a free one, printed)")
    ts.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (tools.*)")
    tk = sub.add_parser("tinker", help="a Tinker-compatible service (docs/tinker.md)")
    tksub = tk.add_subparsers(dest="tinker", required=True)
    tks = tksub.add_parser("serve", help="the tinker SDK's training and sampling API on our learner and SGLang")
    tks.add_argument("--model", default="tiny", help="tiny (default), a local HF directory, or a model shape "
                                                       "(e.g. qwen2.5-0.5b-shape, random weights)")
    tks.add_argument("--model-name", help="the base_model name clients use (default: the model's local path)")
    tks.add_argument("--host", default="127.0.0.1", help="bind address (another than loopback needs "
                                                          "AGENTLOOP_TINKER_KEY)")
    tks.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    tks.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="training model and SGLang device")
    tks.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="training model dtype")
    tks.add_argument("--run-dir", default="runs/tinker", help="checkpoints (tinker:// paths) and the SGLang log")
    tks.add_argument("--max-lora-rank", type=int, default=32, help="largest LoRA rank a client may ask for")
    tks.add_argument("--server-url", help="a running SGLang server (--enable-lora) instead of launching one")
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
    _val_data(cp)
    cp.set_defaults(force=False, force_settings=False, force_data=False)
    return parser


def _val_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--val-data", metavar="FILE",
                   help="training: validation rows, JSONL or Parquet in verl row format (data.val_path); default: "
                        "data.val_holdout rows held out of the training rows")


def _data_parsers(sub: Any) -> None:
    d = sub.add_parser("data", help="prepare recipe data from the data sets' own files; check verl data files")
    dsub = d.add_subparsers(dest="data", required=True)
    pp = dsub.add_parser("prepare", help="the data set's own rows -> verl rows for a recipe")
    pp.add_argument("recipe", choices=["gsm8k", "countdown", "search_r1", "code", "reasoning_gym"])
    src = pp.add_mutually_exclusive_group()
    src.add_argument("--input", metavar="FILE", help="the data set's own .parquet/.jsonl file")
    src.add_argument("--generate", type=int, metavar="N", help="countdown: N puzzles from the built-in generator")
    src.add_argument("--builtin", metavar="SET", help="code: a built-in set (code, code_stdio)")
    pp.add_argument("--output", metavar="FILE",
                    help="output .parquet/.jsonl (default data/<recipe>/<split>.parquet; .jsonl for code)")
    pp.add_argument("--split", help="split name written to extra_info (default: test if the input's name "
                                    "contains 'test', else train)")
    pp.add_argument("--offset", type=int, default=0, metavar="N", help="skip the first N input rows")
    pp.add_argument("--limit", type=int, metavar="N", help="convert at most N input rows")
    pp.add_argument("--template", default="base", choices=["base", "qwen-instruct"],
                    help="countdown: TinyZero's prompt template")
    pp.add_argument("--seed", type=int, default=0, help="countdown --generate, reasoning_gym: generator seed")
    pp.add_argument("--data-source", metavar="NAME",
                    help="search_r1: data_source of every row (nq, hotpotqa, ...; default: the rows' own column)")
    pp.add_argument("--task", metavar="NAME[,NAME...]",
                    help="reasoning_gym: the reasoning-gym dataset(s) to generate (basic_arithmetic, gcd, ...)")
    pp.add_argument("--size", type=int, default=1000, metavar="N", help="reasoning_gym: entries per task")
    pp.add_argument("--config", metavar="JSON", dest="task_config",
                    help='reasoning_gym: dataset config per task, e.g. \'{"basic_arithmetic": {"max_terms": 2}}\'')
    pp.add_argument("--system-prompt", default="default", metavar="NAME|TEXT",
                    help="reasoning_gym: one of reasoning-gym's SYSTEM_PROMPTS (default, DeepSeekZero, simple, "
                         "direct, chain_of_draft), any other text as is, or '' for none")
    pp.add_argument("--answer-format", default="answer_tag", choices=["answer_tag", "hashes"],
                    help="reasoning_gym: how the reward reads the answer: reasoning-gym's <answer> tags (its own "
                         "extract_answer), or the number after the last `####`")
    pp.add_argument("--tools", metavar="NAME[,NAME...]",
                    help="reasoning_gym: tools every row offers (tools_kwargs), e.g. calculator for tool_agent_loop")
    ck = dsub.add_parser("check", help="validate a verl .jsonl/.parquet file, row by row")
    ck.add_argument("file", metavar="FILE")
    ck.add_argument("--prompt-key", default="prompt", help="column holding the chat messages")
    ck.add_argument("--max-problems", type=int, default=50, metavar="N", help="problems printed (0: all)")
    ck.add_argument("--plugin", action="append", default=[], metavar="P",
                    help="import first (registers rewards/tools the rows name); repeatable")
    ck.add_argument("--tools-config", metavar="FILE",
                    help="verl's tool config (tools.verl_tool_config): load it and say which tools each "
                         "data_source's rows can call")


def _data_prepare(args: argparse.Namespace) -> int:
    from itertools import islice
    from pathlib import Path

    from agentloop.data import (
        builtin_rows,
        generate_countdown,
        prepare,
        read_rows,
        write_rows,
    )
    from agentloop.data.prepare import code_rows_for_parquet

    split = args.split or ("test" if args.input and "test" in Path(args.input).name.lower() else "train")
    if args.recipe == "reasoning_gym":
        if args.input or args.generate is not None or args.builtin:
            raise ConfigError("reasoning_gym generates its rows: give --task NAME[,NAME...] --size N --seed S, "
                              "not --input/--generate/--builtin")
        if not args.task:
            raise ConfigError("reasoning_gym needs --task NAME[,NAME...] (a reasoning-gym dataset name)")
        from agentloop.data.reasoning_gym import parse_task_config, reasoning_gym_rows

        rows = reasoning_gym_rows([t.strip() for t in args.task.split(",") if t.strip()], args.size, args.seed,
                                  split=split, config=parse_task_config(args.task_config),
                                  system_prompt=args.system_prompt, answer_format=args.answer_format,
                                  tools=[t.strip() for t in args.tools.split(",")] if args.tools else None)
    elif not (args.input or args.generate is not None or args.builtin):
        raise ConfigError(f"{args.recipe} needs one of --input FILE, --generate N, --builtin SET")
    elif args.generate is not None:
        if args.recipe != "countdown":
            raise ConfigError("--generate works for countdown only")
        rows = generate_countdown(args.generate, seed=args.seed, split=split, template=args.template)
    elif args.builtin is not None:
        if args.recipe != "code":
            raise ConfigError("--builtin works for code only (sets: code, code_stdio)")
        rows = builtin_rows(args.builtin)
    else:
        stop = None if args.limit is None else args.offset + args.limit
        source = islice(read_rows(args.input), args.offset, stop)
        options: dict[str, Any] = {"split": split}
        if args.recipe == "countdown":
            options["template"] = args.template
        if args.recipe == "search_r1":
            options["data_source"] = args.data_source
        rows = prepare(args.recipe, source, **options)
    out = Path(args.output or f"data/{args.recipe}/{split}.{'jsonl' if args.recipe == 'code' else 'parquet'}")
    if args.recipe == "code" and out.suffix.lower() in (".parquet", ".pq"):
        rows = code_rows_for_parquet(rows)
    write_rows(rows, out)
    sources = sorted({r["data_source"] for r in rows})
    print(f"agentloop data prepare {args.recipe}: wrote {len(rows)} rows to {out} (data_source {', '.join(sources)}, "
          f"split {split})")
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from agentloop.data import check_file, format_report
    from agentloop.loops import load_plugin

    for ref in args.plugin:
        load_plugin(ref)
    report = check_file(args.file, prompt_key=args.prompt_key, tools_config=args.tools_config)
    for line in format_report(report, args.file, limit=args.max_problems or None):
        print(line)
    return 1 if report.errors else 0


def _retriever_serve(args: argparse.Namespace) -> int:
    from agentloop.tools.retriever_server import serve
    from agentloop.util.runtime import run_async

    try:
        run_async(serve(args.corpus, host=args.host, port=args.port, topk=args.topk, k1=args.k1, b=args.b))
    except OSError as e:
        raise ConfigError(f"cannot serve on {args.host}:{args.port}: {e}") from None
    return 0


def _tools_serve(args: argparse.Namespace) -> int:
    import json

    from agentloop.config import load_config
    from agentloop.rollout.run import load_plugins
    from agentloop.tools.service import serve, token_from_env
    from agentloop.util.runtime import run_async

    extra = [f"tools.service.host={json.dumps(args.host)}"] if args.host else []
    extra += [f"tools.service.port={args.port}"] if args.port is not None else []
    cfg = load_config(args.config, list(args.overrides) + extra)
    cfg.plugins = list(cfg.plugins) + [p for p in args.plugin if p not in cfg.plugins]
    load_plugins(cfg)
    try:
        run_async(serve(cfg.tools, token=token_from_env()))
    except OSError as e:
        raise ConfigError(f"cannot serve on {cfg.tools.service.host}:{cfg.tools.service.port}: {e}") from None
    return 0


def _tinker_serve(args: argparse.Namespace) -> int:
    from agentloop.tinker.config import TinkerServiceConfig
    from agentloop.tinker.server import key_from_env, serve
    from agentloop.util.runtime import run_async

    cfg = TinkerServiceConfig(model=args.model, model_name=args.model_name, host=args.host, port=args.port,
                              device=args.device, dtype=args.dtype, run_dir=args.run_dir,
                              max_lora_rank=args.max_lora_rank, server_url=args.server_url)
    try:
        run_async(serve(cfg, key=key_from_env()))
    except OSError as e:
        raise ConfigError(f"cannot serve on {cfg.host}:{cfg.port}: {e}") from None
    return 0


_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings (of the parser and all its subparsers) that take a value."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _value_options(sub)
        elif action.option_strings and action.nargs != 0:
            out.update(action.option_strings)
    return out


def overrides_last(argv: list[str], value_options: set[str]) -> list[str]:
    """`key.sub=value` overrides moved behind the flags, so they may come anywhere on the line
    (`agentloop rollout a.b=1 -n 2 c.d=3`): argparse takes a positional list only as one run of tokens.
    A token right after an option that takes a value is that value, and stays."""
    head: list[str] = []
    tail: list[str] = []
    takes_value = False
    for tok in argv:
        if takes_value:
            head.append(tok)
            takes_value = False
        elif tok.startswith("-"):
            head.append(tok)
            takes_value = "=" not in tok and tok in value_options
        elif _OVERRIDE.match(tok):
            tail.append(tok)
        else:
            head.append(tok)
    return head + tail


def _backend(cfg):
    """The training backend `cluster.backend` names (None: this host's, the default)."""
    if cfg.cluster.backend != "ray":
        return None
    try:
        from agentloop.cluster import RayBackend
    except ImportError as e:
        raise ConfigError(f"cluster.backend=ray needs Ray ({e}): pip install 'agentloop[ray]'") from None
    return RayBackend(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(overrides_last(list(sys.argv[1:] if argv is None else argv), _value_options(parser)))
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
    if args.command == "envs":
        from agentloop.loops.verifiers_env import VERIFIERS_PIN, setup_venv

        path = setup_venv(args.extra)
        extra = ", " + ", ".join(args.extra) if args.extra else ""
        print(f"agentloop envs setup verifiers: {path} ({VERIFIERS_PIN}{extra}); its Python: {path / 'bin' / 'python'}")
        return 0
    if args.command == "loops":
        from agentloop.loops import list_agent_loops, load_plugin

        for ref in args.plugin:
            load_plugin(ref)
        print("\n".join(list_agent_loops()))
        return 0
    if args.command == "data":
        return _data_prepare(args) if args.data == "prepare" else _data_check(args)
    if args.command == "retriever":
        return _retriever_serve(args)
    if args.command == "learner-node":
        import subprocess

        from agentloop.train.orchestrator.learner_process import node_command

        cmd = node_command(args.run_dir)
        print(f"agentloop learner-node: {' '.join(cmd)}", file=sys.stderr, flush=True)
        return subprocess.call(cmd)
    if args.command == "tools":
        return _tools_serve(args)
    if args.command == "tinker":
        return _tinker_serve(args)
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
            print(f"agentloop: the run stopped early: {result.stopped}; {len(result.records)} episodes ended, "
                  f"{result.summary.get('not_started', 0)} never started; records: {run_dir / 'records.jsonl'}",
                  file=sys.stderr)
            return 1
        episodes, errors = result.summary.get("episodes", 0), result.summary.get("errors", 0)
        if episodes and errors / episodes > cfg.rollout.max_error_rate:
            kinds = ", ".join(f"{k} x{n}" for k, n in sorted(result.summary.get("errors_by_type", {}).items(),
                                                              key=lambda kv: -kv[1]))
            print(f"agentloop rollout: {errors} of {episodes} episodes are error records, above "
                  f"rollout.max_error_rate={cfg.rollout.max_error_rate:g}: {kinds}; records: "
                  f"{run_dir / 'records.jsonl'}", file=sys.stderr)
            return 1
        return 0
    if args.command == "train" and args.dry_run:
        from agentloop.train.orchestrator.loop import dry_run

        dry_run(cfg)
        return 0
    if args.command == "train":
        from agentloop.train.orchestrator.loop import run_train

        run_dir, final = run_train(cfg, force=args.force or args.force_data, backend=_backend(cfg))
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
    if args.command == "bench" and args.bench == "cache":
        from agentloop.bench.cache import run_bench_cache

        run_bench_cache(build_config(args), args)
        return 0
    if args.command == "bench" and args.bench == "gateway":
        from agentloop.bench.gateway import run_bench_gateway

        run_bench_gateway(cfg, args)
        return 0
    if args.command == "bench" and args.bench == "train":
        from agentloop.bench.train import run_bench_train

        run_bench_train(cfg, args)
        return 0
    raise ConfigError(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
