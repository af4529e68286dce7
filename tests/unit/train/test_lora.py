"""LoRA in the learner (CPU, gloo, a throwaway tiny Qwen2): a zero-initialised adapter is the base model exactly,
training moves only the adapters, the adapter and merged exports give the learner's logprobs, checkpoints
resume exactly, and bad configs are refused with their reason."""

from __future__ import annotations

import json

import pytest
import torch

from agentloop.train.config import AlgoConfig, LearnerConfig, LoraConfig
from agentloop.train.lora import adapter_name, merge_adapter_dir, read_adapter
from agentloop.train.trainer.learner import Learner
from tests.unit.train.test_learner import _hf_logprobs, load_weights, make_records, tiny_model, with_logprobs

__all__ = ["tiny_model"]  # the fixture, imported for its module scope here

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def _cfg(**kw) -> LearnerConfig:
    return LearnerConfig(device="cpu", lr=kw.pop("lr", 5e-3), micro_batch_tokens=40, lora=LORA, **kw)


def test_zero_init_adapter_gives_the_base_models_logprobs_bit_for_bit(tiny_model):
    recs = make_records(1)
    base = Learner(tiny_model, AlgoConfig(), LearnerConfig(device="cpu", micro_batch_tokens=40))
    try:
        want = base.compute_logprobs(recs)
    finally:
        base.close()
    learner = Learner(tiny_model, AlgoConfig(), _cfg())
    try:
        got = learner.compute_logprobs(recs)
        # the adapters are there (A random, B zero), and trainable; nothing else is
        names = {n for n, p in learner.model.named_parameters() if p.requires_grad}
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        assert any(".q_proj.lora_A." in n for n in names) and any(".down_proj.lora_B." in n for n in names)
        a = next(p for n, p in learner.model.named_parameters() if ".lora_A." in n)
        assert float(a.detach().abs().sum()) > 0
        opt_params = sum(p.numel() for g in learner.optimizer.param_groups for p in g["params"])
        assert opt_params == sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    finally:
        learner.close()
    assert got == want


def test_lora_training_moves_only_the_adapters_and_its_exports_give_the_learners_logprobs(tiny_model, tmp_path):
    learner = Learner(tiny_model, AlgoConfig(old_logprobs="rollout"), _cfg())
    try:
        base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
        recs = with_logprobs(make_records(1), learner.compute_logprobs(make_records(1)))
        m = [learner.train_step(recs, s) for s in (1, 2, 3)]
        assert m[2]["actor/loss"] < m[1]["actor/loss"] < m[0]["actor/loss"]
        for n, p in learner.model.named_parameters():
            if n in base:
                assert torch.equal(p.detach(), base[n]), f"{n} is frozen but moved"
        lps = learner.compute_logprobs(recs)
        # what weight_sync=tensor hands over (one cast of the lot, views of it) is the trained adapter, each tensor
        # whole, in the compute dtype
        on_cpu, on_dev = learner.adapter_tensors(on_device=False), learner.adapter_tensors(on_device=True)
        assert on_dev.keys() == on_cpu.keys() and len(on_cpu) > 2
        for k, v in on_cpu.items():
            assert on_dev[k].shape == v.shape and on_dev[k].dtype == learner.compute_dtype
            assert torch.equal(on_dev[k], v.to(learner.compute_dtype)), k
        ad = learner.save_adapter(tmp_path / "adapter")
        merged = learner.save_hf(tmp_path / "merged")
        served = learner.save_served(tmp_path / "served")
    finally:
        learner.close()
    conf, tensors = read_adapter(ad)
    assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (4, 8.0, "LORA")
    assert set(conf["target_modules"]) == set(LORA.target_modules)
    raw = json.loads((ad / "adapter_config.json").read_text())
    assert raw["base_model_name_or_path"] == str(tiny_model)
    from safetensors.torch import load_file

    keys = list(load_file(str(ad / "adapter_model.safetensors")))
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)  # PEFT's names, what SGLang reads
    assert any(k.endswith("self_attn.q_proj.lora_A.weight") for k in keys)
    assert any(float(v.abs().sum()) > 0 for k, v in tensors.items() if ".lora_B." in k)  # B trained away from 0
    assert sorted(p.name for p in served.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # the merged HF directory is the trained policy (an independent forward), and so is an offline merge
    for i in (0, 3):
        assert lps[i] == pytest.approx(_hf_logprobs(merged, recs[i]), abs=1e-5)
    offline = merge_adapter_dir(tiny_model, ad, tmp_path / "offline")
    wa, wb = load_weights(merged), load_weights(offline)
    assert wa.keys() == wb.keys() and not any(".lora_" in k for k in wa)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0, msg=k)
    assert (offline / "tokenizer_config.json").is_file()


