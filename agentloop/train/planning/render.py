"""The plan in words and numbers: its lines for the preflight's "plan:" block, plan.json, and after the run what
was measured next to it (train_summary.json's `plan`).

Map:
    plan_lines        the plan's lines (learner peak, servers' KV pool, per-GPU budget, notes)
    plan_record       the plan's numbers (plan.json)
    served_kv_tokens  after the servers start: each one's KV pool as SGLang reports it (find_key)
    plan_summary      plan.json + what the run measured
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop.train.planning import memory as planner


def plan_lines(plan: planner.Plan) -> list[str]:
    out = []
    mem = plan.learner
    if mem is not None:
        out.append(f"learner    peak {mem.peak:.1f} GiB per rank at {mem.tokens} tokens per micro-batch "
                   f"({mem.parts()}); reserved {mem.need:.1f}, on GPU(s) {plan.learner_gpus}")
    if plan.server_gpus:
        kv = f"KV pool {plan.kv_tokens:,} tokens per server" if plan.kv_tokens is not None else "KV pool: SGLang's"
        out.append(f"servers    on GPU(s) {plan.server_gpus}, {'colocated with' if plan.colocated else 'apart from'} "
                   f"the learner; {kv} (the episodes in flight take {plan.kv_tokens_needed:,})")
    for b in plan.gpus:
        if b.learner_ranks or b.servers:
            out.append(f"GPU {b.index:<6} {b.capacity:.1f} GiB: learner {b.learner:.1f} + servers {b.server:.1f}, "
                       f"{b.left:.1f} left")
    out += [f"note: {n}" for n in plan.notes]
    return out


def plan_record(plan: planner.Plan, machine: str, gpu_gib: list[float], shape: planner.ModelShape) -> dict[str, Any]:
    mem = plan.learner
    return {"machine": machine, "gpu_gib": gpu_gib,
            "learner_peak_gib": round(mem.peak, 3) if mem else None,
            "learner_reserved_gib": round(mem.need, 3) if mem else None,
            "learner_parts_gib": ({k: round(getattr(mem, k), 3)
                                   for k in ("states", "reference", "activations", "logprob_head", "gathered")}
                                  if mem else None),
            "learner_micro_batch_tokens": mem.tokens if mem else None,
            "server_mem_fraction": plan.mem_fraction_static, "server_kv_tokens": plan.kv_tokens,
            "kv_tokens_needed": plan.kv_tokens_needed, "kv_bytes_per_token": shape.kv_bytes_per_token,
            "learner_gpus": plan.learner_gpus, "server_gpus": plan.server_gpus, "weight_sync": plan.weight_sync,
            "max_inflight_per_server": plan.max_inflight_per_server}


def find_key(tree: Any, key: str) -> Any:
    """The first value under `key` anywhere in a JSON tree (None if absent)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for v in tree:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


async def served_kv_tokens(sm: Any) -> list[int | None]:
    """Each server's KV pool in tokens (SGLang's max_total_num_tokens in GET /server_info)."""
    return [find_key(await sm.server_info(i), "max_total_num_tokens") for i in range(len(sm.urls))]


def plan_summary(run_dir: Path, rows: list[dict[str, Any]], kv_tokens: list[int | None]) -> dict[str, Any] | None:
    """plan.json with what the run measured: the learner's peak (learner/perf/peak_memory_gib, the highest of any
    step) and each server's KV pool. None when the run made no plan (CPU)."""
    p = run_dir / "plan.json"
    if not p.is_file():
        return None
    out = json.loads(p.read_text())
    peaks = [r["learner/perf/peak_memory_gib"] for r in rows if isinstance(r.get("learner/perf/peak_memory_gib"),
                                                                             (int, float))]
    reserved = [r["learner/perf/peak_reserved_gib"] for r in rows
                if isinstance(r.get("learner/perf/peak_reserved_gib"), (int, float))]
    out["measured"] = {"learner_peak_gib": max(peaks) if peaks else None,
                       "learner_reserved_gib": max(reserved) if reserved else None,
                       "server_kv_tokens": kv_tokens}
    return out


__all__ = ["find_key", "plan_lines", "plan_record", "plan_summary", "served_kv_tokens"]
