"""The cluster section refuses combinations of backend, servers and weight sync that cannot work, each with what to
do instead, before anything starts; torchrun's multi-node learner gets its rendezvous or an error."""

from __future__ import annotations

import pytest

from agentloop.config import load_config, validate_for_training
from agentloop.errors import ConfigError
from agentloop.train.orchestrator.learner_process import learner_command, node_command

URL = 'server.urls=["http://h:1"]'
MODEL = 'model.path="/m"'


@pytest.mark.parametrize("over,message", [
    (["cluster.backend=ray", "learner.weight_sync=tensor", "server.device=cuda"],
     "learner.weight_sync=tensor with cluster.backend=ray needs cluster.colocate=true"),
    (["cluster.backend=ray", "cluster.colocate=true", URL, MODEL],
     "server.urls servers are not Ray's to place"),
    (["cluster.backend=ray", "cluster.colocate=true", "server.num_local=2"],
     "server.num_local=2 > learner.ranks=1"),
    (["cluster.backend=ray", URL, MODEL], "set cluster.shared_fs=true"),
    (["cluster.backend=ray", "cluster.colocate=true", "cluster.server_gpus=1"],
     "cluster.server_gpus + cluster.learner_gpus = 1.5 > 1"),
    (["cluster.backend=ray", "learner.weight_sync=nccl", "server.device=cpu"], "needs CUDA servers"),
    (["cluster.backend=ray", "learner.nnodes=2", "learner.rdzv_endpoint=h:29400"], "learner.ranks only"),
    (["cluster.address=h:6379"], "cluster.address only apply to cluster.backend=ray"),
    (["learner.nnodes=2", "learner.rdzv_endpoint=h:1", "learner.weight_sync=tensor"], "CUDA IPC"),
])
def test_combinations_that_cannot_work_are_refused(over, message):
    with pytest.raises(ConfigError, match="cannot be used for training") as e:
        validate_for_training(load_config(None, over))
    assert message in str(e.value)


@pytest.mark.parametrize("over", [
    ["cluster.backend=ray", "cluster.address=auto", "cluster.server_resources={a: 1}"],
    ["cluster.backend=ray", "cluster.colocate=true", "learner.weight_sync=tensor", "server.device=cuda"],
    ["cluster.backend=ray", URL, MODEL, "cluster.shared_fs=true"],
    ["cluster.backend=ray", "cluster.colocate=true", "cluster.server_gpus=0.25", "cluster.learner_gpus=0.75"],
    ["cluster.backend=ray", URL, MODEL, "learner.weight_sync=nccl"],
    ["learner.nnodes=2", "learner.rdzv_endpoint=h:1"],
    ["cluster.gpu_memory_gib=80"],  # the planning keys are not Ray's
])
def test_what_can_work_is_accepted(over):
    validate_for_training(load_config(None, over))


def test_a_resolved_config_on_one_host_is_not_taken_for_ray_settings(tmp_path):
    """config.yaml names every key (their defaults too): only values that differ from the defaults count."""
    from agentloop.config import dump_config

    f = tmp_path / "config.yaml"
    f.write_text(dump_config(load_config(None, [])))
    validate_for_training(load_config(f, []))


def test_a_learner_over_nodes_needs_its_rendezvous_and_every_node_runs_one_command(tmp_path):
    with pytest.raises(ConfigError, match="learner.rdzv_endpoint=HOST:PORT"):
        load_config(None, ["learner.nnodes=2"])
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        load_config(None, ["learner.rdzv_endpoint=h"])
    cmd = learner_command(tmp_path, "/m", nproc=2, nnodes=3, rdzv_endpoint="h:29400", rdzv_id="x")
    assert cmd[1:9] == ["-m", "torch.distributed.run", "--nnodes=3", "--nproc-per-node=2", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=h:29400", "--rdzv-id=x", "--max-restarts=0"]
    # the rendezvous outwaits the run's wait for a ready learner, whose timeout names what is missing
    cmd = learner_command(tmp_path, "/m", nnodes=2, rdzv_endpoint="h:1", rdzv_join_timeout_s=660.0)
    assert cmd[9:12] == ["--rdzv-conf=join_timeout=660", "-m", "agentloop.train.trainer"]
    from agentloop.train.orchestrator.learner_process import LearnerProcess

    lp = LearnerProcess(load_config(None, ["learner.ranks=4", "learner.nnodes=2", "learner.rdzv_endpoint=h:1",
                                           "train.learner_ready_timeout_s=100"]), tmp_path, tmp_path / "m")
    assert "--rdzv-conf=join_timeout=160" in lp.cmd
    # learner.ranks counts every host's ranks: torchrun starts ranks / nnodes on each
    assert "--nnodes=2" in lp.cmd and "--nproc-per-node=2" in lp.cmd and lp.node_args["nproc"] == 2
    with pytest.raises(ConfigError, match="learner.ranks=3 is not a multiple of learner.nnodes=2"):
        load_config(None, ["learner.ranks=3", "learner.nnodes=2", "learner.rdzv_endpoint=h:1"])
    with pytest.raises(ConfigError, match="learner_node.json is missing"):
        node_command(tmp_path)
