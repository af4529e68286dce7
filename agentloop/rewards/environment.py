"""Rows whose reward their environment gives (data_source `verifiers`, `textarena`, `openenv`): the environment
loops (verifiers_loop's rubric, textarena_loop's game outcome, openenv_loop's server rewards) set the episode's
reward themselves, so the registry is never asked for one when such a row runs under its loop. Registered so that a
run's checks know these data sources; called, it says which loop scores them (a RewardError, counted)."""

from __future__ import annotations

from typing import Any

from agentloop.errors import RewardError

LOOPS = {"verifiers": "verifiers_loop", "textarena": "textarena_loop", "openenv": "openenv_loop"}


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
                  ) -> float:
    raise RewardError(f"rows of data_source {data_source!r} are scored by their environment: run them with "
                      f"rollout.loop={LOOPS.get(data_source, '<its loop>')} (the episode gave no reward)")


__all__ = ["LOOPS", "compute_score"]
