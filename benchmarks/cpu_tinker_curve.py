"""tinker-cookbook's RL recipe through `agentloop tinker serve` beside the same recipe through `agentloop train`
(issue 32's CPU target): reward curves, several seeds of each, matched settings, on the tiny model.

    python benchmarks/cpu_tinker_curve.py --out DIR [--steps 12] [--seeds 3] [--groups 8] [--group-size 8]

Parts, in the order they run:
    warm start   the random tiny model earns a flat -0.1 on the cookbook's arithmetic env (it never ends with the
                 renderer's stop sequence), so both arms start from one model fine-tuned on the env's own problems:
                 the cookbook's role_colon renderer renders them and its `build_supervised_example` says which
                 tokens train (the last answer and its stop sequence), agentloop's plain-torch `train_sft` trains
                 them for few enough steps that the answers are right only part of the time (cached by spec hash)
    cookbook     `python -m tinker_cookbook.recipes.math_rl.train env=arithmetic ...`, the cookbook's code
                 unchanged, against one `agentloop tinker serve`; one run per seed (the seeds differ by their
                 sampling and their LoRA init)
    agentloop    `agentloop train` on the same problems (the cookbook's ArithmeticDataset batches 0..steps-1 as a
                 data file: the prompt text is the renderer's, checked token for token), the same reward (a
                 plugin that runs the cookbook's own ArithmeticEnv.step on the response's tokens, and its flat
                 -0.1 for an answer cut at max_tokens), and the recipe's settings: synchronous, group-centred
                 advantages without std scaling, the mean over sequences of their token sums (the recipe's
                 importance-sampling loss is the sum over the batch: the same gradient over the batch's size, so
                 Adam's eps is scaled by it), Adam (0.9, 0.95) without clipping, LoRA of the same rank, alpha and
                 targets, temperature 1
    verdict      per step, each arm's mean over seeds; the cookbook's last-steps mean lies within the agentloop
                 runs' spread (min..max of their own last-steps means) widened by the cookbook's standard error

Writes DIR/curves.json (every run's per-step reward, the verdict), DIR/curves.md (a table of the means) and
DIR/curves.html (the curves).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STOP = "\n\nUser:"
LONG_FRACTION = 0.5
"""Share of the warm start's answers that repeat the sum past max_tokens (see warm_model)."""
REWARD_PLUGIN = '''"""The cookbook's arithmetic reward for `agentloop train` (benchmarks/cpu_tinker_curve.py's)."""
import asyncio
import functools

from transformers import AutoTokenizer

MODEL = {model!r}


@functools.lru_cache(maxsize=1)
def _renderer():
    from tinker_cookbook import renderers
    tok = AutoTokenizer.from_pretrained(MODEL)
    return tok, renderers.get_renderer("role_colon", tokenizer=tok)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    tok, renderer = _renderer()
    ended = STOP_TEXT in solution_str or (tok.eos_token and tok.eos_token in solution_str)
    if not ended:  # cut at max_tokens: the cookbook ends the episode with its flat context_overflow_reward
        return {{"score": -0.1, "correct": 0.0, "format": 0.0, "cut": 1.0}}
    env = ArithmeticEnv(int(extra_info["x"]), int(extra_info["y"]), renderer=renderer,
                        convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
    step = asyncio.run(env.step(tok.encode(solution_str, add_special_tokens=False)))
    return {{"score": float(step.reward), "correct": float(step.metrics["correct"]),
            "format": float(step.metrics["format"]), "cut": 0.0}}


STOP_TEXT = {stop!r}
'''


def _log(msg: str) -> None:
    print(f"[cpu_tinker_curve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TINKER_API_KEY", "tml-local")
    env["TINKER_TELEMETRY"] = "0"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# ---------------------------------------------------------------- the warm start

