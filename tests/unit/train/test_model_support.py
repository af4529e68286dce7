"""Which models the learner runs exactly (agentloop.train.model_support), on tiny random models of real
architectures built here (CPU, no hub): the learner's logprobs equal the HF model's own
log_softmax(logits / T) where the model post-processes its head's output (Gemma-2's soft cap, Granite's and
Cohere's scales) and for mixtures of experts; configs the learner cannot run exactly are refused before
anything is built, by the learner and by `agentloop train`; a forward that changes the head's output in a way
the table does not know fails the first pass instead of training on wrong logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentloop.config import load_config
from agentloop.errors import ConfigError
from agentloop.records import EpisodeRecord
from agentloop.train import model_support
from agentloop.train.config import AlgoConfig, LearnerConfig
from agentloop.train.model_support import check_model_support
from agentloop.train.trainer.learner import Learner
from agentloop.train.trainer.logprobs import HeadTransform, chunked_logprobs

VOCAB = 96
T = 0.7
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
"""initializer_range 0.2: logits of a few units, where a scale or a soft cap of 2 changes every logprob."""


def _config(kind: str):
    import transformers as tf

    if kind == "gemma2":  # final soft cap on, attention soft cap off (refused), window as long as the context
        return tf.Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=2.0, attn_logit_softcapping=None,
                               sliding_window=64, query_pre_attn_scalar=8)
    if kind == "granite":  # logits / 0.25, untied head
        return tf.GraniteConfig(**SIZES, logits_scaling=0.25, tie_word_embeddings=False)
    if kind == "cohere":  # logits * 3, tied head
        return tf.CohereConfig(**SIZES, logit_scale=3.0, tie_word_embeddings=True)
    if kind == "granitemoe":  # experts and a head scale
        return tf.GraniteMoeConfig(**SIZES, logits_scaling=0.5, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16)
    if kind == "mixtral":
        return tf.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    if kind == "mistral_window":  # every layer windowed at 16 tokens, sequences up to 64
        return tf.MistralConfig(**SIZES, sliding_window=16)
    raise ValueError(kind)


def _save(tmp_path_factory, kind: str) -> Path:
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(kind)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = _save(tmp_path_factory, kind)
        return cache[kind]

    return get


def _records(seed: int = 0) -> list[EpisodeRecord]:
    g = torch.Generator().manual_seed(seed)
    recs = []
    for idx in range(2):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for rep in range(3):
            r = int(torch.randint(3, 9, (1,), generator=g))
            mask = [1] * r
            if r > 4:
                mask[2] = 0  # a tool token
            recs.append(EpisodeRecord(
                prompt_ids=prompt, response_ids=torch.randint(0, VOCAB, (r,), generator=g).tolist(),
                response_mask=mask, response_logprobs=[-4.0 if m else 0.0 for m in mask], reward=float(rep % 2),
                episode_id=f"{idx}-{rep}", index=idx, repeat=rep, data_source="t", loop="t", seed=rep, step=1))
    return recs


def _hf_logprobs(model_dir: Path, records: list[EpisodeRecord]) -> list[list[float]]:
    """The model's own numbers: log_softmax(model(ids).logits / T) of each sampled token (0 on mask-0 tokens)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for r in records:
        with torch.no_grad():
            logits = m(input_ids=torch.tensor([r.prompt_ids + r.response_ids])).logits[0].float()
        lp = torch.log_softmax(logits / T, -1)
        p = len(r.prompt_ids)
        out.append([float(lp[p + k - 1, t]) if mk else 0.0
                    for k, (t, mk) in enumerate(zip(r.response_ids, r.response_mask))])
    return out


def _learner_logprobs(model_dir: Path, records, attention: str = "padded", step: bool = False):
    learner = Learner(model_dir, AlgoConfig(temperature=T, kl_coef=0.05),
                      LearnerConfig(device="cpu", attention=attention, micro_batch_tokens=40, lr=1e-3))
    try:
        lps = learner.compute_logprobs(records)
        metrics = learner.train_step(records, 1) if step else None
        return lps, metrics, learner.notes
    finally:
        learner.close()


