"""`agentloop train`: the orchestrator (rollouts, the step loop) and the learner (GRPO-family policy-gradient
training of the HF model with FSDP2), each in its own process, joined by a learner handle (files or Ray).

Rooms, one folder per role; each opens with its own map:
    orchestrator/  the orchestrator's process: the step loop, the async schedule, the prompt cursor, resume, what
                   the servers serve, where servers and learner run, the learner as a child process group
    trainer/       the learner's process: Learner, its loop (serve) and command line (`python -m
                   agentloop.train.trainer`), the tensors of a rank's micro-batches, losses, log-probs,
                   attention, checkpoints, verl's order of a step
    planning/      before anything starts: the preflight checks, the GPUs, the memory plan, the defaults it sizes
    weights/       the weight transport: per learner.weight_sync path (disk, tensor, nccl) a learner half and a
                   server half
    handle/        the learner handle: its two protocols and the facts between them, the file carrier (mailbox);
                   the Ray carrier is agentloop.cluster's
    batch/         a step's batch between the processes: episodes, advantages, the plan of every rank's
                   micro-batches, the orchestrator's preparation, the array form the learner reads
    (this folder)  shared by every room: config (AlgoConfig, LearnerConfig: the vocabulary), model_support (which
                   models the learner runs exactly, from the config alone), flops (the FLOP model, GPUs' peak),
                   probe (the log-prob probe's fixed sequence and the servers' log-probs of it)

A step's data enters each room once, in the order of the arrows: the orchestrator's records -> batch (prepare:
episodes, advantages, packing; format: the file) -> handle (submit) -> trainer (serve: its rank's rows; collate:
tensors; learner: the update) -> weights (the learner half publishes, the server half loads or lets it push).

Rooms (checked by tests/unit/test_layout.py): a module imports modules of its own room and of the rooms its row
names, never others. Each row names only rooms further down, so the arrows point one way; the orchestrator and
the trainer never import each other (the orchestrator starts the learner through a backend and talks to it
through the handle). "shared" is the modules of this folder.
    room          may import
    orchestrator  planning weights handle batch shared
    trainer       weights handle batch shared
    planning      shared
    weights       handle shared
    handle        batch shared
    batch         shared
    shared        -

May import: every layer below it (rollout, report, models, loops, data, rewards, tools, inference,
the client, util, the vocabulary); never cluster, bench or the CLI.

Add an advantage estimator: see agentloop.train.batch. Add a weight-sync path: see agentloop.train.weights.

Names are re-exported lazily, so `from agentloop.train import AlgoConfig` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AlgoConfig": "config",
    "LearnerConfig": "config",
    "ESTIMATORS": "batch.advantages",
    "compute_advantages": "batch.advantages",
    "get_estimator": "batch.advantages",
    "register_estimator": "batch.advantages",
    "policy_loss": "trainer.losses",
    "token_weights": "trainer.losses",
    "prepare_episodes": "batch.episodes",
    "plan_micro_batches": "trainer.collate",
    "latest_checkpoint": "trainer.checkpoint",
    "ModelSupport": "model_support",
    "check_model_support": "model_support",
    "require_model_support": "model_support",
    "Learner": "trainer.learner",
    "learner_command": "orchestrator.learner_process",
    "serve": "trainer.serve",
    "MailboxClient": "handle.mailbox",
    "MailboxError": "handle.mailbox",
    "MailboxTimeout": "handle.mailbox",
    "LearnerHandle": "handle.protocol",
    "LearnerInbox": "handle.protocol",
    "LearnerInfo": "handle.protocol",
    "LearnerError": "handle.protocol",
    "LearnerTimeout": "handle.protocol",
    "LearnerDiedError": "handle.protocol",
    "LearnerFailedError": "handle.protocol",
    "UpdateResult": "handle.protocol",
    "SyncRequest": "handle.protocol",
    "WeightsOnDisk": "handle.protocol",
    "PushOrder": "handle.protocol",
    "FileLearner": "orchestrator.learner_process",
    "Backend": "orchestrator.backend",
    "LocalBackend": "orchestrator.backend",
    "BatchLayout": "batch.format",
    "TrainBatch": "batch.format",
    "prepare_batch": "batch.prepare",
    "AsyncSchedule": "orchestrator.schedule",
    "WeightSync": "weights.sync",
    "WeightSyncError": "weights.sync",
    "get_sync": "weights.sync",
    "register_sync": "weights.sync",
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
