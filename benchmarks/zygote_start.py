"""A process's start, spawned vs forked by its zygote (agentloop.util.zygote), side by side, for either program:

  --program server   a CPU SGLang server (agentloop.inference.sglang_cpu.zygote), timed from LocalServer.start() to
                     the end of wait_ready() (it answered /health and a one-token /generate), then stopped;
  --program learner  a one-rank CPU learner (agentloop.train.trainer.zygote), started as `agentloop train` starts it
                     (LearnerProcess) and timed from start() to its "ready" in the mailbox (model loaded, sharded,
                     probe done), then stopped (STOP in the mailbox, its exit code back).

The tiny model, `--rounds` alternating pairs. The zygote's own imports happen before the first round.

    PYTHONPATH=. .venv/bin/python benchmarks/zygote_start.py --program server --rounds 3 \\
        --out benchmarks/results_zygote.json
    PYTHONPATH=. .venv/bin/python benchmarks/zygote_start.py --program learner --rounds 3 \\
        --out benchmarks/results_learner_zygote.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from agentloop.models.modelzoo import ensure_tiny_model
from agentloop.util.forked import ForkedProcess


def server(model: Path, work: Path, forked: bool) -> dict:
    from agentloop.inference.launcher import LocalServer

    t0 = time.monotonic()
    s = LocalServer(model, device="cpu", log_path=work / "server.log", startup_timeout_s=600).start()
    assert isinstance(s.process, ForkedProcess) == forked, type(s.process)
    asyncio.run(s.wait_ready())
    ready = time.monotonic() - t0
    t1 = time.monotonic()
    s.stop()
    return {"forked": forked, "ready_s": round(ready, 2), "stop_s": round(time.monotonic() - t1, 2),
            "exit": s.process.returncode}


def learner(model: Path, run: Path, forked: bool) -> dict:
    from agentloop.config import dump_config, load_config
    from agentloop.train.handle.mailbox import MailboxClient
    from agentloop.train.orchestrator.learner_process import LearnerProcess

    cfg = load_config(None, ["learner.device=cpu", "learner.poll_s=0.05"])
    (run / "config.yaml").write_text(dump_config(cfg))
    lp = LearnerProcess(cfg, run, model)
    t0 = time.monotonic()
    proc = lp.start()
    try:
        assert isinstance(proc, ForkedProcess) == forked, type(proc)
        client = MailboxClient(run, process=proc, poll_s=0.02)
        client.wait_ready(600)
        ready = time.monotonic() - t0
        client.stop()
        code = lp.stop(grace_s=120)
    finally:
        lp.stop(grace_s=0)
    return {"forked": forked, "ready_s": round(ready, 2), "exit": code}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", choices=("server", "learner"), default="server")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.program == "server":
        from agentloop.inference.sglang_cpu import zygote

        env_var, one = zygote.ENV, server
    else:
        from agentloop.train.trainer import zygote

        env_var, one = zygote.ZYGOTE_ENV, learner
    model = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix=f"zygote-bench-{args.program}-"))
    sock = work / "zygote.sock"
    proc = zygote.start(sock, work / "zygote.log")
    rows = []
    try:
        t0 = time.monotonic()
        while not sock.exists():  # the zygote's imports, once
            assert proc.poll() is None, (work / "zygote.log").read_text()[-2000:]
            time.sleep(0.1)
        zygote_ready = time.monotonic() - t0
        for r in range(args.rounds):
            for forked in (r % 2 == 0, r % 2 != 0):  # alternate which goes first
                if forked:
                    os.environ[env_var] = str(sock)
                else:
                    os.environ.pop(env_var, None)
                (work / f"{r}-{int(forked)}").mkdir()
                rows.append({"round": r, **one(model, work / f"{r}-{int(forked)}", forked)})
                print(rows[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait()
    med = {k: statistics.median(x["ready_s"] for x in rows if x["forked"] == (k == "forked"))
           for k in ("forked", "spawned")}
    out = {"program": args.program, "zygote_imports_s": round(zygote_ready, 1), "rows": rows, "median_ready_s": med,
           "ratio_spawned_over_forked": round(med["spawned"] / med["forked"], 2),
           "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