def _assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    """float32 on both sides, different kernels: 2e-5, plus 2e-6 of the value (logprobs reach -60 here)."""
    worst = max(abs(a - b) / (2e-5 + 2e-6 * abs(b)) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst < 1, f"learner vs HF logprobs: max |diff| {worst:.3g} x the tolerance"


# ---- the head transform ------------------------------------------------------------------------

@pytest.mark.parametrize("scale, softcap, fused", [(3.0, None, False), (1.0, 2.0, False), (0.5, 2.0, False),
                                                   (0.5, 2.0, True)], ids=["scale", "softcap", "both", "compiled"])
def test_chunked_logprobs_apply_the_head_transform_exactly(scale, softcap, fused):
    """logp, entropy and both gradients through logits = softcap * tanh(scale * x / softcap) / T, chunk by chunk,
    against the one-shot float64 computation with autograd."""
    from agentloop.train.trainer.logprobs import _Fused

    g = torch.Generator().manual_seed(5)
    n, h, v = 23, 8, 40
    hid = (3 * torch.randn(n, h, generator=g, dtype=torch.float64)).requires_grad_(True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    tr = HeadTransform(scale=scale, softcap=softcap)
    la = torch.log_softmax(tr.apply(hid @ w.T) / T, -1)
    lp, en = la.gather(-1, y[:, None]).squeeze(-1), -(la.exp() * la).sum(-1)
    ((lp * gl).sum() + (en * ge).sum()).backward()
    want = (lp.detach(), en.detach(), hid.grad.clone(), w.grad.clone())
    hid.grad = w.grad = None
    lp2, en2 = chunked_logprobs(hid, w, y, temperature=T, chunk=6, entropy=True, fused=fused, transform=tr)
    assert _Fused.failed is None
    ((lp2 * gl).sum() + (en2 * ge).sum()).backward()
    for a, b in zip((lp2.detach(), en2.detach(), hid.grad, w.grad), want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    plain = torch.log_softmax(hid.detach() @ w.detach().T / T, -1).gather(-1, y[:, None]).squeeze(-1)
    assert (plain - want[0]).abs().max() > 0.1  # the transform matters at these sizes


@pytest.mark.parametrize("kind, attention", [("gemma2", "padded"), ("gemma2", "varlen"), ("granite", "padded"),
                                             ("cohere", "padded")])
def test_learner_logprobs_equal_the_models_own_for_post_processed_heads(models, kind, attention):
    """Gemma-2 (final_logit_softcapping), Granite (logits_scaling, untied head), Cohere (logit_scale, tied head):
    the learner's logprobs are the HF model's log_softmax(logits / T); a train step runs on them. varlen (the
    CPU reference of the packed path) runs Gemma-2's sliding-window layers, whose window covers every sequence."""
    d = models(kind)
    recs = _records()
    lps, metrics, notes = _learner_logprobs(d, recs, attention, step=True)
    _assert_close(lps, _hf_logprobs(d, recs))
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])) and metrics["actor/grad_norm"] > 0
    assert any("logprob head" in n for n in notes), notes  # what it applied is said


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral", "granitemoe"])
def test_mixtures_of_experts_run_with_exact_logprobs(models, kind):
    d = models(kind)
    recs = _records(1)
    lps, metrics, notes = _learner_logprobs(d, recs, step=True)
    _assert_close(lps, _hf_logprobs(d, recs))
    assert metrics["actor/grad_norm"] > 0 and any("load-balancing loss" in n for n in notes), notes


def test_an_unknown_head_post_processing_fails_the_first_forward(models, monkeypatch):
    """A model whose forward changes the head's output in a way the table does not know (here Granite, taken
    out of the table and out of the suspicious keys) is stopped at its first forward pass."""
    monkeypatch.delitem(model_support.HEAD_TRANSFORMS, "granite")
    monkeypatch.delitem(model_support._HEAD_KEYS, "logits_scaling")
    with pytest.raises(RuntimeError, match=r"changed its LM head's output"):
        _learner_logprobs(models("granite"), _records())


@pytest.mark.parametrize("attention", ["flex", "varlen"])
def test_packed_attention_runs_a_window_that_covers_every_sequence_and_refuses_a_shorter_one(attention):
    """Mistral with every layer windowed: flex and varlen compute the packed row as SDPA's dense mask does while
    the window covers the longest sequence (6 tokens here), and refuse the row when the window (5) would cut."""
    import warnings

    import transformers as tf

    from agentloop.train.batch.episodes import Episode
    from agentloop.train.trainer import attention as att
    from agentloop.train.trainer.collate import collate_packed

    att.register_flex()
    att.register_varlen()
    eps = [Episode([1, 2, 3, 4, 5, 6, 7], 3, [1] * 4, [0.0] * 4, 1.0, 1.0),
           Episode([8, 9, 10, 11, 12], 2, [1] * 3, [0.0] * 3, 1.0, 1.0),
           Episode([8, 9, 13, 14], 2, [1] * 2, [0.0] * 2, 1.0, 1.0)]
    mb = collate_packed(eps, [[0], [1, 2]], "token-mean", num_tokens=9, num_seqs=3, pad_multiple=8)
    for window, ok in ((6, True), (5, False)):
        def build(impl: str, window: int = window):  # a config each: the model keeps (and marks its implementation in) the one given
            return tf.MistralForCausalLM._from_config(tf.MistralConfig(**SIZES, head_dim=8, sliding_window=window),
                                                      attn_implementation=impl).eval()

        model, sdpa = build(att.model_attn_impl(attention)), build("sdpa")
        sdpa.load_state_dict(model.state_dict())
        att.check_attn_impl(model, attention)
        bounds = att.attention_inputs(mb, attention, torch.device("cpu"))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # uncompiled flex on CPU warns that it is unfused
            if not ok:
                with pytest.raises(NotImplementedError, match=f"sliding window of {window} tokens"):
                    model(input_ids=mb.input_ids, position_ids=mb.position_ids, **bounds)
                continue
            a = model(input_ids=mb.input_ids, position_ids=mb.position_ids, **bounds).logits
            b = sdpa(input_ids=mb.input_ids, position_ids=mb.position_ids,
                     attention_mask=att.dense_mask(mb.doc_ids, mb.seg_ids)).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        mb.attn_cache.clear()


