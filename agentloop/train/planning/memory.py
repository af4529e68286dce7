"""The GPU memory plan of a training run: what the learner and each server need, which GPU each goes on, and
the settings that follow. Pure: plain numbers in, a Plan out (no GPU, no config tree; torch only for the parameter
count, the model built on the meta device: agentloop.train.planning.meta); the preflight
(agentloop.train.planning.preflight) reads the machine and the config, and writes the plan into the keys left unset.

Map:
    ModelShape        the sizes the memory model needs, from a Hugging Face config.json (a dict): the parameters
                      counted on the meta device (planning.meta), the other sizes read
    LearnerSetup      the learner settings memory depends on; learner_memory -> LearnerMemory (one rank's peak)
    ServerSetup       local servers and what the user fixed of them; Workload: the episodes they must hold
    make_plan         -> Plan: placement, each GPU's budget, the server's memory fraction and KV pool, the weight
                      sync path, max in-flight requests, and the problems that make the plan not fit
    response_budget, request_timeout_s    the length and timeout rules of the derived defaults

Memory model (GiB = 2^30 bytes), calibrated on benchmarks/RESULTS_learner.md (the measurements are the
tests in tests/unit/train/test_plan.py, within 10%):
  learner, per rank   states       16 B/param / nproc: fp32 master weights, fp32 gradients, Adam m and v
                      reference    2 B/param / nproc when algo.kl_coef > 0 (the frozen bf16 copy)
                      activations  for T tokens in one micro-batch (T = max(micro_batch_tokens, the longest
                                   sequence): a longer sequence gets a micro-batch of its own):
                                   no gradient checkpointing  T x layers x 2 B x (10 hidden + 4 intermediate),
                                                              x 0.7 with learner.compile (fused layers keep
                                                              fewer intermediates: 52.4 -> 40.7 GiB measured)
                                   gradient checkpointing     T x layers x 2 B x hidden (each layer's saved
                                                              input) + one layer's full activations
                      logprob head 3 x logprob_chunk_tokens x vocab x 4 B (a chunk's fp32 logits, their
                                   softmax and gradient)
                      gathered     nproc > 1: FSDP gathers a unit's bf16 weights and reduce-scatters its fp32
                                   gradient whole; the largest unit, the embedding, adds vocab x hidden x 6 B
                      the plan reserves the peak x 1.1 (allocator slack) + 0.75 GiB (CUDA context), plus one
                      weight-sync bucket when the learner pushes weights itself (tensor, nccl)
  server              weights 2 B/param; KV 2 x layers x kv_heads x head_dim x 2 B per token, for the episodes
                      in flight (a GRPO group's prompt once: the radix cache shares it) + 25% headroom; and
                      3 GiB outside SGLang's static pool (CUDA graphs, activations, sampling buffers, context)
SGLang's static pool (weights + KV) is mem_fraction_static x the GPU memory free when the server starts
(sglang/srt/mem_cache/kv_cache_configurator.py: free - free x (1 - fraction)); a learner that already holds
memory then leaves the server less, never more, so the fraction is taken of the free memory at plan time.

Placement, when neither server.gpus nor learner.gpus is set: with enough GPUs (learner.ranks + local
servers), learner ranks on the first GPUs and the servers on the next ones (separate, weights over nccl);
else server i on GPU i and learner rank r on GPU r (colocated, weights over CUDA IPC: tensor).

Simplified: dense decoder-only models (an MoE counts its experts' parameters and, for activations, the
experts each token visits); standard attention KV (no MLA or sliding-window pools); a server alone on its GPU
keeps SGLang's own sizing, and its KV pool is estimated as 85% of the GPU less the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

GIB = float(2**30)

STATE_BYTES = 16.0
"""Bytes per parameter of a training rank's state: fp32 master weight, fp32 gradient, Adam m and v."""
REFERENCE_BYTES = 2.0
"""Bytes per parameter of the frozen bf16 reference model (algo.kl_coef > 0)."""
COMPILE_ACTIVATION_FACTOR = 0.7
"""Activations with learner.compile relative to eager (0.5B, 32768 tokens: 40.7 vs 52.4 GiB peak, the
activations 29 of 41 GiB)."""
ALLOCATOR_SLACK = 1.10
"""Reserved over allocated memory the plan allows a learner rank (the caching allocator's fragmentation)."""
CUDA_CONTEXT_GIB = 0.75
"""A CUDA process's context and library workspaces."""
SERVER_RUNTIME_GIB = 3.0
"""What a server uses outside SGLang's static pool: CUDA graphs, activations, sampling buffers, its context."""
KV_HEADROOM = 1.25
"""KV pool planned over the episodes in flight (validation episodes, the radix cache's spare prefixes)."""
SGLANG_OWN_FRACTION = 0.85
"""Roughly the share of a GPU SGLang's own sizing takes for weights + KV when a server has the GPU to itself."""
MAX_NEW_TOKENS_CAP = 4096
"""The derived sampling.max_new_tokens never exceeds this (a GPU run's default response budget)."""
SLOW_DECODE_TOKENS_PER_S = 5.0
"""Per-request decode rate of a fully loaded server the request timeout allows for."""
MIN_REQUEST_TIMEOUT_S = 600.0
"""The request timeout is never derived below this (manager.request_timeout_s's default)."""


