"""The GPU-sized defaults: the memory plan (agentloop.train.planning.memory) for the run's workload, and the keys it
sizes, the user's value where one was set (a key in a --config file, a preset or an override counts as set).

Map:
    Derived      a key the plan sets (or would set: then it is only shown)
    derive       the plan for the machine, and the keys it sizes
    apply_plan   write the derived values into the keys the user did not set
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentloop.config import Config
from agentloop.train.planning import memory as planner


@dataclass
class Derived:
    """A key the plan sets (or would set, when the user set it: then it is only shown)."""

    key: str
    value: Any
    why: str
    user_set: bool


def _workload(cfg: Config, kind: str, longest_prompt: int, ctx: int, max_new_tokens: int) -> planner.Workload:
    t, r = cfg.train, cfg.rollout
    window = (t.max_staleness + 1) if t.schedule == "async" else 1
    episodes = window * t.prompts_per_step * r.n_samples  # the admission rule's most groups in flight
    if _set(r, "max_concurrency"):
        episodes = min(r.max_concurrency, episodes)
    response = max_new_tokens if kind == "single" else min(cfg.tools.max_response_tokens, ctx - longest_prompt)
    return planner.Workload(episodes=episodes, group_size=r.n_samples, prompt_tokens=longest_prompt,
                            response_tokens=max(1, response))


def _set(section: Any, key: str) -> bool:
    return key in section.model_fields_set


def derive(cfg: Config, kind: str, ctx: int, longest_prompt: int, gpu_gib: list[float],
           model: planner.ModelShape) -> tuple[planner.Plan, list[Derived]]:
    """The plan for `gpu_gib`, and the keys it sizes: the user's value where one was set, the plan's otherwise."""
    s, lc, m, smp = cfg.server, cfg.learner, cfg.manager, cfg.sampling
    derived: list[Derived] = []

    def pick(section: Any, key: str, value: Any, why: str, *, user: bool | None = None) -> Any:
        user = _set(section, key) if user is None else user
        name = {id(cfg.server): "server", id(cfg.learner): "learner", id(cfg.manager): "manager",
                id(cfg.sampling): "sampling", id(cfg.rollout): "rollout"}[id(section)]
        derived.append(Derived(f"{name}.{key}", getattr(section, key) if user else value, why, user))
        return getattr(section, key) if user else value

    budget = planner.response_budget(ctx, longest_prompt)
    mnt = pick(smp, "max_new_tokens", max(1, budget),
               f"min({planner.MAX_NEW_TOKENS_CAP}, context {ctx} - longest prompt {longest_prompt})")
    local = 0 if s.urls else s.num_local
    sync_given = lc.weight_sync if _set(lc, "weight_sync") else None
    learner_on_gpu = lc.device != "cpu"
    setup = planner.LearnerSetup(
        nproc=lc.ranks_per_node, micro_batch_tokens=lc.micro_batch_tokens,
        gradient_checkpointing=lc.gradient_checkpointing,
        compile=lc.compile != "off", logprob_chunk_tokens=lc.logprob_chunk_tokens,
        reference=cfg.algo.kl_coef > 0 or cfg.algo.use_kl_in_reward,  # the learner's needs_reference rule
        sync_bucket_gib=0.0 if (sync_given or ("tensor" if local else "disk")) == "disk"
        else lc.weight_sync_bucket_mb / 1024)
    servers = planner.ServerSetup(
        count=local, gpus=s.gpus,
        mem_fraction_static=s.mem_fraction_static,  # None (unset or null): planned
        max_total_tokens=s.max_total_tokens if _set(s, "max_total_tokens") else None,
        max_inflight=m.max_inflight_per_server)  # None: planned
    work = _workload(cfg, kind, longest_prompt, ctx, mnt)
    plan = planner.make_plan(model, setup, servers, work, gpu_gib, learner_gpus=lc.gpus,
                             learner_on_gpu=learner_on_gpu, weight_sync=sync_given)
    ray = cfg.cluster.backend == "ray"
    if local:
        # with Ray, Ray places the actors on GPUs (cluster.colocate, cluster.*_gpus): no GPU lists of ours
        if not ray and (plan.server_gpus != list(range(local)) or _set(s, "gpus")):
            pick(s, "gpus", plan.server_gpus, "separate from the learner" if not plan.colocated else "as placed")
        if not ray and learner_on_gpu and (plan.learner_gpus != list(range(lc.ranks_per_node)) or _set(lc, "gpus")):
            pick(lc, "gpus", plan.learner_gpus, "the first GPUs")
        pick(s, "max_total_tokens", None, "the KV pool from free memory")
        pick(s, "mem_fraction_static", plan.mem_fraction_static,
             "weights + the KV of the episodes in flight, next to the learner" if plan.colocated
             else "SGLang's own sizing (the server has its GPU to itself)", user=s.mem_fraction_static is not None)
        at_once = plan.episodes_per_server * local >= work.episodes
        pick(m, "max_inflight_per_server", plan.max_inflight_per_server,
             "every episode in flight at once" if at_once else "what the KV pool holds at once",
             user=m.max_inflight_per_server is not None)
        pick(cfg.rollout, "max_concurrency", min(work.episodes, plan.episodes_per_server * local),
             "every episode the schedule keeps in flight" if at_once else "what the KV pools hold at once")
        if ray and learner_on_gpu and plan.weight_sync is not None:
            # Ray: where the learner has GPUs its rank 0 broadcasts to the servers' GPUs (nccl), or hands them CUDA
            # IPC handles when colocated; never whole weight directories through the object store each step
            pick(lc, "weight_sync", "tensor" if cfg.cluster.colocate else "nccl",
                 "Ray, colocated: CUDA IPC" if cfg.cluster.colocate
                 else "Ray: NCCL broadcast from the learner's GPUs to the servers'")
        elif plan.weight_sync is not None:
            pick(lc, "weight_sync", plan.weight_sync, "CUDA IPC: colocated" if plan.weight_sync == "tensor"
                 else "broadcast to servers on other GPUs")
    call = mnt if kind == "single" else (cfg.tools.max_tokens_per_turn or max(mnt, cfg.tools.max_response_tokens))
    timeout = pick(m, "request_timeout_s", planner.request_timeout_s(call),
                   f"{call} tokens at {planner.SLOW_DECODE_TOKENS_PER_S:g} tokens/s, at least "
                   f"{planner.MIN_REQUEST_TIMEOUT_S:g} s")
    if timeout > m.retry_budget_s:
        pick(m, "retry_budget_s", 1.5 * timeout, "1.5 x the request timeout")
    if timeout > cfg.rollout.episode_timeout_s:
        derived.append(Derived("rollout.episode_timeout_s", cfg.rollout.episode_timeout_s
                               if _set(cfg.rollout, "episode_timeout_s") else 2 * timeout, "2 x the request timeout",
                               _set(cfg.rollout, "episode_timeout_s")))
    return plan, derived


def apply_plan(cfg: Config, derived: list[Derived]) -> None:
    """Write the derived values into the keys the user did not set."""
    for d in derived:
        if d.user_set:
            continue
        section, key = d.key.split(".")
        setattr(getattr(cfg, section), key, d.value)


__all__ = ["Derived", "apply_plan", "derive"]
