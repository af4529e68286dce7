"""The orchestrator's per-step record handling and resume guard, without servers or a learner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentloop.config import load_config
from agentloop.records import EpisodeRecord
from agentloop.train.mailbox import MailboxClient
from agentloop.train.orchestrator import Trainer, TrainingError, rollout_metrics, trainable


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
    return Trainer(cfg, tmp_path, _Servers(), None, MailboxClient(tmp_path), None, None, None, [])


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
        _trainer(tmp_path).batch_records(3, recs)
    # the limit is a share of the step's records: 0.5 tolerates this one
    usable, checks = _trainer(tmp_path, "train.max_version_violations=0.5").batch_records(3, recs)
    assert len(usable) == 2 and checks["versions/violations"] == 1 and checks["versions/violation_rate"] == 0.5


def test_resume_without_the_last_steps_weights_is_an_error_not_the_initial_weights(tmp_path):
    t = _trainer(tmp_path)
    with pytest.raises(TrainingError, match="weights of step 2 are missing"):
        asyncio.run(t.resume_weights(3))


def test_step_metrics_count_an_episode_of_several_segments_once():
    """openai_agent_loop writes an episode of two segments as two records: one episode, all its tokens."""
    a0, b = _rec(0, 0, [0, 0], reward=1.0), _rec(0, 1, [0], reward=0.0)
    a1 = a0.model_copy(update={"segment": 1, "num_turns": 1})
    m = rollout_metrics([a0, a1, b], "train")
    assert (m["train/episodes"], m["train/reward"]) == (2.0, 0.5)
    assert (m["train/model_tokens"], m["train/turns"]) == ((2 + 2 + 1) / 2, (1 + 1 + 1) / 2)
