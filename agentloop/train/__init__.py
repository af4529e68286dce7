"""`agentloop train`: the orchestrator (rollouts, the step loop) and the learner (GRPO-family
policy-gradient training of the HF model with FSDP2), joined by a learner handle (files or Ray).

Modules, one concept each. The orchestrator side never imports the learner side (FSDP, the model): it
starts the learner through a backend (this host: a command line, learner_process; Ray: agentloop.cluster)
and talks to it through the learner handle (handle: the protocol; mailbox: its file implementation).
    orchestrator the step loop of `agentloop train` (orchestrator side)
    schedule     the async schedule's rules and the AsyncSchedule object the step loop drives (orchestrator side)
    cursor       DataCursor: resumable, epoch-shuffled prompt order, the rows' fingerprint (orchestrator side)
    resume       the resume rule: a run dir's saved config + the values given now, pinned keys refused
                 (orchestrator side)
    served_model what the servers serve against model.path, before step 1 (orchestrator side)
    probe        the log-prob probe: the fixed sequence (both sides) and the servers' log-probs of it against
                 the learner's first forward, before step 1
    backend      Backend (where servers and learner run) and LocalBackend, this host (orchestrator side)
    learner_process  LearnerProcess + learner_command: the learner as a child process group; FileLearner, the
                 handle over it and the mailbox (orchestrator side)
    weight_transport the server half of each weight-sync path: a step's weights into the servers, in the
                 interrupt mode (orchestrator side)
    handle       the learner handle's two protocols (LearnerHandle, LearnerInbox) and the facts between them
    batch_plan   a step's batch as the learner trains it (advantages, every rank's micro-batches), prepared by
                 the orchestrator, in a compact binary form (TrainBatch, prepare_batch)
    model_support  which models the learner runs exactly, from the config alone: refusals and the head
                 transform (soft cap, logit scale) it applies (both sides; no torch)
    preflight    the checks of `agentloop train --dry-run` and of every run's start (data, rewards, chat
                 template, prompts, model, tools, memory) and the GPU-sized defaults (orchestrator side)
    plan         the GPU memory plan: learner peak, server KV pool, placement (pure numbers, no torch)
    config       AlgoConfig (what is optimised), LearnerConfig (how): mounted as Config.algo / Config.learner
    flops        the FLOP model (MFU, the cost of a shared-prompt row) and GPUs' peak throughput
    advantages   estimator registry (grpo, rloo, reinforce_pp) + compute_advantages
    losses       PPO clipped loss (decoupled: behaviour / proximal / current), aggregation weights, KL terms
                 (k1 / k2 / k3 / k1_reward), entropy, TIS and ratio masking, device-side Stats
    batching     records -> episodes -> mini-batches -> per-rank micro-batch plans (batch_plan) -> packed or
                 padded tensors (the learner), staleness metrics, the KL penalty's per-episode return
    rollout_correction  verl's rollout correction: sequence-level importance weights, rejection sampling
    verl_order   verl's order of a step (KL in the reward, rejection) between the no-grad passes and the
                 update: masks, weights and advantages rewritten, the KL controller (learner side)
    attention    packed rows' masks: FlexAttention block masks (CUDA) or dense SDPA masks; the HF attention
                 function that runs flex; the check that a model honours the mask (learner side)
    logprobs     logprobs / entropy from the final hidden states in chunks (no [tokens x vocab] tensor),
                 as a patch of the model's LM head
    checkpoint   resumable sharded checkpoints (atomic: temp dir + rename), synchronous or in the background
                 (learner side)
    mailbox      the file implementation of the learner handle (MailboxClient: orchestrator side, LearnerMailbox:
                 the learner's inbox)
    weight_sync  the learner half of each weight-sync path: disk | tensor (CUDA IPC) | nccl (broadcast), by
                 name; PushOrder, what the server half answers a push request with
    learner      Learner (in-process API) and the learner loop `serve` / torchrun entry point `main` (learner side)

Sides (checked by tests/unit/test_layout.py): a module of one side never imports a module of the other; the
modules not named are shared (the orchestrator imports torch, CPU only, for batch_plan's advantages).
    side          modules
    orchestrator  orchestrator schedule cursor resume served_model backend learner_process weight_transport preflight
    learner       learner verl_order attention checkpoint

May import: every layer below it (rollout, report, models, loops, data, rewards, tools, inference,
the client, util, the vocabulary); never cluster, bench or the CLI.

Add an advantage estimator: write `fn(rewards, groups, lengths, cfg) -> Tensor[B]`, decorate it
with `@register_estimator("name")`, and set `algo.estimator=name`.

Names are re-exported lazily, so `from agentloop.train import AlgoConfig` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AlgoConfig": "config",
    "LearnerConfig": "config",
    "ESTIMATORS": "advantages",
    "compute_advantages": "advantages",
    "get_estimator": "advantages",
    "register_estimator": "advantages",
    "policy_loss": "losses",
    "token_weights": "losses",
    "prepare_episodes": "batching",
    "plan_micro_batches": "batching",
    "latest_checkpoint": "checkpoint",
    "ModelSupport": "model_support",
    "check_model_support": "model_support",
    "require_model_support": "model_support",
    "Learner": "learner",
    "learner_command": "learner_process",
    "serve": "learner",
    "MailboxClient": "mailbox",
    "MailboxError": "mailbox",
    "MailboxTimeout": "mailbox",
    "LearnerHandle": "handle",
    "LearnerInbox": "handle",
    "LearnerInfo": "handle",
    "LearnerError": "handle",
    "LearnerTimeout": "handle",
    "LearnerDiedError": "handle",
    "LearnerFailedError": "handle",
    "UpdateResult": "handle",
    "SyncRequest": "handle",
    "WeightsOnDisk": "handle",
    "FileLearner": "learner_process",
    "Backend": "backend",
    "LocalBackend": "backend",
    "BatchLayout": "batch_plan",
    "TrainBatch": "batch_plan",
    "prepare_batch": "batch_plan",
    "AsyncSchedule": "schedule",
    "PushOrder": "weight_sync",
    "WeightSync": "weight_sync",
    "WeightSyncError": "weight_sync",
    "get_sync": "weight_sync",
    "register_sync": "weight_sync",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'agentloop.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"agentloop.train.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
