"""Kill-and-resume benchmark of the episode journal (issue 30): `agentloop train` runs SIGKILLed (the whole process
group) at a random moment and resumed with the README's command, against uninterrupted runs with the same seeds.

Usage:
    python benchmarks/resume_bench.py OUT [--runs 20] [--baselines 4] [--steps 6] [--prompts 4] [--samples 4]
                                      [--server-url URL] [--seed 30] [key.sub=value ...]
    python benchmarks/resume_bench.py OUT --report-only      # the tables again from OUT's runs

One CPU SGLang server with the warm-started tiny model is started here (or --server-url is used) and every run
trains against it (`--server-url`, the embedded default's task: tool_agent_loop on calculator_train, asynchronous,
η = 1, the journal on), `--steps` x `--prompts` x `--samples`, no validation, the same rollout and learner seeds.
    baselines  `--baselines` uninterrupted runs with the run's settings, and `--timing-baselines` more with only
               `rollout.max_concurrency` changed (4, 8, 16, ...: the same seeds and prompts, other timing). With
               η = 1 a batch is the first B groups to finish, so timing alone changes which groups share a step;
               on an idle box same-setting runs repeat almost bit for bit, so the timing-varied ones give the
               spread an uninterrupted run really has
    killed     `--runs` runs, each SIGKILLed at a moment drawn uniformly from [0, 0.95 x the same-setting baselines'
               training phase (their steps' time/step_s summed)] after its journal directory appears (the learner
               is ready, the first rollout starts: the preflight and learner start before it hold nothing to
               resume), then resumed with the same command (`agentloop train --run-dir X` + the same flags, the
               README's), to the end
Per killed run: the journal as the kill left it (groups, episodes, model tokens, damaged records), what the resume
reused (its `journal/...` rows: tokens reused, calls and tool calls not made again, finished episodes taken as they
were, groups dropped as too stale), prompts skipped (handed out, never trained, not pending in the final data
state) and trained twice (a uid in two steps' batches, read from the mailbox), the trained episodes' lengths, and
the final weights' distance to each baseline's. Writes OUT/results.json and OUT/RESULTS.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- running


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_server(out: Path) -> tuple[subprocess.Popen, str]:
    """A CPU SGLang server with the warm-started tiny model, in a process of its own."""
    script = (
        "import asyncio, sys, time\nfrom pathlib import Path\n"
        "from agentloop.inference.launcher import LocalServer\n"
        "from agentloop.models.warmstart import ensure_warm_model\n"
        "srv = LocalServer(ensure_warm_model(), device='cpu', log_path=Path(sys.argv[1]) / 'server.log',\n"
        "                  startup_timeout_s=900, max_total_tokens=32768).start()\n"
        "asyncio.run(srv.wait_ready())\n(Path(sys.argv[1]) / 'server.url').write_text(srv.url)\n"
        "try:\n    time.sleep(10 ** 7)\nfinally:\n    srv.stop()\n")
    (out / "server.url").unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", script, str(out)], env=_env(), start_new_session=True)
    deadline = time.monotonic() + 900
    while not (out / "server.url").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start; see {out / 'server.log'}")
        time.sleep(1)
    return proc, (out / "server.url").read_text()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def train_cmd(url: str, model: Path, run_dir: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--server-url", url, "--model", str(model),
            "--loop", "tool_agent_loop", "--run-dir", str(run_dir), f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}", f"rollout.n_samples={args.samples}", "train.val_every=0",
            "train.tensorboard=false", "rollout.seed=1", "learner.seed=1", *extra]


def run_to_end(cmd: list[str], log: Path, timeout_s: float = 1800) -> float:
    t0 = time.monotonic()
    with log.open("ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{cmd} ran past {timeout_s} s; see {log}") from None
    if rc != 0:
        raise RuntimeError(f"exit {rc}; see {log}")
    return time.monotonic() - t0


def run_and_kill(cmd: list[str], log: Path, at_s: float, run_dir: Path) -> dict[str, Any]:
    """Start `cmd`; once its journal directory exists (the learner is ready and the first rollout starts: the
    startup before it, preflight and learner start, holds nothing to resume), SIGKILL its process group `at_s`
    seconds later; the learner must die with it."""
    t0 = time.monotonic()
    with log.open("ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    t_journal = None
    while proc.poll() is None:
        now = time.monotonic()
        if t_journal is None and (run_dir / "journal").is_dir():
            t_journal = now
        if t_journal is not None and now - t_journal >= at_s:
            break
        time.sleep(0.01)
    ended_itself = proc.poll() is not None
    learner = None
    try:
        learner = int(json.loads((run_dir / "mailbox" / "learner.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)
    deadline = time.monotonic() + 30
    while learner is not None and _alive(learner) and time.monotonic() < deadline:
        time.sleep(0.05)
    rows = _rows(run_dir)
    return {"killed_at_s": time.monotonic() - t0,
            "killed_after_journal_s": None if t_journal is None else time.monotonic() - t_journal,
            "ended_before_kill": ended_itself, "learner_outlived": learner is not None and _alive(learner),
            "steps_logged_at_kill": [int(r["step"]) for r in rows],
            "batches_at_kill": sorted(int(p.name.split("-")[1]) for p in (run_dir / "mailbox").glob("step-*")
                                      if (p / "batch.ready").exists()) if (run_dir / "mailbox").is_dir() else []}


# ---------------------------------------------------------------------------- measuring


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.exists() else []


def journal_at_kill(run_dir: Path) -> dict[str, Any]:
    """What the journal holds as the kill left it (groups not dropped, their episodes and model tokens)."""
    from agentloop.journal.reader import read_journal

    jdir = run_dir / "journal"
    if not jdir.is_dir():
        return {"groups": 0, "episodes": 0, "finished_episodes": 0, "tokens": 0, "damaged_records": 0, "bytes": 0}
    state = read_journal(jdir)
    groups = state.groups()
    eps = [e for atts in groups.values() for e in atts[max(atts)]]
    tokens = 0
    for e in eps:
        recs = e.records()
        tokens += sum(r.num_model_tokens for r in recs) if recs is not None else e.model_tokens
    # finished: whole records, or a light DONE (its score; its tokens are its journaled calls, EpisodeLog.finished)
    return {"groups": len(groups), "episodes": len(eps), "finished_episodes": sum(e.finished for e in eps),
            "tokens": tokens, "damaged_records": state.damaged_records, "bytes": state.bytes,
            "torn_tail": any(d.tail for _, d in state.damage)}


def trained(run_dir: Path, steps: int) -> dict[str, Any]:
    """Per step, the uids the learner trained and each trained episode's response length (from the mailbox)."""
    from agentloop.train.handle.mailbox import read_batch
    from agentloop.train.trainer.checkpoint import list_checkpoints, read_meta

    seen: dict[int, list[int]] = {}
    lengths: list[int] = []
    for step in range(1, steps + 1):
        batch = read_batch(run_dir, step)
        uids = batch.uid.tolist()
        for u in set(uids):
            seen.setdefault(u, []).append(step)
        lengths += [len(batch.response_ids(i)) for i in range(len(uids))]
    last = read_meta(list_checkpoints(run_dir / "checkpoints")[-1])
    pos = last.data_position or {}
    pending = set(pos.get("requeue") or [])
    handed = set(range(int(pos.get("next", 0))))
    twice = {u: s for u, s in seen.items() if len(s) > 1}
    skipped = sorted(handed - set(seen) - pending)
    return {"trained_twice": len(twice), "twice": twice, "skipped": len(skipped), "skipped_uids": skipped,
            "pending_at_end": len(pending), "trained_groups": len(seen), "lengths": lengths,
            "final_step": last.step}


