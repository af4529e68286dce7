"""Weight-sync benchmark + correctness check for SGLang's /update_weights_from_disk path.

Run by benchmarks/gpu_weight_sync.sh on a GPU machine (sglang bundle installed). Builds a random
Qwen2.5-0.5B-shaped model A (seed 0, bf16) and a perturbed copy B (A + small noise, seed 1, the
"learner's fresh checkpoint"), serves A, times /update_weights_from_disk A<->B, and compares the
server's input-token logprobs of a fixed 256-token sequence with transformers' (bf16 and fp32).
Usage: python3 benchmarks/gpu_weight_sync.py OUT_DIR [TINY_TOKENIZER_DIR]
Env: WS_BUDGET_S (seconds for the whole script, default 360), WS_PORT (30000), WS_UPDATES (5).
"""
from __future__ import annotations

import json, os, shutil, signal, statistics, subprocess, sys, time, urllib.request
from pathlib import Path

T0 = time.time()
BUDGET = float(os.environ.get("WS_BUDGET_S", "360"))
PORT = int(os.environ.get("WS_PORT", "30000"))
N_UPD = int(os.environ.get("WS_UPDATES", "5"))
URL = f"http://127.0.0.1:{PORT}"
OUT = Path(sys.argv[1]); OUT.mkdir(parents=True, exist_ok=True)
TINY = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None
RES: dict = {"notes": []}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def left():
    return BUDGET - (time.time() - T0)


def dump():
    (OUT / "weight_sync.json").write_text(json.dumps(RES, indent=1, default=str))


def post(path, body, timeout=120):
    req = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        txt = r.read()
    try:
        return json.loads(txt)
    except Exception:
        return txt.decode(errors="replace")


import torch
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

DEV = "cuda"
A = Path("/tmp/models/ws_A"); B = Path("/tmp/models/ws_B")
RES["gpu"] = torch.cuda.get_device_name(0)
import transformers, sglang  # noqa: E402
RES["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__, "sglang": sglang.__version__}
log("versions", RES["versions"], "gpu", RES["gpu"])


def save_timed(model, d: Path, label: str):
    if d.exists():
        shutil.rmtree(d)
    torch.cuda.synchronize(); t = time.time()
    model.save_pretrained(str(d), safe_serialization=True)
    os.sync()
    dt = time.time() - t
    size = sum(f.stat().st_size for f in d.iterdir())
    log(f"save_pretrained {label}: {dt:.3f}s ({size/2**20:.0f} MiB, incl. os.sync)")
    return dt, size


# ---------------------------------------------------------------- 1. models A and B
from agentloop.modelzoo import shape_config  # noqa: E402  (the one definition of the shape)

cfg = shape_config("qwen2.5-0.5b-shape", bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
torch.manual_seed(0)
t = time.time()
with torch.device(DEV):
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
RES["n_params"] = sum(p.numel() for p in model.parameters())
log(f"built A: {RES['n_params']/1e6:.1f}M params in {time.time()-t:.1f}s")
save_times = []
save_times.append(save_timed(model, A, "A (first save, cold)"))
# B = A + noise (seed 1): 0.1 x each tensor's std (norm weights, std 0: 0.01 absolute)
g = torch.Generator(device=DEV).manual_seed(1)
with torch.no_grad():
    for name, p in model.named_parameters():
        s = p.float().std().item() if p.numel() > 1 else 0.0
        scale = 0.1 * s if s > 1e-6 else 0.01
        p.add_((torch.randn(p.shape, generator=g, device=DEV, dtype=torch.float32) * scale).to(p.dtype))
save_times.append(save_timed(model, B, "B"))
save_times.append(save_timed(model, Path("/tmp/models/ws_B2"), "B again (warm)"))
shutil.rmtree("/tmp/models/ws_B2", ignore_errors=True)
RES["save_pretrained_s"] = [round(x[0], 4) for x in save_times]
RES["checkpoint_bytes"] = save_times[1][1]
del model; torch.cuda.empty_cache()
if TINY and TINY.is_dir():
    for d in (A, B):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (TINY / f).is_file():
                shutil.copy(TINY / f, d / f)
    RES["notes"].append(f"tiny tokenizer copied from {TINY}")
else:
    RES["notes"].append("no tokenizer files in model dirs (server runs with --skip-tokenizer-init)")
dump()

# ---------------------------------------------------------------- 2. launch server on A
cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(A), "--host", "127.0.0.1", "--port", str(PORT),
       "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
       "--mem-fraction-static", "0.5", "--disable-cuda-graph", "--skip-tokenizer-init"]
log("launch:", " ".join(cmd))
srv_log = open(OUT / "server.log", "w")
t_launch = time.time()
SRV = subprocess.Popen(cmd, stdout=srv_log, stderr=subprocess.STDOUT, start_new_session=True,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")))


def stop_server():
    if SRV.poll() is None:
        log("stopping server pgid", SRV.pid)
        try:
            os.killpg(SRV.pid, signal.SIGTERM)
            SRV.wait(timeout=15)
        except Exception:
            try:
                os.killpg(SRV.pid, signal.SIGKILL)
            except Exception:
                pass


# ---------------------------------------------------------------- 3. HF reference logprobs (while server starts)
torch.manual_seed(123)
IDS = torch.randint(0, cfg.vocab_size, (256,), generator=torch.Generator().manual_seed(123)).tolist()


def hf_logprobs(d: Path, dtype):
    try:
        m = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype)
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(str(d), torch_dtype=dtype)
    m = m.to(DEV).eval()
    with torch.no_grad():
        x = torch.tensor([IDS], device=DEV)
        logits = m(x).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]
    out = lp.double().cpu()
    del m; torch.cuda.empty_cache()
    return out


