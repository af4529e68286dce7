"""The FLOP model (agentloop.train.flops) by hand, N of real shapes, and the GPUs' peak table."""

from __future__ import annotations

import pytest
import torch

from agentloop.train.flops import flop_params, peak_tflops, sequence_flops, step_flops


def test_flop_formula_by_hand():
    # N = 100, L = 2, H = 8, S = 10: train 6*100*10 + 12*2*8*10^2 = 6000 + 19200; forward 2000 + 6400
    assert sequence_flops(100, 2, 8, 10, backward=True) == 25200
    assert sequence_flops(100, 2, 8, 10, backward=False) == 8400
    f = step_flops(100, 2, 8, [10, 5], train_passes=2, forward_passes=1)
    # S = 5: train 3000 + 4800 = 7800, forward 1000 + 1600 = 2600
    assert f["train"] == 2 * (25200 + 7800)
    assert f["forward"] == 8400 + 2600
    assert f["total"] == f["train"] + f["forward"]


@pytest.mark.parametrize("tied", [True, False])
def test_flop_params_counts_matmul_weights(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    # per layer: q 32*32+32, k and v 32*16+16 each, o 32*32, MLP 3*32*64, two norms 32 each
    layer = (32 * 32 + 32) + 2 * (32 * 16 + 16) + 32 * 32 + 3 * 32 * 64 + 2 * 32
    # tied: the embedding matrix is counted once, as the LM head; untied: the LM head, not the lookup
    assert flop_params(model) == 2 * layer + 32 + 96 * 32


def test_flop_params_of_the_05b_shape():
    from transformers import Qwen2ForCausalLM

    from agentloop.models.modelzoo import shape_config

    with torch.device("meta"):
        model = Qwen2ForCausalLM(shape_config("qwen2.5-0.5b-shape"))
    assert flop_params(model) == 494_032_768  # Qwen2.5-0.5B's published parameter count (tied embeddings)


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert peak_tflops("NVIDIA H100 PCIe") == 756
    assert peak_tflops("NVIDIA H200") == 989
    assert peak_tflops("Some GPU") is None and peak_tflops(None) is None
    assert peak_tflops(None, 123.0) == 123.0 and peak_tflops("NVIDIA H200", 5.0) == 5.0
