# Sourced by GPU benchmark scripts, from the repo root on the GPU machine:
#   source benchmarks/gpu_env.sh LOGNAME
# Results folder $OUT (default ./bench_out) with everything printed appended to $OUT/LOGNAME; the
# environment the GPU runs need; SGLang (and Ray, when staged) installed on a machine without a package index:
# from `.gpu-stage/` (benchmarks/gpu_stage.sh: xz archives that fit one call's carry, unpacked into /tmp/site),
# else from the offline bundle `.sglang-gpu` (../shared/sglang-gpu/stage.sh). Where sglang imports already, nothing.
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$1") 2>&1
export PYTHONUNBUFFERED=1 AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-/tmp/alc}
# NVLink multicast stays off on shared hosts (the machine sets these; keep them for the servers too).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
# cuMem handles across processes failed the first broadcast ("Cuda failure 'invalid argument'"); legacy IPC works.
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
ulimit -n 65536 2>/dev/null || true
if [ -f .gpu-stage/site.tar.xz ]; then
  if [ ! -f /tmp/site/.agentloop-staged ]; then
    mkdir -p /tmp/site
    t0=$(date +%s)
    for a in .gpu-stage/site.tar.xz .gpu-stage/ray.tar.xz; do
      [ -f "$a" ] && { xz -d -T0 < "$a" | tar xf - -C /tmp/site || { echo "unpacking $a failed"; exit 1; }; }
    done
    touch /tmp/site/.agentloop-staged
    echo "staged .gpu-stage into /tmp/site in $(( $(date +%s) - t0 )) s"
  fi
  export PYTHONPATH=/tmp/site:$PWD/.gpu-stage/shim:$PWD${PYTHONPATH:+:$PYTHONPATH}
  # the tinker SDK and what it needs beyond the machine's own packages: last on the path, so the machine's win
  # (and tinker-cookbook with what its recipes import, when staged)
  if [ -f .gpu-stage/tinker.tar.xz ] && [ ! -f /tmp/site-tinker/.agentloop-staged ]; then
    mkdir -p /tmp/site-tinker
    for a in .gpu-stage/tinker.tar.xz .gpu-stage/cookbook.tar.xz; do
      [ -f "$a" ] && { xz -d -T0 < "$a" | tar xf - -C /tmp/site-tinker || { echo "unpacking $a failed"; exit 1; }; }
    done
    touch /tmp/site-tinker/.agentloop-staged
  fi
  [ -d /tmp/site-tinker ] && export PYTHONPATH=$PYTHONPATH:/tmp/site-tinker
  python3 -c "import torch, sglang; print('sglang', sglang.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    || { echo "the staged SGLang does not import"; exit 1; }
elif ! python3 -c "import sglang" 2>/dev/null; then
  source .sglang-gpu/install.sh || { echo "bundle install failed"; exit 1; }
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import ray; print('ray', ray.__version__)" 2>/dev/null || echo "ray: not installed (Ray rows will fail)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
