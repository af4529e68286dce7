"""GPU benchmark + correctness check of the three weight-sync paths of agentloop.train.weights.

Run by benchmarks/gpu_weight_sync_paths.sh on a machine with 2 GPUs (sglang bundle installed).
Builds a random Qwen2.5-0.5B-shaped bf16 model A (seed 0) and B = A + small noise (seed 1), and two
agentloop `Learner`s (FSDP2, one rank, GPU 0) holding A and B. Two SGLang servers start on A:
server T on GPU 0 (the learner's GPU: disk and tensor paths) and server N on GPU 1 (nccl path).
Each path alternates the servers between B and A (1 untimed warm-up, then WS_UPDATES timed syncs);
after every sync the server's input-token logprobs of a fixed 256-token sequence are compared with
transformers' logprobs of the target weights (bf16 and fp32), and its weight_version is checked.
  disk    Learner.save_hf (timed once) + DiskSync.load (= /update_weights_from_disk) on server T
  tensor  TensorSync.push (FSDP2 gather + CUDA IPC + /update_weights_from_tensor) on server T
  nccl    NcclSync.push (gather + /update_weights_from_distributed + broadcast GPU 0 -> GPU 1) on
          server N, for each bucket size in WS_BUCKETS_MB; the group is created on the first push
Usage: python3 benchmarks/gpu_weight_sync_paths.py OUT_DIR
Env: WS_BUDGET_S (whole script, default 420), WS_UPDATES (5), WS_BUCKETS_MB ("64,256,1024"),
     WS_TENSOR_BUCKET_MB (512).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

T0 = time.time()
BUDGET = float(os.environ.get("WS_BUDGET_S", "420"))
N_UPD = int(os.environ.get("WS_UPDATES", "5"))
BUCKETS_MB = [float(x) for x in os.environ.get("WS_BUCKETS_MB", "64,256,1024").split(",") if x]
TENSOR_MB = float(os.environ.get("WS_TENSOR_BUCKET_MB", "512"))
OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
RES: dict = {"notes": [], "paths": {}}
URL_T, URL_N = "http://127.0.0.1:30000", "http://127.0.0.1:30001"


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def left():
    return BUDGET - (time.time() - T0)


def dump():
    (OUT / "weight_sync_paths.json").write_text(json.dumps(RES, indent=1, default=str))


def post(url, path, body, timeout=120):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        txt = r.read()
    try:
        return json.loads(txt)
    except ValueError:  # /flush_cache answers plain text
        return txt.decode(errors="replace")


import sglang  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: E402

from agentloop.train.config import LearnerConfig  # noqa: E402
from agentloop.train.trainer.learner import Learner  # noqa: E402
from agentloop.train.weights.nccl import NcclSync  # noqa: E402
from agentloop.train.weights.sync import DiskSync  # noqa: E402
from agentloop.train.weights.tensor import TensorSync  # noqa: E402

RES["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
RES["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__, "sglang": sglang.__version__}
log("versions", RES["versions"], "gpus", RES["gpus"])
if torch.cuda.device_count() < 2:
    sys.exit("needs 2 GPUs")

# ---------------------------------------------------------------- 1. models A and B on disk
try:
    from agentloop.models.modelzoo import shape_config

    cfg = shape_config("qwen2.5-0.5b-shape", bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
except (ImportError, ValueError):  # older checkout without the shape table: the same shape, spelled out
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
A, B = Path("/tmp/models/wsp_A"), Path("/tmp/models/wsp_B")
torch.manual_seed(0)
with torch.device("cuda:0"):
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
RES["n_params"] = sum(p.numel() for p in model.parameters())
model.save_pretrained(str(A), safe_serialization=True)
g = torch.Generator(device="cuda:0").manual_seed(1)
with torch.no_grad():
    for _, p in model.named_parameters():
        s = p.float().std().item() if p.numel() > 1 else 0.0
        p.add_((torch.randn(p.shape, generator=g, device="cuda:0") * (0.1 * s if s > 1e-6 else 0.01)).to(p.dtype))
model.save_pretrained(str(B), safe_serialization=True)
del model
torch.cuda.empty_cache()
log(f"built A and B: {RES['n_params'] / 1e6:.1f}M params")

# ---------------------------------------------------------------- 2. two servers on A (start in the background)
SERVERS = []


def launch(gpu: int, port: int, name: str):
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(A), "--host", "127.0.0.1",
           "--port", str(port), "--attention-backend", "triton", "--sampling-backend", "pytorch",
           "--grammar-backend", "none", "--mem-fraction-static", "0.5", "--disable-cuda-graph",
           "--skip-tokenizer-init", "--base-gpu-id", str(gpu)]
    fh = open(OUT / f"server_{name}.log", "w")
    # Both servers see both GPUs, like the learner, and pick theirs with --base-gpu-id: NCCL's P2P
    # transport between processes with different CUDA_VISIBLE_DEVICES failed at comm init with
    # "Cuda failure 'invalid argument'" (first H100 run).
    p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1"))
    SERVERS.append(p)
    return p


def stop_servers():
    for p in SERVERS:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


t_launch = time.time()
launch(0, 30000, "T")
launch(1, 30001, "N")

# ---------------------------------------------------------------- 3. references (while the servers start)
IDS = torch.randint(0, cfg.vocab_size, (256,), generator=torch.Generator().manual_seed(123)).tolist()


def hf_logprobs(d: Path, dtype):
    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).to("cuda:0").eval()
    with torch.no_grad():
        x = torch.tensor([IDS], device="cuda:0")
        lp = torch.log_softmax(m(x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
    del m
    torch.cuda.empty_cache()
    return lp.double().cpu()


HF = {f"{n}_{k}": hf_logprobs(d, dt) for n, d in (("A", A), ("B", B))
      for k, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}


def gap(x, y):
    d = (x - y).abs()
    return {"max": round(d.max().item(), 6), "mean": round(d.mean().item(), 6)}


RES["hf_bf16_vs_fp32"] = {k: gap(HF[f"{k}_bf16"], HF[f"{k}_fp32"]) for k in "AB"}
RES["hf_A_vs_B_fp32"] = gap(HF["A_fp32"], HF["B_fp32"])
log("HF refs:", RES["hf_bf16_vs_fp32"], "A vs B", RES["hf_A_vs_B_fp32"])

# the learners: agentloop's FSDP2 Learner (one rank on GPU 0), fp32 master weights, bf16 compute
LCFG = LearnerConfig(device="cuda")
LA, LB = Learner(A, cfg=LCFG), Learner(B, cfg=LCFG)
LEARNERS = {"A": LA, "B": LB}
DIRS = {"A": A, "B": B}
log("learners ready (FSDP2, world 1)")
dump()


def server_logprobs(url):
    post(url, "/flush_cache", {}, timeout=30)
    body = post(url, "/generate", {"input_ids": IDS, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                   "return_logprob": True, "logprob_start_len": 0})
    itl = body["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in itl] == IDS
    return torch.tensor([e[0] for e in itl[1:]], dtype=torch.float64), body["meta_info"].get("weight_version")


def wait_healthy(url, proc):
    while left() > 30:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited early")
        try:
            with urllib.request.urlopen(url + "/health", timeout=3) as r:
                if r.status == 200:
                    return
        except OSError:  # not up yet (URLError and socket timeouts are OSErrors)
            pass
        time.sleep(1)
    raise RuntimeError(f"server {url} not healthy in time")


VERSION = [0]


def run_path(key: str, url: str, do_sync, n: int):
    """1 warm-up + n timed syncs alternating B, A, ...; each checked against the HF logprobs."""
    recs = []
    for i in range(n + 1):
        if left() < 40:
            RES["notes"].append(f"{key}: stopped after {i} syncs (time budget)")
            break
        tgt = "B" if i % 2 == 0 else "A"
        VERSION[0] += 1
        ver = f"{key}-{VERSION[0]}"
        torch.cuda.synchronize()
        t = time.perf_counter()
        metrics = do_sync(tgt, ver) or {}
        dt = time.perf_counter() - t
        srv, wv = server_logprobs(url)
        other = "A" if tgt == "B" else "B"
        rec = {"i": i, "warmup": i == 0, "to": tgt, "seconds": round(dt, 4), "weight_version": wv,
               "version_ok": wv == ver, "vs_hf_bf16": gap(srv, HF[f"{tgt}_bf16"]),
               "vs_hf_fp32": gap(srv, HF[f"{tgt}_fp32"]), "vs_other_fp32": gap(srv, HF[f"{other}_fp32"]),
               "metrics": {k: round(v, 4) for k, v in metrics.items()}}
        recs.append(rec)
        log(key, rec)
    timed = [r["seconds"] for r in recs if not r["warmup"]]
    out = {"syncs": recs, "median_s": statistics.median(timed) if timed else None,
           "all_versions_ok": all(r["version_ok"] for r in recs),
           "max_vs_hf_bf16": max((r["vs_hf_bf16"]["max"] for r in recs), default=None),
           "max_vs_hf_fp32": max((r["vs_hf_fp32"]["max"] for r in recs), default=None),
           "min_vs_other_fp32_mean": min((r["vs_other_fp32"]["mean"] for r in recs), default=None)}
    RES["paths"][key] = out
    dump()
    return out


rc = 0
nccl = None
try:
    wait_healthy(URL_T, SERVERS[0])
    wait_healthy(URL_N, SERVERS[1])
    RES["server_startup_s"] = round(time.time() - t_launch, 1)
    log(f"servers healthy after {RES['server_startup_s']}s")
    for name, url in (("T", URL_T), ("N", URL_N)):
        srv, wv = server_logprobs(url)
        RES[f"baseline_{name}"] = {"weight_version": wv, "vs_hf_bf16": gap(srv, HF["A_bf16"]),
                                   "vs_hf_fp32": gap(srv, HF["A_fp32"])}
    log("baselines:", RES["baseline_T"], RES["baseline_N"])

    # disk: the learner's save (FSDP gather + safetensors) once, then the server's load
    save_s = []
    for k in range(2):
        t = time.perf_counter()
        LB.save_hf(f"/tmp/models/wsp_save{k}")
        save_s.append(round(time.perf_counter() - t, 4))
    RES["learner_save_hf_s"] = save_s
    disk = DiskSync(timeout_s=120)
    try:
        run_path("disk", URL_T, lambda tgt, ver: disk.load(str(DIRS[tgt]), [URL_T], ver), N_UPD)
    except Exception as e:  # noqa: BLE001 - one failed path must not lose the others' figures
        rc = 1
        log("disk path failed:", repr(e))
        RES["paths"]["disk"] = {"error": repr(e)}

    tensor = TensorSync(bucket_bytes=int(TENSOR_MB * 2**20), timeout_s=120)
    try:
        run_path(f"tensor_{TENSOR_MB:g}MB", URL_T,
                 lambda tgt, ver: tensor.push(LEARNERS[tgt].model, dtype=torch.bfloat16, device=LA.device, rank=0,
                                              urls=[URL_T], version=ver, flush_cache=True), N_UPD)
    except Exception as e:  # noqa: BLE001 - one failed path must not lose the others' figures
        rc = 1
        log("tensor path failed:", repr(e))
        RES["paths"][f"tensor_{TENSOR_MB:g}MB"] = {"error": repr(e)}

    nccl = NcclSync(bucket_bytes=int(BUCKETS_MB[0] * 2**20), timeout_s=120, master_addr="127.0.0.1")
    for mb in BUCKETS_MB:
        nccl.bucket_bytes = int(mb * 2**20)
        try:
            run_path(f"nccl_{mb:g}MB", URL_N,
                     lambda tgt, ver: nccl.push(LEARNERS[tgt].model, dtype=torch.bfloat16, device=LA.device, rank=0,
                                                urls=[URL_N], version=ver, flush_cache=True), N_UPD)
        except Exception as e:  # noqa: BLE001 - one failed path must not lose the others' figures
            rc = 1
            log(f"nccl {mb} MB failed:", repr(e))
            RES["paths"][f"nccl_{mb:g}MB"] = {"error": repr(e)}
            break
except Exception as e:  # noqa: BLE001 - written into the results file, which is what the run is for
    rc = 1
    log("ERROR:", repr(e))
    RES["error"] = repr(e)
finally:
    if nccl is not None:
        try:
            nccl.close()
        except Exception as e:  # noqa: BLE001 - teardown: noted in the results, the servers still stop
            RES["notes"].append(f"nccl close: {e!r}")
    stop_servers()
    shutil.rmtree("/tmp/models/wsp_save0", ignore_errors=True)
    shutil.rmtree("/tmp/models/wsp_save1", ignore_errors=True)
    dump()

print("\n==== weight sync paths ====", flush=True)
print("gpus", RES["gpus"], "params", RES.get("n_params"), "server start", RES.get("server_startup_s"))
print("learner save_hf (s):", RES.get("learner_save_hf_s"))
for k, v in RES["paths"].items():
    print(f"{k:16s} median {v.get('median_s')}  versions ok {v.get('all_versions_ok')}  max|srv-HF bf16| "
          f"{v.get('max_vs_hf_bf16')}  max|srv-HF fp32| {v.get('max_vs_hf_fp32')}  "
          f"min mean|srv-other| {v.get('min_vs_other_fp32_mean')}  {v.get('error', '')}")
print("HF bf16 vs fp32:", RES.get("hf_bf16_vs_fp32"), "HF A vs B:", RES.get("hf_A_vs_B_fp32"))
print("notes:", RES["notes"], "error:", RES.get("error"))
sys.exit(rc)
