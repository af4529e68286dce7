#!/bin/bash
# Stage what the GPU acceptance needs on a GPU machine without a package index, small enough to travel with the
# working tree in one call (the device carries 64 MiB in all; the tree is ~11 MB): `.gpu-stage/`, ignored by git,
#   site.tar.xz   the offline SGLang bundle (../shared/sglang-gpu/wheels, unpacked, xz: 49 -> ~31 MB) and its shim
#   tinker.tar.xz the tinker SDK (benchmarks/tinker_overhead.py) with the dependencies a GPU torch stack lacks
#   ray.tar.xz    Ray 2.60 for python 3.12 without what a run never loads (jars, dashboard client, RLlib, Data, Serve,
#                 Train, Tune, LLM) and with its three native binaries stripped (79 -> ~18 MB), plus msgpack
# Run once here (a few minutes: xz -9); then every device call carries [".gpu-stage"], and benchmarks/gpu_env.sh
# unpacks them into /tmp/site there. Users with a package index install sglang and ray as usual instead.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${SGLANG_BUNDLE:-../shared/sglang-gpu}
STAGE=.gpu-stage
mkdir -p "$STAGE"
grep -qx "/$STAGE/" .git/info/exclude 2>/dev/null || echo "/$STAGE/" >> .git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ ! -f "$STAGE/site.tar.xz" ]; then
  mkdir -p "$tmp/site"
  for w in "$BUNDLE"/wheels/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
  tar cf - -C "$tmp/site" . | xz -9 -T0 > "$STAGE/site.tar.xz"
fi
rm -rf "$STAGE/shim" && cp -r "$BUNDLE/shim" "$STAGE/shim"
if [ ! -f "$STAGE/ray.tar.xz" ]; then
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
      -d "$tmp/whl" ray==2.60.0 'msgpack>=1,<2'
  mkdir -p "$tmp/ray"
  for w in "$tmp"/whl/*.whl; do unzip -q -o "$w" -d "$tmp/ray"; done
  rm -rf "$tmp"/ray/ray/{jars,rllib,data,serve,train,tune,llm} "$tmp/ray/ray/dashboard/client"
  strip --strip-unneeded "$tmp/ray/ray/_raylet.so" "$tmp/ray/ray/core/src/ray/gcs/gcs_server" \
      "$tmp/ray/ray/core/src/ray/raylet/raylet"
  tar cf - -C "$tmp/ray" . | xz -9 -T0 > "$STAGE/ray.tar.xz"
fi
if [ ! -f "$STAGE/tinker.tar.xz" ]; then
  # the tinker SDK for benchmarks/tinker_overhead.py, with only the dependencies a GPU machine's torch stack lacks
  # (gpu_env.sh puts them last on the path); the cffi backend and pygments dropped, the native parts stripped
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m pip download -q --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp/twhl" tinker==0.38.0
  mkdir -p "$tmp/tinker"
  for w in "$tmp"/twhl/*.whl; do
    case $(basename "$w" | sed 's/-[0-9].*//') in
      numpy|pydantic|pydantic_core|transformers|tokenizers|huggingface_hub|hf_xet|safetensors|fsspec|filelock|regex|\
pyyaml|tqdm|typer|shellingham|packaging|typing_extensions|typing_inspection|annotated_doc|annotated_types|pygments)
        continue ;;
    esac
    unzip -q -o "$w" -d "$tmp/tinker"
  done
  rm -f "$tmp"/tinker/zstandard/_cffi.*.so "$tmp/tinker/zstandard/backend_cffi.py"
  strip --strip-unneeded "$tmp"/tinker/pyqwest/_pyqwest.abi3.so "$tmp"/tinker/zstandard/backend_c.*.so
  tar cf - -C "$tmp/tinker" . | xz -9 -T0 > "$STAGE/tinker.tar.xz"
fi
if [ ! -f "$STAGE/cookbook.tar.xz" ]; then
  # tinker-cookbook 0.6.1 (the acceptance's tinker row runs its math_rl recipe and SFT loop on the GPU) and the small
  # packages its recipes import that a GPU machine's stack lacks. Not staged: datasets with pyarrow and pandas (~70 MB
  # of wheels, past one call's carry); where the machine lacks them the row uses benchmarks/gpu_shims/datasets, a
  # stand-in that lets the cookbook's modules import and refuses any use (the arithmetic env and the SFT driver's
  # in-memory dataset never use it).
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp/cwhl" tinker-cookbook==0.6.1 \
      chz==0.4.0 pyrage==1.4.0 termcolor==3.3.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 pylatexenc==2.11 \
      antlr4-python3-runtime==4.13.2 blobfile==3.0.0 lxml==6.1.3 pycryptodomex==3.24.2 cloudpickle==3.1.3 \
      rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  mkdir -p "$tmp/cookbook"
  for w in "$tmp"/cwhl/*.whl; do unzip -q -o "$w" -d "$tmp/cookbook"; done
  tar cf - -C "$tmp/cookbook" . | xz -9 -T0 > "$STAGE/cookbook.tar.xz"
fi
du -sh "$STAGE"/*
