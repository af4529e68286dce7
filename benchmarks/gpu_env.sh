# Sourced by GPU benchmark scripts, from the repo root on the GPU machine:
#   source benchmarks/gpu_env.sh LOGNAME
# Results folder $OUT (default ./bench_out) with everything printed appended to $OUT/LOGNAME; the
# environment the GPU runs need; the SGLang bundle (`.sglang-gpu`, staged and carried) installed.
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$1") 2>&1
export PYTHONUNBUFFERED=1 AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-/tmp/alc}
# NVLink multicast stays off on shared hosts (the machine sets these; keep them for the servers too).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
# cuMem handles across processes failed the first broadcast ("Cuda failure 'invalid argument'"); legacy IPC works.
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
ulimit -n 65536 2>/dev/null || true
source .sglang-gpu/install.sh || { echo "bundle install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
