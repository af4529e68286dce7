"""The learner process's command line (what agentloop.train.orchestrator.learner_process.learner_command builds).

Launch (one machine, N ranks; gloo on CPU, nccl on GPU):

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m agentloop.train.trainer --run-dir RUN_DIR --model MODEL_DIR \\
        [--config CONFIG.yaml] [--set algo.kl_coef=0.01 --set learner.lr=1e-6 ...] \\
        [--no-resume] [--heartbeat-s 5]

With one rank, `python -m agentloop.train.trainer ...` works too (it starts its own single-rank process group).

    --run-dir    shared directory with mailbox/, weights/, checkpoints/ (see agentloop.train.handle.mailbox)
    --model      HF model directory to start from (also the frozen reference when kl_coef > 0)
    --config     YAML or JSON file; its `algo:` and `learner:` sections are used, other
                 top-level keys are ignored (so the run's resolved config file works as is)
    --set        `algo.key=value` / `learner.key=value` overrides, values parsed as YAML
    --no-resume  start from --model even if RUN_DIR/checkpoints holds a checkpoint

The process trains mailbox steps in order until RUN_DIR/mailbox/STOP appears (exit 0; a final STOP,
the run's normal end, first saves the last step's HF weights and checkpoint where missing), a
step fails (update.failed written, exit 1) or no batch arrives within
`learner.batch_timeout_s` (exit 2). The resolved config is written to
RUN_DIR/learner_config.json.

Its log (LearnerProcess points stdout and stderr at RUN_DIR/learner.log): rank 0 writes the lines of
agentloop.train.trainer.serve and, when it fails, the traceback; other ranks write warnings only. Lines go through
the `agentloop.train.trainer` logger, whose handler `main` installs on stdout and which flushes every line, so they
reach the file as they happen whatever the stdout buffering.

Map:
    load_sections   the algo and learner sections of the run's config (file + --set)
    log_to_stdout   the learner process's log handler (flushed line by line)
    main            the command line
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from agentloop.train.config import AlgoConfig, LearnerConfig
from agentloop.train.trainer.serve import EXIT_FAILED, logger, serve


def load_sections(config: str | Path | None, overrides: list[str]) -> tuple[AlgoConfig, LearnerConfig]:
    """The algo and learner sections of the run's config: `load_config` (the CLI's parser and syntax) on the
    file plus `--set` overrides. An override outside algo./learner. is refused: the learner reads nothing else."""
    from agentloop.config import load_config, parse_override, validate_for_training
    from agentloop.errors import ConfigError

    for ov in overrides:
        key, _ = parse_override(ov)
        if key.split(".", 1)[0] not in ("algo", "learner") or "." not in key:
            raise ConfigError(f"override {ov!r}: expected algo.KEY=VALUE or learner.KEY=VALUE (the learner reads no "
                              "other section)")
    cfg = validate_for_training(load_config(config, overrides))  # algo.temperature is sampling.temperature
    return cfg.algo, cfg.learner


def log_to_stdout(rank: int) -> None:
    """The learner process's log handler: rank 0 logs INFO and up, other ranks WARNING and up, each line
    prefixed with the time and rank. logging.StreamHandler flushes after every record, so a line is in
    learner.log when the call returns, block-buffered stdout or not."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s learner[{rank}] %(levelname)s %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agentloop.train.trainer", description="Mailbox-driven FSDP2 learner.")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--no-resume", dest="resume", action="store_false")
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    a = p.parse_args(argv)
    log_to_stdout(int(os.environ.get("RANK", "0")))
    try:
        algo, cfg = load_sections(a.config, a.overrides)
        from agentloop.config import load_config

        max_len = load_config(a.config, []).model.context_length if a.config else None
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        logger.info("starting (pid %d): model %s, run dir %s, temperature %g", os.getpid(), a.model, a.run_dir,
                    algo.temperature)
        code = serve(a.run_dir, a.model, algo, cfg, resume=a.resume, heartbeat_s=a.heartbeat_s, max_len=max_len)
    except Exception as e:  # noqa: BLE001 - logged (with the traceback) on every rank, then the process exits 1
        logger.exception("failed: %s: %s", type(e).__name__, e)
        code = EXIT_FAILED
    logger.info("exiting with code %d", code)
    return code


__all__ = ["load_sections", "log_to_stdout", "main"]

