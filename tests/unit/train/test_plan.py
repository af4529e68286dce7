"""The GPU memory plan (agentloop.train.planning.memory), pure: the memory model against the peaks measured on H100s
(benchmarks/RESULTS_learner.md), placement, the memory split of a shared GPU, refusals that name sizes and
what to change, and the length and timeout rules."""

from __future__ import annotations

import pytest

from agentloop.models.modelzoo import MODEL_SHAPES
from agentloop.train.planning import memory as plan
from agentloop.train.planning.memory import LearnerSetup, ModelShape, ServerSetup, Workload, learner_memory, make_plan

Q05 = ModelShape.from_config({**MODEL_SHAPES["qwen2.5-0.5b-shape"], "model_type": "qwen2"})
Q15 = ModelShape.from_config({**MODEL_SHAPES["qwen2.5-1.5b-shape"], "model_type": "qwen2"})
Q3 = ModelShape.from_config({**MODEL_SHAPES["qwen2.5-3b-shape"], "model_type": "qwen2"})


def test_parameters_and_kv_from_the_config():
    # the shapes' parameter counts as benchmarks/RESULTS_learner.md gives them (tied heads)
    assert Q05.params == pytest.approx(494.0e6, rel=2e-3)
    assert Q15.params == pytest.approx(1543.7e6, rel=2e-3)
    assert Q3.params == pytest.approx(3085.8e6, rel=2e-3)
    # 2 (K, V) x 24 layers x 2 kv heads x 64 head dim x 2 bytes
    assert Q05.kv_bytes_per_token == 2 * 24 * 2 * 64 * 2
    untied = ModelShape.from_config({**MODEL_SHAPES["qwen2.5-0.5b-shape"], "model_type": "qwen2",
                                     "tie_word_embeddings": False})
    assert untied.params - Q05.params == 151936 * 896
    nested = ModelShape.from_config({"model_type": "llava",
                                     "text_config": {**MODEL_SHAPES["qwen2.5-0.5b-shape"], "model_type": "qwen2"}})
    assert nested == Q05
    with pytest.raises(ValueError, match="vocab_size"):
        ModelShape.from_config({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2})