def resume_numbers(run_dir: Path, log: Path) -> dict[str, Any]:
    """The resumed process's `journal/...` rows summed, and its plan line."""
    text = log.read_text(errors="replace")
    resumed_at = None
    for line in text.splitlines():
        if "resumed at step" in line:
            resumed_at = int(line.split("resumed at step", 1)[1].split()[0])
    plan = [ln.split("agentloop train: ", 1)[1] for ln in text.splitlines() if "agentloop train: journal:" in ln]
    rows = [r for r in _rows(run_dir) if resumed_at is None or r["step"] >= resumed_at]
    keys = ("tokens_reused", "calls_reused", "effects_reused", "effects_rerun", "episodes_resumed",
            "episodes_reused_finished", "episodes_restarted", "groups_dropped_stale", "episodes_dropped_stale",
            "records_damaged", "episodes_failed_unreplayable", "continuations_exact", "continuations_new_sequence",
            "tokens_journaled_at_resume", "episodes_continued_after_failure")
    sums = {k: sum(r.get(f"journal/{k}", 0.0) for r in rows) for k in keys}
    return {"resumed_at": resumed_at, "plan": plan[-1] if plan else None, **{k: int(v) for k, v in sums.items()}}


def final_weights(run_dir: Path, steps: int) -> Any:
    import torch
    from safetensors.torch import load_file

    d = run_dir / "weights" / f"step-{steps:06d}"
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return torch.cat([tensors[k].float().flatten() for k in sorted(tensors)])


