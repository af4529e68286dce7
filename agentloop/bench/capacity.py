"""Capacity: thousands of episodes in flight in one engine process, beside a bare client sending the same requests.

`agentloop bench rollout --bench-episodes N` runs, for each workload in `--bench-kinds` (single: one turn of
single_turn_agent_loop; tool: `--bench-turns` turns of tool_agent_loop with the calculator tool), rounds of two
sides against the same servers, the order swapped every round:

    engine   RolloutEngine.stream with `rollout.max_concurrency` = N: the real loop (template, tokenize, parse
             tool calls, run the tool, score with the data source's reward), N episodes in flight,
             `--bench-waves` x N episodes in all (GRPO groups of `--bench-group` episodes)
    bare     a plain aiohttp loop with a semaphore of N, sending each episode's requests (pre-tokenized, no
             template, no tools, no scoring) one turn after the other: the floor the engine is held to
    journal  (with `--bench-journal`) the engine side with the episode journal on (agentloop.journal, as
             `agentloop train` keeps it; its `journal.*` settings apply): every generate call, tool call and
             finished record journaled to the side's run dir. journal/engine episodes/s is the journal's cost; the
             side also reports the bytes it wrote per episode (what an episode in flight holds on disk at most,
             before compaction) and the records a full queue dropped

Each side runs in a fresh child process (`python -m agentloop.bench.capacity SPEC.json`): its memory, garbage
collector and connections start from nothing, so one side's heap never counts for the other. Measured per side:
wall time and episodes/s; event-loop lag p50/p99/max (a 50 ms timer); the process's CPU seconds and the seconds it
waited for a CPU while runnable (/proc/self/schedstat: other processes on the machine); garbage-collector pauses;
and memory per in-flight episode: (RSS at the moment most episodes were in flight - RSS before the first one
started) / that many episodes. The report gives every round and, per workload, the medians over rounds and
the machine's load average.

Same requests on both sides: the engine's requests are what its loop builds; the bare client's are the same
token ids, rebuilt from one probe episode run before the rounds (prompt ids + the model and tool tokens the
scripted server's answers make). With a scripted server the latency of an answer is drawn from its input ids,
so both sides meet the same latencies, and engine/bare measures what the engine costs, nothing else.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

SIDES = ("bare", "engine")
JOURNAL_SIDE = "journal"


# ---------------------------------------------------------------------------------------------- probes


def rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def runqueue_wait_s() -> float:
    """Seconds this process's threads have waited on a run queue (runnable, no CPU free) since they started."""
    total = 0.0
    try:
        for task in Path("/proc/self/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return float("nan")
    return total


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine() -> dict[str, Any]:
    out: dict[str, Any] = {"nproc": os.cpu_count(), "loadavg": list(os.getloadavg())}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                out["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return out


class SideProbe:
    """Lag, CPU, run-queue wait, GC pauses and memory of one side, from `start()` to `stop()`."""

    def __init__(self, inflight: Any):
        from agentloop.rollout.looplag import LoopLagMonitor

        self.inflight = inflight  # () -> episodes in flight now
        self.lag = LoopLagMonitor()
        self.gc_pauses: list[float] = []
        self._gc_t0 = 0.0
        self.peak_inflight = 0
        self.rss_at_peak = 0.0
        self.rss_max = 0.0
        self._task: asyncio.Task | None = None

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_pauses.append(time.perf_counter() - self._gc_t0)

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            n, rss = self.inflight(), rss_mb()
            self.rss_max = max(self.rss_max, rss)
            if n > self.peak_inflight:
                self.peak_inflight, self.rss_at_peak = n, rss

    def start(self) -> None:
        gc.collect()
        self.gc0 = [g["collections"] for g in gc.get_stats()]
        self.rss0 = rss_mb()
        self.cpu0, self.wait0, self.t0 = cpu_s(), runqueue_wait_s(), time.perf_counter()
        self.load0 = os.getloadavg()[0]
        gc.callbacks.append(self._gc)
        self.lag.start()
        self._task = asyncio.create_task(self._sample())

    async def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        gc.callbacks.remove(self._gc)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.lag.stop()
        lag = self.lag.gauges()
        per = (self.rss_at_peak - self.rss0) * 1024 / self.peak_inflight if self.peak_inflight else float("nan")
        return {
            "wall_s": wall, "cpu_s": cpu_s() - self.cpu0, "runqueue_wait_s": runqueue_wait_s() - self.wait0,
            "lag_p50_ms": lag["loop/lag_p50_ms"], "lag_p99_ms": lag["loop/lag_p99_ms"],
            "lag_max_ms": lag["loop/lag_max_ms"], "own_lag_p50_ms": lag["loop/own_lag_p50_ms"],
            "own_lag_p99_ms": lag["loop/own_lag_p99_ms"], "own_lag_max_ms": lag["loop/own_lag_max_ms"],
            "gc_pauses": len(self.gc_pauses), "gc_total_ms": 1000 * sum(self.gc_pauses),
            "gc_max_ms": 1000 * max(self.gc_pauses, default=0.0),
            "gc_collections_by_generation": [g["collections"] - c for g, c in zip(gc.get_stats(), self.gc0)],
            "peak_inflight": self.peak_inflight, "rss_mb_before": self.rss0, "rss_mb_at_peak": self.rss_at_peak,
            "rss_mb_max": self.rss_max, "kb_per_inflight_episode": per,
            "loadavg_1m_start": self.load0, "loadavg_1m_end": os.getloadavg()[0],
        }


# ---------------------------------------------------------------------------------------------- workloads


def bench_rows(n_prompts: int, seed: int) -> list[dict[str, Any]]:
    """Calculator rows (a system prompt, a question, the calculator tool in tools_kwargs)."""
    from agentloop.data.tasks import calculator_rows

    return calculator_rows(n=n_prompts, seed=seed, split="bench")


def scripted_turns(tokenizer: Any, turns: int) -> dict[str, Any]:
    """The scripted server's answers: `turns - 1` calculator calls, then a final answer (each ending with EOS)."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 24 + 5"}}\n</tool_call>'
    eos = tokenizer.eos_token
    ids = [list(tokenizer.encode(call + eos, add_special_tokens=False))] * (turns - 1)
    ids.append(list(tokenizer.encode("37 * 24 + 5 = 893.\n#### 893" + eos, add_special_tokens=False)))
    marker = tokenizer.convert_tokens_to_ids("<tool_response>")
    return {"script": ids, "turn_marker": marker if isinstance(marker, int) and marker >= 0 else None,
            "stop_ids": [tokenizer.eos_token_id]}


def turn_tails(response_ids: list[int], mask: list[int]) -> list[list[int]]:
    """What each turn's request adds to the prompt: [] for the first, then the response up to the end of each
    run of environment tokens (mask 0 after mask 1)."""
    tails = [[]]
    for i in range(1, len(mask)):
        if mask[i - 1] == 0 and mask[i] == 1:
            tails.append(list(response_ids[:i]))
    return tails


# ---------------------------------------------------------------------------------------------- one side


async def _engine_side(spec: dict[str, Any]) -> dict[str, Any]:
    from agentloop.config import load_config
    from agentloop.data import rows_to_samples
    from agentloop.loops import get_agent_loop
    from agentloop.models.loading import load_tokenizer_for
    from agentloop.rollout.engine import RolloutEngine
    from agentloop.rollout.run import load_plugins
    from agentloop.server_manager import ServerManager

    cfg = load_config(spec["config"], spec["overrides"])
    load_plugins(cfg)
    journal = None
    if spec.get("journal_dir"):  # the journal side: the engine as `agentloop train` runs it, journal on
        from agentloop.journal import Journal, journal_header

        journal = Journal.open(Path(spec["journal_dir"]), cfg.journal, journal_header(cfg, spec["model"], "bench"))
    if spec.get("forced_tool"):
        _register_forced_parser()
    tokenizer = load_tokenizer_for(cfg, Path(spec["model"]))
    loop_cls = get_agent_loop(cfg.rollout.loop)
    samples = rows_to_samples(bench_rows(spec["prompts"], spec["seed"]), source="bench")
    async with ServerManager(spec["urls"], cfg.manager) as sm:
        engine = RolloutEngine(cfg, sm, tokenizer, loop_cls, progress=False)
        # untimed warm-up: reward workers start, the template is measured, the first connections open
        warm = rows_to_samples(bench_rows(1, 7), source="warm-up")
        await engine.run(warm, n_samples=1)
        stream = engine.stream(journal=journal)
        probe = SideProbe(lambda: engine._active)
        errors: dict[str, int] = {}
        episodes = tokens = turns = 0
        probe.start()
        try:
            for s in samples:
                stream.submit(s, spec["group"])
            for _ in samples:
                outcome = await stream.next()
                for r in outcome.records:
                    episodes += 1
                    tokens += r.num_model_tokens
                    turns += r.num_turns
                    if r.error:
                        kind = r.error.split(":", 1)[0]
                        errors[kind] = errors.get(kind, 0) + 1
                if outcome.cancelled:
                    errors["cancelled"] = errors.get("cancelled", 0) + outcome.n
        finally:
            result = await probe.stop()
            await stream.close()
            if journal is not None:
                journal.close()
                w = journal.writer.stats
                result["journal"] = {"bytes": w["bytes"], "records": w["records"], "writes": w["writes"],
                                     "fsyncs": w["fsyncs"], "dropped_queue_full": w["dropped_queue_full"],
                                     "bytes_per_episode": w["bytes"] / max(1, episodes),
                                     "failed": repr(journal.writer.error) if journal.writer.error else None}
        g = sm.gauges()
    result.update({"episodes": episodes, "errors": sum(errors.values()), "errors_by_type": errors,
                   "model_tokens": tokens, "turns_per_episode": turns / max(1, episodes),
                   "requests": int(g["server/requests"]), "retries": int(g["server/retries"]),
                   "ejections": int(g["server/ejections"]), "conn_opened": int(g["server/conn_opened"]),
                   "connect_retries": int(g["server/connect_retries"]), "conn_wait_p99_s": g["server/conn_wait_p99_s"],
                   "conn_wait_max_s": g["server/conn_wait_max_s"], "connect_max_s": g.get("server/connect_max_s", 0.0),
                   "steps_deferred": engine.gate.budget.deferred})
    return result


async def _bare_side(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    requests: list[list[list[int]]] = spec["requests"]  # per episode, per turn: input ids
    sp = spec["sampling_params"]
    urls = spec["urls"]
    sem = asyncio.Semaphore(spec["inflight"])
    inflight = 0
    errors = 0
    tokens = 0
    probe = SideProbe(lambda: inflight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def episode(i: int, turns: list[list[int]]) -> None:
            nonlocal inflight, errors, tokens
            async with sem:
                inflight += 1
                try:
                    for ids in turns:
                        payload = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                                   "logprob_start_len": -1}
                        async with session.post(urls[i % len(urls)] + "/generate", json=payload,
                                                timeout=aiohttp.ClientTimeout(total=600)) as r:
                            body = await r.json(content_type=None)
                            tokens += len(body["meta_info"]["output_token_logprobs"])
                except Exception:  # noqa: BLE001 - counted: the bare side reports its failures as numbers
                    errors += 1
                finally:
                    inflight -= 1

        probe.start()
        try:
            await asyncio.gather(*(episode(i, t) for i, t in enumerate(requests)))
        finally:
            result = await probe.stop()
    n_turns = sum(len(t) for t in requests)
    result.update({"episodes": len(requests), "errors": errors, "errors_by_type": {"error": errors} if errors else {},
                   "model_tokens": tokens, "turns_per_episode": n_turns / max(1, len(requests)),
                   "requests": n_turns, "retries": 0, "steps_deferred": 0})
    return result


def side_main(argv: list[str] | None = None) -> int:
    """Child process: run the side described by the spec file, print its result as one JSON line."""
    from agentloop.util.runtime import run_async

    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    except (ValueError, OSError):
        pass
    side = _engine_side if spec["side"] == "engine" else _bare_side
    result = run_async(side(spec))
    result["episodes_per_s"] = result["episodes"] / result["wall_s"] if result["wall_s"] > 0 else 0.0
    print("RESULT " + json.dumps(result), flush=True)
    return 0


async def run_side(spec: dict[str, Any], path: Path, timeout_s: float) -> dict[str, Any]:
    """Run one side in a child process (bounded by `timeout_s`) and return its result."""
    path.write_text(json.dumps(spec))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "agentloop.bench.capacity", str(path),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"bench side {spec['side']} ran past {timeout_s:.0f}s") from None
    for line in out.decode().splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"bench side {spec['side']} failed (exit {proc.returncode}):\n{err.decode()[-3000:]}")


# ---------------------------------------------------------------------------------------------- the rounds


def summarize_kind(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per side, and the median of the per-round engine/bare ratios (and journal/engine)."""
    out: dict[str, Any] = {"rounds": len(rounds)}
    sides = SIDES + ((JOURNAL_SIDE,) if JOURNAL_SIDE in rounds[0] else ())
    for side in sides:
        rows = [r[side] for r in rounds]
        out[side] = {k: median(row[k] for row in rows) for k in (
            "episodes_per_s", "wall_s", "lag_p50_ms", "lag_p99_ms", "lag_max_ms", "own_lag_p50_ms", "own_lag_p99_ms",
            "own_lag_max_ms", "cpu_s", "runqueue_wait_s",
            "gc_total_ms", "gc_max_ms", "kb_per_inflight_episode", "peak_inflight")}
        out[side]["errors"] = sum(row["errors"] for row in rows)
        out[side]["episodes"] = sum(row["episodes"] for row in rows)
        out[side]["cpu_ms_per_episode"] = median(1000 * row["cpu_s"] / max(1, row["episodes"]) for row in rows)
    eng = [r["engine"] for r in rounds]
    # the engine's connections: the longest any request waited for one, SYNs retried, servers ejected (all rounds)
    out["engine"]["conn_wait_max_s"] = max((row.get("conn_wait_max_s", 0.0) for row in eng), default=0.0)
    out["engine"]["connect_max_s"] = max((row.get("connect_max_s", 0.0) for row in eng), default=0.0)
    out["engine"]["connect_retries"] = sum(row.get("connect_retries", 0) for row in eng)
    out["engine"]["ejections"] = sum(row.get("ejections", 0) for row in eng)
    out["ratio"] = median(r["engine"]["episodes_per_s"] / r["bare"]["episodes_per_s"] for r in rounds)
    if JOURNAL_SIDE in rounds[0]:
        js = [r[JOURNAL_SIDE]["journal"] for r in rounds]
        out["journal_ratio"] = median(r[JOURNAL_SIDE]["episodes_per_s"] / r["engine"]["episodes_per_s"] for r in rounds)
        out["journal_ratios"] = [r[JOURNAL_SIDE]["episodes_per_s"] / r["engine"]["episodes_per_s"] for r in rounds]
        out[JOURNAL_SIDE]["bytes_per_episode"] = median(j["bytes_per_episode"] for j in js)
        out[JOURNAL_SIDE]["dropped_queue_full"] = sum(j["dropped_queue_full"] for j in js)
        out[JOURNAL_SIDE]["fsyncs"] = median(j["fsyncs"] for j in js)
    return out


def _overrides(kind: str, args: Any, scripted: bool) -> list[str]:
    n = args.bench_episodes
    out = [f"rollout.max_concurrency={n}", f"manager.max_inflight_per_server={n}",
           f"sampling.max_new_tokens={args.bench_new_tokens_per_turn}",
           "sampling.ignore_eos=" + ("false" if scripted else "true"), f"rollout.n_samples={args.bench_group}"]
    if kind == "single":
        out.append("rollout.loop=single_turn_agent_loop")
    else:
        out += ["rollout.loop=tool_agent_loop", f"tools.max_turns={args.bench_turns}",
                f"tools.max_tokens_per_turn={args.bench_new_tokens_per_turn}"]
        if not scripted:  # a real model seldom calls the tool: read every turn as a call (bench tools' parser)
            out.append("tools.parser=bench_forced_calculator")
    return out


async def _probe_episode(cfg: Any, sm: Any, tokenizer: Any, row: dict[str, Any], forced: bool) -> Any:
    """One episode of the workload, run here (untimed): its record gives the bare client its requests."""
    from agentloop.data import rows_to_samples
    from agentloop.loops import get_agent_loop
    from agentloop.rollout.engine import RolloutEngine

    if forced:
        _register_forced_parser()
    res = await RolloutEngine(cfg, sm, tokenizer, get_agent_loop(cfg.rollout.loop), progress=False).run(
        rows_to_samples([row], source="probe"), n_samples=1)
    rec = res.records[0]
    if rec.error:
        raise RuntimeError(f"the bench's probe episode failed: {rec.error}")
    return rec


def _register_forced_parser() -> None:
    from agentloop.bench.forced import forced_parser
    from agentloop.tools.parsers import register_parser

    register_parser("bench_forced_calculator", forced_parser("calculator"), override=True)


def _prompt_ids(tokenizer: Any, row: dict[str, Any], tools: list[dict] | None) -> list[int]:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    return list(tokenizer.encode(tokenizer.apply_chat_template(row["prompt"], **kwargs), add_special_tokens=False))


async def run_capacity(cfg: Any, args: Any, run_dir: Path, sm: Any, tokenizer: Any, model_path: Path) -> dict[str, Any]:
    """Every round of every workload (see the module docstring); the report with per-kind medians."""
    from agentloop.config import dump_config, load_config
    from agentloop.tools.registry import get_tool

    scripted = bool(args.scripted_server)
    config_path = run_dir / "capacity_config.yaml"
    config_path.write_text(dump_config(cfg.model_copy(update={"server": cfg.server.model_copy(
        update={"urls": list(sm.urls)})})))
    n, waves, group = args.bench_episodes, args.bench_waves, args.bench_group
    prompts = max(1, n * waves // group)
    report: dict[str, Any] = {"episodes_in_flight": n, "waves": waves, "group": group, "kinds": {},
                              "turns": args.bench_turns}
    for kind in [k.strip() for k in args.bench_kinds.split(",") if k.strip()]:
        overrides = _overrides(kind, args, scripted)
        kcfg = load_config(config_path, overrides)
        schemas = [get_tool("calculator")(kcfg.tools).schema] if kind == "tool" else None
        probe_row = bench_rows(1, 999)[0]
        rec = await _probe_episode(kcfg, sm, tokenizer, probe_row, forced=not scripted and kind == "tool")
        if list(rec.prompt_ids) != _prompt_ids(tokenizer, probe_row, schemas):
            raise RuntimeError("the bare client's prompt ids differ from the engine's (template mismatch)")
        tails = turn_tails(list(rec.response_ids), list(rec.response_mask))
        rounds = []
        for rnd in range(args.bench_rounds):
            seed = 1000 + rnd  # fresh prompts every round: no side meets prompts the other one cached
            rows = bench_rows(prompts, seed)
            ids = [_prompt_ids(tokenizer, r, schemas) for r in rows]
            requests = [[p + t for t in tails] for p in ids for _ in range(group)]
            base = {"urls": list(sm.urls), "model": str(model_path), "config": str(config_path),
                    "overrides": overrides, "prompts": prompts, "seed": seed, "group": group, "inflight": n,
                    "forced_tool": not scripted and kind == "tool"}
            row: dict[str, Any] = {"round": rnd}
            sides = SIDES + ((JOURNAL_SIDE,) if getattr(args, "bench_journal", False) else ())
            for side in (sides if rnd % 2 == 0 else sides[::-1]):
                await sm.flush_cache()
                spec = {**base, "side": side}
                if side == JOURNAL_SIDE:
                    spec["side"] = "engine"
                    spec["journal_dir"] = str(run_dir / f"journal_{kind}_{rnd}")
                if side == "bare":
                    spec.update(requests=requests, sampling_params={
                        "max_new_tokens": args.bench_new_tokens_per_turn, "ignore_eos": not scripted,
                        "temperature": 1.0, "skip_special_tokens": False, "no_stop_trim": True})
                row[side] = await run_side(spec, run_dir / f"capacity_{kind}_{side}_{rnd}.json",
                                           args.bench_side_timeout_s)
                r = row[side]
                print(f"  capacity {kind:<6} round {rnd} {side:<6} {r['episodes']} episodes ({r['errors']} errors) in "
                      f"{r['wall_s']:.1f}s, {r['episodes_per_s']:.0f}/s, peak {r['peak_inflight']} in flight, lag "
                      f"p50/p99/max {r['lag_p50_ms']:.1f}/{r['lag_p99_ms']:.1f}/{r['lag_max_ms']:.0f} ms (own "
                      f"{r['own_lag_p50_ms']:.1f}/{r['own_lag_p99_ms']:.1f}/{r['own_lag_max_ms']:.0f}), cpu "
                      f"{r['cpu_s']:.1f}s, waited for a cpu {r['runqueue_wait_s']:.1f}s, "
                      f"load {r['loadavg_1m_end']:.1f}"
                      + (f", journal {r['journal']['bytes_per_episode']:.0f} B/episode, "
                         f"{r['journal']['dropped_queue_full']} records dropped" if "journal" in r else ""),
                      file=sys.stderr, flush=True)
            row["ratio"] = row["engine"]["episodes_per_s"] / row["bare"]["episodes_per_s"]
            rounds.append(row)
        report["kinds"][kind] = {"rounds": rounds, "median": summarize_kind(rounds)}
    return report


def format_capacity(report: dict[str, Any]) -> str:
    lines = [f"capacity: {report['episodes_in_flight']} episodes in flight, {report['waves']} waves, groups of "
             f"{report['group']}; medians over rounds"]
    head = (f"  {'kind':<6} {'side':<7} {'ep/s':>7} {'wall s':>7} {'lag p50/p99/max ms':>20} "
            f"{'own lag p50/p99/max':>20} {'cpu ms/ep':>9} {'cpu wait s':>10} {'KB/episode':>10} {'errors':>6}")
    lines.append(head)
    for kind, k in report["kinds"].items():
        med = k["median"]
        for side in SIDES + ((JOURNAL_SIDE,) if JOURNAL_SIDE in med else ()):
            m = med[side]
            lag = f"{m['lag_p50_ms']:.1f}/{m['lag_p99_ms']:.1f}/{m['lag_max_ms']:.0f}"
            own = f"{m['own_lag_p50_ms']:.1f}/{m['own_lag_p99_ms']:.1f}/{m['own_lag_max_ms']:.0f}"
            lines.append(f"  {kind:<6} {side:<7} {m['episodes_per_s']:>7.0f} {m['wall_s']:>7.1f} {lag:>20} {own:>20} "
                         f"{m['cpu_ms_per_episode']:>9.2f} {m['runqueue_wait_s']:>10.1f} "
                         f"{m['kb_per_inflight_episode']:>10.1f} {m['errors']:>6}")
        e = med["engine"]
        lines.append(f"  {kind:<6} engine/bare episodes/s {med['ratio']:.3f} (median of {med['rounds']} rounds; "
                     f"target >= 0.95); engine: longest wait for a connection {e.get('conn_wait_max_s', 0.0):.2f} s "
                     f"(in line for a slot, connecting), longest connect {e.get('connect_max_s', 0.0):.2f} s, "
                     f"{e.get('connect_retries', 0)} connects retried, {e.get('ejections', 0)} ejections")
        if JOURNAL_SIDE in med:
            j = med[JOURNAL_SIDE]
            lines.append(f"  {kind:<6} journal/engine episodes/s {med['journal_ratio']:.3f} (rounds "
                         f"{', '.join(f'{x:.3f}' for x in med['journal_ratios'])}; target >= 0.98); journal "
                         f"{j['bytes_per_episode']:.0f} bytes per episode, {j['dropped_queue_full']} records dropped "
                         f"(queue full), {j['fsyncs']:.0f} fsyncs per side")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(side_main())