def warm_model(base: Path, steps: int, n_traces: int, cache: Path) -> Path:
    """The tiny model fine-tuned on the cookbook's arithmetic problems as its renderer renders them (cached)."""
    import hashlib

    spec = {"steps": steps, "n_traces": n_traces, "lr": 1e-3, "batch": 64, "seed": 7, "base": base.name, "v": 2,
            "long_fraction": LONG_FRACTION}
    out = cache / f"arith-warm-{hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    import random

    import torch
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop.models.warmstart.sft import train_sft
    from agentloop.models.warmstart.spec import Trace, WarmStartSpec

    torch.manual_seed(spec["seed"])
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(base)
    renderer = renderers.get_renderer("role_colon", tokenizer=tok)
    rng = random.Random(spec["seed"])
    traces = []
    for _ in range(n_traces):
        x, y = rng.randint(0, 100), rng.randint(0, 100)
        # a share of the answers ramble on past max_tokens (the sum, repeated): the recipe's format term then has
        # something to teach from the first step, beside the sums the model gets right by chance or skill
        answer = " ".join([str(x + y)] * 4) if rng.random() < LONG_FRACTION else str(x + y)
        convo = [*ArithmeticEnv.standard_fewshot_prefix(), {"role": "user", "content": f"What is {x} + {y}?"},
                 {"role": "assistant", "content": answer}]
        mi, weights = renderer.build_supervised_example(
            convo, train_on_what=renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE)
        ids = mi.to_ints()
        traces.append(Trace(messages=convo, uses_tool=False, answer=x + y, ids=ids,
                            mask=[int(w > 0) for w in weights.tolist()]))
    ws = WarmStartSpec(n_traces=n_traces, steps=steps, batch_size=spec["batch"], lr=spec["lr"], warmup_steps=20,
                       seed=spec["seed"], max_len=128)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    t = time.monotonic()
    losses = train_sft(model, traces, ws, pad_id=tok.pad_token_id or 0)
    _log(f"warm start: {steps} SFT steps in {time.monotonic() - t:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "arith_warm.json").write_text(json.dumps({**spec, "loss_first": losses[0], "loss_last": losses[-1]}))
    tmp.rename(out)
    return out


# ---------------------------------------------------------------- the two arms

def data_file(model: Path, steps: int, groups: int, path: Path) -> None:
    """The cookbook's ArithmeticDataset batches 0..steps-1 as agentloop rows, prompts rendered by its renderer."""
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset, ArithmeticEnv
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    renderer = renderers.get_renderer("role_colon", tokenizer=tok)
    ds = ArithmeticDataset(batch_size=groups, renderer=renderer, group_size=1, n_batches=steps)
    rows = []
    for i in range(steps):
        for builder in ds.get_batch(i):
            x, y = builder.env_thunk.args
            convo = [*ArithmeticEnv.standard_fewshot_prefix(), {"role": "user", "content": f"What is {x} + {y}?"}]
            ids = renderer.build_generation_prompt(convo).to_ints()
            text = tok.decode(ids)
            if tok.encode(text, add_special_tokens=False) != ids:
                raise SystemExit(f"the renderer's prompt does not survive a decode/encode round trip: {text!r}")
            rows.append({"data_source": "cookbook_arithmetic", "prompt": [{"role": "user", "content": text}],
                         "reward_model": {"ground_truth": str(x + y)}, "extra_info": {"x": int(x), "y": int(y)}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def cookbook_run(url: str, model: Path, log: Path, a: argparse.Namespace, seed: int) -> list[float]:
    cmd = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={model}",
           "renderer_name=role_colon", "env=arithmetic", f"group_size={a.group_size}", f"groups_per_batch={a.groups}",
           f"max_tokens={a.max_tokens}", f"lora_rank={a.rank}", f"learning_rate={a.lr}", f"max_steps={a.steps}",
           "eval_every=0", "save_every=0", "loss_fn=importance_sampling", f"seed={seed}", f"base_url={url}",
           f"log_path={log}", "behavior_if_log_dir_exists=delete"]
    _run(cmd, log, "the cookbook's run")
    return read_cookbook(log)["reward"]


def _run(cmd: list[str], run: Path, what: str) -> None:
    """`cmd` to the end, its output in RUN.out beside the run's dir; SystemExit naming that file if it fails."""
    out_path = run.parent / f"{run.name}.out"
    with out_path.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, timeout=3600).returncode
    if rc != 0:
        raise SystemExit(f"{what} exited {rc}: {out_path}")


def read_cookbook(log: Path) -> dict[str, list[float]]:
    """A cookbook run's per-step mean reward and share of answers ending with the stop sequence (its metrics)."""
    rows = [json.loads(ln) for ln in (log / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if "env/all/reward/total" in r]
    return {"reward": [float(r["env/all/reward/total"]) for r in rows],
            "format": [float(r["env/all/format"]) for r in rows]}


def agentloop_run(model: Path, data: Path, plugin: Path, run: Path, a: argparse.Namespace, seed: int) -> list[float]:
    cmd = [sys.executable, "-m", "agentloop.cli", "train", "--quiet", "--model", str(model),
           "--loop", "single_turn_agent_loop", "--data", str(data), "--run-dir", str(run),
           "data.apply_chat_template=false", f"train.steps={a.steps}", f"train.prompts_per_step={a.groups}",
           f"rollout.n_samples={a.group_size}", f"sampling.max_new_tokens={a.max_tokens}",
           "sampling.stop=" + json.dumps([STOP]), "sampling.temperature=1.0", "train.schedule=sync",
           "train.val_every=0", "train.tensorboard=false", f"learner.lr={a.lr}", "learner.betas=[0.9,0.95]",
           # the recipe's Adam eps (1e-8) is on a loss summed over the batch's sequences; ours is their mean
           f"learner.adam_eps={1e-8 / (a.groups * a.group_size):.6g}", "learner.grad_clip=null",
           "learner.lora.enabled=true",
           f"learner.lora.rank={a.rank}", f"learner.lora.alpha={a.alpha}", "algo.norm_adv_by_std=false",
           "algo.loss_agg_mode=seq-mean-token-sum", f"reward.custom={plugin}:compute_score",
           # the train preset's KL to the reference (0.1) and lr warm-up (2 steps) are not the recipe's: a first run
           # with them kept learned the format term, then gave it back to the reference (0.9 -> 0.73 of the answers
           # stopping, against the recipe's 1.0)
           "algo.kl_coef=0", "learner.warmup_steps=0",
           "learner.checkpoint_every=null", f"learner.seed={seed}", f"learner.lora.seed={seed}", f"rollout.seed={seed}"]
    _run(cmd, run, "`agentloop train`")
    return read_agentloop(run)["reward"]


def read_agentloop(run: Path) -> dict[str, list[float]]:
    """An `agentloop train` run's per-step mean reward (metrics.jsonl) and share of answers ending with the stop
    sequence (the reward plugin's `format`, in each step's episode records)."""
    from agentloop.records import read_records

    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    fmt = []
    for r in rows:
        recs = [e for e in read_records(run / "rollouts" / f"step-{int(r['step']):06d}.jsonl") if e.reward_info]
        fmt.append(statistics.fmean(float(e.reward_info.get("format", 0.0)) for e in recs))
    return {"reward": [float(r["train/reward"]) for r in rows], "format": fmt}


def collect(out: Path, cookbook_dir: Path) -> dict[str, dict[str, list[list[float]]]]:
    """Every run's curves, read back from its files: the cookbook's from `cookbook_dir`, agentloop's from `out`."""
    arms: dict[str, dict[str, list[list[float]]]] = {}
    for arm, base, read in (("cookbook", cookbook_dir, read_cookbook), ("agentloop", out, read_agentloop)):
        runs = sorted((d for d in base.glob(f"{arm}-*") if d.is_dir()), key=lambda d: int(d.name.rsplit("-", 1)[1]))
        curves = [read(d) for d in runs]
        arms[arm] = {k: [c[k] for c in curves] for k in ("reward", "format")}
    return arms


def serve(run: Path, model: Path) -> tuple[subprocess.Popen, str]:
    err = (run / "serve.err").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "agentloop.cli", "tinker", "serve", "--model", str(model),
                             "--port", "0", "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=err, env=_env(),
                             text=True)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise SystemExit(f"agentloop tinker serve did not come up: {line!r} ({run / 'serve.err'})")
    return proc, line.split(" on ", 1)[1].split()[0]


# ---------------------------------------------------------------- the verdict

def verdict(cook: list[list[float]], ours: list[list[float]], tail: int) -> dict[str, Any]:
    """The cookbook arm's mean over its last `tail` steps (mean over seeds) against the agentloop runs' spread of
    the same figure, widened by the cookbook mean's standard error."""
    def last(c: list[float]) -> float:
        return statistics.fmean(c[-tail:])

    cook_last, ours_last = [last(c) for c in cook], [last(c) for c in ours]
    cm = statistics.fmean(cook_last)
    se = statistics.stdev(cook_last) / len(cook_last) ** 0.5 if len(cook_last) > 1 else 0.0
    lo, hi = min(ours_last), max(ours_last)
    return {"tail_steps": tail, "cookbook_last_means": cook_last, "agentloop_last_means": ours_last,
            "cookbook_mean": cm, "cookbook_se": se, "agentloop_mean": statistics.fmean(ours_last),
            "agentloop_range": [lo, hi],
            "first_steps_mean": {"cookbook": statistics.fmean(statistics.fmean(c[:tail]) for c in cook),
                                 "agentloop": statistics.fmean(statistics.fmean(c[:tail]) for c in ours)},
            "within": lo - se <= cm <= hi + se}


def judge(arms: dict[str, dict[str, list[list[float]]]], tail: int) -> dict[str, Any]:
    """The verdict on the reward and on the stop share (the recipe's format term: far less noisy than the
    reward, whose correct answers are rare on this model); matched when both are within."""
    out = {k: verdict(arms["cookbook"][k], arms["agentloop"][k], tail) for k in ("reward", "format")}
    out["matched"] = all(v["within"] for v in out.values())
    return out


def render(out: Path, result: dict[str, Any]) -> str:
    """curves.md and curves.html from a curves.json's content; returns the tables."""
    arms = result["arms"]
    steps = max(len(c) for arm in arms.values() for c in arm["reward"])
    text = []
    for key, what in (("reward", "mean reward of the step's episodes"),
                      ("format", "share of the step's answers ending with the stop sequence")):
        lines = [f"{what}, mean of seeds (min..max)", "",
                 "| step | cookbook via `agentloop tinker serve` | `agentloop train` |", "|---|---|---|"]
        for s in range(steps):
            cells = []
            for arm in ("cookbook", "agentloop"):
                vals = [c[s] for c in arms[arm][key] if len(c) > s]
                cells.append(f"{statistics.fmean(vals):+.3f} ({min(vals):+.3f}..{max(vals):+.3f})" if vals else "")
            lines.append(f"| {s + 1} | {cells[0]} | {cells[1]} |")
        text.append("\n".join(lines))
    (out / "curves.md").write_text("\n\n".join(text) + "\n")
    from agentloop.report.plots import write_curves_html

    charts = []
    for key, what in (("reward", "reward"), ("format", "share ending with the stop sequence")):
        means = {arm: [(s + 1, statistics.fmean(c[s] for c in arms[arm][key] if len(c) > s)) for s in range(steps)]
                 for arm in ("cookbook", "agentloop") if arms[arm][key]}
        seeds = {f"{arm} {i}": [(s + 1, v) for s, v in enumerate(c)] for arm in ("cookbook", "agentloop")
                 for i, c in enumerate(arms[arm][key])}
        charts += [(f"{what}: mean over seeds", means), (f"{what}: each seed", seeds)]
    write_curves_html(out / "curves.html", "tinker-cookbook math_rl (arithmetic): the Tinker service vs agentloop "
                      "train (CPU, tiny model)", charts, note=json.dumps(result.get("verdict", {})))
    return "\n\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8, help="groups per batch (prompts per step)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=10, help="the answer and the 5-token stop sequence fit")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=32.0, help="the Tinker service's LoRA alpha (its default)")
    ap.add_argument("--warm-steps", type=int, default=150)
    ap.add_argument("--warm-traces", type=int, default=8192)
    ap.add_argument("--tail", type=int, default=4, help="last steps averaged for the verdict")
    ap.add_argument("--arms", default="cookbook,agentloop")
    ap.add_argument("--cookbook-from", type=Path, help="read the cookbook arm's runs from this earlier OUT dir")
    ap.add_argument("--render", action="store_true", help="only read OUT's runs back, judge, write the files")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.render:
        finish(a.out, a.cookbook_from or a.out, {"settings": {k: str(v) for k, v in vars(a).items()}}, a.tail)
        return
    from agentloop.models.modelzoo import ensure_tiny_model

    cache = Path(os.environ.get("AGENTLOOP_CACHE", Path.home() / ".cache" / "agentloop")) / "models"
    model = warm_model(Path(ensure_tiny_model()), a.warm_steps, a.warm_traces, cache)
    _log(f"model {model}")
    data, plugin = a.out / "arithmetic.jsonl", a.out / "cookbook_reward.py"
    data_file(model, a.steps, a.groups, data)
    plugin.write_text(REWARD_PLUGIN.format(model=str(model), stop=STOP))
    result: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                              "model": str(model)}
    arms = a.arms.split(",")
    if "cookbook" in arms:
        svc_dir = a.out / "service"
        shutil.rmtree(svc_dir, ignore_errors=True)
        svc_dir.mkdir()
        proc, url = serve(svc_dir, model)
        try:
            for seed in range(a.seeds):
                t = time.monotonic()
                curve = cookbook_run(url, model, a.out / f"cookbook-{seed}", a, seed)
                _log(f"cookbook seed {seed}: {time.monotonic() - t:.0f} s, reward {[round(x, 3) for x in curve]}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    if "agentloop" in arms:
        for seed in range(a.seeds):
            run = a.out / f"agentloop-{seed}"
            shutil.rmtree(run, ignore_errors=True)
            t = time.monotonic()
            curve = agentloop_run(model, data, plugin, run, a, seed)
            _log(f"agentloop seed {seed}: {time.monotonic() - t:.0f} s, reward {[round(x, 3) for x in curve]}")
    finish(a.out, a.cookbook_from or a.out, result, a.tail)


def finish(out: Path, cookbook_dir: Path, result: dict[str, Any], tail: int) -> None:
    """Read every run back, judge, write curves.json / .md / .html."""
    result["arms"] = collect(out, cookbook_dir)
    result["cookbook_dir"] = str(cookbook_dir)
    if all(result["arms"][arm]["reward"] for arm in ("cookbook", "agentloop")):
        result["verdict"] = judge(result["arms"], tail)
        _log(f"verdict: {json.dumps(result['verdict'])}")
    (out / "curves.json").write_text(json.dumps(result, indent=1))
    print(render(out, result))


if __name__ == "__main__":
    main()
