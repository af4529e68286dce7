"""Packed-row attention masks (agentloop.train.trainer.attention) and the chunked logprob head
(agentloop.train.trainer.logprobs) on CPU: the block mask equals FlexAttention's own and gives SDPA's dense-mask
output, the varlen segments give SDPA's dense-mask output and gradients, the HF model runs our flex and
varlen functions, an eager model is refused, and chunked logprobs, entropy and their gradients equal the
full [tokens x vocab] computation."""

from __future__ import annotations

import warnings

import pytest
import torch

from agentloop.train.batch.episodes import Episode
from agentloop.train.trainer.attention import (
    FLEX_IMPL,
    VARLEN_IMPL,
    allowed,
    block_mask,
    check_attn_impl,
    dense_mask,
    register_flex,
    register_varlen,
    resolve_attention,
    varlen_attn,
    varlen_layout,
)
from agentloop.train.trainer.collate import collate_packed
from agentloop.train.trainer.logprobs import LogprobHead, chunked_logprobs


def _layout():
    """Three items: a plain sequence, a shared prompt with two segments, and end padding."""
    a = Episode([1, 2, 3, 4, 5, 6], 3, [1, 1, 1], [0.0] * 3, 1.0, 1.0)
    b1 = Episode([7, 8, 9, 10, 11], 2, [1, 1, 1], [0.0] * 3, 1.0, 1.0)
    b2 = Episode([7, 8, 12, 13], 2, [1, 1], [0.0] * 2, 1.0, 1.0)
    return [a, b1, b2]


def test_packed_layout_ids_and_mask():
    eps = _layout()
    mb = collate_packed(eps, [[0], [1, 2]], "token-mean", num_tokens=8, num_seqs=3, pad_multiple=8)
    # item 0: 5 positions; item 1: prompt part [7], segment 1 [8, 9, 10, 11 -> targets], segment 2 [8, 12]
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8, 9, 10, 8, 12, 0, 0, 0, 0, 0]]
    assert mb.targets.tolist()[0][:11] == [2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]
    assert mb.position_ids.tolist()[0][:11] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 1, 2]
    assert mb.doc_ids.tolist() == [0] * 5 + [1] * 6 + [-1] * 5
    assert mb.seg_ids.tolist() == [0] * 6 + [1, 1, 1, 2, 2] + [0] * 5
    assert mb.spans == [(0, 2, 3), (0, 6, 3), (0, 9, 2)] and mb.row_lengths == [5, 6]
    assert mb.row_attn_sq == [25, 1 + (16 - 1) + (9 - 1)] and mb.shared_rows == 1
    m = dense_mask(mb.doc_ids, mb.seg_ids)[0, 0].int()
    assert m[9].tolist()[:11] == [0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0]  # segment 2 sees the prompt and itself
    assert m[4].tolist()[:6] == [1, 1, 1, 1, 1, 0]  # item 0 never sees item 1
    assert bool(m[15, 15]) and m.sum(-1).min() >= 1  # padding: no empty query row


