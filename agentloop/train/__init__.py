"""The learner: GRPO-family policy-gradient training of the HF model with FSDP2.

Modules, one concept each (lower ones never import higher ones):
    config       AlgoConfig (what is optimised), LearnerConfig (how): mounted as Config.algo / Config.learner
    advantages   estimator registry (grpo, rloo, reinforce_pp) + compute_advantages
    losses       PPO clipped loss, aggregation weights, KL / entropy terms, TIS, Stats
    batching     records -> episodes -> mini-batches -> per-rank padded micro-batches
    checkpoint   resumable sharded checkpoints (atomic: temp dir + rename)
    mailbox      file protocol orchestrator <-> learner (MailboxClient is the orchestrator side)
    weight_sync  disk | tensor (CUDA IPC) | nccl (broadcast) weight push to the servers, by name
    learner      Learner (in-process API) and the torchrun entry point `serve` / `main`

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
    "Learner": "learner",
    "learner_command": "learner",
    "serve": "learner",
    "MailboxClient": "mailbox",
    "MailboxError": "mailbox",
    "MailboxTimeout": "mailbox",
    "LearnerDiedError": "mailbox",
    "LearnerFailedError": "mailbox",
    "UpdateResult": "mailbox",
    "SyncRequest": "mailbox",
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