def test_the_parameters_are_counted_on_the_model_built_on_the_meta_device():
    """planning.meta: the model transformers builds from the config (as the learner does), on the meta device under
    accelerate.init_empty_weights: every parameter the architecture has, Qwen2's q/k/v biases included (the sizes
    alone leave them out: the estimate for a bare dict), a tied head once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))  # on the CPU, weights allocated
    assert ModelShape.from_config(small).params == sum(p.numel() for p in real.parameters())
    bare = {k: v for k, v in small.items() if k != "model_type"}
    assert ModelShape.from_config(small).params - ModelShape.from_config(bare).params == 2 * (64 + 2 * 2 * 16)


@pytest.mark.parametrize("model, setup, measured", [
    # one H100, 512 x (362 + 512), kl_coef 0.001, micro_batch_tokens 32768: varlen 52.4 GiB, varlen + compile 40.7
    (Q05, LearnerSetup(micro_batch_tokens=32768, reference=True), 52.4),
    (Q05, LearnerSetup(micro_batch_tokens=32768, reference=True, compile=True), 40.7),
    # 64 x (1024 + 1024) in shared rows of 1024 + 8 x 1024 tokens, three to a micro-batch (27648 tokens):
    # flex 47.5 GiB, varlen + compile 37.4
    (Q05, LearnerSetup(micro_batch_tokens=27648, reference=True), 47.5),
    (Q05, LearnerSetup(micro_batch_tokens=27648, reference=True, compile=True), 37.4),
    # two H100s (2 ranks), 16384 tokens per micro-batch, gradient checkpointing: 1.5B 20.9 GiB, 3B 38.7 GiB
    (Q15, LearnerSetup(nproc=2, micro_batch_tokens=16384, reference=True, gradient_checkpointing=True), 20.9),
    (Q3, LearnerSetup(nproc=2, micro_batch_tokens=16384, reference=True, gradient_checkpointing=True), 38.7),
])
def test_learner_peak_matches_the_measured_peaks(model, setup, measured):
    assert learner_memory(model, setup).peak == pytest.approx(measured, rel=0.10)


def test_the_two_measured_out_of_memory_runs_do_not_fit():
    # 1.5B on two 79 GiB H100s at 32768 tokens without checkpointing ran out of memory, compiled or not
    for compile_ in (False, True):
        mem = learner_memory(Q15, LearnerSetup(nproc=2, micro_batch_tokens=32768, reference=True, compile=compile_))
        assert mem.floor > 79.0


def test_activations_follow_the_longest_sequence():
    short = learner_memory(Q05, LearnerSetup(micro_batch_tokens=4096))
    long = learner_memory(Q05, LearnerSetup(micro_batch_tokens=4096), longest_sequence=8192)
    assert long.tokens == 8192 and long.activations == pytest.approx(2 * short.activations)


W = Workload(episodes=512, group_size=8, prompt_tokens=300, response_tokens=2048)


def test_one_gpu_colocates_and_sizes_the_server_from_what_the_learner_leaves():
    setup = LearnerSetup(micro_batch_tokens=32768, reference=True, compile=True, sync_bucket_gib=0.5)
    p = make_plan(Q05, setup, ServerSetup(count=1), W, [79.0])
    assert p.ok, p.problems
    assert p.colocated and p.learner_gpus == [0] and p.server_gpus == [0] and p.weight_sync == "tensor"
    # the KV pool holds every episode in flight (with headroom), so none waits for another
    assert p.kv_tokens >= W.kv_tokens and p.max_inflight_per_server == 512 and not p.notes
    g = p.gpus[0]
    assert g.learner + g.server <= 79.0
    assert p.mem_fraction_static == pytest.approx((Q05.weights_gib + W.kv_tokens * plan.KV_HEADROOM
                                                   * Q05.kv_bytes_per_token / plan.GIB) / 79.0, abs=2e-3)


def test_two_gpus_put_learner_and_server_apart_and_sync_over_nccl():
    p = make_plan(Q05, LearnerSetup(micro_batch_tokens=32768), ServerSetup(count=1), W, [79.0, 79.0])
    assert p.ok and not p.colocated
    assert p.learner_gpus == [0] and p.server_gpus == [1] and p.weight_sync == "nccl"
    assert p.mem_fraction_static is None  # the server has its GPU: SGLang sizes its pool itself
    # what the user placed stays placed (here: both on GPU 0, so the second GPU is idle and said so)
    q = make_plan(Q05, LearnerSetup(micro_batch_tokens=32768), ServerSetup(count=1, gpus=[0]), W, [79.0, 79.0],
                  learner_gpus=[0])
    assert q.colocated and q.weight_sync == "tensor" and any("GPU(s) [1] are not used" in n for n in q.notes)


def test_a_kv_pool_too_small_for_the_step_runs_in_waves_and_says_so():
    many = Workload(episodes=4096, group_size=8, prompt_tokens=300, response_tokens=4096)
    p = make_plan(Q05, LearnerSetup(micro_batch_tokens=32768, compile=True), ServerSetup(count=1), many, [79.0])
    assert p.ok
    assert p.kv_tokens < many.kv_tokens and p.max_inflight_per_server < 4096
    assert p.max_inflight_per_server == int(p.kv_tokens / many.tokens_per_episode)
    assert any("waves" in n for n in p.notes)


def test_too_small_a_gpu_is_refused_naming_sizes_and_what_to_change():
    p = make_plan(Q05, LearnerSetup(micro_batch_tokens=32768, reference=True), ServerSetup(count=1), W, [24.0])
    assert not p.ok
    msg = p.problems[0]
    assert "GPU 0 (24.0 GiB)" in msg and "32768 tokens per micro-batch" in msg
    assert "learner.micro_batch_tokens <=" in msg and "learner.gradient_checkpointing=true" in msg
    assert "more GPUs" in msg and "a smaller model" in msg
    # the suggested budget fits
    budget = int(msg.split("learner.micro_batch_tokens <= ")[1].split()[0])
    smaller = make_plan(Q05, LearnerSetup(micro_batch_tokens=budget, reference=True), ServerSetup(count=1), W, [24.0])
    assert smaller.ok, smaller.problems


def test_a_given_fraction_is_checked_not_changed():
    setup = LearnerSetup(micro_batch_tokens=32768, reference=True, gradient_checkpointing=True)
    ok = make_plan(Q05, setup, ServerSetup(count=1, mem_fraction_static=0.6), W, [79.0])
    assert ok.ok and ok.mem_fraction_static == 0.6
    assert ok.kv_tokens == int((0.6 * 79.0 - Q05.weights_gib) * plan.GIB / Q05.kv_bytes_per_token)
    bad = make_plan(Q05, LearnerSetup(micro_batch_tokens=32768, reference=True),
                    ServerSetup(count=1, mem_fraction_static=0.6), W, [79.0])
    assert not bad.ok
    assert "server.mem_fraction_static=0.6" in bad.problems[0]
    assert "lower server.mem_fraction_static to <= 0.2" in bad.problems[0]


def test_the_measured_colocated_run_fits():
    # benchmarks/RESULTS_learner.md: server at --mem-fraction-static 0.25 and the learner (flex, 32768 tokens,
    # peak 52.2 GiB) on one H100 ran; the plan must not refuse it (it says it is tight)
    p = make_plan(Q05, LearnerSetup(micro_batch_tokens=32768, reference=True, sync_bucket_gib=0.5),
                  ServerSetup(count=1, mem_fraction_static=0.25), Workload(512, 8, 362, 512), [79.1])
    assert p.ok, p.problems
    assert any("tight" in n for n in p.notes)


def test_more_learner_ranks_than_gpus_and_gpus_out_of_range_are_refused():
    p = make_plan(Q05, LearnerSetup(nproc=4), ServerSetup(count=1), W, [79.0, 79.0])
    assert "4 learner ranks on this host (learner.ranks / learner.nnodes) need 4 GPUs, the plan has 2" in p.problems[0]
    q = make_plan(Q05, LearnerSetup(), ServerSetup(count=1, gpus=[3]), W, [79.0])
    assert any("server.gpus places work on GPU [3]" in m for m in q.problems)


def test_external_servers_plan_only_the_learner():
    p = make_plan(Q05, LearnerSetup(micro_batch_tokens=32768), ServerSetup(count=0), W, [79.0])
    assert p.ok and p.server_gpus == [] and p.weight_sync is None and p.max_inflight_per_server is None


def test_length_and_timeout_rules():
    assert plan.response_budget(32768, 200) == 4096
    assert plan.response_budget(4096, 1000) == 3096
    assert plan.response_budget(512, 600) < 0
    assert plan.request_timeout_s(1024) == 600.0
    assert plan.request_timeout_s(32768) == 6554.0  # ceil(32768 / 5 tokens/s)