HF = {}
try:
    for name, d in (("A", A), ("B", B)):
        for dt_name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            t = time.time()
            HF[f"{name}_{dt_name}"] = hf_logprobs(d, dt)
            log(f"HF {name} {dt_name}: {time.time()-t:.2f}s, mean lp {HF[f'{name}_{dt_name}'].mean():.4f}")
    RES["hf_fp32_vs_bf16"] = {k: {"max": (HF[f"{k}_bf16"] - HF[f"{k}_fp32"]).abs().max().item(),
                                  "mean": (HF[f"{k}_bf16"] - HF[f"{k}_fp32"]).abs().mean().item()} for k in "AB"}
    RES["hf_A_vs_B_fp32"] = {"max": (HF["A_fp32"] - HF["B_fp32"]).abs().max().item(),
                             "mean": (HF["A_fp32"] - HF["B_fp32"]).abs().mean().item()}
    RES["logprob_stats_A_fp32"] = {"mean": HF["A_fp32"].mean().item(), "std": HF["A_fp32"].std().item()}
except Exception as e:  # keep going: server timings are still useful
    log("HF reference failed:", repr(e)); RES["notes"].append(f"HF reference failed: {e!r}")
dump()


def server_logprobs():
    try:
        post("/flush_cache", {}, timeout=30)
    except Exception as e:
        log("flush_cache:", repr(e))
    body = post("/generate", {"input_ids": IDS, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                              "return_logprob": True, "logprob_start_len": 0})
    meta = body["meta_info"]
    itl = meta["input_token_logprobs"]
    assert len(itl) == len(IDS), (len(itl), len(IDS))
    ids = [e[1] for e in itl]
    assert ids == IDS, "token ids in input_token_logprobs differ from the request"
    return torch.tensor([e[0] for e in itl[1:]], dtype=torch.float64), meta.get("weight_version")


def cmp(srv, key):
    if key not in HF:
        return None
    d = (srv - HF[key]).abs()
    return {"max": round(d.max().item(), 6), "mean": round(d.mean().item(), 6)}