def _gib(nbytes: float) -> float:
    return nbytes / GIB


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model the memory model reads."""

    params: int
    """All parameters (a tied LM head counted once): counted on the model built on the meta device; estimated from
    the sizes only for a dict that names no model_type transformers knows."""
    layers: int
    hidden: int
    intermediate: int
    """MLP width one token goes through (an MoE: the experts it visits, shared experts included)."""
    vocab: int
    kv_heads: int
    head_dim: int
    context: int | None = None
    """max_position_embeddings."""

    @property
    def kv_bytes_per_token(self) -> float:
        """Server KV cache per token: K and V of every layer, bf16."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0

    @property
    def weights_gib(self) -> float:
        """bf16 weights (what a server loads)."""
        return _gib(2.0 * self.params)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        """The shape from a config.json dict (a multimodal config's `text_config` is the language model).
        ValueError naming the key when one the model needs is missing."""
        from agentloop.train.planning.meta import parameter_count
        c = dict(config)
        if isinstance(c.get("text_config"), Mapping):
            c = {**c, **dict(c["text_config"])}

        def need(*keys: str) -> int:
            for k in keys:
                if isinstance(c.get(k), (int, float)) and c[k] > 0:
                    return int(c[k])
            raise ValueError(f"the model's config.json has no {' / '.join(keys)}")

        hidden = need("hidden_size", "d_model", "n_embd")
        layers = need("num_hidden_layers", "n_layer", "num_layers")
        vocab = need("vocab_size")
        heads = need("num_attention_heads", "n_head")
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        dense_i = int(c.get("intermediate_size") or c.get("n_inner") or 4 * hidden)
        experts = next((int(c[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if isinstance(c.get(k), int) and c[k] > 1), 0)
        attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        if experts:
            moe_i = int(c.get("moe_intermediate_size") or dense_i)
            shared = int(c.get("shared_expert_intermediate_size") or 0) or int(c.get("n_shared_experts") or 0) * moe_i
            per_token = int(c.get("num_experts_per_tok") or c.get("moe_topk") or 1)
            mlp = 3 * hidden * (experts * moe_i + shared) + hidden * experts
            intermediate = per_token * moe_i + shared
        else:
            mlp = 3 * hidden * dense_i
            intermediate = dense_i
        embed = vocab * hidden
        tied = bool(c.get("tie_word_embeddings", False))
        counted = parameter_count(config)
        estimate = layers * (attn + mlp + 2 * hidden) + hidden + embed * (1 if tied else 2)
        params = counted if counted is not None else estimate
        ctx = c.get("max_position_embeddings")
        return cls(params=params, layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab,
                   kv_heads=kv_heads, head_dim=head_dim, context=int(ctx) if isinstance(ctx, int) else None)


# ---------------------------------------------------------------------------------------------- learner


@dataclass(frozen=True)
class LearnerSetup:
    """The learner settings its memory depends on."""

    nproc: int = 1
    """The learner's ranks on the planned host (learner.ranks / learner.nnodes: torchrun's --nproc-per-node)."""
    micro_batch_tokens: int = 8192
    gradient_checkpointing: bool = False
    compile: bool = False
    reference: bool = False
    """A reference model is loaded (algo.kl_coef > 0)."""
    logprob_chunk_tokens: int = 2048
    sync_bucket_gib: float = 0.0
    """Weight-sync bucket the learner holds while pushing (tensor, nccl); 0 for disk."""


@dataclass(frozen=True)
class LearnerMemory:
    """One learner rank's peak, by part (GiB)."""

    tokens: int
    """Tokens of the largest micro-batch the activations are sized for."""
    states: float
    reference: float
    activations: float
    logprob_head: float
    gathered: float
    sync_bucket: float = 0.0

    @property
    def peak(self) -> float:
        """Peak allocated memory (what torch.cuda.max_memory_allocated reports)."""
        return self.states + self.reference + self.activations + self.logprob_head + self.gathered

    @property
    def need(self) -> float:
        """What the plan reserves for the rank on its GPU: the peak with the allocator's slack."""
        return self.peak * ALLOCATOR_SLACK + CUDA_CONTEXT_GIB + self.sync_bucket

    @property
    def floor(self) -> float:
        """The least the rank takes (the peak without slack): above the GPU's memory the plan is refused;
        between `floor` and `need` it is tight (a note)."""
        return self.peak + CUDA_CONTEXT_GIB + self.sync_bucket

    def parts(self) -> str:
        items = [("states", self.states), ("reference", self.reference), ("activations", self.activations),
                 ("logprob head", self.logprob_head), ("gathered", self.gathered)]
        return ", ".join(f"{k} {v:.1f}" for k, v in items if v > 0)


def learner_memory(model: ModelShape, setup: LearnerSetup, longest_sequence: int = 0) -> LearnerMemory:
    """One rank's peak under the memory model of the module doc."""
    n = max(1, setup.nproc)
    tokens = max(setup.micro_batch_tokens, longest_sequence)
    full_layer = tokens * 2.0 * (10 * model.hidden + 4 * model.intermediate)
    if setup.gradient_checkpointing:
        act = tokens * model.layers * 2.0 * model.hidden + full_layer
    else:
        act = model.layers * full_layer * (COMPILE_ACTIVATION_FACTOR if setup.compile else 1.0)
    chunk = min(setup.logprob_chunk_tokens, tokens)
    return LearnerMemory(
        tokens=tokens,
        states=_gib(STATE_BYTES * model.params / n),
        reference=_gib(REFERENCE_BYTES * model.params / n) if setup.reference else 0.0,
        activations=_gib(act),
        logprob_head=_gib(3.0 * chunk * model.vocab * 4.0),
        gathered=_gib(6.0 * model.vocab * model.hidden) if n > 1 else 0.0,
        sync_bucket=setup.sync_bucket_gib,
    )


# ---------------------------------------------------------------------------------------------- servers


@dataclass(frozen=True)
class Workload:
    """What the rollouts ask of the servers at once."""

    episodes: int
    """Episodes in flight at most (a step's, or the async window's, capped by rollout.max_concurrency)."""
    group_size: int
    """Episodes per prompt (their prompt's KV is shared)."""
    prompt_tokens: int
    """The longest prompt."""
    response_tokens: int
    """An episode's response budget: its tokens in the KV cache after the prompt (model and tool tokens)."""

    @property
    def kv_tokens(self) -> int:
        groups = math.ceil(self.episodes / max(1, self.group_size))
        return groups * self.prompt_tokens + self.episodes * self.response_tokens

    @property
    def longest(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def tokens_per_episode(self) -> float:
        return self.response_tokens + self.prompt_tokens / max(1, self.group_size)


@dataclass(frozen=True)
class ServerSetup:
    """Local servers, and what the user fixed of them (None: the plan decides)."""

    count: int
    """Local servers launched for the run (0: server.urls, servers the plan knows nothing of)."""
    gpus: list[int] | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_inflight: int | None = None


@dataclass
class GpuBudget:
    """One GPU's share-out (GiB)."""

    index: int
    capacity: float
    learner_ranks: int = 0
    servers: list[int] = field(default_factory=list)
    learner: float = 0.0
    """Reserved for the learner ranks on it."""
    server: float = 0.0
    """The servers' static pools and runtime memory on it."""

    @property
    def left(self) -> float:
        return self.capacity - self.learner - self.server


@dataclass
class Plan:
    """Where everything goes and how much memory it gets; `problems` non-empty: it does not fit."""

    gpus: list[GpuBudget]
    learner: LearnerMemory | None
    learner_gpus: list[int]
    server_gpus: list[int]
    colocated: bool
    """Every server shares a GPU with a learner rank."""
    mem_fraction_static: float | None
    """The servers' fraction (None: SGLang's own sizing)."""
    kv_tokens: int | None
    """KV pool per server in tokens (planned, or estimated under SGLang's own sizing)."""
    kv_tokens_needed: int
    """Per server: the KV the episodes in flight take."""
    episodes_per_server: int
    """Episodes in flight per server the KV pool holds at once (all of them when it holds the step)."""
    max_inflight_per_server: int | None
    weight_sync: str | None
    """tensor (colocated) or nccl (separate GPUs); None: not decided here (no local GPU servers)."""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _placement(n_gpus: int, nproc: int, learner_gpus: list[int] | None, servers: ServerSetup,
               learner_on_gpu: bool) -> tuple[list[int], list[int]]:
    s = servers.count
    if learner_gpus is None and servers.gpus is None and learner_on_gpu and s and nproc + s <= n_gpus:
        return list(range(nproc)), list(range(nproc, nproc + s))
    lg = list(learner_gpus[:nproc]) if learner_gpus is not None else list(range(nproc))
    sg = list(servers.gpus) if servers.gpus is not None else list(range(s))
    return (lg if learner_on_gpu else []), sg


def _advice(model: ModelShape, setup: LearnerSetup, longest: int, room: float) -> str:
    """What to change so one learner rank fits in `room` GiB."""
    says = []
    mem = learner_memory(model, setup, longest)
    if setup.micro_batch_tokens > longest:
        lo, hi = longest, setup.micro_batch_tokens
        if learner_memory(model, replace(setup, micro_batch_tokens=lo), longest).need <= room:
            while hi - lo > 256:
                mid = (lo + hi) // 2
                fits = learner_memory(model, replace(setup, micro_batch_tokens=mid), longest).need <= room
                lo, hi = (mid, hi) if fits else (lo, mid)
            says.append(f"learner.micro_batch_tokens <= {lo // 256 * 256 or lo} (now {setup.micro_batch_tokens})")
    if not setup.gradient_checkpointing:
        gc = learner_memory(model, replace(setup, gradient_checkpointing=True), longest)
        if gc.need < mem.need:
            says.append(f"learner.gradient_checkpointing=true (~{gc.need:.1f} GiB per rank)")
    says.append("more GPUs (learner.ranks, cluster.num_gpus; servers on GPUs of their own)")
    says.append("a smaller model")
    return "; ".join(says)


def make_plan(model: ModelShape, learner: LearnerSetup, servers: ServerSetup, work: Workload,
              gpu_gib: list[float], *, learner_gpus: list[int] | None = None, learner_on_gpu: bool = True,
              weight_sync: str | None = None) -> Plan:
    """The plan for `gpu_gib` (each GPU's usable memory). `learner_gpus`, `weight_sync`, and the ServerSetup's
    fields: what the user set (None: decided here). The problems name sizes and what to change."""
    n = len(gpu_gib)
    problems: list[str] = []
    notes: list[str] = []
    lg, sg = _placement(n, learner.nproc, learner_gpus, servers, learner_on_gpu)
    if learner_on_gpu and learner.nproc > n:
        problems.append(f"{learner.nproc} learner ranks on this host (learner.ranks / learner.nnodes) need "
                        f"{learner.nproc} GPUs, the plan has {n} (cluster.num_gpus, or the visible ones)")
    for key, gpus in (("learner.gpus", lg), ("server.gpus", sg)):
        bad = sorted({g for g in gpus if g >= n or g < 0})
        if bad:
            problems.append(f"{key} places work on GPU {bad} but the plan has {n} GPU(s) (cluster.num_gpus, "
                            "or the visible ones)")
    if len(set(lg)) < len(lg):
        problems.append(f"learner ranks share GPUs ({lg}): give learner.gpus one GPU per rank")
    mem = learner_memory(model, learner, work.longest) if learner_on_gpu else None
    budgets = [GpuBudget(i, cap) for i, cap in enumerate(gpu_gib)]
    if problems:
        return Plan(budgets, mem, lg, sg, False, servers.mem_fraction_static, None, work.kv_tokens, 0,
                    servers.max_inflight, weight_sync, problems, notes)
    for g in lg:
        budgets[g].learner_ranks += 1
        budgets[g].learner += mem.need if mem is not None else 0.0
    floor = mem.floor if mem is not None else 0.0
    for i, g in enumerate(sg):
        budgets[g].servers.append(i)
    per_server_need = math.ceil(work.kv_tokens / max(1, servers.count))
    bpt = model.kv_bytes_per_token
    kv_min = _gib(work.longest * bpt)
    colocated = bool(sg) and all(budgets[g].learner_ranks for g in sg)
    fraction = servers.mem_fraction_static
    kv_gib: list[float] = []
    for b in budgets:
        if not b.servers:
            if mem is not None and b.learner > b.capacity >= b.learner_ranks * floor:
                notes.append(f"GPU {b.index} ({b.capacity:.1f} GiB) is tight for {b.learner_ranks} learner rank(s) "
                             f"of peak {mem.peak:.1f} GiB (the plan allows {ALLOCATOR_SLACK:.2f}x for the allocator)")
            elif mem is not None and b.learner > b.capacity:
                problems.append(
                    f"GPU {b.index} ({b.capacity:.1f} GiB) cannot hold {b.learner_ranks} learner rank(s) of "
                    f"{mem.need:.1f} GiB (peak {mem.peak:.1f}: {mem.parts()}, at {mem.tokens} tokens per "
                    f"micro-batch): {_advice(model, learner, work.longest, b.capacity / b.learner_ranks)}")
            continue
        k = len(b.servers)
        fixed = model.weights_gib + SERVER_RUNTIME_GIB
        if not b.learner_ranks and servers.mem_fraction_static is None:
            # alone on its GPU: SGLang sizes its own pool (no fraction passed)
            kv = SGLANG_OWN_FRACTION * b.capacity / k - model.weights_gib
            if servers.max_total_tokens is not None:
                kv = min(kv, _gib(servers.max_total_tokens * bpt))
            b.server = k * (model.weights_gib + kv + SERVER_RUNTIME_GIB)
            if kv < kv_min:
                problems.append(f"GPU {b.index} ({b.capacity:.1f} GiB) cannot hold server(s) {b.servers} (weights "
                                f"{model.weights_gib:.1f} GiB) with KV for one episode of {work.longest} tokens: a "
                                "smaller model, or a GPU with more memory")
            kv_gib += [kv] * k
            continue
        if servers.mem_fraction_static is not None:
            kv = servers.mem_fraction_static * b.capacity - model.weights_gib
            if servers.max_total_tokens is not None:
                kv = min(kv, _gib(servers.max_total_tokens * bpt))
            b.server = k * (servers.mem_fraction_static * b.capacity + SERVER_RUNTIME_GIB)
            if kv < kv_min:
                problems.append(
                    f"server.mem_fraction_static={servers.mem_fraction_static} x GPU {b.index}'s {b.capacity:.1f} GiB "
                    f"does not hold the weights ({model.weights_gib:.1f} GiB) and KV for one episode of "
                    f"{work.longest} tokens ({kv_min:.2f} GiB): raise it, or unset it (then it is planned)")
            if b.left < 0 and mem is None:
                problems.append(f"GPU {b.index} ({b.capacity:.1f} GiB): server.mem_fraction_static="
                                f"{servers.mem_fraction_static} leaves no room for the servers' runtime memory "
                                f"({k * SERVER_RUNTIME_GIB:.1f} GiB): lower it")
            elif mem is not None and b.left < 0 <= b.left + b.learner_ranks * (mem.need - floor):
                notes.append(f"GPU {b.index} ({b.capacity:.1f} GiB) is tight: server.mem_fraction_static="
                             f"{servers.mem_fraction_static} leaves the learner {b.capacity - b.server:.1f} GiB for a "
                             f"peak of {mem.peak:.1f} GiB per rank (the plan allows {ALLOCATOR_SLACK:.2f}x for the "
                             "allocator)")
            elif mem is not None and b.left < 0:
                most = math.floor((b.capacity - b.learner_ranks * floor - k * SERVER_RUNTIME_GIB)
                                  / (k * b.capacity) * 1000) / 1000
                least = (model.weights_gib + kv_min) / b.capacity
                short = b.learner_ranks * floor + b.server - b.capacity
                lower = (f"lower server.mem_fraction_static to <= {most:.3f} (or unset it: then it is planned), or "
                         if most >= least else "")
                problems.append(
                    f"GPU {b.index} ({b.capacity:.1f} GiB): server.mem_fraction_static={servers.mem_fraction_static} "
                    f"gives the server(s) {k * servers.mem_fraction_static * b.capacity:.1f} GiB + "
                    f"{k * SERVER_RUNTIME_GIB:.1f} runtime, and the learner takes {b.learner_ranks * floor:.1f} GiB "
                    f"({b.learner_ranks} rank(s), peak {mem.peak:.1f}: {mem.parts()}, at {mem.tokens} tokens per "
                    f"micro-batch): {short:.1f} GiB short; {lower}make the learner smaller: "
                    f"{_advice(model, learner, work.longest, max(0.0, (b.capacity - b.server) / b.learner_ranks))}")
            kv_gib += [kv] * k
            continue
        # colocated, fraction planned here: the learner's need first, the KV pool from what is left
        room = (b.capacity - b.learner) / k - fixed
        want = (_gib(servers.max_total_tokens * bpt) if servers.max_total_tokens is not None
                else _gib(per_server_need * bpt) * KV_HEADROOM)
        kv = min(room, want)
        if kv < kv_min <= (b.capacity - b.learner_ranks * floor) / k - fixed:
            kv = min(want, (b.capacity - b.learner_ranks * floor) / k - fixed)
            notes.append(f"GPU {b.index} ({b.capacity:.1f} GiB) is tight: the learner's peak ({mem.peak:.1f} GiB per "
                         f"rank) and the server(s) fit only without the {ALLOCATOR_SLACK:.2f}x the plan allows for "
                         "the allocator")
        if kv < kv_min:
            short = kv_min - kv
            lr = (b.capacity - k * (fixed + kv_min)) / max(1, b.learner_ranks)
            problems.append(
                f"GPU {b.index} ({b.capacity:.1f} GiB) cannot hold the learner ({b.learner:.1f} GiB: "
                f"{b.learner_ranks} rank(s), peak {mem.peak:.1f} GiB each: {mem.parts()}, at {mem.tokens} tokens "
                f"per micro-batch) and {k} server(s) (weights {model.weights_gib:.1f} GiB + "
                f"{SERVER_RUNTIME_GIB:.1f} runtime + KV for one episode of {work.longest} tokens, "
                f"{kv_min:.2f} GiB, each): {short:.1f} GiB short; "
                + _advice(model, learner, work.longest, max(0.0, lr)))
            kv = max(kv, 0.0)
        # rounded up to SGLang's 3 decimals, but never past what the GPU has left
        most = (b.capacity - b.learner_ranks * (mem.need if kv >= kv_min else floor)) / k - SERVER_RUNTIME_GIB
        frac = min(math.ceil((model.weights_gib + kv) / b.capacity * 1000), math.floor(most / b.capacity * 1000)) / 1000
        kv = max(kv, 0.0) if frac * b.capacity >= model.weights_gib + kv else frac * b.capacity - model.weights_gib
        fraction = frac if fraction is None else min(fraction, frac)  # one setting for every server
        b.server = k * (frac * b.capacity + SERVER_RUNTIME_GIB)
        kv_gib += [kv] * k
    kv_tokens = int(min(kv_gib) * GIB / bpt) if kv_gib else None
    per_server_episodes = math.ceil(work.episodes / max(1, servers.count))
    fit = per_server_episodes
    if kv_tokens is not None and kv_tokens < per_server_need:
        fit = max(1, min(per_server_episodes, int(kv_tokens / work.tokens_per_episode)))
        notes.append(f"the KV pool ({kv_tokens:,} tokens per server) holds {fit} of the {per_server_episodes} "
                     f"episodes in flight per server ({per_server_need:,} tokens): rollouts run in waves; more GPU "
                     "memory, fewer train.prompts_per_step x rollout.n_samples, or shorter responses avoid it")
    inflight = servers.max_inflight if servers.max_inflight is not None else (fit if servers.count else None)
    sync = weight_sync
    if sync is None and servers.count and mem is not None:
        sync = "tensor" if all(g in lg for g in sg) else "nccl"
    if learner_on_gpu and n > len(set(lg) | set(sg)):
        unused = sorted(set(range(n)) - set(lg) - set(sg))
        notes.append(f"GPU(s) {unused} are not used ({learner.nproc} learner rank(s), {servers.count} local server(s))")
    return Plan(budgets, mem, lg, sg, colocated, fraction if servers.count else None, kv_tokens, per_server_need,
                fit, inflight, sync, problems, notes)


# ---------------------------------------------------------------------------------------------- rules


def response_budget(context: int, longest_prompt: int, cap: int = MAX_NEW_TOKENS_CAP) -> int:
    """Derived sampling.max_new_tokens: what the context leaves after the longest prompt, at most `cap`
    (may be <= 0: the caller reports the prompt as too long)."""
    return min(cap, context - longest_prompt)


def request_timeout_s(longest_call_tokens: int) -> float:
    """Derived manager.request_timeout_s: one call's longest generation at SLOW_DECODE_TOKENS_PER_S, never
    below MIN_REQUEST_TIMEOUT_S."""
    return max(MIN_REQUEST_TIMEOUT_S, float(math.ceil(longest_call_tokens / SLOW_DECODE_TOKENS_PER_S)))


__all__ = ["GpuBudget", "LearnerMemory", "LearnerSetup", "ModelShape", "Plan", "ServerSetup", "Workload",
           "learner_memory", "make_plan", "request_timeout_s", "response_budget"]