def _bucket_is_the_adapter(learner: Learner) -> torch.Tensor:
    """Learner.adapter_bucket (views made once) against the bucket of adapter_tensors (read now), both ways."""
    from agentloop.train.lora import adapter_state
    from agentloop.train.weights.tensor import adapter_bucket

    for on_device in (True, False):
        flat, meta = learner.adapter_bucket(on_device=on_device)
        want, want_meta = adapter_bucket(adapter_state(learner.adapter_tensors(on_device=on_device)))
        assert torch.equal(flat, want) and [vars(m) for m in meta] == [vars(m) for m in want_meta]
    return flat


def test_lora_checkpoint_roundtrip_is_exact(tiny_model, tmp_path):
    """...and the adapter weight_sync=tensor pushes (Learner.adapter_bucket) follows every step, a checkpoint's load
    and a parameter whose tensor is replaced."""
    learner = Learner(tiny_model, AlgoConfig(), _cfg(lr=1e-2, mini_batches=2))
    try:
        learner.train_step(make_records(1), 1)
        at_1 = _bucket_is_the_adapter(learner).clone()
        ck = learner.save_checkpoint(tmp_path / "ck")
        learner.train_step(make_records(2), 2)
        assert not torch.equal(_bucket_is_the_adapter(learner), at_1)
        a = read_adapter(learner.save_adapter(tmp_path / "a"))[1]
        learner.load_checkpoint(ck)
        assert learner.step == 1
        assert torch.equal(_bucket_is_the_adapter(learner), at_1)
        p = next(p for n, p in learner.model.named_parameters() if ".lora_B." in n)
        kept = p._local_tensor
        p._local_tensor = kept.clone() + 1.0  # what a reload that swaps a tensor leaves
        assert not torch.equal(_bucket_is_the_adapter(learner), at_1)
        p._local_tensor = kept
        assert torch.equal(_bucket_is_the_adapter(learner), at_1)
        learner.train_step(make_records(2), 2)  # needs the restored adapters and their Adam moments
        b = read_adapter(learner.save_adapter(tmp_path / "b"))[1]
    finally:
        learner.close()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_lora_configs_that_cannot_work_are_refused_with_their_reason(tiny_model):
    with pytest.raises(ValueError, match="never over a NCCL group; use weight_sync=tensor"):
        LearnerConfig(lora=LORA, weight_sync="nccl")
    # tensor: /load_lora_adapter_from_tensors; a CPU learner's adapter goes by value (full weights still need CUDA)
    assert LearnerConfig(lora=LORA, weight_sync="tensor", device="cpu").weight_sync == "tensor"
    with pytest.raises(ValueError, match="needs a GPU learner"):
        LearnerConfig(weight_sync="tensor", device="cpu")
    with pytest.raises(ValueError, match="LM head"):
        LoraConfig(enabled=True, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="is empty"):
        LoraConfig(enabled=True, target_modules=[])
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentloop.train.lora import inject_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    with pytest.raises(ValueError, match=r"\['wq'\], which Qwen2ForCausalLM does not have"):
        inject_lora(model, LORA.model_copy(update={"target_modules": ["q_proj", "wq"]}))
    with pytest.raises(ValueError, match="matches no linear layer"):
        inject_lora(model, LORA.model_copy(update={"target_modules": ["wq"]}))
    assert adapter_name(3) == "agentloop-v3"


