"""A CPU SGLang server's start, spawned vs forked by the zygote (agentloop.inference.sglang_cpu.zygote), side by side:
the tiny model, `--rounds` alternating pairs, each server timed from start() to the end of wait_ready() (it answered
/health and a one-token /generate), then its stop(). The zygote's own imports happen before the first round.

    PYTHONPATH=. .venv/bin/python benchmarks/zygote_start.py --rounds 3 --out benchmarks/results_zygote.json
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

from agentloop.inference.launcher import LocalServer
from agentloop.inference.sglang_cpu import zygote
from agentloop.models.modelzoo import ensure_tiny_model


def one(model: Path, log: Path, forked: bool) -> dict:
    if not forked:
        os.environ.pop(zygote.ENV, None)
    t0 = time.monotonic()
    server = LocalServer(model, device="cpu", log_path=log, startup_timeout_s=600).start()
    assert isinstance(server.process, zygote.ForkedProcess) == forked, type(server.process)
    asyncio.run(server.wait_ready())
    ready = time.monotonic() - t0
    t1 = time.monotonic()
    server.stop()
    return {"forked": forked, "ready_s": round(ready, 2), "stop_s": round(time.monotonic() - t1, 2),
            "exit": server.process.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="zygote-bench-"))
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
                    os.environ[zygote.ENV] = str(sock)
                rows.append({"round": r, **one(model, work / f"s{r}-{int(forked)}.log", forked)})
                print(rows[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait()
    med = {k: statistics.median(x["ready_s"] for x in rows if x["forked"] == (k == "forked"))
           for k in ("forked", "spawned")}
    out = {"zygote_imports_s": round(zygote_ready, 1), "rows": rows, "median_ready_s": med,
           "ratio_spawned_over_forked": round(med["spawned"] / med["forked"], 2),
           "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
