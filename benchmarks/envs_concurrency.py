"""1,000 OpenEnv sessions and 1,000 verifiers episodes in flight in one engine process, against the scripted SGLang
server (no model: the server is never the bottleneck), on this machine.

    .venv/bin/python benchmarks/envs_concurrency.py [--episodes 1000] [--latency-s 1.0] [--out FILE.json]

openenv     openenv_loop, `--episodes` rows, rollout.max_concurrency = episodes, against the calculator OpenEnv server
            (examples/envs/openenv_calculator.py, openenv-core's create_app under uvicorn, one process,
            MAX_CONCURRENT_ENVS 4096): each episode opens a session, resets, calls the calculator, answers, closes
verifiers   verifiers_loop on examples/envs/verifiers_calculator.py (a ToolEnv, verifiers 0.3.1 in its virtualenv):
            `--workers` workers x episodes/workers each, the same two turns through the gateway

The scripted server answers a calculator call on the first turn and `#### 5` on the second (its `turn_marker` is
<tool_response>), each after `--latency-s`, so every episode waits on the model as it would on a GPU. Reported per
side: episodes/s over the whole run, the peak of episodes in flight at once (OpenEnv sessions open / verifiers
episodes running, counted in this process), the engine's event-loop lag p50/p99/max, errors, and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentloop.bench.scripted_server import ScriptedProcess, ScriptedSpec  # noqa: E402
from agentloop.config import load_config  # noqa: E402
from agentloop.data import rows_to_samples  # noqa: E402
from agentloop.loops import (  # noqa: E402
    get_agent_loop,
    openenv_env,
    verifiers_env,
)
from agentloop.models.loading import load_tokenizer_for  # noqa: E402
from agentloop.models.modelzoo import ensure_tiny_model  # noqa: E402
from agentloop.rollout.engine import RolloutEngine  # noqa: E402
from agentloop.server_manager import ServerManager  # noqa: E402

SYSTEM = ("You are a careful assistant. Use the calculator tool for arithmetic. "
          "Finish with the final answer on its own line as `#### <number>`.")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


class Peak:
    def __init__(self) -> None:
        self.now = self.peak = 0

    def up(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def down(self) -> None:
        self.now -= 1


def spec_for(tok, latency_s: float) -> ScriptedSpec:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda t: list(tok.encode(t, add_special_tokens=False)) + [eos]  # noqa: E731
    return ScriptedSpec(script=[enc(CALL), enc("#### 5")], stop_ids=[eos], base_s=latency_s, jitter=0.2,
                        turn_marker=tok.convert_tokens_to_ids("<tool_response>"))


async def run_side(name: str, overrides: list[str], rows: list[dict], model: Path, latency_s: float,
                   peak: Peak) -> dict:
    tok = load_tokenizer_for(load_config(None, [f"model.path=\"{model}\""]), model)
    proc = await ScriptedProcess(spec_for(tok, latency_s)).start()
    try:
        n = len(rows)
        cfg = load_config(None, [f"server.urls=[\"{proc.url}\"]", f"model.path=\"{model}\"",
                                 f"rollout.max_concurrency={n}", "rollout.progress_interval_s=1000",
                                 "sampling.max_new_tokens=64", "manager.max_inflight_per_server=4096", *overrides])
        async with ServerManager(cfg.server.urls, cfg.manager) as sm:
            engine = RolloutEngine(cfg, sm, tok, get_agent_loop(cfg.rollout.loop), progress=False)
            t0 = time.monotonic()
            result = await engine.run(rows_to_samples(rows, source=name), n_samples=1)
            wall = time.monotonic() - t0
    finally:
        await proc.stop()
    s = result.summary
    errors = [r.error for r in result.records if r.error]
    return {"episodes": len(result.records), "wall_s": round(wall, 2),
            "episodes_per_s": round(len(result.records) / wall, 1),
            "peak_in_flight": peak.peak, "errors": len(errors), "first_error": errors[0] if errors else None,
            "mean_reward": s.get("mean_reward"), **{k: s.get(k) for k in s if k.startswith("loop/")}}


def openenv_side(args, model: Path) -> dict:
    port = args.openenv_port
    server = subprocess.Popen([sys.executable, str(ROOT / "examples/envs/openenv_calculator.py"), "--port", str(port)],
                              env={**os.environ, "MAX_CONCURRENT_ENVS": "4096"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the OpenEnv server did not start") from None
                time.sleep(0.5)
        peak = Peak()
        opened, closed = openenv_env.OpenEnvSession.open, openenv_env.OpenEnvSession.close

        async def open_(self):
            await opened(self)
            peak.up()

        async def close_(self):
            if self.ws is not None and not self.ws.closed:
                peak.down()
            await closed(self)

        openenv_env.OpenEnvSession.open, openenv_env.OpenEnvSession.close = open_, close_
        cfg = openenv_env.OpenEnvConfig(url=f"http://127.0.0.1:{port}", episodes=args.episodes, system_prompt=SYSTEM)
        rows = openenv_env.openenv_rows(cfg)
        ov = ["rollout.loop=openenv_loop", f"envs.openenv.url=\"http://127.0.0.1:{port}\"",
              "envs.openenv.observation_role=tool", "envs.openenv.tools=[calculator]", "envs.openenv.max_turns=3",
              "envs.openenv.message_timeout_s=600", "envs.openenv.connect_timeout_s=600"]
        return asyncio.run(run_side("openenv", ov, rows, model, args.latency_s, peak))
    finally:
        server.terminate()
        server.wait(30)


def verifiers_side(args, model: Path, tmp: Path) -> dict:
    env = str(ROOT / "examples/envs/verifiers_calculator.py")
    vargs = {"num_train_examples": args.episodes, "num_eval_examples": 1}
    vcfg = verifiers_env.VerifiersEnvConfig(env=env, args=vargs)
    rows_file = verifiers_env.export_rows(vcfg, "train", tmp / "vf_rows.jsonl")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    peak = Peak()
    run = verifiers_env.VerifiersLoop.run

    async def counted(self, sample, params):
        peak.up()
        try:
            return await run(self, sample, params)
        finally:
            peak.down()

    verifiers_env.VerifiersLoop.run = counted
    per = -(-args.episodes // args.workers)
    ov = ["rollout.loop=verifiers_loop", f"envs.verifiers.env=\"{env}\"", "envs.verifiers.args=" + json.dumps(vargs),
          f"envs.verifiers.workers={args.workers}", f"envs.verifiers.worker_concurrency={per}",
          "envs.verifiers.timeout_s=900"]
    return asyncio.run(run_side("verifiers", ov, rows, model, args.latency_s, peak))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=1000)
    p.add_argument("--latency-s", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--openenv-port", type=int, default=8765)
    p.add_argument("--sides", default="openenv,verifiers")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results_envs/concurrency.json"))
    args = p.parse_args()
    model = ensure_tiny_model()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "agentloop-envs-bench"
    tmp.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version(),
                          "platform": platform.platform()},
              "episodes": args.episodes, "latency_s": args.latency_s}
    for side in args.sides.split(","):
        report[side] = openenv_side(args, model) if side == "openenv" else verifiers_side(args, model, tmp)
        print(side, json.dumps(report[side]), flush=True)
    report["machine"]["load_avg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