def test_lora_on_two_ranks_matches_one_rank(tiny_model, tmp_path):
    """torchrun, 2 CPU ranks (gloo): FSDP2 shards the frozen base and the adapters; the mailbox learner's step-1
    adapter (weights/step-1, what the servers load) equals one rank's on the whole batch."""
    from agentloop.train.handle.mailbox import MailboxClient
    from agentloop.train.trainer.main import load_sections
    from tests.unit.train.test_learner import _finish, _launch

    run = tmp_path / "run"
    run.mkdir()
    # adam_eps 1: Adam's first steps turn near-zero gradients (A's, while B is still ~0) into +-lr by their sign,
    # which float summation order may flip; with eps 1 the update follows the gradient's size (as test_learner's)
    overrides = ["learner.device=cpu", "learner.lr=0.05", "learner.adam_eps=1.0", "learner.poll_s=0.05", "learner.micro_batch_tokens=30",
                 "learner.mini_batches=2", "learner.lora.enabled=true", "learner.lora.rank=4",
                 "learner.lora.alpha=8"]
    batch = make_records(1, seed=21, groups=3)
    proc = _launch(run, tiny_model, overrides, nproc=2)
    try:
        client = MailboxClient(run, process=proc, poll_s=0.05)
        assert client.wait_ready(180)["world_size"] == 2
        client.submit_records(1, batch, load_sections(None, overrides)[0])
        res = client.wait_update(1, 120)
        _finish(proc, client, run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    algo, cfg = load_sections(None, overrides)
    learner = Learner(tiny_model, algo, cfg)
    try:
        m = learner.train_step(batch, 1)
        one = read_adapter(learner.save_adapter(tmp_path / "one"))[1]
    finally:
        learner.close()
    two = read_adapter(res.weights_dir)[1]
    assert res.metrics["actor/loss"] == pytest.approx(m["actor/loss"], rel=1e-4, abs=1e-6)
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=0, msg=k)
    assert any(float(v.abs().sum()) > 0 for k, v in two.items() if ".lora_B." in k)


def test_a_lora_runs_launched_servers_get_the_lora_flags_before_the_users():
    from agentloop.config import load_config
    from agentloop.train.orchestrator.backend import with_lora_server_args

    plain = load_config(None, ["server.device=cpu"])
    assert with_lora_server_args(plain) is plain
    cfg = load_config(None, ["server.device=cpu", "learner.lora.enabled=true", "learner.lora.rank=8",
                             'server.extra_args=["--lora-backend", "triton"]'])
    args = with_lora_server_args(cfg).server.extra_args
    assert args[:3] == ["--enable-lora", "--max-lora-rank", "8"]
    assert args[-2:] == ["--lora-backend", "triton"]  # the user's flags come last and win
    assert "torch_native" in args and cfg.server.extra_args == ["--lora-backend", "triton"]