@pytest.mark.parametrize("case", ["shared", "plain", "cut"])
def test_block_mask_equals_flex_own_and_dense_sdpa(case):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    L, doc, seg = {
        "shared": (300, [0] * 100 + [1] * 120 + [2] * 80, [0] * 100 + [0] * 40 + [1] * 40 + [2] * 40 + [0] * 80),
        "plain": (129, [0] * 129, [0] * 129),
        "cut": (700, [0] * 500 + [1] * 150 + [-1] * 50, [0] * 200 + [1] * 150 + [2] * 150 + [0] * 200),
    }[case]
    doc, seg = torch.tensor(doc, dtype=torch.int32), torch.tensor(seg, dtype=torch.int32)
    bm = block_mask(doc, seg, band_pairs=5000)  # several bands
    ref = create_block_mask(lambda b, h, q, k: allowed(doc, seg, q, k), 1, None, L, L, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks"):
        got, want = getattr(bm, name), getattr(ref, name)
        if name == "kv_indices":  # only the visited prefix of each row is meaningful
            n = bm.kv_num_blocks[0, 0]
            got = [got[0, 0, i, :n[i]].tolist() for i in range(len(n))]
            want = [want[0, 0, i, :n[i]].tolist() for i in range(len(n))]
        else:
            got, want = got.tolist(), want.tolist()
        assert got == want, name
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, L, 16, generator=g), torch.randn(1, 2, L, 16, generator=g), torch.randn(1, 2, L, 16,
                                                                                                       generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex on CPU warns that it is unfused
        out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(doc, seg), enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def _tiny(attn: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation=attn).eval()


@pytest.mark.parametrize("attention", ["flex", "varlen"])
def test_hf_model_runs_our_attention_function_with_the_row_boundaries(attention):
    """The HF model runs our flex (block mask as attention_mask) / varlen (layout as the agentloop_varlen
    keyword) function: the packed row's logits equal SDPA's with the dense mask and each item's own forward,
    and a call without the boundaries is refused."""
    register_flex()
    register_varlen()
    eps = _layout()
    mb = collate_packed(eps, [[0], [1, 2]], "token-mean", num_tokens=8, num_seqs=3, pad_multiple=8)
    impl, bounds, missing = {
        "flex": (FLEX_IMPL, {"attention_mask": block_mask(mb.doc_ids, mb.seg_ids, block=8)}, "BlockMask"),
        "varlen": (VARLEN_IMPL, {"agentloop_varlen": varlen_layout(mb.doc_ids, mb.seg_ids)}, "agentloop_varlen"),
    }[attention]
    model, sdpa = _tiny(impl), _tiny("sdpa")
    sdpa.load_state_dict(model.state_dict())
    check_attn_impl(model, attention)
    check_attn_impl(sdpa, "packed_sdpa")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex on CPU warns that it is unfused
        a = model(input_ids=mb.input_ids, position_ids=mb.position_ids, **bounds).logits
        b = sdpa(input_ids=mb.input_ids, position_ids=mb.position_ids,
                 attention_mask=dense_mask(mb.doc_ids, mb.seg_ids)).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # each item equals its own unpacked, unshared forward: segment 2 never saw segment 1
        alone = sdpa(input_ids=torch.tensor([[7, 8, 12]])).logits[0]
        torch.testing.assert_close(a[0, [5, 9, 10]], alone, atol=1e-5, rtol=1e-5)
        with pytest.raises(RuntimeError, match=missing):
            model(input_ids=mb.input_ids, position_ids=mb.position_ids)


def test_varlen_layout_segments_and_key_ranges():
    eps = _layout()
    mb = collate_packed(eps, [[0], [1, 2]], "token-mean", num_tokens=8, num_seqs=3, pad_multiple=8)
    lay = varlen_layout(mb.doc_ids, mb.seg_ids)
    # query segments tile the row: item 0 [0, 5), prompt of item 1 [5, 6), segment 1 [6, 9), segment 2
    # [9, 11), end padding [11, 16)
    assert lay.cu_q.tolist() == [0, 5, 6, 9, 11, 16]
    # keys: item 0 itself, the prompt itself, prompt + segment 1, prompt + segment 2, padding itself
    assert lay.kv_index.tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 5, 9, 10, 11, 12, 13, 14, 15]
    assert lay.cu_k.tolist() == [0, 5, 6, 10, 13, 18] and (lay.max_q, lay.max_k) == (5, 5)
    plain = varlen_layout(torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32), torch.zeros(5, dtype=torch.int32))
    assert plain.kv_index is None and plain.cu_k.tolist() == plain.cu_q.tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="no prompt part"):
        varlen_layout(torch.tensor([0, 0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32))


@pytest.mark.parametrize("case", ["shared", "plain", "cut"])
def test_varlen_attention_equals_dense_mask_sdpa_values_and_gradients(case):
    """The varlen segments (responses reading their prompt's gathered keys, causal aligned to the end) compute
    what SDPA computes with the dense mask of `allowed`, outputs and gradients of q, k and v (GQA 4:2)."""
    import torch.nn.functional as F

    doc, seg = {
        "shared": ([0] * 100 + [1] * 120 + [2] * 80, [0] * 100 + [0] * 40 + [1] * 40 + [2] * 40 + [0] * 80),
        "plain": ([0] * 129, [0] * 129),
        "cut": ([0] * 500 + [1] * 150 + [-1] * 50, [0] * 200 + [1] * 150 + [2] * 150 + [0] * 200),
    }[case]
    doc, seg = torch.tensor(doc, dtype=torch.int32), torch.tensor(seg, dtype=torch.int32)
    L = doc.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, h, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = varlen_attn(q, k, v, varlen_layout(doc, seg), 0.25)
    heads = lambda t: t.transpose(0, 1)[None].repeat_interleave(4 // t.shape[1], 1)  # noqa: E731
    ref = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=dense_mask(doc, seg),
                                         scale=0.25)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), w), torch.autograd.grad(ref, (q, k, v), w)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_a_model_that_ignores_the_mask_is_refused():
    with pytest.raises(RuntimeError, match="would not apply"):
        check_attn_impl(_tiny("eager"), "packed_sdpa")
    with pytest.raises(RuntimeError, match="would not apply"):
        check_attn_impl(_tiny("sdpa"), "flex")
    assert resolve_attention("auto", "cpu") == "padded"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_attention("flex", "cpu")
    with pytest.raises(RuntimeError, match="would not apply"):
        check_attn_impl(_tiny("sdpa"), "varlen")
    with pytest.raises(ValueError, match="head dimension 8"):
        resolve_attention("flex", "cuda", 8)
    with pytest.raises(ValueError, match="head dimension 12"):
        resolve_attention("varlen", "cpu", 12)
    assert resolve_attention("varlen", "cpu", 64) == "varlen"  # the exact reference, for tests


