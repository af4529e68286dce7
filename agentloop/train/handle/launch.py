"""How the file carrier's learner process starts on its host: the environment it is given, and the zygote that may
fork it instead of a spawn.

`LearnerProcess` (agentloop.train.orchestrator.learner_process) starts the learner with `learner_environment`; a
one-rank learner (plain `python -m agentloop.train.trainer`, no torchrun) is forked by the zygote that
`AGENTLOOP_LEARNER_ZYGOTE` names when there is one (agentloop.train.trainer.zygote, which imports torch, transformers
and the learner once; the test suite starts one), and spawned otherwise. Both rooms read this: the orchestrator to
start the learner, the trainer's zygote to run with what a learner would get.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ZYGOTE_ENV", "learner_environment"]

ZYGOTE_ENV = "AGENTLOOP_LEARNER_ZYGOTE"
"""The environment variable naming the socket of a zygote for one-rank learners (agentloop.train.trainer.zygote)."""


def learner_environment(base: Mapping[str, str], *, weight_sync: str = "disk",
                        gpus: list[int] | None = None) -> dict[str, str]:
    """The learner process's environment: `base` (the orchestrator's) and what the learner needs of its own."""
    env = dict(base)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # don't spin on cores the servers need
    env["PYTHONUNBUFFERED"] = "1"
    if weight_sync == "nccl":
        env.setdefault("NCCL_CUMEM_ENABLE", "0")  # see agentloop.inference.launcher.LocalServer.environment
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env
