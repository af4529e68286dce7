"""The zygote for one-rank learners (agentloop.util.zygote): it imports torch, transformers and the learner once and
forks each learner process from that process.

A learner's start is mostly imports (~8 s of CPU on the 2-core box: torch, transformers' model classes, FSDP), paid
again by every `agentloop train` run. `python -m agentloop.train.trainer.zygote --socket PATH` pays them once; the
orchestrator's LearnerProcess asks the zygote named by `AGENTLOOP_LEARNER_ZYGOTE` (agentloop.train.handle.launch) for
a one-rank learner and spawns it itself when there is none, when the zygote does not answer, or when the learner's
environment differs from the zygote's in a variable read at start. A forked learner runs `main` on the same argv as
a spawned one, writes the same learner.log, and dies with the orchestrator. torchrun's ranks (learner.ranks > 1) are
always spawned. The test suite starts one for its session (tests/conftest.py).

Map:
    LEARNER         the program: what a learner imports, and its command line's main
    start           start a zygote for the learners this process would start
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agentloop.train.handle.launch import ZYGOTE_ENV, learner_environment
from agentloop.util.zygote import Program
from agentloop.util.zygote import main as _main
from agentloop.util.zygote import start as _start

__all__ = ["LEARNER", "ZYGOTE_ENV", "start"]

_MODULE = "agentloop.train.trainer.zygote"


def _preload() -> None:
    """What every learner imports before its first step, in the zygote's process, once."""
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp  # noqa: F401
    import transformers
    import transformers.models.qwen2.modeling_qwen2  # the model the tests and the default run train

    import agentloop.train.trainer.checkpoint
    import agentloop.train.trainer.collate
    import agentloop.train.trainer.learner
    import agentloop.train.trainer.main  # noqa: F401

    transformers.AutoModelForCausalLM  # noqa: B018 - resolves the lazy module's auto classes


def _run(argv: list[str]) -> None:
    from agentloop.train.trainer.main import main

    sys.argv = [str(Path(__file__).with_name("__main__.py")), *argv]
    sys.exit(main(argv))


LEARNER = Program(module="agentloop.train.trainer", preload=_preload, run=_run)
"""A one-rank learner, as `python -m agentloop.train.trainer ARGV` runs one."""


def start(sock_path: Path, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a zygote on `sock_path` for the learners this process (and those inheriting its environment) would
    start, with `env` (default: `learner_environment` of ours); it dies with this process
    (agentloop.util.zygote.start)."""
    return _start(_MODULE, sock_path, log_path, learner_environment(os.environ) if env is None else env)


def main(argv: list[str] | None = None) -> None:
    _main(LEARNER, zygote_module=_MODULE, environment=learner_environment(os.environ), doc=__doc__, argv=argv)


if __name__ == "__main__":
    main()