# ---- refusals ----------------------------------------------------------------------------------

def test_configs_the_learner_cannot_run_exactly_are_refused_with_the_key_and_the_fix():
    import transformers as tf

    def problems(cfg, **kw) -> str:
        s = check_model_support(cfg, **kw)
        assert not s.ok
        return "\n".join(s.problems)

    window = _config("mistral_window")
    msg = problems(window)
    assert "sliding_window=16" in msg and "sequences may reach 64" in msg and "model.context_length <= 16" in msg
    ok = check_model_support(window, max_len=16)  # the run's context fits the window: exact
    assert ok.ok and any("window never cuts" in a for a in ok.applied)
    assert "attn_logit_softcapping=50" in problems(tf.Gemma2Config(**SIZES, sliding_window=64))
    # a key other architectures apply to the head, on a model type agentloop does not list
    assert "final_logit_softcapping=5.0" in problems(tf.Qwen2Config(**SIZES, final_logit_softcapping=5.0))
    assert "linear_attention" in problems(tf.Qwen3NextConfig(**SIZES))
    assert "attention sinks" in problems(tf.GptOssConfig(**SIZES, sliding_window=128))
    assert "LM head bias" in problems(tf.PhiConfig(**SIZES))
    assert "bidirectional" in problems(tf.Gemma3TextConfig(**SIZES, use_bidirectional_attention=True))
    # what is supported says what it applies
    assert check_model_support(_config("granite")).head_scale == 4.0
    assert check_model_support(_config("cohere")).head_scale == 3.0
    assert check_model_support(_config("gemma2")).head_softcap == 2.0
    plain = check_model_support(tf.Qwen2Config(**SIZES))
    assert plain.ok and plain.transform().identity and not plain.applied


def test_the_learner_refuses_an_active_sliding_window_before_building_anything(models, monkeypatch):
    """A window of 16 tokens with sequences up to 64: refused as the learner starts (no model built), with the
    model's key named; the same model with the run's context inside the window starts."""
    d = models("mistral_window")
    monkeypatch.setattr(Learner, "_build", lambda *a, **k: pytest.fail("built a model it must refuse"))
    with pytest.raises(ConfigError, match=r"sliding_window=16: the window cuts sequences longer than 16 tokens"):
        Learner(d, AlgoConfig(), LearnerConfig(device="cpu"))
    monkeypatch.undo()
    learner = Learner(d, AlgoConfig(), LearnerConfig(device="cpu"), max_len=16)
    learner.close()


def test_the_learner_process_checks_against_the_runs_context_length(models, tmp_path):
    """The learner process reads model.context_length from the run's config: without it (sequences up to
    max_position_embeddings = 64) the window of 16 is refused (exit 1); with 16 it starts and, given no batch,
    times out (exit 2)."""
    from agentloop.train.trainer.main import main
    from agentloop.train.trainer.serve import EXIT_FAILED, EXIT_TIMEOUT, logger

    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    try:
        for ctx, code in ((None, EXIT_FAILED), (16, EXIT_TIMEOUT)):
            conf = tmp_path / f"config-{ctx}.yaml"
            conf.write_text(("" if ctx is None else f"model: {{context_length: {ctx}}}\n")
                            + "learner: {device: cpu, batch_timeout_s: 0.2, poll_s: 0.05}\n")
            run_dir = tmp_path / f"run-{ctx}"
            run_dir.mkdir()
            argv = ["--run-dir", str(run_dir), "--model", str(models("mistral_window")), "--config", str(conf),
                    "--no-resume", "--heartbeat-s", "0.1"]
            assert main(argv) == code, ctx
    finally:
        logger.handlers[:], logger.propagate = handlers, propagate
        logger.setLevel(level)


def test_agentloop_train_refuses_the_model_before_starting_anything(models, tmp_path):
    """`agentloop train` checks the model first: no learner process, no server contact, the reason named."""
    from agentloop.train.orchestrator.loop import run_train

    run_dir = tmp_path / "run"
    cfg = load_config(None, ['server.urls=["http://127.0.0.1:1"]', f'model.path="{models("mistral_window")}"',
                             f'run_dir="{run_dir}"', "train.steps=1", "train.tensorboard=false",
                             "tools.python.allow_unisolated=true"])  # the sandbox check is not under test
    with pytest.raises(ConfigError, match=r"sliding_window=16"):
        run_train(cfg)
    assert not (run_dir / "learner.log").exists()
