"""The orchestrator's per-step record handling and resume guard, without servers or a learner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentloop.config import load_config
from agentloop.errors import failure_kind
from agentloop.records import EpisodeRecord
from agentloop.train.batch.episodes import prepare_episodes
from agentloop.train.config import AlgoConfig
from agentloop.train.orchestrator.learner_process import FileLearner
from agentloop.train.orchestrator.loop import Trainer, TrainingError, rollout_metrics, trainable


def _rec(uid: int, repeat: int, versions: list[int], *, reward: float | None = 1.0, error: str | None = None,
         finish: str = "stop") -> EpisodeRecord:
    n = len(versions)
    return EpisodeRecord(
        prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), response_mask=[1] * n,
        response_logprobs=[-0.5] * n, token_versions=list(versions), weight_versions=[str(max(versions))],
        reward=reward, error=error, finish_reason=finish, episode_id=f"{uid}-{repeat}", index=uid, uid=uid,
        repeat=repeat, data_source="t", loop="single_turn_agent_loop", seed=0)


class _Servers:
    """What batch_records asks of the server manager: the versions it names in its error."""

    def server_versions(self) -> dict[str, int]:
        return {"http://s0": 2}


def _trainer(tmp_path: Path, *over: str) -> Trainer:
    cfg = load_config(None, list(over))
    return Trainer(cfg, tmp_path, _Servers(), None, FileLearner(tmp_path), None, None, [])


def test_aborted_failed_and_unscored_records_are_not_trained():
    ok = _rec(0, 0, [0])
    assert trainable(ok)
    assert not trainable(_rec(0, 1, [0], finish="abort"))
    assert not trainable(_rec(0, 2, [0], error="RuntimeError: boom", reward=None))
    assert not trainable(_rec(0, 3, [0], reward=None))


def test_batch_keeps_trainable_records_in_uid_order_and_checks_their_versions(tmp_path):
    t = _trainer(tmp_path, "train.max_staleness=1")
    recs = [_rec(2, 0, [1, 1]), _rec(1, 1, [0, 1]), _rec(1, 0, [1]), _rec(3, 0, [0], finish="abort")]
    usable, checks = t.batch_records(2, recs)
    assert [(r.uid, r.repeat) for r in usable] == [(1, 0), (1, 1), (2, 0)]
    assert all(r.step == 2 for r in recs)
    assert checks["versions/violations"] == 0 and checks["staleness/lag_max"] == 1


def test_a_step_fails_once_violations_pass_the_limit(tmp_path):
    """Step 3 with η=0 may only train tokens of version 2; one record of two holds a version-0 token."""
    recs = [_rec(0, 0, [2, 2]), _rec(1, 0, [2, 0])]
    with pytest.raises(TrainingError, match=r"1 of 2 records hold tokens sampled outside versions \[2, 2\]"):
        _trainer(tmp_path, "train.max_staleness=0").batch_records(3, recs)
    # the limit is a share of the step's records: 0.5 tolerates this one
    usable, checks = _trainer(tmp_path, "train.max_staleness=0",
                              "train.max_version_violations=0.5").batch_records(3, recs)
    assert len(usable) == 2 and checks["versions/violations"] == 1 and checks["versions/violation_rate"] == 0.5


def test_the_default_schedule_is_async_with_one_version_of_staleness():
    """README: training is asynchronous by default, η = 1 with the off-policy correction (decoupled PPO
    around the recomputed proximal policy, truncated importance weights); η = 0 is one override away."""
    cfg = load_config(None, [])
    assert (cfg.train.schedule, cfg.train.max_staleness) == ("async", 1)
    assert (cfg.algo.old_logprobs, cfg.algo.proximal, cfg.algo.tis_cap) == ("recompute", "recompute", 2.0)
    assert load_config(None, ["train.max_staleness=0"]).train.max_staleness == 0


def test_the_synchronous_schedule_checks_versions_as_eta_zero(tmp_path):
    """train.schedule=sync keeps the default η = 1 in its config, but its records must all be of version s-1."""
    recs = [_rec(0, 0, [2, 2]), _rec(1, 0, [2, 1])]
    assert _trainer(tmp_path).batch_records(3, recs)[1]["versions/violations"] == 0  # async, η = 1
    with pytest.raises(TrainingError, match=r"outside versions \[2, 2\]"):
        _trainer(tmp_path, "train.schedule=sync").batch_records(3, recs)


def test_resume_without_the_last_steps_weights_is_an_error_not_the_initial_weights(tmp_path):
    t = _trainer(tmp_path)
    with pytest.raises(TrainingError, match="weights of step 2 are missing"):
        asyncio.run(t.resume_weights(3))


def _failed(uid: int, repeat: int, error: str, *, finish: str = "error") -> EpisodeRecord:
    """An error record as the engine makes it: no tokens, no reward."""
    return EpisodeRecord(prompt_ids=[], response_ids=[], response_mask=[], response_logprobs=[], num_turns=0,
                         finish_reason=finish, error=error, episode_id=f"{uid}-{repeat}", index=uid, uid=uid,
                         repeat=repeat, data_source="t", loop="single_turn_agent_loop", seed=0)


def test_failure_kinds():
    assert failure_kind(None, "stop") == failure_kind(None, "length") == "ok"
    assert failure_kind("EpisodeTimeout: episode exceeded rollout.episode_timeout_s=5", "timeout") == "policy"
    assert failure_kind(None, "abort") == "infra"  # a server abort the manager did not continue
    assert failure_kind("AgentTimeoutError: the agent ran past agent.timeout_s=5", "error") == "policy"
    assert failure_kind("AgentError: the command exited with 1", "error") == "infra"
    # the agent failed after the gateway saw the policy overflow the context or make an unusable tool call
    assert failure_kind("AgentPolicyError: the agent raised (after the policy's context overflow)", "error") == "policy"
    for err in ("RetryBudgetExhausted: generate failed after 5 attempts", "AllServersDownError: all down",
                "ValueError: BadLoop returned extra['x'] is a set, not JSON data", "RewardError: no reward registered",
                "PromptTooLongError: prompt of 9000 tokens", "TimeoutError: a tool's own timeout"):
        assert failure_kind(err, "error") == "infra", err


def test_a_policy_failure_stays_in_its_group_at_the_failure_score_and_an_infra_failure_drops_the_group(tmp_path):
    """Group 1: three scored episodes and one that ran past the episode timeout (policy): trained at the
    failure score, the advantages computed over all four. Group 2: one episode's retries ran out (infra):
    the whole group is left out, never trained partial."""
    t = _trainer(tmp_path, "reward.failure_score=-1")
    timeout = _rec(1, 3, [0, 0], reward=None, error="EpisodeTimeout: episode exceeded rollout.episode_timeout_s=5",
                   finish="timeout")  # the turns it finished were kept
    recs = [_rec(1, 0, [0], reward=1.0), _rec(1, 1, [0], reward=0.0), _rec(1, 2, [0], reward=1.0), timeout,
            _rec(2, 0, [0], reward=1.0), _rec(2, 1, [0], reward=0.0),
            _failed(2, 2, "RetryBudgetExhausted: generate for episode 2-2 failed after 5 attempt(s)"),
            _rec(3, 0, [0], reward=0.0), _failed(3, 1, "EpisodeTimeout: episode exceeded rollout.episode_timeout_s=5",
                                                  finish="timeout")]  # tokenless: in the baseline only
    usable, checks = t.batch_records(1, recs)
    assert [(r.uid, r.repeat) for r in usable] == [(1, 0), (1, 1), (1, 2), (1, 3), (3, 0), (3, 1)]
    assert [r.reward for r in usable] == [1.0, 0.0, 1.0, -1.0, 0.0, -1.0]
    assert timeout.reward is None  # the record as written stays as it was; the learner gets a scored copy
    assert checks["train/groups_dropped_infra"] == 1 and checks["train/episodes_policy_failed"] == 2
    # the trained mean with the failures at reward.failure_score, and without them
    assert checks["train/reward_mean_with_failures"] == pytest.approx(0.0)
    assert checks["train/reward_mean_without_failures"] == pytest.approx(2 / 4)
    prepared = prepare_episodes(usable, AlgoConfig(norm_adv_by_std=False))
    adv = [e.advantage for e in prepared.episodes]
    # group 1 over all four rewards (mean 0.25); group 3's tokenless failure is in its baseline (mean -0.5)
    assert adv == [0.75, -0.25, 0.75, -1.25, 0.5]
    assert prepared.metrics["batch/policy_failed"] == 2 and prepared.metrics["batch/failed"] == 0


def test_a_server_aborted_episode_drops_its_group(tmp_path):
    """A server abort is no fault of the policy: its group is left out whole, the others are trained."""
    recs = [_rec(5, 0, [0]), _rec(5, 1, [0], reward=None, finish="abort"), _rec(6, 0, [0]), _rec(6, 1, [0], reward=0.0)]
    usable, checks = _trainer(tmp_path).batch_records(1, recs)
    assert [(r.uid, r.repeat) for r in usable] == [(6, 0), (6, 1)] and checks["train/groups_dropped_infra"] == 1

def test_step_metrics_count_an_episode_of_several_segments_once():
    """openai_agent_loop writes an episode of two segments as two records: one episode, all its tokens."""
    a0, b = _rec(0, 0, [0, 0], reward=1.0), _rec(0, 1, [0], reward=0.0)
    a1 = a0.model_copy(update={"segment": 1, "num_turns": 1})
    m = rollout_metrics([a0, a1, b], "train")
    assert (m["train/episodes"], m["train/reward"]) == (2.0, 0.5)
    assert (m["train/model_tokens"], m["train/turns"]) == ((2 + 2 + 1) / 2, (1 + 1 + 1) / 2)