def test_a_16_bit_base_merges_in_float32_when_asked_so_the_merged_model_is_the_served_policy(tmp_path):
    """The merged weights of a bf16 base are rounded to bf16 by default (the base's dtype); dtype=float32 keeps
    W + alpha/r * B A exactly: the reference the integration test compares the servers' tokens with (a bf16 merge
    moved the untrained tiny model's logprobs by 2.7e-3, the float32 one matched the servers to 1e-6)."""
    from safetensors.torch import load_file, save_file

    from agentloop.train.lora import save_adapter

    g = torch.Generator().manual_seed(0)
    base = tmp_path / "base"
    base.mkdir()
    w = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    save_file({"model.layers.0.self_attn.q_proj.weight": w, "model.norm.weight": torch.ones(5, dtype=torch.bfloat16)},
              str(base / "model.safetensors"))
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}))
    a, b = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g) * 1e-2
    cfg = LoraConfig(enabled=True, rank=2, alpha=4.0, target_modules=["q_proj"])
    ad = save_adapter(tmp_path / "ad", {"model.layers.0.self_attn.q_proj.lora_A.weight": a,
                                        "model.layers.0.self_attn.q_proj.lora_B.weight": b}, cfg)
    exact = w.float() + 2.0 * (b @ a)
    m16 = load_file(str(merge_adapter_dir(base, ad, tmp_path / "m16") / "model.safetensors"))
    m32_dir = merge_adapter_dir(base, ad, tmp_path / "m32", dtype=torch.float32)
    m32 = load_file(str(m32_dir / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert m16[key].dtype == torch.bfloat16 and torch.equal(m16[key], exact.to(torch.bfloat16))
    assert not torch.equal(m16[key].float(), exact)  # the rounding a bf16 merge makes
    assert all(v.dtype == torch.float32 for v in m32.values()) and torch.equal(m32[key], exact)
    assert json.loads((m32_dir / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "by-value"])
def test_an_adapter_serializes_as_sglangs_safe_unpickler_reads_it(shm, monkeypatch):
    """weight_sync=tensor's adapter: one flattened bucket in a shared-memory segment named in the payload (a few
    hundred bytes however large the adapter), or by value where /dev/shm has no room; SGLang's restricted
    unpickler and its bucket reader give every tensor back bit for bit, in its dtype, once per TP rank."""
    pytest.importorskip("sglang")
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from agentloop.train.weights import tensor as tensor_mod

    monkeypatch.setattr(tensor_mod, "_shm_room", lambda n: shm)
    t = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(64, 512),
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(512, 64).to(torch.bfloat16)}
    payloads, flat = tensor_mod.serialize_adapter(t, copies=2)
    assert len(payloads) == 2 and flat.dtype == torch.uint8 and flat.numel() == 64 * 512 * 4 + 512 * 64 * 2
    if shm:
        assert max(len(p) for p in payloads) < 2000  # the segment's name, not its bytes
    for p in payloads:  # as each of the server's TP workers reads flattened_bucket
        data = MultiprocessingSerializer.deserialize(p)
        back = dict(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                          metadata=data["metadata"]).reconstruct_tensors())
        assert back.keys() == t.keys()
        assert all(torch.equal(back[k], t[k]) and back[k].dtype == t[k].dtype for k in t)


def test_the_learners_views_of_one_cast_go_as_that_tensor_without_a_second_copy(monkeypatch):
    """Learner.adapter_tensors hands back views of one cast tensor; serialize_adapter sends that tensor's bytes as the
    bucket (no second concatenation) with each view's range, and flattens anything else as before."""
    pytest.importorskip("sglang")
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from agentloop.train.weights import tensor as tensor_mod

    monkeypatch.setattr(tensor_mod, "_shm_room", lambda n: False)
    one = torch.randn(64 * 32 + 32 * 48).to(torch.bfloat16)
    a, b = one.split([64 * 32, 32 * 48])
    views = {"x.lora_A.weight": a.view(32, 64), "x.lora_B.weight": b.view(48, 32)}
    _, flat = tensor_mod.serialize_adapter(views)
    assert flat.data_ptr() == one.data_ptr() and flat.numel() == one.numel() * 2  # the cast itself
    for order in (views, dict(reversed(views.items())), {k: v.clone() for k, v in views.items()}):
        payloads, flat = tensor_mod.serialize_adapter(order)
        data = MultiprocessingSerializer.deserialize(payloads[0])
        back = dict(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                          metadata=data["metadata"]).reconstruct_tensors())
        assert list(back) == list(order) and all(torch.equal(back[k], views[k]) for k in views)