def weight_distances(out: Path, base: list[str], killed: list[str], steps: int, model: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    init = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        init.update(load_file(str(f)))
    w0 = torch.cat([init[k].float().flatten() for k in sorted(init)])
    W = {n: final_weights(out / n, steps) for n in base + killed}

    def dist(a: str, b: str) -> float:
        return float((W[a] - W[b]).norm())

    pairs = [dist(a, b) for i, a in enumerate(base) for b in base[i + 1:]]
    same = [n for n in base if n.startswith("base-")]
    same_pairs = [dist(a, b) for i, a in enumerate(same) for b in same[i + 1:]]
    per_killed = {k: [dist(k, b) for b in base] for k in killed}
    return {"update_norm_baselines": [float((W[b] - w0).norm()) for b in base],
            "baseline_pairwise": pairs, "same_setting_pairwise": same_pairs, "killed_to_baselines": per_killed,
            "killed_to_same_setting": {k: [dist(k, b) for b in same] for k in killed}}


def ks_test(a: list[int], b: list[int]) -> dict[str, float]:
    from scipy import stats

    ks = stats.ks_2samp(a, b)
    mw = stats.mannwhitneyu(a, b, alternative="two-sided")
    return {"ks_statistic": float(ks.statistic), "ks_pvalue": float(ks.pvalue), "mw_pvalue": float(mw.pvalue),
            "n_a": len(a), "n_b": len(b), "mean_a": statistics.mean(a), "mean_b": statistics.mean(b)}


# ---------------------------------------------------------------------------- the report


def _after(kill: dict[str, Any]) -> str:
    a = kill.get("killed_after_journal_s")
    return "-" if a is None else f"{a:.1f}"


def report(out: Path, res: dict[str, Any]) -> str:
    killed, base = res["killed"], res["baselines"]
    lines = ["| run | killed at s (after the journal appeared) | steps logged / batches at kill | journal at kill: "
             "groups, episodes (finished), model tokens, damaged | resumed at | tokens reused | calls / tool calls "
             "not made again | finished taken as were | dropped stale (episodes) | restarted | skipped | "
             "trained twice |",
             "|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for k in killed:
        j, r, t = k["journal_at_kill"], k["resume"], k["trained"]
        lines.append(
            f"| {k['name']} | {k['kill']['killed_at_s']:.1f} ({_after(k['kill'])}) | "
            f"{k['kill']['steps_logged_at_kill'] or '-'} / "
            f"{k['kill']['batches_at_kill'] or '-'} | {j['groups']}, {j['episodes']} ({j['finished_episodes']}), "
            f"{j['tokens']}, {j['damaged_records']}{' (torn tail)' if j.get('torn_tail') else ''} | "
            f"{r['resumed_at']} | {r['tokens_reused']} | {r['calls_reused']} / {r['effects_reused']} | "
            f"{r['episodes_reused_finished']} | {r['groups_dropped_stale']} ({r['episodes_dropped_stale']}) | "
            f"{r['episodes_restarted']} | {t['skipped']} | {t['trained_twice']} |")
    tot = {key: sum(k["resume"][key] for k in killed) for key in ("tokens_reused", "tokens_journaled_at_resume")}
    at_kill = sum(k["journal_at_kill"]["tokens"] for k in killed)
    w = res["weights"]
    pair = w["baseline_pairwise"]
    kd = [statistics.mean(v) for v in w["killed_to_baselines"].values()]
    inside = sum(d <= max(pair) for d in kd) if pair else 0
    identical = sum(min(v) < 1e-4 for v in w.get("killed_to_same_setting", {}).values() if v)
    ks = res["lengths_test"]
    text = [
        f"{len(killed)} killed-and-resumed runs (of {res.get('runs_asked', len(killed))} asked), {len(base)} "
        f"uninterrupted runs; {res['config']}; each killed at a moment drawn uniformly from [0, "
        f"{res.get('kill_window_s', float('nan')):.1f} s] after its journal appeared",
        "",
        "\n".join(lines),
        "",
        f"Totals: prompts skipped {sum(k['trained']['skipped'] for k in killed)}, trained twice "
        f"{sum(k['trained']['trained_twice'] for k in killed)} (uninterrupted runs: skipped "
        f"{sum(b['trained']['skipped'] for b in base)}, twice {sum(b['trained']['trained_twice'] for b in base)}); "
        f"model tokens in the journal at the kills {at_kill}, planned for reuse at the resumes "
        f"{tot['tokens_journaled_at_resume']}, reused {tot['tokens_reused']}.",
        "",
        f"Trained episode lengths (response tokens), killed-and-resumed runs pooled ({ks['n_a']} episodes, mean "
        f"{ks['mean_a']:.2f}) vs uninterrupted ({ks['n_b']}, mean {ks['mean_b']:.2f}): two-sample Kolmogorov-Smirnov "
        f"D = {ks['ks_statistic']:.4f}, p = {ks['ks_pvalue']:.3f}; Mann-Whitney U p = {ks['mw_pvalue']:.3f}.",
        "",
        f"Final weights (L2 distance over all parameters; uninterrupted runs: {len(base)}, of which "
        f"{sum(b['name'].startswith('timing-') for b in base)} with another rollout.max_concurrency): uninterrupted "
        f"runs from each other "
        f"{min(pair):.4g} - {max(pair):.4g} (median {statistics.median(pair):.4g}; their update from the initial "
        f"weights {statistics.mean(w['update_norm_baselines']):.4g}); each killed run's mean distance to the "
        f"uninterrupted ones {min(kd):.4g} - {max(kd):.4g} (median {statistics.median(kd):.4g}); "
        f"{inside} of {len(kd)} within the uninterrupted runs' largest pairwise distance. Same-setting uninterrupted "
        f"runs from each other: {', '.join(f'{d:.3g}' for d in w.get('same_setting_pairwise', []))}; killed runs "
        f"identical to them (distance < 1e-4): {identical} of {len(kd)}." if pair else
        "Final weights: need at least two baselines for a spread.",
    ]
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--baselines", type=int, default=2)
    ap.add_argument("--timing-baselines", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--server-url", default=None)
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--kill-window-s", type=float, default=None,
                    help="kill each run at a moment drawn uniformly from [0, this] seconds after its journal "
                         "appears (default: 0.95 x the same-setting uninterrupted runs' training phase)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no killed run once this many seconds have passed since the script started (the "
                         "report says how many of --runs ran)")
    args, extra = ap.parse_known_args()
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    res: dict[str, Any] = json.loads(res_path.read_text()) if res_path.exists() else {"baselines": [], "killed": []}
    res["runs_asked"] = args.runs
    res["config"] = (f"{args.steps} steps x {args.prompts} prompts x {args.samples} samples, tool_agent_loop on "
                     f"calculator_train, async eta=1, journal on, rollout.seed=1 learner.seed=1, extra {extra}")
    from agentloop.models.warmstart import ensure_warm_model

    model = ensure_warm_model()
    if not args.report_only:
        server = None
        url = args.server_url
        if url is None:
            server, url = start_server(out)
        try:
            done = {b["name"] for b in res["baselines"]}
            for i in range(args.baselines):
                name = f"base-{i}"
                if name in done:
                    continue
                run_dir = out / name
                wall = run_to_end(train_cmd(url, model, run_dir, args, extra), out / f"{name}.log")
                res["baselines"].append({"name": name, "wall_s": wall, "trained": trained(run_dir, args.steps)})
                res_path.write_text(json.dumps(res))
                print(f"{name}: {wall:.0f} s", flush=True)
            for i in range(args.timing_baselines):
                name = f"timing-{i}"
                if name in done:
                    continue
                run_dir = out / name
                conc = [4, 8, 16, 24, 6, 12][i % 6]
                wall = run_to_end(train_cmd(url, model, run_dir, args, [*extra, f"rollout.max_concurrency={conc}"]),
                                  out / f"{name}.log")
                res["baselines"].append({"name": name, "wall_s": wall, "trained": trained(run_dir, args.steps),
                                         "max_concurrency": conc})
                res_path.write_text(json.dumps(res))
                print(f"{name} (rollout.max_concurrency={conc}): {wall:.0f} s", flush=True)
            # the kill window: the training phase of the same-setting uninterrupted runs (from the first rollout to
            # the last update: their steps' time/step_s summed), counted from the moment the journal appears
            same = [b for b in res["baselines"] if b["name"].startswith("base-")] or res["baselines"]
            phase = statistics.mean(sum(r["time/step_s"] for r in _rows(out / b["name"])) for b in same)
            window = args.kill_window_s if args.kill_window_s is not None else 0.95 * phase
            res["kill_window_s"] = window
            rng = random.Random(args.seed)
            moments = [rng.uniform(0.0, window) for _ in range(args.runs)]
            done = {k["name"] for k in res["killed"]}
            for i, at in enumerate(moments):
                name = f"kill-{i:02d}"
                if name in done:
                    continue
                if args.time_budget_s is not None and time.monotonic() - started > args.time_budget_s:
                    print(f"time budget of {args.time_budget_s:.0f} s spent: {len(res['killed'])} of {args.runs} "
                          "killed runs done", flush=True)
                    break
                run_dir = out / name
                cmd = train_cmd(url, model, run_dir, args, extra)
                kill = run_and_kill(cmd, out / f"{name}.log", at, run_dir)
                at_kill = journal_at_kill(run_dir)
                wall = run_to_end(cmd, out / f"{name}.resume.log")
                res["killed"].append({"name": name, "kill": kill, "journal_at_kill": at_kill,
                                      "resume": resume_numbers(run_dir, out / f"{name}.resume.log"),
                                      "resume_wall_s": wall, "trained": trained(run_dir, args.steps)})
                res_path.write_text(json.dumps(res))
                print(f"{name}: killed at {kill['killed_at_s']:.1f} s, {res['killed'][-1]['resume']}", flush=True)
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(60)
    res["lengths_test"] = ks_test([n for k in res["killed"] for n in k["trained"]["lengths"]],
                                  [n for b in res["baselines"] for n in b["trained"]["lengths"]])
    res["weights"] = weight_distances(out, [b["name"] for b in res["baselines"]], [k["name"] for k in res["killed"]],
                                      args.steps, model)
    res_path.write_text(json.dumps(res))
    text = report(out, res)
    (out / "RESULTS.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
