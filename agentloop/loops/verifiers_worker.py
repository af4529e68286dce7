"""The verifiers worker: run by the Python of a virtualenv that holds verifiers (never by agentloop's own: verifiers
needs openai >= 2.9, sglang pins 2.8.0), so it imports nothing from agentloop and only the standard library besides
verifiers and its dependencies.

    python verifiers_worker.py export --env SPEC --args JSON --split train|eval [--n N] --out FILE
        the environment's dataset (or eval_dataset) as verl rows (JSON lines): its prompt messages as the
        environment formats them (system prompt, few-shot), its answer as the ground truth, and answer, info, task
        and example_id as JSON in extra_info["verifiers"]; data_source "verifiers", ability the environment's id
    python verifiers_worker.py serve --env SPEC --args JSON [--sampling-args JSON]
        a long-lived worker of agentloop's protocol (agentloop/loops/agent_workers.py): per episode, the
        environment's own `run_rollout(input, client, "policy", sampling_args)` (its turns, tools, stop conditions,
        then its rubric) against that episode's gateway session, and {"reward": r, "metrics": {...}} on
        AGENTLOOP_RESULT_FD. A rollout that ended in verifiers' error state for the model's doing (its ModelError:
        an empty or invalid response) is scored as verifiers' own evaluation scores it (the rubric's reward, the
        error named in the result); any other error state (ToolError, InfraError, ...), a rubric whose reward
        function raised or gave no number (verifiers logs it and scores 0.0), or an exception is {"error": "..."}
        with verifiers' own message

SPEC: an installed environment module (`vf-my-env`, `my_env`: verifiers' own load_environment resolves it) or a
path to a .py file defining `load_environment(**kwargs)`.
"""

import argparse
import asyncio
import contextvars
import importlib.util
import json
import logging
import math
import os
import ssl
import sys
import traceback

_EPISODE_ERRORS = contextvars.ContextVar("verifiers_episode_errors", default=None)
"""The error log lines verifiers writes while an episode's task runs (its rubric logs a reward function that raised or
returned no number, and scores it 0.0): the worker makes such an episode an error record instead."""


class _EpisodeErrors(logging.Handler):
    def emit(self, record):
        errors = _EPISODE_ERRORS.get()
        if errors is not None and record.levelno >= logging.ERROR:
            errors.append(record.getMessage())


def load_env(spec, args):
    import verifiers as vf

    if spec.endswith(".py") or os.sep in spec:
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise SystemExit(f"verifiers environment file {spec!r} does not exist")
        sys.path.insert(0, os.path.dirname(path))
        mod_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        if not hasattr(module, "load_environment"):
            raise SystemExit(f"{spec} defines no load_environment(**kwargs)")
        env = module.load_environment(**args)
    else:
        env = vf.load_environment(spec, **args)
    if not isinstance(env, vf.Environment):
        raise SystemExit(f"load_environment of {spec} returned {type(env).__name__}, not a verifiers Environment")
    return env


