"""The Ray backend of `agentloop train` (`cluster.backend=ray`, `pip install 'agentloop[ray]'`): Ray's own
engine places the servers and the learner across nodes; agentloop's seams (ServerPool, LearnerHandle, the weight
transport) do the rest, as on one host.

    ray_servers   RayServerPool: each SGLang server a Ray actor holding its GPUs (or a fraction, colocated),
                  launched with today's launcher on its node; HF weights directories shipped to each server's
                  node through Ray's object store when no filesystem is shared
    ray_learner   RayLearner: the learner's ranks as Ray actors in a placement group, forming their
                  torch.distributed group themselves, each running the learner loop (agentloop.train.trainer.serve)
                  with batches and control through Ray (RayInbox); weights/checkpoints in `cluster.learner_dir`
    ray_rollout   rollout workers (cluster.rollout_workers): engine processes as actors running the asynchronous
                  schedule's groups, their ServerManagers following the driver's (pauses, versions, interrupts)
    backend       RayBackend: connects to (or starts) the cluster, owns the placement group, hands the run its
                  pool, its learner and its rollout workers

Nothing here is imported unless cluster.backend=ray: the CLI imports it, and `run_train(cfg, backend=
RayBackend(cfg))` does for API users. May import: train and every layer below it; never bench or the CLI.
"""

from __future__ import annotations

from agentloop.cluster.backend import RayBackend

__all__ = ["RayBackend"]