def test_auto_attention_on_cuda(monkeypatch):
    """auto on CUDA: varlen where aten's FlashAttention runs and the head dimension and dtype suit it, flex
    where FlexAttention does (head dimension >= 16, a power of two), packed SDPA otherwise."""
    from agentloop.train.trainer import attention

    monkeypatch.setattr(attention, "varlen_available", lambda: True)
    assert resolve_attention("auto", "cuda", 64, torch.bfloat16) == "varlen"
    assert resolve_attention("auto", "cuda", 80, torch.bfloat16) == "varlen"  # flex could not run 80
    assert resolve_attention("auto", "cuda", 64, torch.float32) == "flex"  # FlashAttention is half precision only
    with pytest.raises(ValueError, match="bf16/fp16"):
        resolve_attention("varlen", "cuda", 64, torch.float32)
    monkeypatch.setattr(attention, "varlen_available", lambda: False)
    assert resolve_attention("auto", "cuda", 64) == "flex" and resolve_attention("auto", "cuda", 128) == "flex"
    assert resolve_attention("auto", "cuda", 8) == "packed_sdpa" and resolve_attention("auto", "cuda", 80) == "packed_sdpa"
    with pytest.raises(ValueError, match="no FlashAttention"):
        resolve_attention("varlen", "cuda", 64, torch.bfloat16)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("ent_w", [0.0, 0.3])
def test_chunked_logprobs_equal_the_full_computation(temperature, ent_w, fused):
    """Chunks of 5 (the last one short) against one [37 x 50] log-softmax, float64; `fused` runs each
    chunk's math through torch.compile (the GPU default), which must not fall back to eager here."""
    from agentloop.train.trainer.logprobs import _Fused

    g = torch.Generator().manual_seed(3)
    n, h, v = 37, 8, 50
    hid = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    gl = torch.randn(n, generator=g, dtype=torch.float64)
    la = torch.log_softmax(hid @ w.T / temperature, -1)
    lp, en = la.gather(-1, y[:, None]).squeeze(-1), -(la.exp() * la).sum(-1)
    ((lp * gl).sum() + ent_w * en.sum()).backward()
    want = (lp.detach(), en.detach(), hid.grad.clone(), w.grad.clone())
    hid.grad = w.grad = None
    lp2, en2 = chunked_logprobs(hid, w, y, temperature=temperature, chunk=5, entropy=True, fused=fused)
    assert _Fused.failed is None
    ((lp2 * gl).sum() + ent_w * en2.sum()).backward()
    for a, b in zip((lp2.detach(), en2.detach(), hid.grad, w.grad), want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    # entropy not asked for: none computed, the logprob gradient alone
    lp3, en3 = chunked_logprobs(hid.detach(), w.detach(), y, temperature=temperature, chunk=64)
    assert en3 is None
    torch.testing.assert_close(lp3, want[0], atol=1e-10, rtol=1e-10)


def test_logprob_head_replaces_logits_only_while_asked():
    model = _tiny("sdpa")
    head = LogprobHead(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    targets = torch.tensor([[6, 7, 8, 9]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # plain forward untouched
        assert logits.shape == (1, 4, 64)
        with head.use(targets, entropy=True, entropy_grad=False, temperature=1.0, chunk=3):
            out = model(input_ids=ids).logits
    la = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(out[..., 0], la.gather(-1, targets[..., None])[..., 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[..., 1], -(la.exp() * la).sum(-1), atol=1e-6, rtol=1e-6)
    assert head.request is None and model(input_ids=ids).logits.shape == (1, 4, 64)