def _plain(value):
    """Messages and other pydantic objects of verifiers as JSON data."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def export(ns):
    env = load_env(ns.env, json.loads(ns.args))
    n = ns.n if ns.n is not None else -1
    ds = env.get_dataset(n) if ns.split == "train" else env.get_eval_dataset(n)
    env_id = os.path.splitext(os.path.basename(ns.env))[0] if ns.env.endswith(".py") else ns.env
    count = 0
    with open(ns.out, "w") as f:
        for i, row in enumerate(ds):
            prompt = _plain(row["prompt"])
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            messages = [{"role": m["role"], "content": m.get("content") or ""} for m in prompt]
            info = row.get("info") or {}
            keep = {"answer": row.get("answer", ""), "info": info if isinstance(info, str) else json.dumps(info),
                    "task": row.get("task") if isinstance(row.get("task"), dict) else None,
                    "example_id": row.get("example_id", i)}
            f.write(json.dumps({"data_source": "verifiers", "prompt": messages, "ability": env_id,
                                "reward_model": {"style": "verifiers", "ground_truth": str(row.get("answer", ""))},
                                "extra_info": {"split": ns.split, "index": i, "verifiers": json.dumps(keep)}}) + "\n")
            count += 1
    print(f"exported {count} rows of {ns.env} ({ns.split})", file=sys.stderr)


class Worker:
    def __init__(self, env, sampling_args):
        import verifiers as vf
        from openai import AsyncOpenAI  # noqa: F401 - imported once, here

        self.env = env
        self.sampling_args = sampling_args
        self.model_errors = {c.__name__ for c in _subclasses(vf.ModelError)}
        logging.getLogger("verifiers").addHandler(_EpisodeErrors())
        self.ssl = ssl.create_default_context()
        self.results = os.fdopen(int(os.environ["AGENTLOOP_RESULT_FD"]), "w")
        os.set_inheritable(self.results.fileno(), False)

    def send(self, obj):
        self.results.write(json.dumps(obj) + "\n")
        self.results.flush()

    async def episode(self, msg):
        import httpx
        from openai import AsyncOpenAI
        from verifiers.clients import OpenAIChatCompletionsClient

        task = msg["task"]
        out = {"id": msg["id"], "result": None}
        errors = []
        _EPISODE_ERRORS.set(errors)
        try:
            raw = (task.get("extra_info") or {}).get("verifiers")
            if raw is None:
                raise ValueError("the row has no extra_info['verifiers'] (make rows with `--env verifiers:...`)")
            row = json.loads(raw) if isinstance(raw, str) else raw
            info = row.get("info") or {}
            rollout_input = {"prompt": task["messages"], "answer": row.get("answer", ""),
                             "info": json.loads(info) if isinstance(info, str) and info else info,
                             "example_id": row.get("example_id", task.get("index", 0))}
            if row.get("task"):  # a task payload (a JSON object) when the dataset has one
                rollout_input["task"] = row["task"]
            http = httpx.AsyncClient(verify=self.ssl, timeout=None)
            async with AsyncOpenAI(base_url=msg["openai_base_url"], api_key=msg["api_key"], max_retries=0,
                                   http_client=http) as oai:
                output = await self.env.run_rollout(rollout_input, OpenAIChatCompletionsClient(oai), "policy",
                                                    dict(self.sampling_args))
            error = output.get("error")
            reward = output.get("reward")
            rubric = [e for e in errors if e.startswith("Error calling reward function")]
            if rubric:  # verifiers would score it 0.0: a reward function that raised or gave no number
                out = {"id": msg["id"], "error": f"verifiers rubric: {rubric[0]}"}
            elif error and _error_name(error) not in self.model_errors:
                out = {"id": msg["id"], "error": f"verifiers rollout error: {_error_text(error)}"}
            elif reward is None or not isinstance(reward, (int, float)) or isinstance(reward, bool) \
                    or not math.isfinite(reward):
                out = {"id": msg["id"], "error": f"verifiers rubric gave no reward (got {reward!r}); metrics "
                                                 f"{output.get('metrics')}"}
            else:
                metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
                if error:  # the model's fault (verifiers' ModelError): scored as verifiers' evaluation scores it
                    metrics["verifiers_model_error"] = 1.0
                out["result"] = {"reward": float(reward), "metrics": metrics,
                                 "stop_condition": output.get("stop_condition"),
                                 "verifiers_error": _error_text(error) if error else None}
        except asyncio.CancelledError:
            return  # agentloop cancelled it (its deadline passed): no answer is expected
        except Exception as e:  # noqa: BLE001 - the episode's failure, reported to agentloop with verifiers' words
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            out = {"id": msg["id"], "error": f"verifiers: {tb}"}
        self.send(out)

    async def serve(self):
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        running = {}
        while line := await reader.readline():
            msg = json.loads(line)
            if msg["type"] == "episode":
                task = running[msg["id"]] = asyncio.create_task(self.episode(msg))
                task.add_done_callback(lambda _, i=msg["id"]: running.pop(i, None))
            elif msg["type"] == "cancel" and msg["id"] in running:
                running[msg["id"]].cancel()
        for task in list(running.values()):  # stdin closed: agentloop is done with this worker
            task.cancel()


def _subclasses(cls):
    out = {cls}
    for sub in cls.__subclasses__():
        out |= _subclasses(sub)
    return out


def _error_name(error):
    return error.get("error") if isinstance(error, dict) else type(error).__name__


def _error_text(error):
    if isinstance(error, dict):
        return f"{error.get('error', error.get('type', ''))}: {error.get('message', error)}"
    return str(error)


def main():
    p = argparse.ArgumentParser(prog="verifiers_worker")
    sub = p.add_subparsers(dest="mode", required=True)
    ex = sub.add_parser("export")
    sv = sub.add_parser("serve")
    for s in (ex, sv):
        s.add_argument("--env", required=True)
        s.add_argument("--args", default="{}")
    ex.add_argument("--split", choices=["train", "eval"], default="train")
    ex.add_argument("--n", type=int)
    ex.add_argument("--out", required=True)
    sv.add_argument("--sampling-args", default="{}")
    ns = p.parse_args()
    if ns.mode == "export":
        export(ns)
        return
    env = load_env(ns.env, json.loads(ns.args))
    asyncio.run(Worker(env, json.loads(ns.sampling_args)).serve())


if __name__ == "__main__":
    main()
