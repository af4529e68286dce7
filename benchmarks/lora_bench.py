"""LoRA against full weights, one learner and one SGLang server: the learner's peak memory and step time, and the
weight push (the learner's save + the server's load) of each.

Usage: python benchmarks/lora_bench.py --model DIR --server-url URL --out OUT.json [--rank 32] [--device cuda]
       [--sequences 16] [--prompt-tokens 128] [--response-tokens 384]
The server must serve LoRA (--enable-lora --max-lora-rank >= rank --lora-target-modules ...: agentloop.train.lora.
server_args). Full weights: Learner.save_hf (weight_sync disk's save) + /update_weights_from_disk; LoRA (rank r,
alpha 2r, every attention and MLP projection): Learner.save_adapter + /load_lora_adapter. Then weight_sync=tensor's
push, what a step's time/sync_s holds besides the pause: LoRA, TensorSync.push_adapter (the adapter's tensors to
/load_lora_adapter_from_tensors + /update_weight_version; CUDA IPC handles, by value on the CPU); full weights,
TensorSync.push (CUDA only). Each mode runs one warmup step and two timed ones on the same synthetic GRPO batch,
then three pushes of each kind (five tensor pushes of an adapter, each after the last one's unload, as in training;
the median is reported); the server gets its original weights back at the end.
Used by benchmarks/gpu_acceptance.py's row lora-0.5b.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read() or b"{}")
    if isinstance(out, dict) and out.get("success") is False:
        raise RuntimeError(f"{path} refused: {out}")
    return out


def _records(vocab: int, n: int, prompt: int, response: int):
    import torch

    from agentloop.records import EpisodeRecord

    g = torch.Generator().manual_seed(0)
    recs = []
    for i in range(n):
        p = torch.randint(10, vocab - 10, (prompt,), generator=g).tolist()
        r = torch.randint(10, vocab - 10, (response,), generator=g).tolist()
        recs.append(EpisodeRecord(prompt_ids=p, response_ids=r, response_mask=[1] * response,
                                  response_logprobs=[-2.0] * response, reward=float(i % 2), episode_id=f"{i // 4}-{i}",
                                  index=i // 4, repeat=i % 4, data_source="bench", loop="none", seed=i))
    return recs


def run_mode(mode: str, a: argparse.Namespace, work: Path) -> dict:
    import torch

    from agentloop.train.config import AlgoConfig, LearnerConfig, LoraConfig
    from agentloop.train.lora import adapter_name
    from agentloop.train.trainer.learner import Learner

    lora = LoraConfig(enabled=True, rank=a.rank, alpha=2.0 * a.rank) if mode == "lora" else LoraConfig()
    cfg = LearnerConfig(device=a.device, lr=1e-5, lora=lora, micro_batch_tokens=a.micro_batch_tokens,
                        compile="off")
    if a.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    learner = Learner(a.model, AlgoConfig(), cfg)
    try:
        vocab = int(learner.hf_config.vocab_size)
        recs = _records(vocab, a.sequences, a.prompt_tokens, a.response_tokens)
        learner.train_step(recs, 1)  # warmup
        t = time.perf_counter()
        for s in (2, 3):
            learner.train_step(recs, s)
        step_s = (time.perf_counter() - t) / 2
        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
        trainable = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
        saves, loads = [], []
        for i in range(3):
            d = work / f"{mode}-{i}"
            t = time.perf_counter()
            learner.save_served(d)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            if mode == "lora":
                _post(a.server_url, "/load_lora_adapter", {"lora_name": adapter_name(1000 + i), "lora_path": str(d)})
            else:
                _post(a.server_url, "/update_weights_from_disk", {"model_path": str(d)})
            loads.append(time.perf_counter() - t)
            if mode == "lora":
                _post(a.server_url, "/unload_lora_adapter", {"lora_name": adapter_name(1000 + i)})
        size = sum(f.stat().st_size for f in (work / f"{mode}-0").iterdir() if f.is_file())
        tensor = _tensor_pushes(mode, a, learner)
    finally:
        learner.close()
    if mode == "full":
        _post(a.server_url, "/update_weights_from_disk", {"model_path": str(a.model)})
    save, load = statistics.median(saves), statistics.median(loads)
    return {"peak_memory_gib": peak, "step_s": step_s, "trainable_params": trainable, "push_bytes": size,
            "save_s": save, "load_s": load, "push_s": save + load, "tensor_push_s": tensor}


def _tensor_pushes(mode: str, a: argparse.Namespace, learner) -> float | None:
    """Median seconds of three weight_sync=tensor pushes (None: full weights on the CPU, which that path refuses)."""
    from agentloop.train.lora import adapter_name
    from agentloop.train.weights.tensor import TensorSync

    sync = TensorSync(timeout_s=600.0)
    if mode == "full" and a.device != "cuda":
        return None
    times, parts = [], []
    for i in range(5 if mode == "lora" else 3):
        t = time.perf_counter()
        if mode == "lora":
            # as in training, each push may write the host memory of an adapter the server unloaded
            parts.append(sync.push_adapter(learner, urls=[a.server_url], version=2000 + i,
                                           released=[2000 + i - 1] if i else []))
        else:
            parts.append(sync.push(learner.model, dtype=learner.compute_dtype, device=learner.device, rank=0,
                                   urls=[a.server_url], version=None))
        times.append(time.perf_counter() - t)
        if mode == "lora":
            _post(a.server_url, "/unload_lora_adapter", {"lora_name": adapter_name(2000 + i)})
    print(f"{mode}: weight_sync=tensor pushes {[round(x * 1e3, 1) for x in times]} ms; their parts (s): {parts}",
          flush=True)
    if mode == "lora" and a.device == "cuda":
        try:  # a diagnosis: its failure must not cost the row its figures
            print("lora push parts (median ms of 5): " + json.dumps(_push_parts(a, learner)), flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"lora push parts: failed: {e!r}", flush=True)
    sync.close()
    return statistics.median(times)


def _push_parts(a: argparse.Namespace, learner) -> dict[str, float]:
    """Where a LoRA push's time goes, each part timed alone between device synchronizations: the learner's adapter
    read, the host shared-memory segment's allocation and the copy into it (pageable, and pinned with
    cudaHostRegister), the payload's pickle, and the server's floor (a rank-1 adapter of the same modules through
    /load_lora_adapter_from_tensors, then /update_weight_version)."""
    import torch

    from agentloop.train.lora import adapter_config, adapter_name, adapter_state
    from agentloop.train.weights import tensor as tm

    def timed(f, n: int = 5) -> tuple[float, object]:
        out, res = None, []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = f()
            torch.cuda.synchronize()
            res.append(time.perf_counter() - t)
        return round(statistics.median(res) * 1e3, 2), out

    parts: dict[str, float] = {}
    parts["read_tensors"], state = timed(lambda: learner.adapter_tensors(on_device=True))
    peft = adapter_state(state)
    parts["read"], (flat, meta) = timed(lambda: learner.adapter_bucket(on_device=True))

    def alloc():
        return tm._new_segment(flat.numel())

    parts["shm_alloc"], _ = timed(alloc)
    parts["shm_alloc_copy"], shared = timed(lambda: alloc().copy_(flat))
    cudart = torch.cuda.cudart()

    def pinned():
        s = alloc()
        cudart.cudaHostRegister(s.data_ptr(), s.numel(), 0)
        s.copy_(flat)
        cudart.cudaHostUnregister(s.data_ptr())
        return s

    parts["shm_alloc_register_copy"], _ = timed(pinned)
    segments = tm.AdapterSegments()
    again = segments.take(flat.numel(), pin=True)
    parts["copy_reused_pinned"], _ = timed(lambda: again.copy_(flat))
    segments.forget(again)
    parts["pickle"], _ = timed(lambda: tm._share_pickle_by_name({"flattened_tensor": shared, "metadata": meta}))
    one = {k: torch.zeros((1, v.shape[1]) if "lora_A" in k else (v.shape[0], 1), dtype=v.dtype)
           for k, v in peft.items()}
    conf = {**adapter_config(learner.lora, str(learner.model_path)), "r": 1, "lora_alpha": 2.0}
    loads, versions = [], []
    for i in range(5):
        payloads, _keep = tm.serialize_adapter(one)
        t = time.perf_counter()
        _post(a.server_url, "/load_lora_adapter_from_tensors",
              {"lora_name": adapter_name(3000 + i), "config_dict": conf, "serialized_named_tensors": payloads,
               "load_format": "flattened_bucket"})
        loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        _post(a.server_url, "/update_weight_version", {"new_version": str(3000 + i), "abort_all_requests": False})
        versions.append(time.perf_counter() - t)
        _post(a.server_url, "/unload_lora_adapter", {"lora_name": adapter_name(3000 + i)})
    parts["server_load_rank1"] = round(statistics.median(loads) * 1e3, 2)
    parts["server_version"] = round(statistics.median(versions) * 1e3, 2)
    parts["adapter_mb"] = round(flat.numel() / 2**20, 2)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--server-url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--response-tokens", type=int, default=384)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        res = {m: run_mode(m, a, Path(tmp)) for m in ("full", "lora")}
    res["config"] = vars(a)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
