"""A harness per episode vs long-lived harness workers vs the in-process agent, same episodes, one CPU SGLang server.

Usage:
    PYTHONPATH=. .venv/bin/python benchmarks/harness_workers.py AGENTS_ENV [--episodes 16] [--out FILE.md]
AGENTS_ENV is a virtualenv with openai-agents installed (tests/integration/test_harnesses_real.py builds one
under ~/.cache/agentloop/harness-envs/agents_sdk-*). Starts a CPU SGLang server on the shipped warm calculator
model and runs the built-in calculator task (`--episodes` episodes: half as many prompts, 2 samples each) with
openai_agent_loop, chat completions every time:
    in-process      agent.entry=examples/calculator_agent.py:run (the OpenAI SDK in the engine's process)
    per-episode     agent.command=".../agents_sdk.py" with AGENT_API=chat (a process per episode)
    workers         agent.workers=2 agent.worker_concurrency=8, agents_sdk_worker.py with AGENT_API=chat
after one warm-up rollout, and reports the wall time of each rollout, the CPU seconds of this process and of the
agents' processes (RUSAGE_CHILDREN), and the error records. Writes the table to --out (default
benchmarks/RESULTS_harness_workers.md).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


async def rollout(url: str, model: Path, agent: list[str], prompts: int) -> dict:
    from agentloop.config import ManagerConfig, load_config
    from agentloop.data import load_samples
    from agentloop.loops import get_agent_loop
    from agentloop.models.loading import load_tokenizer_for
    from agentloop.rollout.engine import RolloutEngine
    from agentloop.server_manager import ServerManager

    cfg = load_config(None, [f"server.urls=[\"{url}\"]", f"model.path=\"{model}\"", "rollout.loop=openai_agent_loop",
                             "data.builtin=calculator", "sampling.max_new_tokens=160", "agent.timeout_s=600",
                             "rollout.progress_interval_s=1000", *agent])
    tok = load_tokenizer_for(cfg, model)
    async with ServerManager([url], ManagerConfig(health_interval_s=60)) as sm:
        engine = RolloutEngine(cfg, sm, tok, get_agent_loop("openai_agent_loop"), progress=False)
        samples = load_samples(cfg.data)[:prompts]
        c0, k0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.monotonic()
        res = await engine.run(samples, n_samples=2)
        wall = time.monotonic() - t0
    return {"wall_s": wall, "cpu_self_s": cpu(resource.RUSAGE_SELF) - c0,
            "cpu_agents_s": cpu(resource.RUSAGE_CHILDREN) - k0, "episodes": len({r.episode_id for r in res.records}),
            "errors": sum(r.error is not None for r in res.records if r.segment == 0),
            "turns": sum(r.num_turns for r in res.records)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("env", type=Path)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS_harness_workers.md")
    args = ap.parse_args()
    from agentloop.inference.launcher import LocalServer
    from agentloop.models.warmstart import ensure_warm_model

    model = ensure_warm_model()
    python, h = args.env / "bin" / "python", ROOT / "examples" / "harnesses"
    modes = {
        "in-process (agent.entry, OpenAI SDK)": [f"agent.entry=\"{ROOT / 'examples' / 'calculator_agent.py'}:run\""],
        "per-episode process (Agents SDK)": [f"agent.command=\"{python} {h / 'agents_sdk.py'}\"",
                                             "agent.env.AGENT_API=chat"],
        "2 workers x 8 (Agents SDK)": [f"agent.command=\"{python} {h / 'agents_sdk_worker.py'}\"", "agent.workers=2",
                                       "agent.worker_concurrency=8", "agent.env.AGENT_API=chat"],
    }
    server = LocalServer(model, device="cpu", log_path=Path("/tmp/harness_workers_sglang.log"),
                         startup_timeout_s=280).start()
    try:
        asyncio.run(server.wait_ready())
        # a first rollout warms the server (its first requests build kernels): no mode pays for it
        asyncio.run(rollout(server.url, model, modes["in-process (agent.entry, OpenAI SDK)"], 4))
        rows = {}
        for name, agent in modes.items():
            rows[name] = asyncio.run(rollout(server.url, model, agent, args.episodes // 2))
            print(name, rows[name], flush=True)
    finally:
        server.stop()
    lines = [f"# Harness per episode vs long-lived workers ({args.episodes} calculator episodes, chat completions, "
             "one CPU SGLang server, 2-core box)", "",
             "`PYTHONPATH=. python benchmarks/harness_workers.py ~/.cache/agentloop/harness-envs/agents_sdk-*`", "",
             "| mode | wall s | CPU s, engine | CPU s, agent processes | episodes | error records | turns |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['cpu_self_s']:.1f} | {r['cpu_agents_s']:.1f} | "
                     f"{r['episodes']} | {r['errors']} | {r['turns']} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
