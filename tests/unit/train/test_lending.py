"""The lent servers' sleep/wake schedule (agentloop.train.orchestrator.lending), without an event loop: the learner
trains only beside lent servers asleep, they wake only after the step's update, stay asleep when the next batch is
ready, and a transition out of turn raises. The config's rules for server.lend_learner_gpus."""

from __future__ import annotations

import pytest

from agentloop.config import ConfigError, lent_server_indices, load_config, validate_for_training
from agentloop.train.orchestrator.lending import LendSchedule


def test_a_step_sleeps_before_training_and_wakes_after_the_update():
    s = LendSchedule(1)
    assert not s.may_train()  # awake lent servers: the learner must not start
    assert s.before_train() == "sleep"
    assert not s.may_train()  # still draining
    s.slept()
    assert s.may_train()
    assert s.after_update(next_batch_ready=False) == "wake"
    s.woken()
    assert s.state == "awake" and (s.sleeps, s.wakes) == (1, 1)


def test_back_to_back_steps_keep_them_asleep():
    s = LendSchedule(2)
    assert s.before_train() == "sleep"
    s.slept()
    assert s.after_update(next_batch_ready=True) is None  # the learner trains again at once
    assert s.before_train() is None and s.may_train()
    assert s.after_update(next_batch_ready=False) == "wake"
    s.woken()
    assert (s.sleeps, s.wakes, s.kept_asleep) == (1, 1, 1)
    assert s.metrics()["lend/kept_asleep"] == 1.0


def test_out_of_turn_raises():
    s = LendSchedule(1)
    with pytest.raises(RuntimeError):
        s.after_update()  # an update ending while they serve: the learner trained beside them
    with pytest.raises(RuntimeError):
        s.slept()
    s.before_train()
    with pytest.raises(RuntimeError):
        s.woken()
    with pytest.raises(RuntimeError):
        s.after_update()  # still sleeping


def test_no_lent_server_is_a_no_op():
    s = LendSchedule(0)
    assert s.may_train() and s.before_train() is None and s.after_update() is None


def _cfg(*over):
    return load_config(None, ["train.steps=1", *over])


def test_lent_servers_from_the_placement_or_named():
    assert lent_server_indices(_cfg()) == []
    c = _cfg("server.lend_learner_gpus=true", "server.num_local=2", "server.gpus=[0,1]", "learner.gpus=[1]")
    assert lent_server_indices(c) == [1]
    validate_for_training(c)
    c = _cfg("server.lend_learner_gpus=true", "server.urls=[http://a:1,http://b:2]", "server.lent_servers=[1]",
             "model.path=/m")
    assert lent_server_indices(c) == [1]
    validate_for_training(c)


@pytest.mark.parametrize("over, says", [
    (["server.num_local=1", "server.gpus=[0]", "learner.gpus=[1]"], "no server runs on a learner GPU"),
    (["server.urls=[http://a:1]", "model.path=/m"], "needs server.lent_servers"),
    (["server.urls=[http://a:1]", "model.path=/m", "server.lent_servers=[3]"], "outside the 1 server"),
])
def test_refused_with_a_clear_message(over, says):
    with pytest.raises(ConfigError, match=says):
        validate_for_training(_cfg("server.lend_learner_gpus=true", *over))


def test_releasing_weights_is_refused_by_the_schema():
    with pytest.raises(ConfigError):
        _cfg("server.lend_learner_gpus=true", "server.lend_release=[weights]")