rc = 0
try:
    # wait for health
    healthy = False
    while left() > 20:
        if SRV.poll() is not None:
            log("server exited early, rc", SRV.returncode); break
        try:
            with urllib.request.urlopen(URL + "/health", timeout=3) as r:
                if r.status == 200:
                    healthy = True; break
        except Exception:
            pass
        time.sleep(1)
    if not healthy:
        raise RuntimeError("server not healthy; tail of server.log:\n" + "".join(open(OUT / "server.log").readlines()[-30:]))
    RES["server_startup_s"] = round(time.time() - t_launch, 1)
    log(f"server healthy after {RES['server_startup_s']}s")

    # ---------------------------------------------------------------- baseline on A
    srvA, wv = server_logprobs()
    RES["baseline_A"] = {"weight_version": wv, "vs_hf_bf16": cmp(srvA, "A_bf16"), "vs_hf_fp32": cmp(srvA, "A_fp32")}
    log("baseline A:", RES["baseline_A"]); dump()

    # ---------------------------------------------------------------- 4. timed updates, alternating
    RES["updates"] = []
    srv_last = {}
    for i in range(N_UPD):
        if left() < 25:
            RES["notes"].append(f"stopped after {i} updates: time budget"); log("budget: stop updates"); break
        tgt = "B" if i % 2 == 0 else "A"
        path = str(B if tgt == "B" else A)
        t = time.perf_counter()
        r = post("/update_weights_from_disk", {"model_path": path, "weight_version": str(i + 1)}, timeout=120)
        dt = time.perf_counter() - t
        srv, wv = server_logprobs()
        srv_last[tgt] = srv
        rec = {"i": i + 1, "to": tgt, "seconds": round(dt, 4), "success": r.get("success") if isinstance(r, dict) else r,
               "message": (r.get("message") if isinstance(r, dict) else None), "weight_version": wv,
               "vs_hf_bf16": cmp(srv, f"{tgt}_bf16"), "vs_hf_fp32": cmp(srv, f"{tgt}_fp32")}
        RES["updates"].append(rec); log("update:", rec); dump()
    times = [u["seconds"] for u in RES["updates"]]
    if times:
        RES["update_median_s"] = statistics.median(times)

    # ---------------------------------------------------------------- final comparison with B loaded
    if "B" in srv_last:
        srvB = srv_last["B"]
        RES["after_update_B"] = {"vs_hf_bf16": cmp(srvB, "B_bf16"), "vs_hf_fp32": cmp(srvB, "B_fp32"),
                                 "server_B_vs_server_A": {"max": round((srvB - srvA).abs().max().item(), 6),
                                                          "mean": round((srvB - srvA).abs().mean().item(), 6)},
                                 "server_B_vs_hf_A_bf16": cmp(srvB, "A_bf16")}
        log("after update (B):", RES["after_update_B"])
    if "A" in srv_last:
        RES["back_to_A_vs_baseline_server"] = {"max": round((srv_last["A"] - srvA).abs().max().item(), 6)}
except Exception as e:
    rc = 1
    log("ERROR:", repr(e)); RES["error"] = repr(e)
finally:
    stop_server()
    dump()

# ---------------------------------------------------------------- table
print("\n==== weight sync summary ====", flush=True)
print(f"gpu {RES.get('gpu')}  params {RES.get('n_params', 0)/1e6:.1f}M  ckpt {RES.get('checkpoint_bytes', 0)/2**20:.0f} MiB  server start {RES.get('server_startup_s')}s")
print(f"save_pretrained (s): {RES.get('save_pretrained_s')}")
for u in RES.get("updates", []):
    print(f"update {u['i']} -> {u['to']}: {u['seconds']:.4f}s ok={u['success']} wv={u['weight_version']} "
          f"vs HF bf16 {u['vs_hf_bf16']} fp32 {u['vs_hf_fp32']}")
print(f"update median (s): {RES.get('update_median_s')}")
print("baseline A:", RES.get("baseline_A"))
print("after update B:", RES.get("after_update_B"))
print("HF bf16 vs fp32:", RES.get("hf_fp32_vs_bf16"), " HF A vs B fp32:", RES.get("hf_A_vs_B_fp32"))
print("notes:", RES["notes"], "error:", RES.get("error"))
sys.exit(rc)
