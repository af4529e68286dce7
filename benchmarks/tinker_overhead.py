"""The Tinker service's overhead: a forward_backward + optim_step round trip through the tinker SDK (HTTP,
protobuf, futures, the service's queue) against the same calls on the backend directly, same batch, same model
shape, side by side in one run (alternating rounds, so load on the machine hits both alike).

    python benchmarks/tinker_overhead.py --model tiny --device cpu --out benchmarks/results_tinker
    python benchmarks/tinker_overhead.py --model qwen2.5-0.5b-shape --device cuda --out DIR   (random weights)

The service runs in a process of its own, as `agentloop tinker serve` does (this script started again with
--serve, without a sampler), and the SDK and the direct backend in this one: in one process the SDK's thread, the
service's event loop and its training thread would share one interpreter lock, a cost no deployment pays (--in-process
measures that way). Needs the tinker SDK (`agentloop[tinker]`). No SGLang server: only training calls are timed.
Prints the medians and the ratio (sdk / direct); writes tinker_overhead_<model>_<device>.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, a model shape (qwen2.5-0.5b-shape) or a local HF dir")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds of each, alternating (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds of each first (allocator, clocks)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per forward_backward")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank")
    ap.add_argument("--out", default="benchmarks/results_tinker", help="directory of the JSON result")
    ap.add_argument("--in-process", action="store_true", help="the service in this process (a thread of its own)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the service's own process
    args = ap.parse_args()

    import numpy as np
    import tinker
    from aiohttp import web
    from tinker import types

    from agentloop.tinker.backend import ModelSpec, TrainingModel
    from agentloop.tinker.config import TinkerServiceConfig
    from agentloop.tinker.server import TinkerService, resolve_model_path
    from agentloop.tinker.wire import Datum, FwdBwdRequest

    model_path = resolve_model_path(args.model)
    cfg = TinkerServiceConfig(model=str(model_path), device=args.device, dtype=args.dtype, port=0,
                              run_dir=str(Path(args.out) / "run"), max_lora_rank=max(32, args.rank))
    service = TinkerService(cfg, sampler=None, model_path=model_path)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def up() -> None:
        runner = web.AppRunner(service.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"], holder["port"] = runner, runner.addresses[0][1]
        started.set()

    if args.serve:  # the service's process: say the port, serve until the parent closes our stdin
        spans = _record_spans(TrainingModel)
        loop.run_until_complete(up())
        print(f"PORT {holder['port']}", flush=True)

        async def until_stdin_closes() -> None:
            await loop.run_in_executor(None, sys.stdin.read)
            await service.close()
            await holder["runner"].cleanup()

        loop.run_until_complete(until_stdin_closes())
        (Path(args.out) / "service_spans.json").write_text(json.dumps(spans))
        return
    child = None
    if args.in_process:
        thread = threading.Thread(target=lambda: (loop.run_until_complete(up()), loop.run_forever()), daemon=True)
        thread.start()
        if not started.wait(120):
            raise SystemExit("the service did not start in 120 s")
    else:
        child = subprocess.Popen([sys.executable, __file__, "--serve", "--model", args.model, "--device", args.device,
                                  "--dtype", args.dtype, "--rank", str(args.rank), "--out", args.out],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = child.stdout.readline()
        if not line.startswith("PORT "):
            raise SystemExit(f"the service's process did not start: {line!r}")
        holder["port"] = int(line.split()[1])
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    rng = np.random.default_rng(0)
    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    seqs = [rng.integers(3, vocab, args.seq_len + 1).tolist() for _ in range(args.batch)]
    sdk_batch = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                             loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * args.seq_len}) for s in seqs]
    direct_req = FwdBwdRequest(model_id="direct", seq_id=0, loss_fn="cross_entropy", data=[
        Datum(tokens=s[:-1], inputs={"target_tokens": np.asarray(s[1:]), "weights": np.ones(args.seq_len, np.float32)})
        for s in seqs])
    adam = types.AdamParams(learning_rate=1e-5)

    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{holder['port']}")
    tc = sc.create_lora_training_client(base_model=str(model_path), rank=args.rank)
    tc = tc.result() if callable(getattr(tc, "result", None)) else tc  # SDK 0.38 hands back a future of it
    # built on the service's training thread too: transformers' from_pretrained keeps global init state (its
    # meta-device context), so two threads loading at once broke one of the loads
    direct_spans = _record_spans(TrainingModel)  # the direct calls' own times, beside the service's
    direct = service.pool.submit(TrainingModel, ModelSpec(base_model=str(model_path), model_path=str(model_path),
                                                          lora_rank=args.rank, lora_alpha=cfg.lora_alpha),
                                 args.device, args.dtype).result()

    def sync() -> None:
        if args.device == "cuda":
            import torch

            torch.cuda.synchronize()

    rounds: list[tuple[float, float]] = []  # the SDK rounds' (start, end), time.time() (the service's spans too)

    def sdk_round() -> float:
        t0, w0 = time.perf_counter(), time.time()
        fb = tc.forward_backward(sdk_batch, "cross_entropy")
        op = tc.optim_step(adam)
        fb.result()
        op.result()
        rounds.append((w0, time.time()))
        return time.perf_counter() - t0

    def direct_round() -> float:
        t0 = time.perf_counter()
        direct.forward_backward(direct_req)
        direct.optim_step(adam)
        sync()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        sdk_round()
        direct_round()
    sdk_t, direct_t = [], []
    for _ in range(args.rounds):
        sdk_t.append(sdk_round())
        direct_t.append(direct_round())
    sdk_m, direct_m = statistics.median(sdk_t), statistics.median(direct_t)
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "batch": args.batch,
              "service": "in-process" if args.in_process else "own process",
              "seq_len": args.seq_len, "lora_rank": args.rank, "rounds": args.rounds,
              "sdk_round_s": sdk_t, "direct_round_s": direct_t, "sdk_median_s": sdk_m, "direct_median_s": direct_m,
              "ratio": sdk_m / direct_m, "overhead_pct": 100 * (sdk_m / direct_m - 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tinker_overhead_{args.model.replace('/', '_')}_{args.device}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"forward_backward+optim_step round trip, {args.model} on {args.device}, batch {args.batch}x{args.seq_len}, "
          f"LoRA r{args.rank}: through the SDK {sdk_m * 1000:.1f} ms, direct {direct_m * 1000:.1f} ms, ratio "
          f"{sdk_m / direct_m:.3f} ({result['overhead_pct']:+.1f}%) -> {path}")
    sc.close("success")
    if child is not None:
        child.stdin.close()
        child.wait(60)
        child.stdout.close()
        spans_file = out / "service_spans.json"
        if spans_file.is_file():  # where an SDK round's time went: before, in and after the service's calls
            spans = json.loads(spans_file.read_text())
            result["sdk_round_parts_ms"] = _round_parts(rounds[-args.rounds:], spans)
            result["direct_parts_ms"] = {k: round(1e3 * statistics.median(
                e - b for n, b, e in direct_spans[-2 * args.rounds:] if n == k), 2)
                for k in ("forward_backward", "optim_step")}
            path.write_text(json.dumps(result, indent=1))
            print("SDK rounds, median ms: " + json.dumps(result["sdk_round_parts_ms"]) + "; direct calls: "
                  + json.dumps(result["direct_parts_ms"]))
        return
    asyncio.run_coroutine_threadsafe(service.close(), loop).result(60)
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


def _record_spans(cls) -> list[tuple[str, float, float]]:
    """Wrap `cls`'s forward_backward and optim_step (in the service's process) to record each call's (name, start,
    end) in time.time(), CUDA synchronised at the end so the span holds the device's work."""
    spans: list[tuple[str, float, float]] = []
    for name in ("forward_backward", "optim_step"):
        fn = getattr(cls, name)

        def timed(self, *a, _fn=fn, _name=name):
            t = time.time()
            out = _fn(self, *a)
            if str(getattr(self, "device", "cpu")).startswith("cuda"):
                import torch

                torch.cuda.synchronize()
            spans.append((_name, t, time.time()))
            return out

        setattr(cls, name, timed)
    return spans


def _round_parts(rounds: list[tuple[float, float]], spans: list) -> dict[str, float]:
    """Per SDK round, from the client's start to the service's forward_backward start (`to_service`), the
    forward_backward, the gap to optim_step, optim_step, and from its end to the client's end (`back`): medians."""
    parts: dict[str, list[float]] = {k: [] for k in ("to_service", "forward_backward", "gap", "optim_step", "back")}
    for w0, w1 in rounds:
        fb = [s for s in spans if s[0] == "forward_backward" and w0 <= s[1] <= w1]
        op = [s for s in spans if s[0] == "optim_step" and w0 <= s[1] <= w1]
        if len(fb) != 1 or len(op) != 1:
            continue
        (_, f0, f1), (_, o0, o1) = fb[0], op[0]
        for k, v in (("to_service", f0 - w0), ("forward_backward", f1 - f0), ("gap", o0 - f1),
                     ("optim_step", o1 - o0), ("back", w1 - o1)):
            parts[k].append(1e3 * v)
    return {k: round(statistics.median(v), 2) for k, v in parts.items() if v}


if __name__ == "__main__":
    main()