def test_a_shared_adapter_outlives_the_learners_copy_in_another_process(tmp_path):
    """The server's process opens the segment by name and keeps its own mapping: the learner dropping its tensor
    after the server answered does not take the adapter from under it."""
    pytest.importorskip("sglang")
    import subprocess
    import sys

    from agentloop.train.weights import tensor as tensor_mod

    if not tensor_mod._shm_room(1 << 20):
        pytest.skip("/dev/shm has no room here")
    t = {"a.lora_A.weight": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    payloads, flat = tensor_mod.serialize_adapter(t)
    script = (
        "import sys, torch\n"
        "from sglang.srt.utils.common import MultiprocessingSerializer\n"
        "d = MultiprocessingSerializer.deserialize(sys.stdin.read())\n"
        "x = d['flattened_tensor']\n"
        "print('opened', flush=True)\n"
        "sys.stdin = open(sys.argv[1]); input()\n"
        "print(float(x.view(torch.float32).sum()))\n")
    gate = tmp_path / "gate"
    os_fifo = __import__("os").mkfifo
    os_fifo(gate)
    p = subprocess.Popen([sys.executable, "-c", script, str(gate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    p.stdin.write(payloads[0])
    p.stdin.close()
    assert p.stdout.readline().strip() == "opened"
    del flat, payloads  # the learner's copy goes
    with open(gate, "w") as g:
        g.write("go\n")
    out = p.stdout.read()
    p.stdout.close()
    assert p.wait(60) == 0 and float(out) == float(sum(range(4096)))


def test_save_adapter_copies_only_views_and_writes_them_whole(tmp_path):
    """save_adapter writes tensors as given without copying each (a copy per tensor was most of a 0.5B adapter's
    save); tensors that view a larger storage, overlapping ones included (safetensors refuses those), are copied."""
    from agentloop.train.lora import save_adapter

    big = torch.arange(24.0).reshape(6, 4)
    state = {"model.layers.0.self_attn.q_proj.lora_A.weight": big[:2],   # a view: rows 0-1 of `big`
             "model.layers.0.self_attn.q_proj.lora_B.weight": big[1:],   # a view overlapping the first
             "model.layers.0.self_attn.k_proj.lora_A.weight": torch.ones(2, 4)}
    read = read_adapter(save_adapter(tmp_path / "a", state, LORA))[1]
    assert len(read) == 3
    torch.testing.assert_close(read["model.layers.0.self_attn.q_proj.lora_A.weight"], big[:2])
    torch.testing.assert_close(read["model.layers.0.self_attn.q_proj.lora_B.weight"], big[1:])


def test_an_adapters_host_memory_is_written_again_only_once_no_server_holds_it():
    """AdapterSegments: a version's segment is reused only after the order reported that version released; a
    failed push's segment never is; released segments beyond `keep_free` are let go."""
    from agentloop.train.weights.tensor import AdapterSegments

    segs = AdapterSegments()
    one = segs.take(64, pin=False)
    segs.hold(1, one)
    two = segs.take(64, pin=False)
    assert two is not one  # version 1 is still held by the servers
    segs.hold(2, two)
    segs.release([])
    fresh = segs.take(64, pin=False)
    assert fresh is not one and fresh is not two
    segs.release([1, 7])  # 7: never pushed by this learner
    assert sorted(segs.held) == [2]
    assert [id(x) for x in segs.free] == [id(one)] and segs.take(32, pin=False) is not one  # another size: a fresh segment
    assert segs.take(64, pin=False) is one and not segs.free
    failed = segs.take(64, pin=False)
    segs.forget(failed)
    segs.release([2])
    assert segs.take(64, pin=False) is two
    three, four, five = (segs.take(64, pin=False) for _ in range(3))
    for v, seg in ((3, three), (4, four), (5, five)):
        segs.hold(v, seg)
    segs.release([3, 4, 5])
    assert segs.keep_free == 2 and [id(x) for x in segs.free] == [id(four), id(five)]
    segs.close()
    assert not segs.held and not segs.free
